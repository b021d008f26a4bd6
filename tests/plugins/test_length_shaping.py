"""length_shaping: LASER / LASER-D / LASER-DE step bonus and (difficulty-aware) DLER truncation.

Exact formulas on tensors and on a hand-built RewardContext; the neutral setting (alpha = 0) reproduces
trl.GRPOTrainer (apart from the added all-zero column); a short LASER-D run trains and logs its metrics."""

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import digit_fraction_reward, make_reward_context, make_tiny_trainer, record_run
from trl_plugins_builtin.length_shaping import (
    dler_caps,
    dler_zero_mask,
    difficulty_buckets,
    ecr_target,
    group_accuracy,
    laser_bonus,
)

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


def test_dler_caps_and_mask():
    assert dler_caps(torch.tensor([0.0, 0.5, 1.0]), 10, 0.5, 1).tolist() == [10, 8, 5]  # round(7.5) = 8
    assert dler_caps(torch.tensor([1.0]), 10, 1.0, 3).tolist() == [3]  # floor
    lengths = torch.tensor([4, 6, 6, 3])
    caps = torch.tensor([5, 5, 8, 8])
    unfinished = torch.tensor([False, False, False, True])
    assert dler_zero_mask(lengths, caps, unfinished).tolist() == [False, True, False, True]


def _reward_ctx(rewards, names, lengths, unfinished, G):
    ids = [[7] * (n - 1) + ([7] if u else [EOS]) for n, u in zip(lengths, unfinished)]
    ctx = make_reward_context(torch.tensor(rewards, dtype=torch.float32), num_generations=G, reward_func_names=names,
                              completions=["c"] * len(lengths), local_completion_ids=ids)
    ctx.set_active_plugin("length_shaping")  # what the plugin stack does when it calls the hook
    return ctx


def _plugin(max_len=10, **options):
    plugin = build_plugins(["length_shaping"], {"length_shaping": options}).plugins[0]
    plugin.max_len, plugin.eos_ids = max_len, {EOS}
    return plugin


def test_laser_fixed_target_fills_its_column():
    plugin = _plugin(mode="laser", target_length=5, alpha=0.5)
    ctx = _reward_ctx([[1, 0], [1, 0], [0, 0], [1, 0]], ["acc", "length_shaping"], [4, 7, 3, 5], [False] * 4, G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.5, 0.0, 0.0, 0.5]
    assert ctx.rewards_per_func[:, 0].tolist() == [1, 1, 0, 1]  # correctness untouched
    assert ctx.metrics["plugins/length_shaping/mean_target"] == [5.0]


def test_laser_d_ecr_estimator_targets_by_difficulty():  # the non-official estimator (option)
    # G = 4, max_len 8, budgets 1..8. Group 0 easy (acc 1): lengths 2,3,6,8 -> ECR(2) = 4 * 1/4 = 1 -> target 2.
    # Group 1 hard (acc 1/4): its only correct answer has length 7 -> ECR(7) = 4 * 1/4 = 1 -> target 7.
    plugin = _plugin(max_len=8, mode="laser_d", alpha=1.0, target_estimator="ecr")
    acc = [1, 1, 1, 1, 0, 0, 1, 0]
    ctx = _reward_ctx([[a, 0] for a in acc], ["acc", "length_shaping"], [2, 3, 6, 8, 1, 2, 7, 8], [False] * 8, G=4)
    plugin.trl_plugins_transform_rewards(ctx)
    assert plugin.targets == [2, None, 7]
    assert ctx.rewards_per_func[:, 1].tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert ctx.metrics["plugins/length_shaping/target_medium"] == [8.0]  # no medium prompt yet: max length
    state = plugin.trl_plugins_state_dict()
    fresh = _plugin(max_len=8, mode="laser_d", alpha=1.0, target_estimator="ecr")
    fresh.trl_plugins_load_state_dict(state=state)
    assert fresh.targets == [2, None, 7] and len(fresh.history) == 1


def test_dler_zeroes_every_column_of_truncated_rows():
    plugin = _plugin(max_len=10, mode="dler", cap=6)
    ctx = _reward_ctx([[1, 0.3], [1, float("nan")], [0, 0.2], [1, 0.9]], ["acc", "fmt"], [5, 7, 6, 10],
                      [False, False, False, True], G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    out = ctx.rewards_per_func
    assert out[0].tolist() == pytest.approx([1, 0.3])
    assert out[1, 0] == 0 and torch.isnan(out[1, 1])  # NaN (not applicable) stays NaN
    assert out[2].tolist() == pytest.approx([0, 0.2])  # exactly at the cap: kept
    assert out[3].tolist() == [0, 0]
    assert ctx.metrics["plugins/length_shaping/truncated_fraction"] == [0.5]


def test_dler_difficulty_tightens_caps_on_easy_groups():
    plugin = _plugin(max_len=10, mode="dler_difficulty", shrink=0.5, zero_unfinished=False)
    # group 0 all correct -> cap 5; group 1 none correct -> cap 10
    ctx = _reward_ctx([[1], [1], [0], [0]], ["acc"], [4, 6, 9, 10], [False, False, False, True], G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [1, 0, 0, 0]
    assert ctx.metrics["plugins/length_shaping/mean_cap"] == [7.5]


def test_options_refused():
    with pytest.raises(PluginConfigError, match="difficulty_edges"):
        build_plugins(["length_shaping"], {"length_shaping": {"difficulty_edges": [0.8, 0.2]}})
    with pytest.raises(PluginConfigError, match="'mode'"):
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "laser-d"}})


def test_unknown_correctness_column_refused_at_construction(tmp_path):
    with pytest.raises(PluginConfigError, match="correctness_column='acc'"):
        make_tiny_trainer(plugins=["length_shaping"], plugin_config={"length_shaping": {"correctness_column": "acc"}},
                          output_dir=str(tmp_path))


RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")


def test_neutral_alpha_zero_is_vanilla(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(plugins=["length_shaping"],
                                        plugin_config={"length_shaping": {"mode": "laser", "alpha": 0.0}},
                                        output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    for x, y in zip(vanilla.completion_ids, ours.completion_ids):
        assert torch.equal(x, y)
    for x, y in zip(vanilla.rewards, ours.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
        assert torch.equal(y[:, 1], torch.zeros_like(y[:, 1]))
    for name in ("advantages",):
        for x, y in zip(getattr(vanilla, name), getattr(ours, name)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(ours.losses), rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], ours.params[key], rtol=0, atol=0)


def test_end_to_end_laser_d(tmp_path):
    trainer = make_tiny_trainer(
        plugins=["length_shaping"],
        plugin_config={"length_shaping": {"mode": "laser_d", "correctness_column": "digit_fraction_reward",
                                          "correct_threshold": 0.2}},
        output_dir=str(tmp_path), **RUN,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert "rewards/length_shaping/mean" in log
        assert "plugins/length_shaping/target_easy" in log and "plugins/length_shaping/mean_length" in log
