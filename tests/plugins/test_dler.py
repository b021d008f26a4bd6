"""dler: DLER's truncation penalty (every reward column of a row past the cap, or cut off unfinished, is 0; NaN stays
NaN) and its difficulty-aware caps, by hand and through the reward hook; the neutral setting (no unfinished zeroing,
default cap) reduces to trl.GRPOTrainer; bad options are refused; mask_truncated_completions is warned about."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, make_reward_context, make_tiny_trainer
from trl_plugins_builtin._length import truncation_mask
from trl_plugins_builtin.dler import dler_caps

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
    runs = assert_reduces_to_vanilla("dler", {"zero_unfinished": False}, loss_types=("dapo",), steps=1)
    logs = [log for log in runs["dapo"].logs if "loss" in log]
    assert logs and all(log["plugins/dler/truncated_fraction"] == 0.0 for log in logs)
