"""ROVER: the TD loss (Q - y)^2 with Q = rho (lp - lp_old), y = sg(A + c_U U), U from the chunked mean log-softmax
of the next position; on-policy it is REINFORCE with twice rho times the gradient; the rover clip freezes Q."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.runtime.head_stats import HeadStats
from trl_plugins.testing import (
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
    stub_policy_stats,
)
from trl_plugins_builtin.rover import OLD_MEAN_LOGSOFTMAX_KEY, rover_next_values, rover_token_loss

B, C, D, V = 3, 5, 8, 37


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, C + 2, D, generator=g)
    W = torch.randn(V, D, generator=g)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[2, 3:] = 0
    z = hidden[:, -(C + 1):-1] @ W.t()  # brute-force (B, C, V) logits
    return hidden, W, mask, z


# ------------------------------------------------------------------------------------------ formula
def test_next_values_shift_by_one_and_vanish_at_the_end_and_on_masked_positions():
    ml = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    ml_old = torch.tensor([[0.0, 1.5, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    u = rover_next_values(ml, ml_old, mask, rho=2.0)
    torch.testing.assert_close(u, torch.tensor([[1.0, 2.0, 0.0, 0.0]]))


def test_hand_computed_td_loss():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[1.0]])
    u = torch.tensor([[0.25, 0.0]])
    loss, clipped = rover_token_loss(lp, old, adv, u, rho=2.0, next_value_coef=0.5)
    # Q = [1, 0], y = [1.125, 1]
    torch.testing.assert_close(loss, torch.tensor([[0.015625, 1.0]]))
    assert not clipped.any()
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[2 * 2 * (1 - 1.125), 2 * 2 * (0 - 1.0)]]))


def test_target_carries_no_gradient():
    adv = torch.tensor([[0.5, -0.5]], requires_grad=True)
    u = torch.zeros(1, 2)
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = rover_token_loss(lp, lp.detach(), adv, u, rho=1.0, next_value_coef=1.0)
    loss.sum().backward()
    assert adv.grad is None


@pytest.mark.parametrize("rho", [0.5, 1.0, 3.0])
def test_on_policy_gradient_is_twice_rho_reinforce(rho):
    """lp_old = sg(lp): the TD loss's gradient is 2 rho times that of -A lp (token-mean), the spec's identity."""
    g = torch.Generator().manual_seed(0)
    lp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0]).unsqueeze(1)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    ctx = make_loss_context(lp, advantages=adv.squeeze(1), mask=mask)
    run_hook(build_stack("rover", {"rover": {"rho": rho}}), "trl_plugins_loss", ctx)
    (grad,) = torch.autograd.grad(loss_from_context(ctx), lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    reinforce = -(adv * lp2 * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, lp2)
    torch.testing.assert_close(grad, 2 * rho * expected)


def test_clip_freezes_tokens_past_the_bound():
    lp = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.1]], requires_grad=True)
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    bounds = (math.log(0.8), math.log(1.2))
    loss, clipped = rover_token_loss(lp, old, adv, torch.zeros(1, 5), 1.0, 1.0, bounds)
    # token 0: y > Q > ln 1.2 -> frozen; token 2: y < Q? no (Q=-0.5 < ln 0.8 but y=-1 < Q) -> frozen; others free
    assert clipped.tolist() == [[True, False, True, False, False]]
    loss.sum().backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 2] == 0
    assert lp.grad[0, 1] != 0 and lp.grad[0, 3] != 0 and lp.grad[0, 4] != 0
    torch.testing.assert_close(loss[0, 0], (math.log(1.2) - 1.0) ** 2 * torch.ones(()))


# ------------------------------------------------------------------------------------------ hooks
def test_loss_hook_uses_the_chunked_mean_log_softmax_of_the_next_position():
    hidden, W, mask, z = _head()
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=2)
    brute = torch.log_softmax(z, -1).mean(-1)
    torch.testing.assert_close(stats.mean_log_softmax(), brute * mask)
    ml_old = brute - 0.1 * torch.arange(C).float()  # a different sampling policy
    lp = (-torch.rand(B, C, generator=torch.Generator().manual_seed(3))).requires_grad_(True)
    old = lp.detach() - 0.2
    adv = torch.tensor([1.0, -1.0, 0.5])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv, mask=mask.float(), head_stats=stats,
                            extras={OLD_MEAN_LOGSOFTMAX_KEY: ml_old})
    stack = build_stack("rover", {"rover": {"next_value": "always", "next_value_coef": 0.5}})
    run_hook(stack, "trl_plugins_loss", ctx)
    u = torch.zeros(B, C)
    u[:, :-1] = (brute[:, 1:] - ml_old[:, 1:]) * mask[:, 1:]
    y = adv.unsqueeze(1) + 0.5 * u
    expected = ((lp.detach() - old) - y) ** 2
    token_mask, values = ctx.replacement
    assert torch.equal(token_mask, mask.bool())
    torch.testing.assert_close(values.detach(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_from_context(ctx), (expected * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)


def test_offpolicy_tokens_keep_their_shaped_branch():
    off = torch.zeros(2, 4, dtype=torch.bool)
    off[0, 2:] = True
    ctx = make_loss_context(offpolicy_mask=off)
    run_hook("rover", "trl_plugins_loss", ctx)
    token_mask, _ = ctx.replacement
    assert torch.equal(token_mask, ~off)


def test_advantage_hook_stores_the_old_mean_log_softmax_only_when_needed():
    hidden, W, mask, z = _head(1)
    stats = stub_policy_stats(B, C, mask=mask, head_stats=HeadStats(hidden, C, mask, W, None, chunk_size=3))
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0]), num_generations=3, policy_stats=stats)
    run_hook("rover", "trl_plugins_transform_advantages", ctx, {"rover": {"next_value": "always"}})
    torch.testing.assert_close(ctx.local_extras[OLD_MEAN_LOGSOFTMAX_KEY], torch.log_softmax(z, -1).mean(-1) * mask)
    # auto, on-policy (the tiny config: gradient_accumulation_steps a multiple of steps_per_generation): no pass
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0]), num_generations=3, policy_stats=stats)
    run_hook("rover", "trl_plugins_transform_advantages", ctx)
    assert ctx.policy_stats_calls == [] and not ctx.local_extras


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="rho"):
        build_plugins(["rover"], {"rover": {"rho": 0.0}})
    with pytest.raises(PluginConfigError, match="'auto', 'always', 'never'"):
        build_plugins(["rover"], {"rover": {"next_value": "sometimes"}})


def test_exclusive_with_other_surrogate_replacers():
    with pytest.raises(IncompatiblePluginsError, match="rover"):
        build_plugins(["rover", "lp_reg"])


# ------------------------------------------------------------------------------------------ real trainer
def test_neutral_half_rho_on_policy_gives_dapos_gradients(tmp_path):
    """rho = 1/2, one pass per batch: gradients and parameters equal TRL's DAPO (the loss value differs: A^2)."""
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=2, loss_type="dapo", log_level="error")
    ours = record_run(make_tiny_trainer(plugins=["rover"], plugin_config={"rover": {"rho": 0.5}},
                                        output_dir=str(tmp_path / "a"), **common))
    vanilla = record_run(make_tiny_trainer(trainer_cls=GRPOTrainer, output_dir=str(tmp_path / "b"), **common))
    for x, y in zip(ours.advantages, vanilla.advantages):
        torch.testing.assert_close(x, y)
    assert len(ours.grads) == len(vanilla.grads) == 2
    for ga, gb in zip(ours.grads, vanilla.grads):
        for key in ga:
            torch.testing.assert_close(ga[key], gb[key], atol=1e-6, rtol=1e-5)
    for key in ours.params:
        torch.testing.assert_close(ours.params[key], vanilla.params[key], atol=1e-6, rtol=1e-5)


def test_end_to_end_off_policy_computes_the_next_state_value(tmp_path):
    # steps_per_generation=2 with one accumulation step: TRL keeps old log-probs, the second micro-step is off-policy
    trainer = make_tiny_trainer(plugins=["rover"], reward_funcs=[digit_fraction_reward], max_steps=2,
                                per_device_train_batch_size=2, num_generations=2, steps_per_generation=2,
                                gradient_accumulation_steps=1, output_dir=str(tmp_path))
    assert trainer.plugin_stack.plugins[0]._with_next_value
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/rover/td_loss" in log for log in logs)
    assert any(log["plugins/rover/next_value_abs"] > 0 for log in logs)
