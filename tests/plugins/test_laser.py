"""laser: LASER / LASER-D / LASER-DE step bonus.

Exact formulas on tensors and on a hand-built RewardContext; the neutral setting (alpha = 0) reproduces
trl.GRPOTrainer (apart from the added all-zero column); bad options are refused; a short LASER-D run trains and logs
its metrics."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin._length import group_accuracy
from trl_plugins_builtin.laser import difficulty_buckets, ecr_target, laser_bonus

EOS = 99


def test_laser_bonus():
    lengths = torch.tensor([3, 5, 8, 10])
    correct = torch.tensor([True, True, False, True])
    targets = torch.tensor([6, 6, 6, 6])
    assert laser_bonus(lengths, correct, targets, 0.5).tolist() == [0.5, 0.5, 0.0, 0.0]
    # LASER-DE: wrong answers longer than the target are rewarded for exploring
    assert laser_bonus(lengths, correct, targets, 0.5, explore=True).tolist() == [0.5, 0.5, 0.5, 0.0]
    assert laser_bonus(lengths, correct, torch.tensor([3, 4, 8, 10]), 1.0).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_difficulty_and_ecr():
    correct = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    acc = group_accuracy(correct, 4)
    assert acc.tolist() == [0.75, 0.25, 0.0]
    assert difficulty_buckets(acc, (1 / 3, 2 / 3)).tolist() == [0, 2, 2]  # easy, hard, hard
    assert difficulty_buckets(torch.tensor([0.5, 1 / 3, 0.7]), (1 / 3, 2 / 3)).tolist() == [1, 2, 0]
    lengths = torch.tensor([2, 4, 6, 8])
    cor = torch.tensor([False, True, False, True])
    # P(correct, L <= 2) = 0, P(<= 4) = 1/4 -> ECR = 4 * 1/4 = 1 >= 1
    assert ecr_target(lengths, cor, [2, 4, 6, 8], group_size=4, ecr_min=1.0) == 4
    assert ecr_target(lengths, cor, [2, 4, 6, 8], group_size=4, ecr_min=2.0) == 8
    assert ecr_target(lengths, cor, [2, 4, 6, 8], group_size=4, ecr_min=3.0) == 8  # none qualifies: largest
    assert ecr_target(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.bool), [2, 4], 4, 1.0) == 4


def _reward_ctx(rewards, names, lengths, unfinished, G):
    ids = [[7] * (n - 1) + ([7] if u else [EOS]) for n, u in zip(lengths, unfinished)]
    ctx = make_reward_context(torch.tensor(rewards, dtype=torch.float32), num_generations=G, reward_func_names=names,
                              completions=["c"] * len(lengths), local_completion_ids=ids)
    ctx.set_active_plugin("laser")  # what the plugin stack does when it calls the hook
    return ctx


def _plugin(max_len=10, **options):
    plugin = build_plugins(["laser"], {"laser": options}).plugins[0]
    plugin.max_len, plugin.eos_ids = max_len, {EOS}
    return plugin


def test_laser_fixed_target_fills_its_column():
    plugin = _plugin(variant="laser", target_length=5, alpha=0.5)
    ctx = _reward_ctx([[1, 0], [1, 0], [0, 0], [1, 0]], ["acc", "laser"], [4, 7, 3, 5], [False] * 4, G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.5, 0.0, 0.0, 0.5]
    assert ctx.rewards_per_func[:, 0].tolist() == [1, 1, 0, 1]  # correctness untouched
    assert ctx.metrics["plugins/laser/mean_target"] == [5.0]


def test_laser_d_ecr_estimator_targets_by_difficulty():  # the non-official estimator (option)
    # G = 4, max_len 8, budgets 1..8. Group 0 easy (acc 1): lengths 2,3,6,8 -> ECR(2) = 4 * 1/4 = 1 -> target 2.
    # Group 1 hard (acc 1/4): its only correct answer has length 7 -> ECR(7) = 4 * 1/4 = 1 -> target 7.
    plugin = _plugin(max_len=8, variant="laser_d", alpha=1.0, target_estimator="ecr")
    acc = [1, 1, 1, 1, 0, 0, 1, 0]
    ctx = _reward_ctx([[a, 0] for a in acc], ["acc", "laser"], [2, 3, 6, 8, 1, 2, 7, 8], [False] * 8, G=4)
    plugin.trl_plugins_transform_rewards(ctx)
    assert plugin.targets == [2, None, 7]
    assert ctx.rewards_per_func[:, 1].tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert ctx.metrics["plugins/laser/target_medium"] == [8.0]  # no medium prompt yet: max length
    state = plugin.trl_plugins_state_dict()
    fresh = _plugin(max_len=8, variant="laser_d", alpha=1.0, target_estimator="ecr")
    fresh.trl_plugins_load_state_dict(state=state)
    assert fresh.targets == [2, None, 7] and len(fresh.history) == 1


def test_options_refused():
    with pytest.raises(PluginConfigError, match="'difficulty_edges' of plugin 'laser' got \\[0.8, 0.2\\]"):
        build_plugins(["laser"], {"laser": {"difficulty_edges": [0.8, 0.2]}})
    with pytest.raises(PluginConfigError, match="'variant'.*Did you mean 'laser_d'"):
        build_plugins(["laser"], {"laser": {"variant": "laser-d"}})
    with pytest.raises(PluginConfigError, match="'alpha' of plugin 'laser' got -0.1"):
        build_plugins(["laser"], {"laser": {"alpha": -0.1}})


def test_unknown_correctness_column_refused_at_construction(tmp_path):
    with pytest.raises(PluginConfigError, match="correctness_column='acc'"):
        make_tiny_trainer(plugins=["laser"], plugin_config={"laser": {"correctness_column": "acc"}},
                          output_dir=str(tmp_path))
    with pytest.raises(PluginConfigError, match="format_column='fmt'"):
        make_tiny_trainer(plugins=["laser"], plugin_config={"laser": {"format_column": "fmt"}},
                          output_dir=str(tmp_path))


RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")


def test_neutral_alpha_zero_is_vanilla():
    runs = assert_reduces_to_vanilla("laser", {"variant": "laser", "alpha": 0.0}, loss_types=("dapo",), steps=2)
    assert all(r.shape[1] == 2 and not r[:, 1].any() for r in runs["dapo"].rewards)  # the plugin's all-zero column


def test_end_to_end_laser_d(tmp_path):
    trainer = make_tiny_trainer(
        plugins=["laser"],
        plugin_config={"laser": {"variant": "laser_d", "correctness_column": "digit_fraction_reward",
                                 "correct_threshold": 0.2}},
        output_dir=str(tmp_path), **RUN,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert "rewards/laser/mean" in log
        assert "plugins/laser/target_easy" in log and "plugins/laser/mean_length" in log
