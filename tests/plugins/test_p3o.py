"""P3O: the jointly clipped pairwise loss on small tensors (value, gradient, clipping, invariance to a per-group reward
shift), the neutral mix, construction checks and runs on the tiny model."""

import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (assert_reduces_to_vanilla, digit_fraction_reward, loss_from_context, make_loss_context,
                                 make_tiny_trainer, record_run)
from trl_plugins_builtin.p3o import pairwise_clipped_loss


def test_two_responses_by_hand():
    """G = 2: the pairs (1, 2) and (2, 1); D = (A1 - A2) / 2 = 1, rho_12 = e^(s1 - s2)."""
    s = torch.tensor([[0.1, -0.05]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, clipped = pairwise_clipped_loss(s, adv, 0.2, 0.2)
    r = math.exp(0.15)  # inside [0.8, 1.2]: unclipped both ways
    assert loss.item() == pytest.approx((-r * 1 + -(1 / r) * -1) / 2)
    assert not clipped.any()
    (grad,) = torch.autograd.grad(loss, s)
    # d/ds1 of (-r + 1/r) / 2 = (-r - 1/r) / 2; s2 gets the opposite
    torch.testing.assert_close(grad, torch.tensor([[(-r - 1 / r) / 2, (r + 1 / r) / 2]]))


def test_on_policy_gradient_is_the_pairwise_policy_gradient():
    """s = 0 (pi_theta = pi_old): the gradient is the mean over ordered pairs of -D_ij grad(s_i - s_j)."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(2, 4, generator=g)
    s = torch.zeros(2, 4, requires_grad=True)
    loss, _ = pairwise_clipped_loss(s, adv, 0.2, 0.28)
    (grad,) = torch.autograd.grad(loss, s)
    expected = torch.zeros(2, 4)
    for b in range(2):
        for i in range(4):
            for j in range(4):
                if i != j:
                    d = (adv[b, i] - adv[b, j]) / 2
                    expected[b, i] -= d
                    expected[b, j] += d
    torch.testing.assert_close(grad, expected / (2 * 12))


def test_clipped_pairs_have_no_gradient():
    s = torch.tensor([[1.0, 0.0, 0.05]], requires_grad=True)  # rho_12 = e > 1.2 with D > 0: clipped
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, clipped = pairwise_clipped_loss(s, adv, 0.2, 0.2)
    assert clipped[0, 0, 1] and clipped[0, 1, 0] and clipped[0, 0, 2] and not clipped[0, 1, 2]
    (grad,) = torch.autograd.grad(loss, s)
    assert grad[0, 0] == 0  # every pair of row 0 is clipped
    assert grad[0, 1] == 0 and grad[0, 2] == 0  # (1, 2) has D = 0; its other pairs are with row 0


def test_invariant_to_a_per_group_shift_of_the_advantages():
    g = torch.Generator().manual_seed(1)
    s = (0.3 * torch.randn(3, 4, generator=g)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g)
    base, _ = pairwise_clipped_loss(s, adv, 0.2, 0.28)
    shifted, _ = pairwise_clipped_loss(s, adv + torch.tensor([[5.0], [-2.0], [0.3]]), 0.2, 0.28)
    torch.testing.assert_close(base, shifted)


LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2], [-0.7, -0.9, -1.1], [-2.0, -0.1, -4.0]])
OLD = LP - torch.tensor([[0.05, 0.0, 0.02], [-0.02, 0.01, 0.0], [0.0, 0.05, 0.0], [0.03, -0.01, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.2, -0.4, -1.1, 0.3])


def _ctx(lp, **kw):
    return make_loss_context(lp, old_per_token_logps=OLD, advantages=ADV, mask=MASK, loss_type="dapo",
                             epsilon_low=0.2, epsilon_high=0.28, num_generations=2, **kw)


def test_loss_hook_takes_the_surrogate_place():
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["p3o"]).call("trl_plugins_loss", ctx)
    s = ((lp - OLD) * MASK).sum(1).view(2, 2)  # the padded log-ratio (9.0) does not count
    by_hand, _ = pairwise_clipped_loss(s, ADV.view(2, 2), 0.2, 0.28)
    total = loss_from_context(ctx)
    torch.testing.assert_close(total, by_hand)
    (g1,) = torch.autograd.grad(total, lp)
    (g2,) = torch.autograd.grad(by_hand, lp)
    torch.testing.assert_close(g1, g2)
    assert ctx.metrics["plugins/p3o/pair_clip_fraction"] == [0.0]


def test_mix_interpolates_and_zero_switches_the_hook_off():
    lp = LP.clone().requires_grad_(True)
    base = loss_from_context(_ctx(lp))
    full = _ctx(lp)
    build_plugins(["p3o"]).call("trl_plugins_loss", full)
    half = _ctx(lp)
    build_plugins(["p3o"], {"p3o": {"mix": 0.5}}).call("trl_plugins_loss", half)
    torch.testing.assert_close(loss_from_context(half), 0.5 * base + 0.5 * loss_from_context(full))
    stack = build_plugins(["p3o"], {"p3o": {"mix": 0.0}})
    assert not stack.has("trl_plugins_loss") and not stack.needs_whole_groups


def test_construction_checks(tmp_path):
    with pytest.raises(PluginConfigError, match="mix"):
        build_plugins(["p3o"], {"p3o": {"mix": -0.1}})
    with pytest.raises(IncompatiblePluginsError, match="p3o.*sapo"):
        make_tiny_trainer(plugins=["p3o"], loss_type="sapo", output_dir=str(tmp_path / "a"))
    with pytest.raises(IncompatiblePluginsError, match="'p3o'.*per_device_train_batch_size=2 is not a multiple"):
        make_tiny_trainer(plugins=["p3o"], per_device_train_batch_size=2, gradient_accumulation_steps=2,
                          output_dir=str(tmp_path / "b"))


def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_mix_is_vanilla():
    """The neutral setting switches every hook off: the run equals trl.GRPOTrainer exactly (kit check)."""
    assert_reduces_to_vanilla("p3o", {"mix": 0.0}, loss_types=("grpo", "dapo"))

def test_end_to_end_trains_on_pairs(tmp_path):
    trainer = _trainer(tmp_path, "p", plugins=["p3o"], scale_rewards="none", per_device_train_batch_size=4,
                       num_generations=2, gradient_accumulation_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert all(math.isfinite(x) for x in run.losses)
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2 and all("plugins/p3o/pair_clip_fraction" in log for log in logs)
