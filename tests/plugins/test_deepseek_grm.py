"""deepseek_grm: voted principle + critique + score judgements (SPCT) with meta-RM filtering, as a reward column.
Transform tests on hand-built RewardContexts with scripted judges; trainer runs check the column end to end, the
neutral setting and the refusals."""

import math

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.errors import PluginError
from trl_plugins.components.genrm import (
    GenerativeRewardModel,
    GenRMParseError,
    ScriptedGenRMBackend,
    clear_shared_genrm_backends,
    meta_judge_filter,
    neutral_fill,
)
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, row_from_question
from trl_plugins.testing import (
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    run_on_processes,
    script_generation,
)
from trl_plugins_builtin.deepseek_grm import COLUMN, GRM_TEMPLATE, META_TEMPLATE

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])
RIGHT, WRONG = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15"


def _ctx(texts, G, **processes):
    N = len(texts)
    matrix = torch.stack([torch.zeros(N), torch.zeros(N)], dim=1)
    return make_reward_context(matrix, num_generations=G, reward_func_names=["accuracy_reward", COLUMN],
                               rows=[{"prompt": [{"role": "user", "content": PROBLEM.question}]}] * N,
                               completions=[[{"role": "assistant", "content": t}] for t in texts], **processes)


def _run(ctx, grm=None, **options):
    stack = build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted", **options}})
    plugin = list(stack)[0]
    if grm is not None:
        plugin.grm = grm
    stack.call("trl_plugins_transform_rewards", ctx)
    return plugin


def test_reward_is_the_vote_of_k_scripted_judgements():
    ctx = _ctx([RIGHT, WRONG, RIGHT, "gibberish"], 2)
    plugin = _run(ctx, k=4, meta_rm="none")
    column = ctx.rewards_per_func[:, 1]
    assert column[0] == 40.0 and column[2] == 40.0  # 4 samples of 10: the sum
    assert 4.0 <= column[1] < 40.0 and column[3] < 40.0
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0] * 4  # the other column untouched
    assert ctx.metrics["plugins/deepseek_grm/unparsable_fraction"] == [0.0] and plugin.grm.k == 4


def test_meta_rm_keeps_the_judgements_it_rates_sound():
    """An unreliable judge (every other sample says 1): the meta RM (the verifier-backed scripted meta judge) rates
    those samples unsound, so the vote of the kept half is the true score, k times."""
    from trl_plugins.components.genrm import scripted_genrm

    honest = scripted_genrm()
    state = {"n": 0}

    def noisy(messages):
        if "[Judgement]" in messages[-1]["content"]:
            return honest(messages)  # the meta RM
        state["n"] += 1
        return "Score: \\boxed{1}" if state["n"] % 2 == 0 else honest(messages)

    backend = ScriptedGenRMBackend(noisy)
    meta = GenerativeRewardModel(backend, META_TEMPLATE, k=1, aggregate="mean")
    filtered = GenerativeRewardModel(backend, GRM_TEMPLATE, k=4, aggregate="vote", meta_filter=meta_judge_filter(meta),
                                     meta_keep=2)
    plain = GenerativeRewardModel(backend, GRM_TEMPLATE, k=4, aggregate="vote")
    ctx = _ctx([RIGHT, RIGHT], 2)
    _run(ctx, grm=filtered)
    assert ctx.rewards_per_func[:, 1].tolist() == [40.0, 40.0]  # 10 kept twice, voted over k = 4
    ctx2 = _ctx([RIGHT, RIGHT], 2)
    _run(ctx2, grm=plain)
    assert ctx2.rewards_per_func[:, 1].tolist() == [22.0, 22.0]  # 10 + 1 + 10 + 1 without the meta RM


def test_options_build_the_meta_rm_and_refuse_bad_values():
    plugin = list(build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted"}}))[0]
    plugin.trl_plugins_configure(trainer=None, args=None)
    assert plugin.grm.k == 8 and plugin.grm.meta_keep == 4 and plugin.grm.meta_filter is not None  # paper: k/2
    assert plugin.grm.backend.location == "scripted"
    with pytest.raises(PluginConfigError, match="genrm_base_url"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {}})
    with pytest.raises(PluginConfigError, match="k"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted", "k": 0}})
    with pytest.raises(PluginConfigError, match="meta_keep=5 is more than k=4"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted", "k": 4, "meta_keep": 5}})
    with pytest.raises(PluginConfigError, match="genrm_model"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "hf"}})
    with pytest.raises(PluginConfigError, match="genrm_oracle"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted", "genrm_oracle": "nope"}})
    with pytest.raises(PluginConfigError, match="genrm_max_unparsable"):
        build_plugins(["deepseek_grm"], {"deepseek_grm": {"genrm": "scripted", "genrm_max_unparsable": 1.5}})


def test_unparsable_rows_get_the_group_mean_and_too_many_fail_naming_the_judge():
    garbled = {"Answer: 99"}

    def judge(messages):
        return "no verdict at all" if any(g in messages[-1]["content"] for g in garbled) else "\\boxed{6}"

    grm = GenerativeRewardModel(ScriptedGenRMBackend(judge), GRM_TEMPLATE, k=2, max_unparsable=0.5,
                                name="deepseek_grm")
    ctx = _ctx([RIGHT, "Answer: 99", RIGHT, WRONG], 2)
    _run(ctx, grm=grm)
    assert ctx.rewards_per_func[:, 1].tolist() == [12.0, 12.0, 12.0, 12.0]  # row 1: its group's mean, not 0
    assert ctx.metrics["plugins/deepseek_grm/unparsable_fraction"] == [0.25]
    values, missing = neutral_fill(torch.tensor([math.nan, math.nan, 3.0, math.nan]), 2)
    assert values.tolist() == [0.0, 0.0, 3.0, 3.0] and missing.tolist() == [True, True, False, True]
    with pytest.raises(GenRMParseError, match=r"'deepseek_grm' at scripted.*row 0.*no verdict at all"):
        _run(_ctx(["Answer: 99", "Answer: 99 ", RIGHT, RIGHT], 2), grm=grm)


def test_a_judge_failing_on_one_process_stops_both():
    def work(rank, gather):
        ctx = _ctx([RIGHT, WRONG, WRONG, RIGHT], 2, num_processes=2, process_index=rank, gather=gather)
        judge = (lambda m: "\\boxed{7}") if rank == 0 else (lambda m: "garbage")
        grm = GenerativeRewardModel(ScriptedGenRMBackend(judge), GRM_TEMPLATE, k=1, name="deepseek_grm")
        try:
            _run(ctx, grm=grm)
            return ctx.rewards_per_func[:, 1].tolist()
        except Exception as exc:
            return exc

    first, second = run_on_processes(2, work, timeout=10)
    assert isinstance(second, GenRMParseError) and "garbage" in str(second)
    assert isinstance(first, PluginError) and "deepseek_grm: process 1 failed" in str(first)


def test_neutral_weight_zero_matches_vanilla_grpo(tmp_path):
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["deepseek_grm"], plugin_config={"deepseek_grm": {"genrm": "scripted", "k": 2, "reward_weight": 0.0}},
        **common))
    for a, b in zip(vanilla.rewards, neutral.rewards):
        assert b.shape[1] == a.shape[1] + 1 and torch.equal(a, b[:, :2])
    for a, b in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], atol=0, rtol=0)
    clear_shared_genrm_backends()


