"""scope: SCOPE step-wise correction of failed rollouts.

Unit tests drive the after-generation hook on hand-built RolloutContexts (the real tiny tokenizer, the bundled
tasks' reward and programmatic PRM, stub teachers / generation service); trainer-level tests use a scripted
generation backend that returns vLLM-style log-probs; one end-to-end run stacks scope with lp_reg on the tiny model."""

import math
from types import SimpleNamespace

import pytest
import torch
import trl

from trl_plugins import (
    Completion, IncompatiblePluginsError, PluginConfigError, PluginError, RunInfo, build_plugins,
)
from trl_plugins.components.prm import FunctionPRM, ProgrammaticPRM, arithmetic_row
from trl_plugins.components.teacher import ReferenceTeacher
from trl_plugins.api.contexts import OFFPOLICY_KEY, group_layout
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, make_dataset
from trl_plugins.testing import (
    assert_runs_equal,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_on_processes,
    tiny_model,
    tiny_tokenizer,
)

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
PROBLEMS = [Problem.from_expression([3, 4, 2, 5], ["+", "*", "-"]), Problem.from_expression([6, 2, 3], ["-", "*"])]
# PROBLEMS[0]: 3+4=7 / 7*2=14 / 14-5=9 / Answer: 9      PROBLEMS[1]: 6-2=4 / 4*3=12 / Answer: 12
BASE = {"mode": "reference_suffix", "prm": "programmatic"}


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"] + [EOS]


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def make_ctx(groups, *, service=None, process_index=0, gatherer=None, with_logprobs=True, step=0):
    """``groups``: one list of completion texts per local group (group g asks PROBLEMS[g])."""
    G = len(groups[0])
    B = G * len(groups)
    _, group_ids, _ = group_layout(process_index, B, G)
    rows = []
    for i in range(B):
        p = PROBLEMS[group_ids[i] % len(PROBLEMS)]
        prompt = [{"role": "user", "content": p.question}]
        rows.append({"prompt": prompt, "answer": str(p.answer), "solution": p.solution, "problem": p.to_json()})

    def question_ids(prompts):
        return [TOK(p[-1]["content"], add_special_tokens=False)["input_ids"] for p in prompts]

    return make_rollout_context(
        groups, num_generations=G, rows=rows, service=service, process_index=process_index, gather=gatherer,
        step=step, tokenizer=TOK, eos=True, run=RunInfo(max_completion_length=64),
        sampling_logprob=(lambda j: -0.1 - 0.01 * j) if with_logprobs else None,
        prompt_ids=question_ids([r["prompt"] for r in rows]), tokenize_prompts=question_ids,
        scorer=lambda rows_, prompts_, comps: torch.tensor(accuracy_reward(comps, [r["answer"] for r in rows_])),
    )


def run(ctx, prm=None, corrector=None, **options):
    stack = build_plugins(["scope"], {"scope": {**BASE, **options}})
    plugin = list(stack)[0]
    plugin.prm = prm
    plugin.teacher = corrector
    stack.call("trl_plugins_after_generation", ctx)
    return plugin


def metric(ctx, name):
    return ctx.metrics[f"plugins/scope/{name}"][0]


ONE_SLIP = "3+4=7\n7*2=15\n15-5=10\nAnswer: 10"  # first error at step 1 (0-based): one verified step
TWO_OK = "3+4=7\n7*2=14\n14-5=8\nAnswer: 8"  # first error at step 2: two verified steps
WRONG_FIRST = "3+5=8\n8*2=16\n16-5=11\nAnswer: 11"  # first step wrong: nothing to salvage
RIGHT = PROBLEMS[0].solution


