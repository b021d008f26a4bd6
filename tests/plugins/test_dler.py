"""dler: DLER's truncation penalty (every reward column of a row past the cap, or cut off unfinished, is 0; NaN stays
NaN) and its difficulty-aware caps, by hand and through the reward hook; the neutral setting (no unfinished zeroing,
default cap) reduces to trl.GRPOTrainer; bad options are refused; mask_truncated_completions is warned about."""

import pytest
import torch

from trl_plugins import PluginConfigError, RunInfo, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    make_refill_context,
    make_reward_context,
    make_tiny_trainer,
)
from trl_plugins_builtin._length import truncation_mask
from trl_plugins_builtin.dler import LENGTH_COLUMN, dler_caps

EOS = 99


def test_dler_caps_and_mask():
    assert dler_caps(torch.tensor([0.0, 0.5, 1.0]), 10, 0.5, 1).tolist() == [10, 8, 5]  # round(7.5) = 8
    assert dler_caps(torch.tensor([1.0]), 10, 1.0, 3).tolist() == [3]  # floor
    lengths = torch.tensor([4, 6, 6, 3])
    caps = torch.tensor([5, 5, 8, 8])
    unfinished = torch.tensor([False, False, False, True])
    assert truncation_mask(lengths, caps, unfinished).tolist() == [False, True, False, True]


def _reward_ctx(rewards, names, lengths, unfinished, G):
    ids = [[7] * (n - 1) + ([7] if u else [EOS]) for n, u in zip(lengths, unfinished)]
    ctx = make_reward_context(torch.tensor(rewards, dtype=torch.float32), num_generations=G, reward_func_names=names,
                              completions=["c"] * len(lengths), local_completion_ids=ids)
    ctx.set_active_plugin("dler")  # what the plugin stack does when it calls the hook
    return ctx


def _plugin(max_len=10, **options):
    plugin = build_plugins(["dler"], {"dler": options}).plugins[0]
    plugin.max_len, plugin.eos_ids = max_len, {EOS}
    return plugin


def test_dler_zeroes_every_column_of_truncated_rows():
    plugin = _plugin(max_len=10, cap=6)
    ctx = _reward_ctx([[1, 0.3], [1, float("nan")], [0, 0.2], [1, 0.9]], ["acc", "fmt"], [5, 7, 6, 10],
                      [False, False, False, True], G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    out = ctx.rewards_per_func
    assert out[0].tolist() == pytest.approx([1, 0.3])
    assert out[1, 0] == 0 and torch.isnan(out[1, 1])  # NaN (not applicable) stays NaN
    assert out[2].tolist() == pytest.approx([0, 0.2])  # exactly at the cap: kept
    assert out[3].tolist() == [0, 0]
    assert ctx.metrics["plugins/dler/truncated_fraction"] == [0.5]


def test_difficulty_aware_caps_are_tighter_on_easy_groups():
    plugin = _plugin(max_len=10, difficulty_aware=True, shrink=0.5, zero_unfinished=False)
    # group 0 all correct -> cap 5; group 1 none correct -> cap 10
    ctx = _reward_ctx([[1], [1], [0], [0]], ["acc"], [4, 6, 9, 10], [False, False, False, True], G=2)
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [1, 0, 0, 0]
    assert ctx.metrics["plugins/dler/mean_cap"] == [7.5]


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(PluginConfigError, match="'shrink' of plugin 'dler' got 1.5"):
        build_plugins(["dler"], {"dler": {"shrink": 1.5}})
    with pytest.raises(PluginConfigError, match="'cap' of plugin 'dler' got 0"):
        build_plugins(["dler"], {"dler": {"cap": 0}})
    with pytest.raises(PluginConfigError, match="correctness_column='acc'"):
        make_tiny_trainer(plugins=["dler"], plugin_config={"dler": {"correctness_column": "acc"}},
                          output_dir=str(tmp_path))


def test_mask_truncated_completions_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="mask_truncated_completions=True removes truncated completions"):
        make_tiny_trainer(plugins=["dler"], mask_truncated_completions=True, output_dir=str(tmp_path))


