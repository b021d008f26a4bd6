"""sweet_spot (SSL, reconstructed tiers): zones and progressively amplified tiers by hand; the reward hook reads the
graded score column and fills only its own column; the order of the scores is kept; bad options and an unknown score
column are refused; alpha = 0 is vanilla TRL; a tiny run trains."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, make_reward_context, make_tiny_trainer
from trl_plugins_builtin.sweet_spot import tier_reward, zone_index


def _plugin(**options):
    return build_plugins(["sweet_spot"], {"sweet_spot": options} if options else {}).plugins[0]


def test_zones_are_equal_width_and_the_sweet_spot_is_the_top_zone():
    scores = torch.tensor([0.0, 0.24, 0.25, 0.5, 0.74, 0.99, 1.0, float("nan"), 1.7, -0.3])
    assert zone_index(scores, 4).tolist() == [0, 0, 1, 2, 2, 3, 3, 0, 3, 0]
    assert zone_index(torch.tensor([0.49, 0.5, 1.0]), 2).tolist() == [0, 1, 1]


def test_tiers_are_progressively_amplified():
    zones = torch.arange(4)
    tiers = tier_reward(zones, 4, 2.0)
    assert tiers.tolist() == pytest.approx([0.0, 1 / 7, 3 / 7, 1.0])
    steps = tiers.diff()
    assert steps[1] == pytest.approx(2 * steps[0]) and steps[2] == pytest.approx(2 * steps[1])
    assert tier_reward(zones, 4, 1.0).tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])  # b = 1: evenly spaced


def test_reward_hook_fills_its_column_from_the_score_column():
    # columns: verifier (binary), graded score, sweet_spot placeholder
    values = [[1.0, 1.0, 0.0], [0.0, 0.6, 0.0], [0.0, 0.1, 0.0], [0.0, float("nan"), 0.0]]
    ctx = make_reward_context(values, num_generations=2, reward_func_names=["acc", "score", "sweet_spot"])
    ctx.set_active_plugin("sweet_spot")
    _plugin(score_column="score").trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 2].tolist() == pytest.approx([0.5, 0.5 * 3 / 7, 0.0, 0.0])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the verifier is untouched
    assert ctx.metrics["plugins/sweet_spot/zone_mean"] == pytest.approx([(3 + 2) / 4])
    assert ctx.metrics["plugins/sweet_spot/unscored_fraction"] == pytest.approx([0.25])
    # default: the verifier column is the score; a score range maps onto [0, 1]
    ctx = make_reward_context([[10.0, 0.0], [4.0, 0.0]], num_generations=2, reward_func_names=["points", "sweet_spot"])
    ctx.set_active_plugin("sweet_spot")
    _plugin(score_max=10.0, alpha=1.0).trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([1.0, 1 / 7])


def test_closer_rollouts_never_earn_less():
    scores = torch.linspace(0, 1, 101)
    total = scores + tier_reward(zone_index(scores, 4), 4, 2.0)  # a graded verifier plus the tier
    assert bool((total.diff() >= 0).all())


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(PluginConfigError, match="'zones' of plugin 'sweet_spot' got 1"):
        _plugin(zones=1)
    with pytest.raises(PluginConfigError, match="'amplification' of plugin 'sweet_spot' got 0.5"):
        _plugin(amplification=0.5)
    with pytest.raises(PluginConfigError, match="'score_min' and 'score_max' of plugin 'sweet_spot' got 1.0 and 1.0"):
        _plugin(score_min=1.0)
    with pytest.raises(PluginConfigError, match="score_column='partial' is not a reward column"):
        make_tiny_trainer(plugins=["sweet_spot"], plugin_config={"sweet_spot": {"score_column": "partial"}},
                          output_dir=str(tmp_path))


def test_neutral_alpha_reduces_to_vanilla():
    runs = assert_reduces_to_vanilla("sweet_spot", {"alpha": 0.0}, loss_types=("dapo", "grpo"), steps=1)
    assert any("plugins/sweet_spot/zone_mean" in log for log in runs["dapo"].logs)


def test_tiny_run_trains_with_the_tier_column(tmp_path):
    from trl_plugins.testing import digit_fraction_reward

    trainer = make_tiny_trainer(plugins=["sweet_spot"], reward_funcs=[digit_fraction_reward], max_steps=1,
                                output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert "plugins/sweet_spot/zone_mean" in logs and logs["rewards/sweet_spot/mean"] >= 0