# ------------------------------------------------------------------------------------------ splice invariants
def test_reference_suffix_keeps_the_verified_prefix_token_exact():
    ctx = make_ctx([[ONE_SLIP, WRONG_FIRST, RIGHT, "junk"]])
    before = {i: (list(ctx.completion_ids[i]), list(ctx.sampling_logprobs[i])) for i in range(4)}
    run(ctx, prm=ProgrammaticPRM())
    assert ctx.changed == {0}  # WRONG_FIRST (k*=0) and junk have nothing to salvage; RIGHT succeeded
    L = len(TOK("3+4=7\n", add_special_tokens=False)["input_ids"])
    ids = ctx.completion_ids[0]
    assert ids[:L] == before[0][0][:L]  # prefix token-exact
    assert ids[L:] == _ids("7*2=14\n14-5=9\nAnswer: 9")  # the reference from its step 1 on, EOS-terminated
    assert _text(ctx.completions[0]) == RIGHT
    assert ctx.offpolicy[0] == [False] * L + [True] * (len(ids) - L)
    assert ctx.sampling_logprobs[0][:L] == before[0][1][:L]  # the policy's log-probs are kept on the prefix
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[0][L:])
    for i in (1, 2, 3):  # untouched rows bit-identical
        assert (ctx.completion_ids[i], ctx.sampling_logprobs[i]) == before[i]
        assert not any(ctx.offpolicy[i])
    assert ctx.annotations[0] == {"scope_first_error": 1, "scope_prefix_tokens": L}
    assert metric(ctx, "rectified_fraction") == 0.25 and metric(ctx, "acceptance_rate") == 1.0
    assert metric(ctx, "candidate_fraction") == 0.75 and metric(ctx, "mean_prefix_steps") == 1.0


def test_at_most_m_per_group_longest_prefix_first():
    ctx = make_ctx([[ONE_SLIP, TWO_OK, ONE_SLIP, "junk"]])
    run(ctx, prm=ProgrammaticPRM())
    assert ctx.changed == {1}  # two verified steps beat one
    ctx = make_ctx([[ONE_SLIP, TWO_OK, ONE_SLIP, "junk"]])
    run(ctx, prm=ProgrammaticPRM(), max_per_group=2, tie_break="first")
    assert ctx.changed == {0, 1}  # then the first of the tied one-step prefixes
    assert all(_text(ctx.completions[i]) == RIGHT for i in (0, 1))
    ctx = make_ctx([[ONE_SLIP, ONE_SLIP, ONE_SLIP, ONE_SLIP], [ONE_SLIP] * 4])
    run(ctx, prm=ProgrammaticPRM(), max_per_group=3)
    # group 0: M = 3 of its 4 repairable rows; group 1 asks PROBLEMS[1], whose first step ONE_SLIP gets wrong
    assert len(ctx.changed) == 3 and all(ctx.group_ids[i] == 0 for i in ctx.changed)
    assert len(ctx.completion_ids) == 8


def test_min_prefix_steps_zero_repairs_from_scratch():
    ctx = make_ctx([[WRONG_FIRST, "junk", "xx", "yy"]])
    run(ctx, prm=ProgrammaticPRM(), min_prefix_steps=0, tie_break="first")
    assert ctx.changed == {0} and _text(ctx.completions[0]) == RIGHT
    assert all(ctx.offpolicy[0])  # nothing of the policy's kept


# ------------------------------------------------------------------------------------------ acceptance, teacher
class StubTeacher:
    def __init__(self, text):
        self.text, self.calls = text, []

    def continue_from(self, rows, prompts, prefixes, *, stop=None, max_tokens=None):
        self.calls.append((list(prefixes), stop, max_tokens))
        return [self.text(p) if callable(self.text) else self.text for p in prefixes]


def test_only_verified_repairs_are_accepted():
    teacher = StubTeacher("7*2=14\n14-5=9\nAnswer: 1")  # a wrong correction
    ctx = make_ctx([[ONE_SLIP, "junk"]])
    run(ctx, prm=ProgrammaticPRM(), corrector=teacher, mode="teacher_suffix", teacher="hf")
    assert teacher.calls == [(["3+4=7\n"], None, 64)] and not ctx.changed
    assert metric(ctx, "acceptance_rate") == 0.0 and metric(ctx, "rectified_fraction") == 0.0
    ctx = make_ctx([[ONE_SLIP, "junk"]])
    run(ctx, prm=ProgrammaticPRM(), corrector=teacher, mode="teacher_suffix", teacher="hf", accept="any")
    assert ctx.changed == {0} and _text(ctx.completions[0]).endswith("Answer: 1")


