"""Reg-GRPO: the predicted advantage and the regression loss on small tensors, its gradient at the on-policy point,
the mix option, construction checks and runs on the tiny model."""

import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    loss_from_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.reg_grpo import predicted_advantages

# one group of G = 4 rows, three positions; row 3 has a padded position (G = 2 would be degenerate: two standardised
# values are always +-1/sqrt(2))
LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2], [-0.7, -0.9, -1.1], [-2.0, -0.1, -4.0]])
OLD = LP - torch.tensor([[0.1, 0.0, 0.2], [-0.2, 0.1, 0.0], [0.0, 0.05, 0.0], [0.3, -0.1, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.2, -0.4, -1.1, 0.3])


def test_predicted_advantages_hand_made():
    rho = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # unbiased, as TRL's advantages
    expected = (torch.tensor([1.0, 2.0, 3.0, 6.0]) - 3.0) / (std + 1e-4)
    torch.testing.assert_close(predicted_advantages(rho, 1e-4)[0], expected)


def test_predicted_advantages_gradient_matches_torch_std():
    g = torch.Generator().manual_seed(0)
    rho = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    target = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ours = (target - predicted_advantages(rho, 1e-3)).pow(2).mean()
    ref = (target - (rho - rho.mean(1, keepdim=True)) / (rho.std(1, keepdim=True) + 1e-3)).pow(2).mean()
    (g1,) = torch.autograd.grad(ours, rho)
    (g2,) = torch.autograd.grad(ref, rho)
    torch.testing.assert_close(g1, g2)


def _ctx(lp, old=OLD, adv=ADV, mask=MASK, **kw):
    return make_loss_context(lp, old_per_token_logps=old, advantages=adv, mask=mask, loss_type="grpo",
                             num_generations=4, **kw)


def test_loss_is_the_regression_of_the_sequence_log_ratio():
    """mix = 1: the surrogate is weighted 0 and the loss is mean_i (A_i - A^theta_i)^2 over the group's rows."""
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["reg_grpo"]).call("trl_plugins_loss", ctx)
    loss = loss_from_context(ctx)
    rho = ((lp - OLD) * MASK).sum(1).view(1, 4)  # the padded log-ratio (9.0) does not count
    by_hand = (ADV.view(1, 4) - (rho - rho.mean(1, keepdim=True)) / (rho.std(1, keepdim=True) + 1e-4)).pow(2).mean()
    torch.testing.assert_close(loss, by_hand)
    (g_loss,) = torch.autograd.grad(loss, lp)
    (g_hand,) = torch.autograd.grad(by_hand, lp)
    torch.testing.assert_close(g_loss, g_hand)
    assert g_loss[3, 2] == 0
    assert ctx.metrics["plugins/reg_grpo/regression_error"] == [pytest.approx(by_hand.item(), rel=1e-5)]


def test_on_policy_gradient_is_grpo_direction_over_eps():
    """pi_theta = pi_old: every rho is 0, the prediction 0, and d loss / d lp = -(2 / (B eps)) (A_i - mean A) per loss
    token."""
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp, old=LP.clone())
    build_plugins(["reg_grpo"], {"reg_grpo": {"eps": 0.01}}).call("trl_plugins_loss", ctx)
    (grad,) = torch.autograd.grad(loss_from_context(ctx), lp)
    assert torch.isfinite(grad).all()
    expected = (-2 / (4 * (0.01 + 1e-10)) * (ADV - ADV.mean())).unsqueeze(1) * MASK
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("mix", [0.25, 0.5])
def test_mix_interpolates_surrogate_and_regression(mix):
    lp = LP.clone().requires_grad_(True)
    base = loss_from_context(_ctx(lp))
    full = _ctx(lp)
    build_plugins(["reg_grpo"]).call("trl_plugins_loss", full)
    reg = loss_from_context(full)
    mixed = _ctx(lp)
    build_plugins(["reg_grpo"], {"reg_grpo": {"mix": mix}}).call("trl_plugins_loss", mixed)
    torch.testing.assert_close(loss_from_context(mixed), (1 - mix) * base + mix * reg)


def test_mix_zero_switches_the_loss_hook_off():
    stack = build_plugins(["reg_grpo"], {"reg_grpo": {"mix": 0.0}})
    assert not stack.has("trl_plugins_loss") and not stack.needs_whole_groups
    assert build_plugins(["reg_grpo"]).needs_whole_groups


def test_option_validation():
    with pytest.raises(PluginConfigError, match="eps"):
        build_plugins(["reg_grpo"], {"reg_grpo": {"eps": 0.0}})
    with pytest.raises(PluginConfigError, match="mix"):
        build_plugins(["reg_grpo"], {"reg_grpo": {"mix": 1.5}})


def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_refuses_non_group_reward_scaling(tmp_path):
    with pytest.raises(IncompatiblePluginsError, match="reg_grpo.*scale_rewards='none'.*allowed: 'group'"):
        _trainer(tmp_path, "a", plugins=["reg_grpo"], scale_rewards="none")


def test_refuses_micro_batches_without_whole_groups(tmp_path):
    with pytest.raises(IncompatiblePluginsError, match="'reg_grpo'.*per_device_train_batch_size=2 is not a multiple"):
        _trainer(tmp_path, "a", plugins=["reg_grpo"], per_device_train_batch_size=2, gradient_accumulation_steps=2)


def test_neutral_mix_is_vanilla():
    """The neutral setting switches every hook off: the run equals trl.GRPOTrainer exactly (kit check)."""
    assert_reduces_to_vanilla("reg_grpo", {"mix": 0.0}, loss_types=("grpo", "dapo"))

def test_end_to_end_trains_with_the_regression(tmp_path):
    trainer = _trainer(tmp_path, "r", plugins=["reg_grpo"], per_device_train_batch_size=4, num_generations=2,
                       gradient_accumulation_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert all(math.isfinite(x) for x in run.losses)
    errors = [log["plugins/reg_grpo/regression_error"] for log in run.logs if "loss" in log]
    assert len(errors) == 2 and all(e >= 0 for e in errors)
