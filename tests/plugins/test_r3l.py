"""r3l: reflect-then-retry (from the official code).

Pure functions (report parsing and validation, guidance, step boundaries, amplified advantages), the sampling hook
on hand-built RolloutContexts with a scripted service (half the group retries, invalid/perfect reports keep the
first attempt, prompt swap, pivot replay, collective calls across two processes), the advantage and loss hooks, and
tiny-model runs (neutral = vanilla; task-feedback reflections with the OPMD loss end to end)."""

import json
import math
import threading

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import Completion, PluginConfigError, build_plugins
from trl_plugins.tasks.arithmetic import Problem
from trl_plugins.testing import (
    SimulatedCollective,
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    tiny_tokenizer,
)
from trl_plugins_builtin.r3l import (
    GUIDANCE_HEADER,
    PIVOT_KEY,
    format_trajectory,
    parse_report,
    r3l_advantages,
    step_prefix_tokens,
    validate_report,
    with_guidance,
)

TOK = tiny_tokenizer()
PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7 / 7*2=14 / Answer: 14
WRONG = "3+4=7\n7*2=15\nAnswer: 15"  # first error at step 1
RIGHT = "3+4=7\n7*2=14\nAnswer: 14"


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ pure functions
def test_parse_report_takes_the_outermost_braces():
    assert parse_report('Sure! {"a": {"b": 1}} done') == {"a": {"b": 1}}
    assert parse_report('{"a": 1}') == {"a": 1}
    assert parse_report("no json here") is None
    assert parse_report("{broken: }") is None
    assert parse_report("[1, 2]") is None


def _report(outcome="failure", **extra):
    report = {"trajectory_summary": "s", "root_cause_analysis": "r", "trajectory_outcome": outcome}
    report.update(extra)
    return report


@pytest.mark.parametrize(
    "report, steps, expected",
    [
        (None, 3, (False, False, 0)),
        ({"trajectory_summary": "s", "trajectory_outcome": "failure"}, 3, (False, False, 0)),
        (_report("success"), 3, (True, True, 0)),  # perfect: no retry
        (_report("failure"), 3, (False, False, 0)),  # no suggestion / step
        (_report("failure", improvement_suggestion="x", retry_from_step=2), 3, (True, False, 2)),
        (_report("success_but_inefficient", improvement_suggestion="x", retry_from_step="1"), 3, (True, False, 1)),
        (_report("failure", improvement_suggestion="x", retry_from_step=3), 3, (False, False, 0)),  # out of range
        (_report("failure", improvement_suggestion="x", retry_from_step=-1), 3, (False, False, 0)),
        (_report("failure", improvement_suggestion="x", retry_from_step="two"), 3, (False, False, 0)),
        (_report("partial", improvement_suggestion="x", retry_from_step=0), 3, (False, False, 0)),
        (_report("failure", improvement_suggestion="x", retry_from_step=0), 0, (True, False, 0)),  # empty attempt
    ],
)
def test_validate_report(report, steps, expected):
    assert validate_report(report, steps) == expected


def test_guidance_goes_into_the_system_prompt():
    user = [{"role": "user", "content": "Q"}]
    assert with_guidance(user, "G") == [{"role": "system", "content": f"{GUIDANCE_HEADER}\nG"}, *user]
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert with_guidance(with_system, "G")[0] == {"role": "system", "content": f"S\n\n{GUIDANCE_HEADER}\nG"}
    assert with_system[0]["content"] == "S"  # not mutated
    assert with_guidance("Q", "G") == f"{GUIDANCE_HEADER}\nG\n\nQ"


def test_step_prefix_tokens_counts_whole_lines():
    texts = [TOK.decode([t]) for t in _ids("3+4=7\n\n7*2=15\nAnswer: 15")]
    assert step_prefix_tokens(texts, 0) == 0
    assert step_prefix_tokens(texts, 1) == len("3+4=7\n")
    assert step_prefix_tokens(texts, 2) == len("3+4=7\n\n7*2=15\n")  # the blank line is not a step
    assert step_prefix_tokens(texts, 3) == len(texts)  # fewer complete steps: everything


def test_format_trajectory_numbers_steps_from_zero():
    text = format_trajectory("Q?", ["a", "b"], "Incorrect.")
    assert "Task:\nQ?" in text and "Step 0: a\nStep 1: b" in text and text.endswith("Feedback: Incorrect.")


