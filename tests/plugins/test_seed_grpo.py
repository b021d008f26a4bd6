"""seed_grpo: semantic-entropy advantage scaling.

The exact factor f(alpha SE / log G), zero entropy leaves advantages unchanged, alpha = 0 reproduces
trl.GRPOTrainer, clustering is shared with empo (computed once), and a short empo + seed_grpo run trains."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import build_plugins
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.seed_grpo import entropy_scale, scale_advantages


def test_entropy_scale_exact():
    G = 4
    se_max = math.log(G)
    se = torch.tensor([0.0, math.log(4), -(math.log(0.5) + 2 * math.log(0.25)) / 3])
    x = se / se_max
    assert entropy_scale(se, se_max, 1.0).tolist() == pytest.approx((1 - x).tolist())
    assert entropy_scale(se, se_max, 0.5).tolist() == pytest.approx((1 - 0.5 * x).tolist())
    assert entropy_scale(se, se_max, 1.0, "exponential").tolist() == pytest.approx(torch.exp(-x).tolist())
    assert entropy_scale(se, se_max, 1.0, "focal", gamma=2.0).tolist() == pytest.approx(((1 - x) ** 2).tolist())
    assert entropy_scale(se, se_max, 3.0).tolist()[1] == 0.0  # clamped at 0: never flips a sign
    assert entropy_scale(se, 0.0, 1.0).tolist() == [1.0, 1.0, 1.0]  # G = 1
    adv = torch.arange(8.0).view(4, 2)
    assert scale_advantages(adv, torch.tensor([1.0, 0.5]), 2).tolist() == [[0, 1], [2, 3], [2, 2.5], [3, 3.5]]


def _contexts(texts, G, advantages):
    N = len(texts)
    gathered = []

    def gather(values):
        gathered.append(values)
        return values

    rctx = make_reward_context(torch.zeros(N, 1), num_generations=G, reward_func_names=["r"], completions=list(texts),
                               gather_object=gather)
    rctx.gathered = gathered
    actx = make_advantage_context(torch.zeros(N), num_generations=G, advantages=advantages,
                                  completion_lengths=torch.ones(N))
    return rctx, actx


def test_zero_entropy_leaves_advantages_unchanged_and_uncertain_groups_are_scaled():
    texts = ["Answer: 5"] * 4 + ["Answer: 1", "Answer: 1", "Answer: 2", "no answer"]
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0])
    rctx, actx = _contexts(texts, 4, adv.clone())
    stack = build_plugins(["seed_grpo"])
    stack.call("trl_plugins_transform_rewards", rctx)
    assert rctx.rewards_per_func.tolist() == [[0.0]] * 8  # the reward stage only reads
    stack.call("trl_plugins_transform_advantages", actx)
    assert actx.advantages[:4].tolist() == adv[:4].tolist()  # SE = 0: unchanged, exactly
    # group 1: clusters {1: 2, 2: 1, unanswered singleton: 1} -> SE = -(log .5 + 2 log .25) / 3
    se = -(math.log(0.5) + 2 * math.log(0.25)) / 3
    factor = 1 - se / math.log(4)
    assert actx.advantages[4:].tolist() == pytest.approx((adv[4:] * factor).tolist())
    assert actx.metrics["plugins/seed_grpo/scale"] == [pytest.approx((1 + factor) / 2)]


def test_clusters_shared_with_empo_are_computed_once():
    texts = ["Answer: 5", "Answer: 5", "Answer: 6", "Answer: 5"]
    rctx, actx = _contexts(texts, 4, torch.ones(4))
    rctx.rewards_per_func = torch.zeros(4, 2)
    rctx.reward_func_names = ["r", "empo"]
    stack = build_plugins(["empo", "seed_grpo"])
    stack.call("trl_plugins_transform_rewards", rctx)
    assert len(rctx.gathered) == 1
    assert rctx.rewards_per_func[:, 1].tolist() == [0.75, 0.75, 0.25, 0.75]
    stack.call("trl_plugins_transform_advantages", actx)
    se = -(math.log(0.75) + math.log(0.25)) / 2
    assert actx.advantages.tolist() == pytest.approx([1 - se / math.log(4)] * 4)


RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")


def test_neutral_alpha_zero_is_vanilla(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(plugins=["seed_grpo"], plugin_config={"seed_grpo": {"alpha": 0.0}},
                                        output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


def test_end_to_end_stacked_with_empo(tmp_path):
    trainer = make_tiny_trainer(plugins=["empo", "seed_grpo"],
                                plugin_config={"empo": {"extractor": "last_number"},
                                               "seed_grpo": {"extractor": "last_number"}},
                                output_dir=str(tmp_path), **RUN)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert 0.0 <= log["plugins/seed_grpo/scale"] <= 1.0
        assert "plugins/seed_grpo/semantic_entropy" in log and "rewards/empo/mean" in log