def test_neutral_setting_reduces_to_vanilla():
    runs = assert_reduces_to_vanilla("dler", {"zero_unfinished": False, "filter_groups": "none"}, loss_types=("dapo",),
                                     steps=1)
    logs = [log for log in runs["dapo"].logs if "loss" in log]
    assert logs and all(log["plugins/dler/truncated_fraction"] == 0.0 for log in logs)


# ------------------------------------------------------------------------------------------ the recipe's filter
def _refill_ctx(acc, signed_lengths, G=2, **kwargs):
    values = torch.tensor([acc, signed_lengths], dtype=torch.float32).T
    ctx = make_refill_context(values, num_generations=G, reward_weights=[1.0, 0.0],
                              run=RunInfo(reward_func_names=("acc", LENGTH_COLUMN)), **kwargs)
    ctx.set_active_plugin("dler")
    return ctx


def test_filter_rejects_groups_without_variance_after_the_truncation():
    """DAPO's filter on DLER's truncated rewards: group 1's only success is over the cap (both 0 after it): rejected,
    though its raw rewards vary; group 2's all-correct rewards vary once the unfinished row is zeroed: kept; group 3
    is all wrong: rejected. (dynamic_sampling, judging the raw rewards, would keep group 1 and reject group 2.)"""
    plugin = _plugin(max_len=10, cap=6)
    ctx = _refill_ctx([1, 0, 1, 0, 1, 1, 0, 0], [5, 4, 8, 4, 3, -10, 3, 3])
    plugin.trl_plugins_reject_groups(ctx)
    assert ctx.rejected.tolist() == [False, True, False, True]
    assert ctx.metrics["plugins/dler/filtered_fraction"] == [0.5]
    # a refill round judges its fresh groups only
    later = _refill_ctx([1, 0, 0, 0, 1, 1, 0, 0], [5, 4, 8, 4, 3, 3, 3, 3], round=1, fresh=[False, True, True, False])
    plugin.trl_plugins_reject_groups(later)
    assert later.rejected.tolist() == [False, True, True, False]
    # difficulty-aware caps: group 0 all correct -> cap 5 cuts its 6-token row; without zero_unfinished an unfinished
    # row keeps its reward
    aware = _plugin(max_len=10, difficulty_aware=True, zero_unfinished=False)
    ctx = _refill_ctx([1, 1, 1, 0], [4, 6, -8, 4])  # group 1 at accuracy 0.5: cap 8, its 8 unfinished tokens kept
    aware.trl_plugins_reject_groups(ctx)
    assert ctx.rejected.tolist() == [False, False]


def test_length_column_is_signed_and_weightless_and_off_without_the_filter():
    plugin = _plugin(max_len=10)
    assert plugin.signed_length([7] * 10) == -10.0 and plugin.signed_length([7, EOS]) == 2.0
    (column,) = plugin.trl_plugins_reward_functions(args=None)
    assert column.__name__ == LENGTH_COLUMN and column.reward_weight == 0.0
    assert column(["p"], ["c"], completion_ids=[[7, 7, EOS]]) == [3.0]
    assert plugin.hook_enabled("trl_plugins_reject_groups") and plugin.hook_enabled("trl_plugins_reward_functions")
    off = _plugin(filter_groups="none")
    assert not off.hook_enabled("trl_plugins_reject_groups") and not off.hook_enabled("trl_plugins_reward_functions")
    with pytest.raises(PluginConfigError, match="filter_groups"):
        build_plugins(["dler"], {"dler": {"filter_groups": "zero"}})


def test_end_to_end_refills_with_the_weightless_length_column(tmp_path):
    from trl_plugins.tasks.arithmetic import accuracy_reward

    trainer = make_tiny_trainer(plugins=["dler"], reward_funcs=[accuracy_reward], max_steps=2, max_refill_rounds=2,
                                output_dir=str(tmp_path))
    assert trainer.reward_func_names[-1] == LENGTH_COLUMN and float(trainer.reward_weights[-1]) == 0.0
    trainer.train()
    logs = {k: v for log in trainer.state.log_history for k, v in log.items()}
    assert "plugins/dler/filtered_fraction" in logs and "plugins/framework/refill_rounds" in logs
