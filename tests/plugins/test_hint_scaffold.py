"""hint_scaffold: GHPO (group mode) and Scaf-GRPO (one mode).

Unit tests drive the after-generation hook on a hand-built RolloutContext with a scripted generation service;
an end-to-end run on the tiny model checks that replaced rows are trained under the hinted prompts' token ids."""

import math
import threading

import pytest
import torch

from trl_plugins import Completion, PluginConfigError, build_plugins
from trl_plugins.api.contexts import group_layout
from trl_plugins.testing import (
    SimulatedCollective,
    build_stack,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin._hints import DEFAULT_TEMPLATE, hinted_prompt
from trl_plugins_builtin.hint_scaffold import hint_text

SOLUTION = "ABCDEFGH"  # 25 % -> "AB", 50 % -> "ABCD", 75 % -> "ABCDEF"
SAMPLING_LP = -0.5


def _encode(text):
    return [ord(c) for c in text]


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _text(prompt):
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _question(prompt_text):
    return prompt_text.split("\n\n")[0]


def _hint_of(prompt_text):
    marker = "refer to:\n"
    return prompt_text.split(marker, 1)[1] if marker in prompt_text else ""


class ScriptedService:
    """Records every generate call. In each call, the first hinted prompt of a question whose hint has at least
    ``need[question]`` characters gets a successful completion ("OK..."), every other prompt a failing one."""

    def __init__(self, need):
        self.need = need
        self.calls = []

    def generate(self, prompts=None, **kwargs):
        assert not kwargs
        self.calls.append(list(prompts))
        seen, out = set(), []
        for j, prompt in enumerate(prompts):
            text = _text(prompt)
            q, hint = _question(text), _hint_of(text)
            ok = q not in seen and len(hint) >= self.need.get(q, math.inf)
            seen.add(q)
            body = f"{'OK' if ok else 'no'}{len(self.calls)}.{j}"
            out.append(Completion(completion_ids=_encode(body), logprobs=[SAMPLING_LP] * len(body), text=body))
        return out


def _score(rows, prompts, completions):
    return torch.tensor([1.0 if _text(c).startswith("OK") else 0.0 for c in completions])


def make_ctx(groups, G, *, service=None, step=0, conversational=True, solution=SOLUTION, process_index=0,
             gatherer=None, with_logprobs=True):
    """``groups``: one list of G completion texts per local group (texts starting with "OK" succeed)."""
    B = len(groups) * G
    global_index, group_ids, index_in_group = group_layout(process_index, B, G)
    prompts, rows = [], []
    for i in range(B):
        q = f"Q{group_ids[i]}"
        prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": q}] if conversational else q
        prompts.append(prompt)
        rows.append({"prompt": prompt, "solution": solution, "answer": "1"})
    score_calls = []

    def scorer(rows_, prompts_, completions_):
        score_calls.append(len(completions_))
        return _score(rows_, prompts_, completions_)

    # the kit's tokens are characters (ord), like _encode / _decode here
    ctx = make_rollout_context(groups, num_generations=G, rows=rows, service=service, step=step,
                               conversational=conversational, process_index=process_index, gather=gatherer,
                               sampling_logprob=-1.0 if with_logprobs else None, scorer=scorer)
    ctx.score_calls = score_calls
    return ctx


def run_plugin(ctx, **options):
    build_plugins(["hint_scaffold"], {"hint_scaffold": options} if options else None).call(
        "trl_plugins_after_generation", ctx
    )
    return ctx


def _hinted(question, hint, conversational=True):
    content = DEFAULT_TEMPLATE.format(question=question, hint=hint)
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": content}] if conversational else content


def _snapshot(ctx, rows):
    return [(ctx.completion_ids[i], ctx.completions[i], ctx.training_prompts[i], ctx.prompt_ids[i],
             ctx.sampling_logprobs[i] if ctx.sampling_logprobs else None, ctx.offpolicy[i], ctx.prompt_swapped[i],
             dict(ctx.annotations[i])) for i in rows]


# ------------------------------------------------------------------------------------------ group mode (GHPO)
def test_group_mode_neutral_group_kept_and_all_fail_group_replaced_at_first_successful_level():
    G = 3
    service = ScriptedService(need={"Q1": 4})  # Q1 first succeeds with the 50 % hint
    ctx = make_ctx([["no", "OK", "no"], ["no", "no", "no"]], G, service=service)
    before_group0 = _snapshot(ctx, range(3))
    original_prompts = [list(map(dict, p)) for p in ctx.prompts]
    run_plugin(ctx)

    # (a) the group with a success is untouched
    assert _snapshot(ctx, range(3)) == before_group0
    # (b) 25 % first (no success), then 50 %; only the failing group's rows are re-generated; no 75 % round
    assert service.calls == [[_hinted("Q1", "AB")] * 3, [_hinted("Q1", "ABCD")] * 3]
    assert len(ctx) == 6 and len(ctx.completion_ids) == 6  # the group keeps G rows
    assert ctx.changed == {3, 4, 5}
    for j, i in enumerate(range(3, 6)):  # the whole group comes from the 50 % round, failures included
        text = f"{'OK' if j == 0 else 'no'}2.{j}"
        assert ctx.completion_ids[i] == _encode(text)
        assert ctx.completions[i] == [{"role": "assistant", "content": text}]
        assert ctx.training_prompts[i] == _hinted("Q1", "ABCD")  # trained under the hinted prompt
        assert ctx.prompt_ids[i] == _encode(_hinted("Q1", "ABCD")[-1]["content"])
        assert ctx.prompt_swapped[i] is False
        assert ctx.offpolicy[i] == [False] * len(text)  # on-policy w.r.t. the hinted prompt
        assert ctx.sampling_logprobs[i] == [SAMPLING_LP] * len(text)  # real sampling log-probs kept
        assert ctx.annotations[i] == {"hint_level": 0.5}
    assert [list(map(dict, p)) for p in ctx.prompts] == original_prompts  # prompts not mutated
    assert ctx.metrics == {
        "plugins/hint_scaffold/all_fail_group_fraction": [0.5],
        "plugins/hint_scaffold/rescued_group_fraction": [0.5],
        "plugins/hint_scaffold/extra_rollouts": [6.0],
    }


def test_group_mode_groups_rescued_at_different_levels():
    service = ScriptedService(need={"Q0": 2, "Q1": 6})
    ctx = run_plugin(make_ctx([["no", "no"], ["no", "no"]], 2, service=service))
    assert service.calls == [
        [_hinted("Q0", "AB")] * 2 + [_hinted("Q1", "AB")] * 2,
        [_hinted("Q1", "ABCD")] * 2,  # Q0 was rescued at 25 % and is not re-generated
        [_hinted("Q1", "ABCDEF")] * 2,
    ]
    assert [a.get("hint_level") for a in ctx.annotations] == [0.25, 0.25, 0.75, 0.75]
    assert ctx.training_prompts == [_hinted("Q0", "AB")] * 2 + [_hinted("Q1", "ABCDEF")] * 2


def test_no_level_succeeds_keeps_the_original_rollouts_when_asked():
    service = ScriptedService(need={})
    ctx = make_ctx([["no", "no", "no"]], 3, service=service)
    before = _snapshot(ctx, range(3))
    run_plugin(ctx, on_no_success="original")
    assert len(service.calls) == 3  # 25, 50 and 75 % were tried
    assert _snapshot(ctx, range(3)) == before and not ctx.changed
    assert ctx.metrics["plugins/hint_scaffold/rescued_group_fraction"] == [0.0]
    assert ctx.metrics["plugins/hint_scaffold/extra_rollouts"] == [9.0]


def test_no_failing_group_still_calls_nothing_changed():
    service = ScriptedService(need={})
    ctx = run_plugin(make_ctx([["OK", "no"], ["no", "OK"]], 2, service=service))
    # every level is a (collective) call, with no prompt; the loop stops after the first since nothing is open
    assert service.calls == [[]]
    assert not ctx.changed


# ------------------------------------------------------------------------------------------ one mode (Scaf-GRPO)
def test_one_mode_replaces_only_the_slot_with_the_minimal_successful_level():
    G = 3
    service = ScriptedService(need={"Q0": 4, "Q1": 6})
    ctx = make_ctx([["no", "no", "no"], ["no", "no", "no"], ["OK", "no", "no"]], G, service=service)
    before = _snapshot(ctx, range(9))
    run_plugin(ctx, replace="one", replace_index=1)
    # one hinted rollout per all-fail group and level, generated for slot 1 only
    assert service.calls == [
        [_hinted("Q0", "AB"), _hinted("Q1", "AB")],
        [_hinted("Q0", "ABCD"), _hinted("Q1", "ABCD")],
        [_hinted("Q1", "ABCDEF")],
    ]
    assert ctx.changed == {1, 4}
    after = _snapshot(ctx, range(9))
    for i in set(range(9)) - {1, 4}:
        assert after[i] == before[i]
    assert ctx.annotations[1] == {"hint_level": 0.5} and ctx.annotations[4] == {"hint_level": 0.75}
    assert ctx.completions[1] == [{"role": "assistant", "content": "OK2.0"}]
    assert ctx.training_prompts[1] == _hinted("Q0", "ABCD") and ctx.training_prompts[4] == _hinted("Q1", "ABCDEF")
    assert ctx.metrics["plugins/hint_scaffold/extra_rollouts"] == [5.0]


def test_one_mode_replaces_the_configured_slot_and_refuses_a_slot_beyond_the_group():
    service = ScriptedService(need={"Q0": 2})
    ctx = run_plugin(make_ctx([["no", "no", "no"]], 3, service=service), replace="one", replace_index=2)
    assert ctx.changed == {2}
    with pytest.raises(PluginConfigError, match=r"'replace_index' .* got 7; allowed: a slot of the group, 0 to 3 "
                                                r"\(num_generations=4\)"):
        build_stack("hint_scaffold", {"hint_scaffold": {"replace": "one", "replace_index": 7}}, num_generations=4)


# ------------------------------------------------------------------------------------------ prompt swap
@pytest.mark.parametrize("as_offpolicy", [False, True])
def test_train_prompt_original_swaps_the_prompt(as_offpolicy):
    service = ScriptedService(need={"Q0": 4})
    ctx = make_ctx([["no", "no"]], 2, service=service)
    original = [(ctx.training_prompts[i], ctx.prompt_ids[i]) for i in range(2)]
    run_plugin(ctx, train_prompt="original", swapped_as_offpolicy=as_offpolicy)
    assert ctx.changed == {0, 1}
    for i in range(2):
        assert (ctx.training_prompts[i], ctx.prompt_ids[i]) == original[i]  # trained after the original prompt
        assert ctx.prompt_swapped[i] is True
        n = len(ctx.completion_ids[i])
        assert all(math.isnan(x) for x in ctx.sampling_logprobs[i]) and len(ctx.sampling_logprobs[i]) == n
        assert ctx.offpolicy[i] == [as_offpolicy] * n
        assert ctx.annotations[i] == {"hint_level": 0.5}


def test_hf_generation_without_sampling_logprobs():
    service = ScriptedService(need={"Q0": 2})
    ctx = run_plugin(make_ctx([["no", "no"]], 2, service=service, with_logprobs=False))
    assert ctx.sampling_logprobs is None and ctx.changed == {0, 1}


# ------------------------------------------------------------------------------------------ hint text and prompt
def test_hint_text_chars():
    s = "0123456789"
    assert hint_text(s, 0.25, "chars") == "012"  # ceil(2.5)
    assert hint_text(s, 0.5, "chars") == "01234"
    assert hint_text(s, 0.75, "chars") == "01234567"  # ceil(7.5)
    assert hint_text(s, 1.0, "chars") == s
    assert hint_text(s, 0.01, "chars") == "0"  # at least one character
    assert hint_text("x" * 100, 0.07, "chars") == "x" * 7  # 0.07 * 100 = 7.000000000000001 in floating point


def test_hint_text_lines():
    s = "l1\nl2\nl3\nl4\nl5"
    assert hint_text(s, 0.25, "lines") == "l1\nl2"  # ceil(1.25)
    assert hint_text(s, 0.5, "lines") == "l1\nl2\nl3"
    assert hint_text(s, 0.75, "lines") == "l1\nl2\nl3\nl4"
    assert hint_text(s, 1.0, "lines") == s
    assert hint_text(s, 0.01, "lines") == "l1"
    assert hint_text("\n".join(["a"] * 25), 0.28, "lines") == "\n".join(["a"] * 7)  # 0.28 * 25 = 7.000000000000001


def test_hinted_prompt_conversational_and_string():
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
              {"role": "assistant", "content": "a"}, {"role": "user", "content": "Q"}]
    out = hinted_prompt(prompt, "HINT", DEFAULT_TEMPLATE)
    assert out[:3] == prompt[:3]
    assert out[3] == {"role": "user", "content": DEFAULT_TEMPLATE.format(question="Q", hint="HINT")}
    assert prompt[3]["content"] == "Q"  # the input is not mutated
    assert "beginning of the answer" in out[3]["content"] and out[3]["content"].endswith("HINT")
    assert hinted_prompt("Q?", "H", "{question} || {hint}") == "Q? || H"
    with pytest.raises(PluginConfigError, match="no user message"):
        hinted_prompt([{"role": "system", "content": "s"}], "H", DEFAULT_TEMPLATE)


