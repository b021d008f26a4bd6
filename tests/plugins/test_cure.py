"""cure: critical-token re-concatenation.

The critical position is chosen among the top-k valid positions (never index 0, never a special token); the branch
prompt is the exact concatenation prompt + response[:t*]; the group keeps G = n1 (1 + n2) rows; n2 = 0 is vanilla.
Unit tests drive the hook on hand-built RolloutContexts with a scripted service; the end-to-end run uses the tiny
model and checks the training batch."""

import threading

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import Completion, Plugin, PluginConfigError, build_plugins, hookimpl
from trl_plugins.api.contexts import group_layout
from trl_plugins.testing import (
    SimulatedCollective,
    assert_runs_equal,
    digit_fraction_reward,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    temporary_plugin,
    tiny_tokenizer,
)
from trl_plugins_builtin.cure import (
    branch_source,
    choose_position,
    critical_candidates,
    group_layout_cure,
    row_generator,
)

TOK = tiny_tokenizer()


# ------------------------------------------------------------------------------------------ pure functions
def test_candidates_walk_by_descending_entropy_and_skip_invalid_positions():
    ids = TOK("ab cd", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    texts = [TOK.decode([t]) for t in ids]  # "a", "b", " ", "c", "d", "<|end|>"
    ent = [9.0, 1.0, 8.0, 3.0, 2.0, 7.0]
    special = set(TOK.all_special_ids)
    # index 0 (highest) skipped, " " fails the stripped-length rule, <|end|> is special
    assert critical_candidates(ent, ids, texts, special, top_k=20, min_chars=1) == [3, 4, 1]
    assert critical_candidates(ent, ids, texts, special, top_k=2, min_chars=1) == [3, 4]
    # the official rule (stripped text longer than one character) rejects every character token
    assert critical_candidates(ent, ids, texts, special, top_k=20, min_chars=2) == []
    # without the special-token check <|end|> (7 characters) would be the best candidate
    assert critical_candidates(ent, ids, texts, set(), top_k=1, min_chars=2) == [5]


def test_candidates_ties_broken_by_position_and_explicit_order():
    ids, texts = [10, 11, 12, 13], ["xx", "yy", "zz", "ww"]
    assert critical_candidates([1.0, 1.0, 1.0, 1.0], ids, texts, set(), top_k=2, min_chars=2) == [1, 2]
    assert critical_candidates([0.0] * 4, ids, texts, set(), top_k=3, min_chars=2, order=[3, 0, 1, 2]) == [3, 1, 2]


def test_choose_position_uniform_over_candidates_and_zero_without():
    assert choose_position([], row_generator(0, 0, 0)) == 0
    picks = [choose_position([4, 7, 9], row_generator(0, 3, g)) for g in range(300)]
    assert set(picks) == {4, 7, 9} and all(60 < picks.count(x) < 140 for x in (4, 7, 9))
    # deterministic in (seed, step, global row): every process draws the same for a row
    assert choose_position([4, 7, 9], row_generator(5, 2, 11)) == choose_position([4, 7, 9], row_generator(5, 2, 11))


def test_group_layout_is_n1_originals_then_n2_branches_each():
    assert group_layout_cure(16, 3) == 4  # the paper's 4 + 12
    assert [branch_source(j, 4, 3) for j in range(16)] == [None] * 4 + [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    with pytest.raises(PluginConfigError, match="multiple of 1 \\+ branches_per_response"):
        group_layout_cure(6, 3)


# ------------------------------------------------------------------------------------------ the hook
class ScriptedService:
    """Returns continuation ids [900 + call, 800 + j] with log-prob -0.5 per token; records the requests."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None):
        assert prompts is None and prefix_ids is None
        self.calls.append([list(p) for p in prompt_ids])
        return [Completion(completion_ids=[900 + len(self.calls), 800 + j], logprobs=[-0.5, -0.5], text="")
                for j in range(len(prompt_ids))]


def make_ctx(completions, G, *, process_index=0, gatherer=None, entropy_fn=None, service=None, step=0):
    """``completions``: B lists of token ids (local rows). Prompt ids of group g are [1000 + g]."""
    _, group_ids, _ = group_layout(process_index, len(completions), G)
    calls = []

    def entropies(prompt_ids, completion_ids):
        calls.append([list(c) for c in completion_ids])
        return entropy_fn(prompt_ids, completion_ids) if entropy_fn else [torch.zeros(len(c)) for c in completion_ids]

    ctx = make_rollout_context(
        [TOK.decode(c) for c in completions], num_generations=G, process_index=process_index, gather=gatherer,
        service=service or ScriptedService(), step=step, tokenizer=TOK, prompt_ids=[[1000 + g] for g in group_ids],
        tokenize_prompts=lambda ps: [[1000] for _ in ps],
        decode=lambda ids, prompt: [{"role": "assistant", "content": TOK.decode(ids)}], policy_entropies=entropies,
    )
    ctx.entropy_calls = calls  # every forward's completion ids (the kit's own record counts rows only)
    return ctx


def run(ctx, **options):
    options.setdefault("min_token_chars", 1)
    build_plugins(["cure"], {"cure": options}).call("trl_plugins_after_generation", ctx)
    return ctx


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def peak_at(position):
    return lambda prompts, comps: [torch.tensor([5.0 if t == position else 0.1 for t in range(len(c))]) for c in comps]


def test_hook_branches_from_the_highest_entropy_prefix_and_keeps_the_group_size():
    # G = 4, n2 = 3: row 0 of each group is the original, rows 1..3 its branches; top_k = 1 -> t* is the peak
    comps = [_ids("12+3=15"), _ids("xx"), _ids("yy"), _ids("zz"), _ids("4*2=8"), _ids("aa"), _ids("bb"), _ids("cc")]
    ctx = make_ctx(comps, 4, entropy_fn=peak_at(3))
    before = [list(c) for c in ctx.completion_ids]
    run(ctx, top_k=1)
    assert ctx.entropy_calls == [[before[0], before[4]]]  # one forward over the originals only
    prefix0, prefix1 = before[0][:3], before[4][:3]  # the tokens before the critical token "3" / "2"
    assert ctx.service.calls == [[[1000] + prefix0] * 3 + [[1001] + prefix1] * 3]
    assert len(ctx.completion_ids) == 8 and ctx.changed == {1, 2, 3, 5, 6, 7}
    assert ctx.completion_ids[0] == before[0] and ctx.completion_ids[4] == before[4]  # originals untouched
    for j, i in enumerate([1, 2, 3, 5, 6, 7]):
        group, prefix = (0, prefix0) if i < 4 else (1, prefix1)
        assert ctx.prompt_ids[i] == [1000 + group] + prefix  # the branch trains on prompt + prefix ...
        assert ctx.completion_ids[i] == [901, 800 + j]  # ... and only on its continuation
        assert ctx.sampling_logprobs[i] == [-0.5, -0.5] and ctx.prompt_swapped[i] is False
        assert ctx.offpolicy[i] == [False, False]
        assert ctx.annotations[i] == {"cure_branch_of": 4 * group, "cure_prefix_tokens": 3}
    assert ctx.metrics["plugins/cure/extra_rollouts"] == [6.0]
    assert ctx.metrics["plugins/cure/critical_token_entropy"] == [5.0]


def test_hook_branch_layout_for_two_originals():
    # G = 4, n2 = 1: originals rows 0, 1; row 2 branches from 0 and row 3 from 1
    comps = [_ids("abcd"), _ids("wxyz"), _ids("--"), _ids("--")]
    ctx = run(make_ctx(comps, 4, entropy_fn=peak_at(2)), branches_per_response=1, top_k=1)
    assert ctx.service.calls == [[[1000] + _ids("ab"), [1000] + _ids("wx")]]
    assert ctx.changed == {2, 3}


def test_no_valid_position_branches_from_the_prompt():
    comps = [[TOK.eos_token_id], _ids("x"), _ids("y"), _ids("z")]  # only a special token at index 0
    ctx = run(make_ctx(comps, 4))
    assert ctx.service.calls == [[[1000]] * 3]
    assert ctx.metrics["plugins/cure/no_candidate_fraction"] == [1.0]


def test_random_selection_needs_no_entropy_forward():
    ctx = run(make_ctx([_ids("abcdef"), _ids("x"), _ids("y"), _ids("z")], 4), selection="random")
    assert ctx.entropy_calls == [] and len(ctx.service.calls) == 1
    assert 1 <= ctx.annotations[1]["cure_prefix_tokens"] <= 5


@pytest.mark.parametrize("options", [{"branches_per_response": 0}, {"stage1_steps": 3}])
def test_switched_off_does_nothing(options):
    ctx = make_ctx([_ids("abc"), _ids("x"), _ids("y"), _ids("z")], 4, step=3)
    run(ctx, **options)
    assert ctx.entropy_calls == [] and ctx.service.calls == [] and not ctx.changed and ctx.metrics == {}


def test_indivisible_group_is_refused():
    with pytest.raises(PluginConfigError, match="num_generations=6"):
        run(make_ctx([_ids("a")] * 6, 6))


def test_group_straddling_two_processes():
    """G = 4 over 2 processes of 2 rows: the original lives on rank 0, two of its branches on rank 1."""
    coll = SimulatedCollective(2)
    comps = [[_ids("5+5=10"), _ids("aa")], [_ids("bb"), _ids("cc")]]
    ctxs = [make_ctx(comps[r], 4, process_index=r, entropy_fn=peak_at(2), gatherer=lambda t, r=r: coll.gather(r, t))
            for r in range(2)]
    errors = []

    def work(r):
        try:
            run(ctxs[r], top_k=1)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    prefix = _ids("5+")
    assert [len(c.entropy_calls) for c in ctxs] == [1, 1]  # the forward is collective: rank 1 calls with no row
    assert ctxs[1].entropy_calls == [[]]
    assert ctxs[0].service.calls == [[[1000] + prefix]] and ctxs[1].service.calls == [[[1000] + prefix] * 2]
    assert ctxs[0].changed == {1} and ctxs[1].changed == {0, 1}
    assert ctxs[1].prompt_ids == [[1000] + prefix] * 2


# ------------------------------------------------------------------------------------------ trainer runs
class _Recorder(Plugin):
    """Listed before cure: records the batch as generated and the policy entropies of every row."""

    name = "test_cure_recorder"

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = []
        self.trainer = None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.trainer = trainer  # the reference forward below needs the model (a test plugin, not a method)

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        reference = []
        model, temperature = self.trainer.model, self.trainer.temperature
        for p, c in zip(ctx.prompt_ids, ctx.completion_ids):  # full-vocabulary entropies, one row at a time
            with torch.no_grad():
                logits = model(torch.tensor([p + c])).logits[0, len(p) - 1: len(p) + len(c) - 1]
            reference.append(torch.distributions.Categorical(logits=logits.float() / temperature).entropy())
        self.seen.append({"before": [list(c) for c in ctx.completion_ids],
                          "prompt_ids": [list(p) for p in ctx.prompt_ids],
                          "entropies": ctx.policy_entropies(range(len(ctx))), "reference": reference})


@pytest.fixture(scope="module")
def cure_run(tmp_path_factory):
    with temporary_plugin(_Recorder):
        trainer = make_tiny_trainer(plugins=["test_cure_recorder", "cure"],
                                    plugin_config={"cure": {"min_token_chars": 1, "top_k": 5}},
                                    reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error",
                                    output_dir=str(tmp_path_factory.mktemp("cure")))
    seen = trainer.plugin_stack.by_name["test_cure_recorder"].seen
    batches = []
    original_gen = trainer._generate_and_score_completions

    def gen(inputs):
        batches.append(original_gen(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = gen
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    record = record_run(trainer)
    return trainer, seen, batches, before, record


def test_policy_entropies_match_a_full_vocabulary_forward(cure_run):
    """RolloutContext.policy_entropies (batched, padded, TRL's fused head) == a plain per-row forward."""
    _, seen, *_ = cure_run
    for s in seen:
        assert [len(e) for e in s["entropies"]] == [len(c) for c in s["before"]]
        for got, expected in zip(s["entropies"], s["reference"]):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_end_to_end_branch_rows_train_on_prompt_plus_prefix(cure_run):
    trainer, seen, batches, before, record = cure_run
    assert len(batches) == 2
    for batch, s in zip(batches, seen):
        original_prompt, original = s["prompt_ids"][0], s["before"][0]
        got_original = batch["completion_ids"][0][batch["completion_mask"][0].bool()].tolist()
        assert got_original == original[: len(got_original)]  # the original row is kept
        for i in range(4):
            got_prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            assert got_prompt[: len(original_prompt)] == original_prompt
            if i > 0:  # a branch: original prompt + a prefix of the original's completion (t* >= 1)
                k = len(got_prompt) - len(original_prompt)
                assert 1 <= k < len(original) and got_prompt[len(original_prompt):] == original[:k]
    assert any(not torch.equal(before[n], p) for n, p in record.params.items())
    logs = [log for log in record.logs if "loss" in log]
    assert all(log["plugins/cure/extra_rollouts"] == 3 for log in logs)
    assert all(log["plugins/framework/extra_rollouts"] == 3 for log in logs)


def test_configure_refuses_an_indivisible_group(tmp_path):
    with pytest.raises(PluginConfigError, match="num_generations=4"):
        make_tiny_trainer(plugins=["cure"], plugin_config={"cure": {"branches_per_response": 2}},
                          output_dir=str(tmp_path))


def test_no_branches_is_vanilla(tmp_path):
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=1, log_level="error")
    with_plugin = record_run(make_tiny_trainer(plugins=["cure"], plugin_config={"cure": {"branches_per_response": 0}},
                                               output_dir=str(tmp_path / "a"), **common))
    vanilla = record_run(make_tiny_trainer(trainer_cls=GRPOTrainer, output_dir=str(tmp_path / "b"), **common))
    assert_runs_equal(with_plugin, vanilla)