def test_amplified_advantages_hand_computed():
    r = torch.tensor([1.0, 0.5, 0.0, 0.0, 0.2, 0.2, 0.2, float("nan")])
    # group 0: mean 0.375 -> [1 (success), 3*0.125, -0.375, -0.375]; group 1: mean 0.2 -> A = 0 -> 3*0 = 0, NaN -> 0
    adv = r3l_advantages(r, 4, "mean", amplify=True, scale=3.0, success=1.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.375, -0.375, -0.375, 0.0, 0.0, 0.0, 0.0]))
    plain = r3l_advantages(r, 4, "mean", amplify=False, scale=3.0, success=1.0)
    torch.testing.assert_close(plain[:4], torch.tensor([0.625, 0.125, -0.375, -0.375]))
    z = r3l_advantages(r[:4], 4, "zscore", amplify=True, scale=3.0, success=1.0)
    std = torch.tensor([1.0, 0.5, 0.0, 0.0]).std()
    d = std + 1e-6
    torch.testing.assert_close(z, torch.tensor([1.0, 3 * 0.125 / d, -0.375 / d, -0.375 / d]))


def test_amplification_on_trl_advantages_per_token():
    r = torch.tensor([1.0, 0.0])
    token_adv = torch.tensor([[0.5, -0.5], [0.2, -0.1]])
    out = r3l_advantages(r, 2, "trl", amplify=True, scale=3.0, success=1.0, trl_advantages=token_adv)
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0], [0.6, -0.1]]))


# ------------------------------------------------------------------------------------------ the sampling hook
class ScriptedService:
    """Call 1 (policy reflections) returns ``reflections`` in order; retries return 'R<k>' + the prefix."""

    def __init__(self, reflections=None):
        self.reflections = list(reflections or [])
        self.calls = []

    def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None):
        self.calls.append({"prompts": prompts, "prefix_ids": prefix_ids})
        out = []
        for j, _ in enumerate(prompts):
            if prefix_ids is None:  # a reflection request
                text = self.reflections.pop(0)
                out.append(Completion(completion_ids=_ids(text), logprobs=[-1.0] * len(text), text=text))
            else:
                new = _ids(f"R{j}")
                ids = list(prefix_ids[j]) + new
                out.append(Completion(completion_ids=ids, logprobs=[math.nan] * len(prefix_ids[j]) + [-0.5] * len(new),
                                      text=TOK.decode(ids)))
        return out


def make_ctx(texts, G, *, service, process_index=0, gatherer=None, system=False):
    """Local rows with completions ``texts``; every group asks PROBLEM; score = 1 for a correct answer."""
    B = len(texts)
    base = [{"role": "user", "content": PROBLEM.question}]
    if system:
        base = [{"role": "system", "content": "You solve arithmetic."}, *base]
    rows = [{"prompt": list(base), "answer": str(PROBLEM.answer), "problem": PROBLEM.to_json()} for _ in range(B)]
    return make_rollout_context(
        texts, num_generations=G, rows=rows, service=service, process_index=process_index, gather=gatherer,
        tokenizer=TOK, prompt_ids=[[7, 7] for _ in range(B)], tokenize_prompts=lambda ps: [[9] for _ in ps],
        decode=lambda ids_, prompt: [{"role": "assistant", "content": TOK.decode(ids_)}],
        scorer=lambda rows_, prompts_, comps: torch.tensor(
            [1.0 if c[-1]["content"].strip().endswith(f"Answer: {PROBLEM.answer}") else 0.0 for c in comps]),
    )


def run(ctx, **options):
    build_plugins(["r3l"], {"r3l": options}).call("trl_plugins_after_generation", ctx)
    return ctx


def test_task_feedback_retry_replays_the_pivot_and_is_trained_under_the_original_prompt():
    G = 4  # rows 0, 1 first attempts; slot 2 pairs with 0 (wrong at step 1), slot 3 with 1 (correct: perfect)
    service = ScriptedService()
    ctx = make_ctx([WRONG, RIGHT, "x", "y"], G, service=service, system=True)
    original_prompts = [list(p) for p in ctx.prompts]
    run(ctx, reflection_source="task_feedback")
    assert len(service.calls) == 1  # the retries only (no policy reflection)
    call = service.calls[0]
    prefix = _ids("3+4=7\n")
    assert call["prefix_ids"] == [prefix]
    guided = call["prompts"][0]
    assert guided[1:] == original_prompts[2][1:]
    assert guided[0]["content"].startswith("You solve arithmetic.\n\n" + GUIDANCE_HEADER)
    report = json.loads(guided[0]["content"].split("\n\n", 3)[-1])  # the rendered report (after the template text)
    assert report["trajectory_outcome"] == "failure" and report["retry_from_step"] == 1
    assert "7*2 is 14, not 15" in report["improvement_suggestion"]
    # the retry replaced slot 2: prefix + new tokens, trained under the ORIGINAL prompt, NaN sampling log-probs
    assert ctx.changed == {2}
    assert ctx.completion_ids[2] == prefix + _ids("R0")
    assert ctx.training_prompts[2] == original_prompts[2] and ctx.prompt_ids[2] == [7, 7]
    assert ctx.prompt_swapped[2] is True and all(math.isnan(x) for x in ctx.sampling_logprobs[2])
    assert ctx.offpolicy[2] == [False] * len(ctx.completion_ids[2])
    assert ctx.annotations[2] == {"r3l": "retry", "r3l_pair": 0, "r3l_step": 1, "r3l_pivot_tokens": len(prefix),
                                  "r3l_first_pivot_tokens": len(prefix)}
    assert ctx.annotations[3] == {"r3l": "kept_perfect"} and ctx.completion_ids[3] == _ids("y")
    assert ctx.annotations[0] == {"r3l": "first"} and ctx.annotations[1] == {"r3l": "first"}
    assert ctx.metrics["plugins/r3l/valid_reflection_fraction"] == [1.0]
    assert ctx.metrics["plugins/r3l/perfect_reflection_fraction"] == [0.5]
    assert ctx.metrics["plugins/r3l/extra_rollouts"] == [1.0]


