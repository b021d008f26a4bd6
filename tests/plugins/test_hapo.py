"""HAPO: token-level group average (equal lengths = population-std GRPO; longer rows weigh more; the fallback fires
exactly when some |A| >= 5); h_hat hits +1 / -1 at the extreme entropies (paper sign) and is >= 0 with the code's
sign; alpha = beta = 0 without dual clip is PPO; on-policy high-entropy tokens keep A and low-entropy ones shrink;
adaptive clip ranges widen the right side; the dual clip bounds negative-advantage losses; neutral settings equal
vanilla end to end; bad options and incompatible settings are refused at construction."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_runs_equal,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.hapo import (
    adaptive_clip_ranges,
    hapo_token_loss,
    normalized_entropy,
    padding_advantages,
    redistributed_advantages,
    token_level_group_advantages,
    with_grpo_fallback,
)

NEUTRAL = {"token_level_advantage": False, "clip_alpha": 0.0, "adv_beta": 0.0, "dual_clip_c": None}


# ------------------------------------------------------------------------------------------ advantage stage
def test_equal_lengths_give_population_std_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1])
    adv = token_level_group_advantages(rewards, torch.full((8,), 7.0), 4)
    grouped = rewards.view(-1, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)
    torch.testing.assert_close(adv, expected.view(-1))


def test_longer_rows_weigh_more_in_the_group_mean():
    rewards = torch.tensor([1.0, 0.0])
    adv = token_level_group_advantages(rewards, torch.tensor([9.0, 1.0]), 2, scale=False)
    # mean = (9*1 + 1*0) / 10 = 0.9
    torch.testing.assert_close(adv, torch.tensor([0.1, -0.9]))


def test_fallback_fires_exactly_at_the_threshold():
    token_adv = torch.tensor([4.99, -1.0, 5.0, -1.0])
    grpo = torch.tensor([0.7, -0.7, 0.3, -0.3])
    out, fallback = with_grpo_fallback(token_adv, grpo, 2, 5.0)
    assert fallback.tolist() == [False, True]
    torch.testing.assert_close(out, torch.tensor([4.99, -1.0, 0.3, -0.3]))


def test_advantage_hook_replaces_with_token_level_and_falls_back_on_outlier_groups():
    # group 0: lengths 1 vs 30 -> the single short correct row gets |A| >= 5 -> TRL's GRPO advantage
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    lengths = torch.tensor([1.0, 30.0, 30.0, 30.0, 4.0, 4.0, 4.0, 4.0])
    ctx = make_advantage_context(rewards, num_generations=4, completion_lengths=lengths)
    trl_adv = ctx.advantages.clone()
    run_hook("hapo", "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages[:4], trl_adv[:4])
    expected = token_level_group_advantages(rewards[4:], lengths[4:], 4)
    torch.testing.assert_close(ctx.advantages[4:], expected)
    assert ctx.metrics["plugins/hapo/fallback_group_fraction"] == [0.5]


def test_official_fallback_test_counts_the_padding_positions():
    # Official test over the padded score tensor (rows x padded length): a row shorter than the padded length has
    # padding positions with score 0, normalised to (0 - mu) / (sigma + 1e-6). Rewards 0.9 / 1.0, lengths 2, 2, 4, 4
    # (padded length 4): mu = (0.9*2 + 1.0*2 + 0.9*4 + 1.0*4) / 12 = 0.95, sigma = 0.05 -> padding value -19 -> fallback.
    rewards = torch.tensor([0.9, 1.0, 0.9, 1.0])
    lengths = torch.tensor([2.0, 2.0, 4.0, 4.0])
    pad = padding_advantages(rewards, lengths, 4, padded_length=4)
    torch.testing.assert_close(pad, torch.tensor([-0.95 / (0.05 + 1e-6)]), rtol=1e-4, atol=1e-4)
    ctx = make_advantage_context(rewards, num_generations=4, completion_lengths=lengths)
    trl_adv = ctx.advantages.clone()
    run_hook("hapo", "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, trl_adv)
    assert ctx.metrics["plugins/hapo/fallback_group_fraction"] == [1.0]
    # the real rows alone stay at |A| = 1: 'real' keeps the token-level advantage
    ctx = make_advantage_context(rewards, num_generations=4, completion_lengths=lengths)
    run_hook("hapo", "trl_plugins_transform_advantages", ctx, {"hapo": {"fallback_test": "real"}})
    torch.testing.assert_close(ctx.advantages, token_level_group_advantages(rewards, lengths, 4))
    assert ctx.metrics["plugins/hapo/fallback_group_fraction"] == [0.0]


def test_no_padding_no_padding_test():
    # every row at the padded length: nothing is padded, the test sees the real rows only
    pad = padding_advantages(torch.tensor([0.9, 1.0]), torch.tensor([4.0, 4.0]), 2, padded_length=4)
    assert pad.tolist() == [0.0]


def test_entropy_floor_before_the_log_is_the_official_1e_8():
    ent = torch.tensor([[0.0, 1e-7, 1.0, 2.0]])
    mask = torch.ones_like(ent)
    logh = torch.log(ent.clamp(min=1e-8))
    med = torch.quantile(logh[0], 0.8, interpolation="nearest")
    h = (logh - med) / (logh - med).pow(2).mean().sqrt()
    expected = torch.where(h > 0, h / h.max(), h / h.min().abs())
    torch.testing.assert_close(normalized_entropy(ent, mask, 0.8), expected)


def test_advantage_hook_is_idle_when_switched_off():
    ctx = make_advantage_context([1.0, 0.0, 0.5, 0.2], num_generations=2, completion_lengths=[1.0, 9.0, 2.0, 3.0])
    before = ctx.advantages.clone()
    run_hook("hapo", "trl_plugins_transform_advantages", ctx, {"hapo": {"token_level_advantage": False}})
    assert torch.equal(ctx.advantages, before)


# ------------------------------------------------------------------------------------------ entropy normalisation
def _entropies(seed=0, shape=(3, 5)):
    g = torch.Generator().manual_seed(seed)
    return 0.05 + 2 * torch.rand(*shape, generator=g)


@pytest.mark.parametrize("seed", range(4))
def test_h_hat_hits_plus_and_minus_one_at_the_extremes(seed):
    H = _entropies(seed)
    mask = torch.ones_like(H)
    mask[2, 3:] = 0
    h_hat = normalized_entropy(H, mask, 0.8)
    valid = mask.bool()
    assert float(h_hat[valid].max()) == pytest.approx(1.0)
    assert float(h_hat[valid].min()) == pytest.approx(-1.0)
    assert h_hat[valid][H[valid].argmax()] == pytest.approx(1.0)
    assert h_hat[valid][H[valid].argmin()] == pytest.approx(-1.0)
    # monotone in the entropy
    order = H[valid].argsort()
    assert torch.all(h_hat[valid][order][1:] >= h_hat[valid][order][:-1])


def test_code_sign_makes_every_h_hat_non_negative():
    H = _entropies(1)
    mask = torch.ones_like(H)
    paper = normalized_entropy(H, mask, 0.8)
    code = normalized_entropy(H, mask, 0.8, code_sign=True)
    assert torch.all(code >= 0)
    torch.testing.assert_close(code, paper.abs())


def test_pivot_sets_the_centre():
    H = torch.tensor([[0.1, 0.2, 0.4, 0.8, 1.6]])
    # nearest-rank quantile 0.5 of 5 values is the third: 0.4 -> h_hat = 0 there
    h_hat = normalized_entropy(H, torch.ones_like(H), 0.5)
    assert float(h_hat[0, 2]) == 0.0
    assert (h_hat[0, :2] < 0).all() and (h_hat[0, 3:] > 0).all()


# ------------------------------------------------------------------------------------------ loss stage pieces
def test_adaptive_clip_widens_the_right_side():
    h_hat = torch.tensor([[-1.0, -0.5, 0.0, 0.5, 1.0]])
    low, high = adaptive_clip_ranges(h_hat, 0.2, 0.28, 1.0)
    torch.testing.assert_close(low, torch.tensor([[0.4, 0.3, 0.2, 0.2, 0.2]]))
    torch.testing.assert_close(high, torch.tensor([[0.28, 0.28, 0.28, 0.42, 0.56]]))


def test_on_policy_high_entropy_keeps_a_and_low_entropy_shrinks():
    h_hat = torch.tensor([[0.5, -0.5, 1.0, -1.0]])
    adv = torch.tensor([[2.0]])
    low, high = adaptive_clip_ranges(h_hat, 0.2, 0.2, 1.0)
    out = redistributed_advantages(adv, h_hat, torch.ones(1, 4), low, high, 1.0)
    torch.testing.assert_close(out, torch.tensor([[2.0, 1.0, 2.0, 0.0]]))
    # outside the neutral band the branches swap
    out = redistributed_advantages(adv, h_hat, torch.full((1, 4), 1.5), low, high, 1.0)
    torch.testing.assert_close(out, torch.tensor([[3.0, 2.0, 4.0, 2.0]]))


def test_dual_clip_bounds_negative_advantage_losses():
    ratio = torch.tensor([[20.0, 20.0, 0.5]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    eps = torch.full((1, 3), 0.2)
    no_dual = hapo_token_loss(ratio, adv, eps, eps, None)
    dual = hapo_token_loss(ratio, adv, eps, eps, 10.0)
    assert float(no_dual[0, 0]) == 20.0 and float(dual[0, 0]) == 10.0
    assert float(dual[0, 1]) == float(no_dual[0, 1])  # positive advantages untouched
    assert float(dual[0, 2]) == float(no_dual[0, 2])  # below c: untouched


def test_zero_alpha_beta_without_dual_clip_is_the_base_surrogate():
    g = torch.Generator().manual_seed(3)
    lp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    base = make_loss_context(lp, old_per_token_logps=old, advantages=adv, entropies=_entropies(2, (4, 6)))
    h_hat = normalized_entropy(base.entropies, base.mask, 0.8)
    low, high = adaptive_clip_ranges(h_hat, 0.2, 0.2, 0.0)
    a = redistributed_advantages(base.advantages, h_hat, base.coef_1.detach(), low, high, 0.0)
    values = hapo_token_loss(base.coef_1, a, low, high, None)
    torch.testing.assert_close(values, base.per_token_loss)


def test_loss_hook_replaces_on_policy_tokens_and_changes_gradients():
    g = torch.Generator().manual_seed(0)
    lp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(4, 6, generator=g)
    off = torch.zeros(4, 6, dtype=torch.bool)
    off[3, 4:] = True
    ctx = make_loss_context(lp, old_per_token_logps=old, entropies=_entropies(5, (4, 6)), offpolicy_mask=off,
                            advantages=torch.tensor([1.0, -1.0, 2.0, -0.5]))
    base_loss = loss_from_context(ctx)
    run_hook("hapo", "trl_plugins_loss", ctx)
    mask, _ = ctx.replacement
    assert torch.equal(mask, ~off)
    assert not torch.allclose(loss_from_context(ctx), base_loss)
    assert "plugins/hapo/mean_eps_high" in ctx.metrics


def test_neutral_loss_setting_leaves_the_surrogate_alone():
    ctx = make_loss_context(shape=(2, 5), entropies=_entropies(0, (2, 5)))
    run_hook("hapo", "trl_plugins_loss", ctx, {"hapo": NEUTRAL})
    assert ctx.replacement is None and ctx.token_weights == []


# ------------------------------------------------------------------------------------------ construction
def test_bad_options_and_settings_are_refused():
    with pytest.raises(PluginConfigError, match="entropy_pivot"):
        build_plugins(["hapo"], {"hapo": {"entropy_pivot": 1.5}})
    with pytest.raises(PluginConfigError, match="dual_clip_c"):
        build_plugins(["hapo"], {"hapo": {"dual_clip_c": 1.0}})
    with pytest.raises(IncompatiblePluginsError, match="cannot go through vLLM"):
        build_stack("hapo", {"hapo": {"temperature_tau": 0.05}}, use_vllm=True)
    with pytest.raises(IncompatiblePluginsError, match="importance_sampling_level"):
        build_stack("hapo", importance_sampling_level="sequence")
    with pytest.raises(IncompatiblePluginsError, match="compute the advantages from scratch"):
        build_stack(["hapo", "canon"])
    with pytest.raises(IncompatiblePluginsError, match="token_level_advantage=false"):
        build_stack(["prl", "hapo"])
    assert build_stack(["prl", "hapo"], {"hapo": {"token_level_advantage": False}})  # loss-only HAPO stacks
    with pytest.raises(IncompatiblePluginsError, match="entropy collapse"):
        build_plugins(["hapo", "lp_reg"])
    with pytest.raises(IncompatiblePluginsError, match="replace the base surrogate"):
        build_plugins(["hapo", "disco"])


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_setting_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["hapo"], plugin_config={"hapo": NEUTRAL}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_end_to_end_trains_and_logs(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["hapo"], num_iterations=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/hapo/mean_eps_high" in log for log in logs)
    assert all(log["plugins/hapo/mean_eps_high"] > 0.2 for log in logs)  # widened on high-entropy tokens
