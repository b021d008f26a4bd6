"""rec: REC / OPMD / AsymRE off-policy group REINFORCE (from the official Trinity-RFT code).

Trust regions of every clip mode on hand-picked ratios, the gradients of each weighting and regulariser against their
closed forms, the GRPO member (one-side + importance sampling) against TRL's clipped surrogate, RED-Drop's balanced
keep mask and re-centred advantages, off-policy token handling, option validation, and the neutral setting on the
tiny model (variant='grpo' gives trl.GRPOTrainer's run)."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    run_hook,
)
from trl_plugins_builtin.rec import balance_drop, kept_mean_advantages, rec_in_range, rec_token_loss

RATIOS = torch.tensor([[0.5, 0.85, 1.0, 1.15, 1.5, 3.5]])


def _region(mode, advantage):
    adv = torch.full_like(RATIOS, advantage)
    return rec_in_range(RATIOS, adv, mode, 0.2, 0.2, 0.6, 2.0)[0].tolist()


def test_trust_regions_of_every_clip_mode():
    # one-side: positive advantages lose only r > 1.2, negative ones only r < 0.8 (PPO's gradient region)
    assert _region("one-side", 1.0) == [True, True, True, True, False, False]
    assert _region("one-side", -1.0) == [False, True, True, True, True, True]
    assert _region("two-side", 1.0) == [False, True, True, True, False, False]
    assert _region("two-side", -1.0) == [False, True, True, True, False, False]
    # ring: the inner band plus r <= 0.4 for A >= 0 and r >= 3 for A <= 0
    assert _region("ring", 1.0) == [False, True, True, True, False, False]
    assert rec_in_range(torch.tensor([[0.3]]), torch.tensor([[1.0]]), "ring", 0.2, 0.2, 0.6, 2.0).item()
    assert _region("ring", -1.0) == [False, True, True, True, False, True]
    assert _region("none", -1.0) == [True] * 6


def _grad(loss_fn, lp, old, adv, mask=None):
    lp = lp.clone().requires_grad_(True)
    mask = torch.ones_like(lp) if mask is None else mask
    loss, _ = loss_fn(lp, old, adv, mask)
    loss.sum().backward()
    return lp.grad


def test_reinforce_gradient_is_minus_advantage_whatever_the_ratio():
    lp, old = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-3.0, -0.1, -0.5]])  # ratios far from 1
    adv = torch.tensor([[0.7]])
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", weight="none"), lp, old, adv)
    assert torch.allclose(g, torch.full_like(g, -0.7))


def test_one_side_nois_drops_out_of_region_tokens_only():
    lp = torch.tensor([[0.0, 0.0, 0.0]]).log_softmax(-1)  # equal log-probs
    old = lp - torch.tensor([[0.0, 0.5, -0.5]])  # ratios 1, e^0.5 (> 1.2), e^-0.5 (< 0.8)
    g_pos = _grad(lambda *a: rec_token_loss(*a, clip_mode="one-side"), lp, old, torch.tensor([[1.0]]))
    g_neg = _grad(lambda *a: rec_token_loss(*a, clip_mode="one-side"), lp, old, torch.tensor([[-1.0]]))
    assert g_pos.tolist() == [[-1.0, 0.0, -1.0]]  # the too-likely token is frozen for A > 0
    assert g_neg.tolist() == [[1.0, 1.0, 0.0]]  # the too-unlikely token is frozen for A < 0


def test_importance_weighting_multiplies_the_gradient_by_the_ratio():
    lp, old = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.1, -0.9]])
    adv = torch.tensor([[2.0]])
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", weight="importance_sampling"), lp, old, adv)
    assert torch.allclose(g, -2.0 * torch.exp(lp - old))


def test_gspo_weight_uses_one_sequence_ratio_and_advantage_weight_uses_exp_a():
    lp, old = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.2, -1.0]])
    adv = torch.tensor([[1.0]])
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", weight="gspo_importance_sampling"), lp, old, adv)
    assert torch.allclose(g, torch.full_like(g, -torch.exp(torch.tensor(0.1)).item()))
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", weight="advantage", temp=2.0), lp, old, adv)
    assert torch.allclose(g, torch.full_like(g, -torch.exp(torch.tensor(0.5)).item()))


def test_opmd_k2_and_asymre_forward_kl_regularisers():
    lp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[1.0]])
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", regularizer="k2", regularizer_coef=0.1), lp, old, adv)
    assert torch.allclose(g, torch.tensor([[-1.0 + 0.2 * 0.5, -1.0]]))
    g = _grad(lambda *a: rec_token_loss(*a, clip_mode="none", regularizer="forward-kl", regularizer_coef=0.1),
              lp, old, adv)
    assert torch.allclose(g, torch.full_like(g, -1.1))  # AsymRE: the baseline lowered by 0.1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_member_has_trl_clipped_surrogate_gradient(loss_type):
    # stale old log-probs so that some tokens are clipped on each side
    g = torch.Generator().manual_seed(3)
    lp0 = -3 * torch.rand(4, 6, generator=g)
    old = lp0 + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    grads = []
    for plugins in ([], ["rec"]):
        lp = lp0.clone().requires_grad_(True)
        ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv, loss_type=loss_type)
        if plugins:
            run_hook(plugins, "trl_plugins_loss", ctx, {"rec": {"variant": "grpo"}})
        loss_from_context(ctx).backward()
        grads.append(lp.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    clipped = ctx.metrics["plugins/rec/clipped_token_fraction"][0]
    assert 0.0 < clipped < 1.0


def test_plugin_replaces_every_loss_token_and_offpolicy_option():
    off = torch.tensor([[False, True, True, False]] * 2)
    ctx = make_loss_context(shape=(2, 4), offpolicy_mask=off)
    run_hook("rec", "trl_plugins_loss", ctx, {"rec": {"variant": "reinforce"}}, scale_rewards="none")
    mask, values = ctx.replacement
    assert mask.all()
    assert torch.allclose(values, -ctx.advantages * ctx.per_token_logps)
    ctx = make_loss_context(shape=(2, 4), offpolicy_mask=off)
    run_hook("rec", "trl_plugins_loss", ctx, {"rec": {"offpolicy_tokens": "shaped"}}, scale_rewards="none")
    assert torch.equal(ctx.replacement[0], ~off)  # the shaped branch keeps the injected tokens


def test_balance_drop_keeps_as_many_negatives_as_positives():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # group 0: 1 pos / 3 neg; group 1: 3 / 1
    keep = balance_drop(rewards, 4, torch.Generator().manual_seed(0))
    assert keep[:4].sum() == 2 and bool(keep[0])  # the positive and one negative
    assert keep[4:].all()
    adv = kept_mean_advantages(rewards, keep, 4)
    kept = torch.nonzero(keep[:4]).flatten()
    assert torch.allclose(adv[:4][kept].sum(), torch.tensor(0.0))  # re-centred on the kept rewards
    assert adv[:4][~keep[:4]].abs().sum() == 0
    assert torch.allclose(adv[4:], rewards[4:] - 0.75)


def test_advantage_hook_drops_only_with_balance():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ctx = make_advantage_context(rewards, num_generations=4)
    before = ctx.advantages.clone()
    run_hook("rec", "trl_plugins_transform_advantages", ctx, scale_rewards="none")
    assert torch.equal(ctx.advantages, before)
    run_hook("rec", "trl_plugins_transform_advantages", ctx, {"rec": {"drop": "balance"}}, scale_rewards="none")
    assert (ctx.advantages != 0).sum() == 2
    assert ctx.advantages[0] == 0.5


def test_option_validation():
    with pytest.raises(PluginConfigError, match="variant='opmd' sets"):
        build_plugins(["rec"], {"rec": {"variant": "opmd", "clip_mode": "two-side"}})
    with pytest.raises(PluginConfigError, match="clip_mode"):
        build_plugins(["rec"], {"rec": {"clip_mode": "three-side"}})
    stack = build_plugins(["rec"], {"rec": {"variant": "asymre"}})
    assert stack.plugins[0].options.resolved() == ("none", "none", "forward-kl", 0.1)


def test_official_advantage_warning():
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        from trl_plugins.testing import build_stack

        build_stack("rec")


def test_neutral_grpo_variant_is_vanilla():
    assert_reduces_to_vanilla("rec", {"variant": "grpo"}, loss_types=("grpo", "dapo"), steps=1)