def test_string_prompts_and_lines_unit_end_to_end_in_the_hook():
    service = ScriptedService(need={"Q0": 3})
    ctx = make_ctx([["no", "no"]], 2, service=service, conversational=False, solution="s1\ns2\ns3\ns4")
    run_plugin(ctx, hint_unit="lines")
    assert service.calls[0] == [_hinted("Q0", "s1", conversational=False)] * 2
    assert service.calls[1] == [_hinted("Q0", "s1\ns2", conversational=False)] * 2
    assert ctx.training_prompts == [_hinted("Q0", "s1\ns2", conversational=False)] * 2
    assert ctx.completions[0] == "OK2.0"


# ------------------------------------------------------------------------------------------ warm-up, errors
def test_warmup_steps_skip():
    service = ScriptedService(need={"Q0": 2})
    ctx = make_ctx([["no", "no"]], 2, service=service, step=4)
    run_plugin(ctx, warmup_steps=5)
    assert service.calls == [] and ctx.score_calls == [] and not ctx.changed and ctx.metrics == {}
    ctx = run_plugin(make_ctx([["no", "no"]], 2, service=service, step=5), warmup_steps=5)
    assert ctx.changed == {0, 1}


def _three_other_processes(t):
    """Gather as if 3 earlier processes held rows 0..11 (all successful) and raised no error flag."""
    if t.numel() == 1:  # the plugin's error flag: -1 = nothing wrong on that process
        return torch.cat([torch.full((3,), -1, dtype=t.dtype), t])
    return torch.cat([torch.ones(12, dtype=t.dtype), t])