def test_groups_option_and_no_error_policy():
    groups = [[ONE_SLIP, RIGHT], [ONE_SLIP.replace("3+4=7", "6-2=4"), "junk"]]  # group 1 (PROBLEMS[1]) all fail
    ctx = make_ctx(groups)
    run(ctx, prm=ProgrammaticPRM(), scope_groups="no_success")
    assert ctx.changed == {2}
    ctx = make_ctx(groups)
    run(ctx, prm=ProgrammaticPRM(), scope_groups="partial")
    assert ctx.changed == {0}
    blind = FunctionPRM(lambda row, steps: [1.0] * len(steps), separator="\n")  # disagrees with the verifier
    ctx = make_ctx([[ONE_SLIP, "x"]])
    run(ctx, prm=blind)
    assert not ctx.changed and metric(ctx, "prm_no_error_fraction") == 1.0
    ctx = make_ctx([[ONE_SLIP, "x"]])
    run(ctx, prm=blind, no_error_policy="last_step", accept="any")
    L = len(TOK("3+4=7\n7*2=15\n15-5=10\n", add_special_tokens=False)["input_ids"])
    assert ctx.changed == {0} and ctx.offpolicy[0].index(True) == L  # rectified from the answer line


# ------------------------------------------------------------------------------------------ teacher_step
class ScriptedService:
    def __init__(self, continuation):
        self.continuation, self.calls = continuation, []

    def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None):
        self.calls.append((prompt_ids, prefix_ids))
        new = _ids(self.continuation)
        return [Completion(completion_ids=list(p) + new, logprobs=[math.nan] * len(p) + [-0.7] * len(new), text="")
                for p in prefix_ids]


def test_teacher_step_policy_continues_after_one_corrected_step():
    teacher = StubTeacher("7*2=14")
    service = ScriptedService("14-5=9\nAnswer: 9")
    ctx = make_ctx([[ONE_SLIP, "junk"]], service=service)
    before = list(ctx.sampling_logprobs[0])
    run(ctx, prm=ProgrammaticPRM(), corrector=teacher, mode="teacher_step", teacher="hf")
    assert teacher.calls[0][1] == ["\n"]  # the teacher writes one step: it stops at the separator
    L = len(TOK("3+4=7\n", add_special_tokens=False)["input_ids"])
    S = len(TOK("7*2=14\n", add_special_tokens=False)["input_ids"])
    (prompt_ids, prefix_ids), = service.calls
    assert prompt_ids == [ctx.prompt_ids[0]] and prefix_ids == [_ids("3+4=7\n7*2=14\n")[:-1]]
    n = len(ctx.completion_ids[0])
    assert _text(ctx.completions[0]) == RIGHT
    assert ctx.offpolicy[0] == [False] * L + [True] * S + [False] * (n - L - S)  # only the step is off-policy
    lps = ctx.sampling_logprobs[0]
    assert lps[:L] == before[:L] and all(math.isnan(x) for x in lps[L:L + S]) and lps[L + S:] == [-0.7] * (n - L - S)


def test_teacher_step_calls_the_service_even_without_a_repair():
    service = ScriptedService("x")
    ctx = make_ctx([[RIGHT, RIGHT]], service=service)
    run(ctx, prm=ProgrammaticPRM(), corrector=StubTeacher("?"), mode="teacher_step", teacher="hf")
    assert service.calls == [([], [])] and not ctx.changed


class ReferenceService(ScriptedService):
    """Continues each prefix with the rest of PROBLEMS[0]'s reference solution."""

    def __init__(self):
        super().__init__("")

    def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None):
        self.calls.append((prompt_ids, prefix_ids))
        out = []
        for p in prefix_ids:
            done = len(TOK.decode(p).splitlines())
            new = _ids("\n".join(PROBLEMS[0].solution_lines[done:]))
            out.append(Completion(completion_ids=list(p) + new, logprobs=[math.nan] * len(p) + [-0.7] * len(new),
                                  text=""))
        return out


TWO_PROCESS_TEXTS = [[ONE_SLIP, RIGHT], [TWO_OK, "junk"]]


