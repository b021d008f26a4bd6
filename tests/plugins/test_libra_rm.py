"""libra_rm: binary correctness verdicts of a reasoning generative RM (Libra-RM) as a reward column. Verdict parsing
and the reward on hand-built RewardContexts with scripted judges; a loopback endpoint; trainer runs check the column
end to end, the neutral setting and the refusals."""

import dataclasses

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components import serve_openai_compatible
from trl_plugins.components.genrm import (
    GenerativeRewardModel,
    GenRMParseError,
    ScriptedGenRMBackend,
    clear_shared_genrm_backends,
    genrm_handler,
    scripted_genrm,
)
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, row_from_question
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    script_generation,
)
from trl_plugins_builtin.libra_rm import COLUMN, LIBRA_TEMPLATE

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14
RIGHT, WRONG = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15"


def _ctx(texts, G, rows=None):
    """A reward context over ``texts`` (columns accuracy_reward, libra_rm, both zero); ``rows`` default: PROBLEM."""
    N = len(texts)
    rows = rows if rows is not None else [{"prompt": [{"role": "user", "content": PROBLEM.question}]}] * N
    return make_reward_context(torch.zeros(N, 2), num_generations=G, reward_func_names=["accuracy_reward", COLUMN],
                               rows=rows, completions=[[{"role": "assistant", "content": t}] for t in texts])


def _run(ctx, grm=None, **options):
    stack = build_plugins(["libra_rm"], {"libra_rm": {"genrm": "scripted", **options}})
    plugin = list(stack)[0]
    if grm is not None:
        plugin.grm = grm
    stack.call("trl_plugins_transform_rewards", ctx)
    return plugin


@pytest.mark.parametrize("answer, verdict", [
    ("The steps hold.\n\\boxed{1}", 1.0),
    ("The last step is wrong. \\boxed{ 0 }", 0.0),
    ("<think>maybe \\boxed{0}</think>On reflection it is right: \\boxed{1}", 1.0),  # the thinking is skipped
    ("The answer is \\boxed{14}, so the response is \\boxed{1}", 1.0),  # the last \\boxed{} is the verdict
    ("Verdict \\boxed{1}. The true answer is \\boxed{14}", None),  # ... and must hold 0 or 1
    ("\\boxed{0.5}", None),
    ("\\boxed{10}", None),
    ("correct", None),
])
def test_the_verdict_is_the_last_boxed_zero_or_one(answer, verdict):
    assert LIBRA_TEMPLATE.parse(answer) == verdict


def test_reward_is_the_verdict_and_k_verdicts_are_averaged_or_voted():
    ctx = _ctx([RIGHT, WRONG, RIGHT, "Answer: 99"], 2)
    plugin = _run(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0] * 4  # the other column untouched
    assert ctx.metrics["plugins/libra_rm/judged_correct"] == [0.5]
    assert ctx.metrics["plugins/libra_rm/unparsable_fraction"] == [0.0] and plugin.grm.k == 1

    def judge(verdicts):  # the n-th sample of every request says verdicts[n % len]
        state = {"n": 0}

        def answer(messages):
            state["n"] += 1
            return f"\\boxed{{{verdicts[(state['n'] - 1) % len(verdicts)]}}}"

        return ScriptedGenRMBackend(answer)

    three = GenerativeRewardModel(judge([1, 1, 0]), LIBRA_TEMPLATE, k=3, aggregate="mean")
    ctx = _ctx([RIGHT, WRONG], 2)
    _run(ctx, grm=three)
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor([2 / 3, 2 / 3]))
    for k, verdicts, expected in [(3, [1, 1, 0], 1.0), (2, [1, 0], 0.5)]:  # majority; a tie is 1/2
        ctx = _ctx([RIGHT, WRONG], 2)
        _run(ctx, grm=GenerativeRewardModel(judge(verdicts), LIBRA_TEMPLATE, k=k, aggregate="majority"))
        assert ctx.rewards_per_func[:, 1].tolist() == [expected, expected]


def test_official_defaults_and_bad_values_refused_at_construction():
    plugin = list(build_plugins(["libra_rm"], {"libra_rm": {"genrm": "scripted"}}))[0]
    plugin.trl_plugins_configure(trainer=None, args=None)
    o = plugin.options
    assert (o.k, o.aggregate, o.genrm_temperature, o.genrm_max_tokens, o.reward_weight) == (1, "mean", 0.6, 8192, 1.0)
    assert plugin.grm.template is LIBRA_TEMPLATE and plugin.grm.meta_filter is None
    for options, match in [
        ({}, "genrm_base_url"),
        ({"genrm": "scripted", "k": 0}, "Option 'k' of plugin 'libra_rm' got 0"),
        ({"genrm": "scripted", "aggregate": "vote"}, "aggregate"),
        ({"genrm": "scripted", "reward_weight": -1.0}, "reward_weight"),
        ({"genrm": "scripted", "genrm_temperature": -0.1}, "genrm_temperature"),
        ({"genrm": "hf"}, "genrm_model"),
        ({"genrm": "scripted", "genrm_oracle": "nope"}, "genrm_oracle"),
        ({"genrm": "scripted", "genrm_max_unparsable": 1.5}, "genrm_max_unparsable"),
    ]:
        with pytest.raises(PluginConfigError, match=match):
            build_plugins(["libra_rm"], {"libra_rm": options})