@pytest.mark.parametrize("solution", [None, ""])
def test_missing_solution_is_a_clear_error_naming_the_row(solution):
    # process 3 of 4 holds global rows 12..15; the other processes' groups all succeed; group of rows 14, 15 fails
    ctx = make_ctx([["OK", "no"], ["no", "no"]], 2, service=ScriptedService(need={}), solution=solution,
                   process_index=3, gatherer=_three_other_processes)
    with pytest.raises(PluginConfigError, match=r"row 14 .*'solution'"):
        run_plugin(ctx)


def test_missing_solution_column_refused_at_construction(tmp_path):
    data = tiny_dataset(4).remove_columns("solution")
    with pytest.raises(PluginConfigError, match=r"'hint_scaffold'.*'solution'"):
        make_tiny_trainer(plugins=["hint_scaffold"], dataset=data, output_dir=str(tmp_path))
    with pytest.raises(PluginConfigError, match=r"'reference'"):
        make_tiny_trainer(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"solution_column": "reference"}},
                          output_dir=str(tmp_path))


def test_option_validation():
    with pytest.raises(PluginConfigError, match="hint_fractions"):
        build_plugins(["hint_scaffold"], {"hint_scaffold": {"hint_fractions": [0.5, 1.5]}})
    with pytest.raises(PluginConfigError, match="hint_fractions"):
        build_plugins(["hint_scaffold"], {"hint_scaffold": {"hint_fractions": []}})
    with pytest.raises(PluginConfigError, match="template"):
        build_plugins(["hint_scaffold"], {"hint_scaffold": {"template": "{question} only"}})