def test_end_to_end_column_from_the_scripted_judge(tmp_path):
    clear_shared_genrm_backends()
    trainer = make_tiny_trainer(plugins=["deepseek_grm"],
                                plugin_config={"deepseek_grm": {"genrm": "scripted", "k": 2}},
                                max_steps=2, output_dir=str(tmp_path), log_level="error")
    # even rows answer right, odd rows get the first step wrong (the tiny model itself writes no arithmetic)
    script_generation(trainer, lambda prompt, row: row_from_question(prompt)["solution"] if row % 2 == 0
                      else "1+1=3\nAnswer: 3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2 and all("plugins/deepseek_grm/unparsable_fraction" in log for log in logs)
    for rewards in run_.rewards:
        grm, correct = rewards[:, -1], rewards[:, 0] > 0.5
        assert torch.equal(correct, torch.arange(len(grm)) % 2 == 0)
        assert (grm[correct] == 20.0).all()  # k=2 samples of 10, summed
        assert (grm[~correct] == 2.0).all()  # the first step is wrong: the lowest score, twice
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
    clear_shared_genrm_backends()


@pytest.mark.slow
def test_smollm2_itself_as_the_generative_rm_through_the_local_hf_backend(capsys):
    """builtin:smollm2 (135M) judges 4 completions of 2 held-out prompts through the local HF backend: k=3 sampled
    judgements each, rated by the same model as meta RM, voted into the reward column. A 135M model follows the
    \\boxed{score} format poorly: the test checks the accounting (every sample parsed or counted, rows without a
    verdict at their group's mean, the metric equal to their share), not the quality, and prints the numbers."""
    from trl_plugins.runtime.models import smollm2_path
    from trl_plugins.tasks.arithmetic import make_dataset

    clear_shared_genrm_backends()
    rows = list(make_dataset(2, levels=(1,), seed=7, split="test"))
    texts = [t for r in rows for t in (r["solution"], "I think the answer is 12.\nAnswer: 12")]
    N = len(texts)
    ctx = make_reward_context(torch.zeros(N, 2), num_generations=2, reward_func_names=["accuracy_reward", COLUMN],
                              rows=[r for r in rows for _ in range(2)],
                              completions=[[{"role": "assistant", "content": t}] for t in texts])
    stack = build_plugins(["deepseek_grm"], {"deepseek_grm": {
        "genrm": "hf", "genrm_model": str(smollm2_path()), "k": 3, "genrm_max_tokens": 64,
        "genrm_max_unparsable": 1.0}})
    plugin = list(stack)[0]
    stack.call("trl_plugins_transform_rewards", ctx)
    grm = plugin.grm
    column = ctx.rewards_per_func[:, 1]
    stats, meta_stats = dict(grm.stats), dict(grm.meta_filter.judge.stats)
    share = ctx.metrics["plugins/deepseek_grm/unparsable_fraction"][0]
    with capsys.disabled():
        print(f"\nsmollm2 as GRM: judge stats {stats}; meta-RM stats {meta_stats}; rows without a verdict {share:.3f}; "
              f"column {[round(v, 2) for v in column.tolist()]}")
    assert stats["requests"] == N and stats["samples"] == N * 3  # k samples per row, no retries configured
    assert 0 <= stats["unparsable_samples"] <= stats["samples"] and stats["unparsable_rows"] == round(share * N)
    assert torch.isfinite(column).all()
    for g in range(N // 2):  # rows without a verdict hold their group's mean; voted rows lie in k * [1, 10]
        pair = column[2 * g:2 * g + 2]
        assert all(3.0 <= v <= 30.0 for v in pair.tolist()) or pair[0] == pair[1]
    clear_shared_genrm_backends()