def test_unparsable_verdicts_get_the_group_mean_and_too_many_fail_naming_judge_row_and_text():
    def judge(messages):
        return "I cannot tell." if "Answer: 99" in messages[-1]["content"] else "\\boxed{1}"

    grm = GenerativeRewardModel(ScriptedGenRMBackend(judge), LIBRA_TEMPLATE, k=1, max_unparsable=0.25,
                                name="libra_rm")
    ctx = _ctx([RIGHT, "Answer: 99", WRONG, RIGHT], 2)
    _run(ctx, grm=grm)
    assert ctx.rewards_per_func[:, 1].tolist() == [1.0, 1.0, 1.0, 1.0]  # row 1: its group's mean, not 0
    assert ctx.metrics["plugins/libra_rm/unparsable_fraction"] == [0.25]
    assert grm.stats["unparsable_rows"] == 1
    with pytest.raises(GenRMParseError, match=r"'libra_rm' at scripted.*row 1 .*I cannot tell"):
        _run(_ctx([RIGHT, "Answer: 99", "Answer: 99 ", RIGHT], 2), grm=grm)


def test_loopback_endpoint_asks_one_judgement_per_completion_with_the_official_sampling():
    clear_shared_genrm_backends()
    seen = []
    with serve_openai_compatible(genrm_handler(ScriptedGenRMBackend(scripted_genrm()), seen)) as url:
        ctx = _ctx([RIGHT, WRONG, WRONG, RIGHT], 2)
        plugin = _run(ctx, genrm="endpoint", genrm_base_url=url, genrm_model="libra-rm", genrm_max_retries=1)
        _run(_ctx([RIGHT, WRONG, WRONG, RIGHT], 2), grm=plugin.grm)  # cached: no new request
        clear_shared_genrm_backends()
    assert ctx.rewards_per_func[:, 1].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert len(seen) == 4 and {p["model"] for p in seen} == {"libra-rm"}
    assert seen[0]["temperature"] == 0.6 and seen[0]["max_tokens"] == 8192
    system, user = seen[0]["messages"]
    assert system["content"] == LIBRA_TEMPLATE.system and PROBLEM.question in user["content"]


def test_neutral_weight_zero_matches_vanilla_grpo(tmp_path):
    """reward_weight=0: the same run as trl.GRPOTrainer (rewards, advantages, losses, gradients, parameters) once the
    libra_rm column -- still filled, weighted 0 -- is set aside."""
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["libra_rm"], plugin_config={"libra_rm": {"genrm": "scripted", "reward_weight": 0.0}}, **common))
    assert all(r.shape[1] == 3 for r in neutral.rewards)
    assert_runs_equal(vanilla, dataclasses.replace(neutral, rewards=[r[:, :2] for r in neutral.rewards]))
    clear_shared_genrm_backends()


def test_end_to_end_the_scripted_judge_is_the_only_reward(tmp_path):
    """The tiny trainer with the libra_rm column as its only weighted reward (the paper's setting: no reference-based
    reward): the column equals the verifier's verdict, and the policy moves."""
    clear_shared_genrm_backends()
    trainer = make_tiny_trainer(plugins=["libra_rm"], plugin_config={"libra_rm": {"genrm": "scripted"}},
                                reward_weights=[0.0], max_steps=2, output_dir=str(tmp_path), log_level="error")
    script_generation(trainer, lambda prompt, row: row_from_question(prompt)["solution"] if row % 2 == 0
                      else "1+1=3\nAnswer: 3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2 and all(log["plugins/libra_rm/judged_correct"] == 0.5 for log in logs)
    for rewards in run_.rewards:
        assert torch.equal(rewards[:, -1], (rewards[:, 0] > 0.5).float())  # verdict == the verifier's
        assert torch.equal(rewards[:, -1], (torch.arange(len(rewards)) % 2 == 0).float())
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
    clear_shared_genrm_backends()


@pytest.mark.slow
def test_smollm2_itself_as_the_judge_through_the_local_hf_backend(capsys):
    """builtin:smollm2 (135M) judges 4 completions of 2 held-out prompts through the local HF backend, k=2 sampled
    verdicts each, averaged into the reward column. A 135M model rarely writes the \\boxed{0/1} verdict: the test
    checks the accounting (every sample parsed or counted, rows without a verdict at their group's mean, the metric
    equal to their share, verdicts in [0, 1]), not the quality, and prints the numbers."""
    from trl_plugins.runtime.models import smollm2_path
    from trl_plugins.tasks.arithmetic import make_dataset

    clear_shared_genrm_backends()
    rows = list(make_dataset(2, levels=(1,), seed=7, split="test"))
    ctx = _ctx([t for r in rows for t in (r["solution"], "Answer: 12")], 2, rows=[r for r in rows for _ in range(2)])
    N = len(ctx.rewards_per_func)
    stack = build_plugins(["libra_rm"], {"libra_rm": {
        "genrm": "hf", "genrm_model": str(smollm2_path()), "k": 2, "genrm_max_tokens": 48,
        "genrm_max_unparsable": 1.0}})
    plugin = list(stack)[0]
    stack.call("trl_plugins_transform_rewards", ctx)
    stats, column = dict(plugin.grm.stats), ctx.rewards_per_func[:, 1]
    share = ctx.metrics["plugins/libra_rm/unparsable_fraction"][0]
    with capsys.disabled():
        print(f"\nsmollm2 as Libra judge: stats {stats}; rows without a verdict {share:.3f}; "
              f"column {[round(v, 2) for v in column.tolist()]}")
    assert stats["requests"] == N and stats["samples"] == N * 2  # k samples per row, no retries configured
    assert 0 <= stats["unparsable_samples"] <= stats["samples"] and stats["unparsable_rows"] == round(share * N)
    assert torch.isfinite(column).all() and ((column >= 0) & (column <= 1)).all()
    clear_shared_genrm_backends()