# ------------------------------------------------------------------------------------------ two processes
@pytest.mark.parametrize("replace", ["group", "one"])
def test_two_processes_issue_the_same_generation_calls(replace):
    """Rank 0 holds a group with a success, rank 1 an all-fail group: both call the service once per level."""
    coll = SimulatedCollective(2)
    services = [ScriptedService(need={"Q1": 4}), ScriptedService(need={"Q1": 4})]
    groups = [[["OK", "no"]], [["no", "no"]]]
    ctxs = [make_ctx(groups[r], 2, service=services[r], process_index=r,
                     gatherer=lambda t, r=r: coll.gather(r, t)) for r in range(2)]
    errors = []

    def work(r):
        try:
            run_plugin(ctxs[r], replace=replace)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert [len(s.calls) for s in services] == [2, 2]
    assert services[0].calls == [[], []]
    assert not ctxs[0].changed
    assert ctxs[1].changed == ({0, 1} if replace == "group" else {0})
    for ctx in ctxs:
        assert ctx.metrics["plugins/hint_scaffold/all_fail_group_fraction"] == [0.5]
        assert ctx.metrics["plugins/hint_scaffold/rescued_group_fraction"] == [0.5]


# ------------------------------------------------------------------------------------------ end to end
def test_end_to_end_hinted_prompts_are_trained(tmp_path):
    """Real HF generation on the tiny model; the reward is 0 until the second hinted round of a batch (50 %) and
    dense after it. Every group fails, the 50 % group replaces it, and the training batch's prompt ids are the
    hinted prompts' ids (chat template applied) and its completions the 50 % round's completions."""
    phase = {"round": 0}

    def staged_reward(completions, **kwargs):
        texts = [_text(c) for c in completions]
        if phase["round"] < 2:
            return [0.0] * len(texts)
        return [1.0 + len(set(t)) / 20 for t in texts]  # > 0 (success) and varied (non-zero advantages)

    trainer = make_tiny_trainer(plugins=["hint_scaffold"], reward_funcs=[staged_reward], max_steps=2,
                                output_dir=str(tmp_path))
    service = trainer.generation_service
    rounds = []
    original_generate, original_begin = service.generate, service.begin_batch

    def begin_batch(*args, **kwargs):
        phase["round"] = 0
        rounds.append([])
        return original_begin(*args, **kwargs)

    def generate(*args, **kwargs):
        phase["round"] += 1
        out = original_generate(*args, **kwargs)
        rounds[-1].append((kwargs["prompts"], out))
        return out

    service.generate, service.begin_batch = generate, begin_batch
    batches = []
    original_gen = trainer._generate_and_score_completions

    def gen(inputs):
        out = original_gen(inputs)
        batches.append((inputs, out))
        return out

    trainer._generate_and_score_completions = gen
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)

    tok = trainer.processing_class
    assert len(batches) == 2 and len(rounds) == 2
    for (inputs, out), batch_rounds in zip(batches, rounds):
        assert len(batch_rounds) == 2  # 25 % (fails), 50 % (succeeds): no 75 % round
        hinted_prompts, completions = batch_rounds[1]
        assert len(inputs) == len(hinted_prompts) == out["prompt_ids"].size(0) == trainer.num_generations
        for i, row in enumerate(inputs):
            half = row["solution"][: math.ceil(0.5 * len(row["solution"]))]
            expected_prompt = [{"role": "user", "content": DEFAULT_TEMPLATE.format(
                question=row["prompt"][-1]["content"], hint=half)}]
            assert hinted_prompts[i] == expected_prompt
            text = tok.apply_chat_template(expected_prompt, add_generation_prompt=True, tokenize=False)
            expected_ids = tok(text, add_special_tokens=False)["input_ids"]
            ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
            assert ids == expected_ids
            plain = tok(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]
            assert ids != plain
            got = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
            assert got == completions[i].completion_ids[: len(got)] and len(got) > 0
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/hint_scaffold/all_fail_group_fraction"] == 1.0
        assert log["plugins/hint_scaffold/rescued_group_fraction"] == 1.0
        assert log["plugins/hint_scaffold/extra_rollouts"] == 2 * trainer.num_generations
        assert log["reward"] > 1.0 and log["reward_std"] > 0  # TRL's reward of the trained (replaced) rows