def _on_two_processes(services, edit=None, **options):
    """One group of G = 4 split over two simulated processes (rows 0,1 on rank 0, rows 2,3 on rank 1), scope run on
    each; ``edit(rank, ctx)`` may change a context first. Returns the contexts and each rank's exception (or None)."""
    ctxs = [None, None]

    def work(rank, gather):
        ctx = make_ctx([TWO_PROCESS_TEXTS[rank] + ["pad", "pad"]], service=services[rank], gatherer=gather)
        for name in ("rows", "prompts", "training_prompts", "prompt_ids", "completion_ids", "completions",
                     "sampling_logprobs", "offpolicy", "prompt_swapped", "annotations"):
            setattr(ctx, name, getattr(ctx, name)[:2])
        ctx.global_index, ctx.group_ids, ctx.index_in_group = group_layout(rank, 2, 4)
        if edit is not None:
            edit(rank, ctx)
        ctxs[rank] = ctx
        try:
            run(ctx, prm=ProgrammaticPRM(), corrector=ReferenceTeacher(separator="\n"), **options)
        except Exception as exc:  # returned: both ranks' outcomes are checked
            return exc
        return None

    return ctxs, run_on_processes(2, work, timeout=20)


def test_two_processes_choose_per_group_on_gathered_data():
    """A group split over two processes: each holds one repairable row; only the longer prefix is repaired, on
    whichever process holds it, and both processes make the same collective calls."""
    services = [ReferenceService(), ReferenceService()]
    ctxs, errors = _on_two_processes(services, mode="teacher_step", teacher="hf")
    assert errors == [None, None]
    assert [len(s.calls) for s in services] == [1, 1]
    assert not ctxs[0].changed and ctxs[1].changed == {0}  # TWO_OK (global row 2) wins over ONE_SLIP (row 0)
    assert ctxs[0].metrics["plugins/scope/rectified_fraction"] == ctxs[1].metrics["plugins/scope/rectified_fraction"]


@pytest.mark.parametrize("mode", ["teacher_step", "reference_suffix"])
def test_missing_solution_on_one_process_stops_every_process(mode):
    """Rank 1's repairable row has no reference solution: rank 1 raises the config error and rank 0 raises too
    (naming process 1) instead of waiting in the next collective forever."""

    def drop_solution(rank, ctx):
        if rank == 1:
            ctx.rows[0] = {**ctx.rows[0], "solution": ""}

    _, errors = _on_two_processes([ReferenceService(), ReferenceService()], drop_solution, mode=mode, teacher="hf")
    assert isinstance(errors[1], PluginConfigError) and "no reference solution" in str(errors[1])
    assert isinstance(errors[0], PluginError) and "process 1 failed" in str(errors[0])


# ------------------------------------------------------------------------------------------ options
def test_options_and_construction_checks(tmp_path):
    with pytest.raises(PluginConfigError, match="teacher_base_url"):
        build_plugins(["scope"], {"scope": {"prm": "programmatic"}})
    with pytest.raises(PluginConfigError, match="prm_base_url"):
        build_plugins(["scope"], {"scope": {"mode": "reference_suffix", "prm": "endpoint"}})
    plugin = list(build_plugins(["scope"], {"scope": {**BASE, "gamma": 0.2}}))[0]
    with pytest.raises(IncompatiblePluginsError, match="offpolicy_shaping_gamma"):  # refused at construction
        plugin.trl_plugins_configure(trainer=None, args=SimpleNamespace(offpolicy_shaping_gamma=0.1))
    with pytest.raises(PluginConfigError, match="'problem'"):
        make_tiny_trainer(plugins=["scope"], plugin_config={"scope": BASE}, output_dir=str(tmp_path),
                          dataset=make_dataset(4).remove_columns("problem"))
    plugin = list(build_plugins(["scope"], {"scope": BASE}))[0]
    assert plugin.reconstructed and all(
        info.reconstructed for info in plugin.Options.describe()
        if info.name in ("mode", "teacher", "threshold", "accept", "max_per_group", "gamma", "scope_groups"))


# ------------------------------------------------------------------------------------------ trainer level
G = 4