def test_policy_reflection_prompt_invalid_json_keeps_the_first_attempt_and_retry_from_beginning():
    good = json.dumps(_report("failure", improvement_suggestion="check the product", retry_from_step=1))
    service = ScriptedService(reflections=["I think it went fine.", "Report: " + good])
    ctx = make_ctx([RIGHT, WRONG, "x", "y"], 4, service=service)
    run(ctx, retry_start="beginning", pivotal_credit=True)
    assert len(service.calls) == 2
    reflection_prompts = service.calls[0]["prompts"]
    assert [m["role"] for m in reflection_prompts[0]] == ["system", "user"]
    assert '"retry_from_step"' in reflection_prompts[0][0]["content"]
    user0, user1 = reflection_prompts[0][1]["content"], reflection_prompts[1][1]["content"]
    assert PROBLEM.question in user0 and "Step 1: 7*2=14" in user0 and "Feedback: Correct." in user0
    assert "Step 1: 7*2=15" in user1 and "Feedback: Incorrect." in user1
    # slot 2 (pair 0): invalid JSON -> no retry; slot 3 (pair 1): valid -> retry from the beginning
    assert ctx.annotations[2] == {"r3l": "kept_invalid"}
    assert service.calls[1]["prefix_ids"] == [[]]
    assert ctx.changed == {3} and ctx.completion_ids[3] == _ids("R0")
    assert ctx.annotations[3]["r3l_first_pivot_tokens"] == len("3+4=7\n")  # first attempt masked to its step 1
    assert ctx.annotations[3]["r3l_pivot_tokens"] == 2  # "R0" has no complete line: all of it
    assert ctx.metrics["plugins/r3l/extra_rollouts"] == [3.0]  # 2 reflections + 1 retry


def test_no_retry_slots_means_no_calls():
    service = ScriptedService()
    ctx = run(make_ctx([WRONG, "x"], 2, service=service), retry_fraction=0.0)
    assert service.calls == [] and not ctx.changed and ctx.annotations == [{}, {}]


@pytest.mark.parametrize("source", ["task_feedback", "policy"])
def test_two_processes_same_calls_and_pairs_across_processes(source):
    """G = 4 over 2 processes: first attempts on rank 0, their retry slots on rank 1."""
    coll = SimulatedCollective(2)
    valid = json.dumps(_report("failure", improvement_suggestion="x", retry_from_step=1))
    services = [ScriptedService(), ScriptedService(reflections=[valid, valid])]
    texts = [[WRONG, WRONG], ["a", "b"]]
    ctxs = [make_ctx(texts[r], 4, service=services[r], process_index=r, gatherer=lambda t, r=r: coll.gather(r, t))
            for r in range(2)]
    errors = []

    def work(r):
        try:
            run(ctxs[r], reflection_source=source)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    n_calls = 2 if source == "policy" else 1
    assert [len(s.calls) for s in services] == [n_calls, n_calls]
    assert all(c["prompts"] == [] for c in services[0].calls)  # rank 0 holds no slot but joins every call
    assert services[1].calls[-1]["prefix_ids"] == [_ids("3+4=7\n")] * 2  # rank 0's first attempts, replayed
    assert ctxs[1].changed == {0, 1} and not ctxs[0].changed


# ------------------------------------------------------------------------------------------ advantage and loss hooks
def _adv_ctx(rewards, annotations, G):
    N = len(rewards)
    return make_advantage_context(torch.tensor(rewards), num_generations=G, advantages=torch.zeros(N),
                                  completion_lengths=torch.ones(N), annotations=annotations)