def _partly_right_backend(tok, calls):
    """A generation backend (vLLM-like: returns log-probs) answering each prompt with one right step then a slip."""

    def fake(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(len(prompt_ids))
        ids_out, lps_out = [], []
        for ids in prompt_ids:
            text = tok.decode(ids, skip_special_tokens=True)
            problem = Problem.from_json(arithmetic_row(text[text.index("Compute"):])["problem"])
            a, op, b, c = problem.steps[0]
            completion = f"{a}{op}{b}={c}\n{c}+1000=0\nAnswer: 0"
            out = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids_out.append(out)
            lps_out.append([-0.2] * len(out))
        return ids_out, lps_out

    return fake


def test_trainer_rectifies_with_nan_sampling_logps_and_no_is_correction(tmp_path, monkeypatch):
    trainer = make_tiny_trainer(plugins=["scope"], plugin_config={"scope": BASE}, max_completion_length=40,
                                output_dir=str(tmp_path), log_level="error")
    calls = []
    trainer._generate_single_turn = _partly_right_backend(trainer.processing_class, calls)
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_truncate")
    ds = trainer.train_dataset
    rows = [dict(ds[k]) for k in range(2) for _ in range(G)]
    trainer.model.train()
    out = trainer._generate_and_score_completions(rows)
    assert calls == [2 * G]  # exactly G rollouts per prompt from the backend; repairs cost no generation
    mask = out["completion_mask"].bool()
    off = out[OFFPOLICY_KEY]
    lps = out["sampling_per_token_logps"]
    tok = trainer.processing_class
    repaired = [i for i in range(2 * G) if off[i].any()]
    assert len(repaired) == 2 and {i // G for i in repaired} == {0, 1}  # one per group
    for i in range(2 * G):
        n = int(mask[i].sum())
        ids = out["completion_ids"][i, :n].tolist()
        if i in repaired:
            problem = Problem.from_json(rows[i]["problem"])
            L = len(tok(problem.step_lines[0] + "\n", add_special_tokens=False)["input_ids"])
            assert tok.decode(ids, skip_special_tokens=True) == problem.solution
            assert off[i, :n].tolist() == [False] * L + [True] * (n - L)
            assert torch.all(lps[i, :L] == -0.2) and torch.isnan(lps[i, L:n]).all()
        else:
            assert not off[i].any() and torch.all(lps[i, :n] == -0.2)
    ratio = out["importance_sampling_ratio"]
    nan = torch.isnan(lps) & mask
    assert torch.equal(ratio[nan], torch.ones_like(ratio[nan]))  # off-policy tokens: no IS correction
    rewards = out["advantages"]
    assert all(rewards[i] > 0 for i in repaired)


def test_neutral_setting_reduces_to_vanilla_grpo(tmp_path):
    """threshold = 0: no step is ever below it, nothing is repaired -> identical to trl.GRPOTrainer."""
    from trl_plugins.testing import digit_fraction_reward

    rewards = [accuracy_reward, digit_fraction_reward]
    common = dict(max_steps=1, reward_funcs=rewards, output_dir=str(tmp_path), log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(plugins=["scope"], plugin_config={"scope": {**BASE, "threshold": 0.0}},
                                           **common))
    assert_runs_equal(vanilla, neutral)


def test_end_to_end_scope_with_lp_reg(tmp_path):
    """Real HF generation on the untrained tiny model (every rollout fails): min_prefix_steps=0 repairs one rollout
    per group from the reference, lp_reg regularises the loss; parameters move and both plugins log."""
    tok = tiny_tokenizer()
    trainer = make_tiny_trainer(
        plugins=["scope", "lp_reg"], plugin_config={"scope": {**BASE, "min_prefix_steps": 0}},
        model=tiny_model(tok), tokenizer=tok, max_completion_length=40, loss_type="dr_grpo", max_steps=2,
        output_dir=str(tmp_path), log_level="error")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/scope/rectified_fraction"] == pytest.approx(1 / G)
        assert log["plugins/scope/acceptance_rate"] == 1.0
        assert log["reward"] == pytest.approx(1 / G)  # TRL's reward of the trained batch: one repaired row per group
        assert log["plugins/framework/offpolicy_token_fraction"] > 0
        assert any(k.startswith("plugins/lp_reg/") for k in log)
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