def test_advantage_hook_pivots_both_trajectories_and_amplifies():
    anns = [{"r3l": "first"}, {"r3l": "first"},
            {"r3l": "retry", "r3l_pair": 0, "r3l_pivot_tokens": 4, "r3l_first_pivot_tokens": 6},
            {"r3l": "kept_invalid"}]
    ctx = _adv_ctx([0.0, 0.0, 1.0, 0.5], anns, 4)
    build_plugins(["r3l"]).call("trl_plugins_transform_advantages", ctx)
    assert ctx.extras[PIVOT_KEY].tolist() == [6, 0, 4, 0]
    torch.testing.assert_close(ctx.advantages, torch.tensor([-0.375, -0.375, 1.0, 0.375]))
    assert ctx.metrics["plugins/r3l/retry_improved_fraction"] == [1.0]
    neutral = _adv_ctx([0.0, 0.0, 1.0, 0.5], [{}] * 4, 4)
    stack = build_plugins(["r3l"], {"r3l": {"baseline": "trl", "amplify": False}})
    stack.call("trl_plugins_transform_advantages", neutral)
    assert neutral.advantages.tolist() == [0.0] * 4 and neutral.extras == {}


def _loss_ctx(lp, adv, mask, extras):
    B, T = lp.shape
    return make_loss_context(lp, advantages=adv, mask=mask, extras=extras, loss_type="dapo",
                             entropies=torch.zeros(B, T), completion_ids=torch.zeros(B, T, dtype=torch.long))


def test_loss_hook_zeroes_the_pivot_tokens_and_opmd_replaces_the_surrogate():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.1], [0.2, 0.3, 0.4, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[2.0], [-1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ctx = _loss_ctx(lp, adv, mask, {PIVOT_KEY: torch.tensor([2, 0])})
    build_plugins(["r3l"]).call("trl_plugins_loss", ctx)
    assert ctx.replacement is None and len(ctx.token_weights) == 1
    assert ctx.token_weights[0].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    ctx = _loss_ctx(lp, adv, mask, {})
    stack = build_plugins(["r3l"], {"r3l": {"loss": "opmd", "opmd_tau": 1.0}})
    assert stack.by_name["r3l"].replaces_surrogate
    stack.call("trl_plugins_loss", ctx)
    where, values = ctx.replacement
    assert where.tolist() == mask.bool().tolist() and ctx.token_weights == []
    torch.testing.assert_close(values, -adv * lp / 2)


def test_option_validation():
    with pytest.raises(PluginConfigError, match="retry_fraction"):
        build_plugins(["r3l"], {"r3l": {"retry_fraction": 0.75}})
    with pytest.raises(PluginConfigError, match="guidance_template"):
        build_plugins(["r3l"], {"r3l": {"guidance_template": "no placeholder"}})
    assert not build_plugins(["r3l"]).by_name["r3l"].replaces_surrogate


# ------------------------------------------------------------------------------------------ trainer runs
def test_neutral_setting_is_vanilla(tmp_path):
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=1, log_level="error")
    neutral = {"retry_fraction": 0.0, "baseline": "trl", "amplify": False}
    with_plugin = record_run(make_tiny_trainer(plugins=["r3l"], plugin_config={"r3l": neutral},
                                               output_dir=str(tmp_path / "a"), **common))
    vanilla = record_run(make_tiny_trainer(trainer_cls=GRPOTrainer, output_dir=str(tmp_path / "b"), **common))
    assert_runs_equal(with_plugin, vanilla)


def test_end_to_end_task_feedback_retries_with_opmd_loss(tmp_path):
    options = {"reflection_source": "task_feedback", "loss": "opmd", "guidance_template": "{report}"}
    trainer = make_tiny_trainer(plugins=["r3l"], plugin_config={"r3l": options}, reward_funcs=[digit_fraction_reward],
                                max_steps=2, max_completion_length=16, log_level="error", output_dir=str(tmp_path))
    batches = []
    original_gen = trainer._generate_and_score_completions

    def gen(inputs):
        batches.append((inputs, original_gen(inputs)))
        return batches[-1][1]

    trainer._generate_and_score_completions = gen
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    record = record_run(trainer)
    tok = trainer.processing_class
    for inputs, out in batches:
        plain = tok(tok.apply_chat_template(inputs[0]["prompt"], add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
        for i in range(4):  # every row, retries included, is trained under the original (unguided) prompt
            assert out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist() == plain
    assert any(not torch.equal(before[n], p) for n, p in record.params.items())
    logs = [log for log in record.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/r3l/valid_reflection_fraction"] == 1.0  # verifier reports are always valid
        assert log["plugins/r3l/retry_fraction"] + log["plugins/r3l/perfect_reflection_fraction"] == 1.0
        assert "plugins/r3l/retry_improved_fraction" in log
