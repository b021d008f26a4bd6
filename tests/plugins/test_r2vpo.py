"""R2VPO: the unclipped surrogate plus lambda (r - 1)^2, lambda following a projected dual ascent on the measured
ratio variance; on-policy it trains exactly as GRPO; off-policy it keeps the gradient of tokens clipping would zero."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.r2vpo import dual_update, r2vpo_token_loss


def test_hand_computed_token_loss_and_gradient():
    lp = torch.tensor([[0.0, 0.5, -0.5]], requires_grad=True)
    r = torch.exp(lp)
    adv = torch.tensor([[2.0, 1.0, -1.0]])
    loss, sq = r2vpo_token_loss(r, adv, lam=3.0)
    e = torch.exp(torch.tensor([0.0, 0.5, -0.5]))
    torch.testing.assert_close(loss.detach()[0], -e * adv[0] + 3.0 * (e - 1) ** 2)
    torch.testing.assert_close(sq.detach()[0], (e - 1) ** 2)
    loss.sum().backward()
    # d/dlp of -r A + lam (r-1)^2 = r (-A + 2 lam (r - 1))
    torch.testing.assert_close(lp.grad[0], e * (-adv[0] + 6.0 * (e - 1)))


def test_tokens_past_the_clip_range_keep_their_gradient():
    """r = 1.5 > 1 + eps with A > 0: TRL's clipped surrogate gives no gradient, R2VPO (lambda = 0) gives -A r."""
    lp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    base = make_loss_context(lp, old_per_token_logps=old, advantages=adv)
    (g_base,) = torch.autograd.grad(loss_from_context(base), lp)
    assert g_base[0, 0] == 0
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv)
    run_hook(build_stack("r2vpo", {"r2vpo": {"initial_lambda": 0.0}}), "trl_plugins_loss", ctx)
    (g,) = torch.autograd.grad(loss_from_context(ctx), lp)
    torch.testing.assert_close(g, torch.tensor([[-1.5 / 2, -1.0 / 2]]))  # dapo: token-mean over 2 tokens


def test_loss_hook_replaces_on_policy_tokens_and_logs_the_variance():
    lp = torch.tensor([[0.2, -0.2, 0.0, 0.1]], requires_grad=True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    off = torch.tensor([[False, False, True, False]])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([1.0]), mask=mask, offpolicy_mask=off)
    stack = build_stack("r2vpo", {"r2vpo": {"initial_lambda": 2.0}})
    run_hook(stack, "trl_plugins_loss", ctx)
    token_mask, values = ctx.replacement
    assert token_mask.tolist() == [[True, True, False, False]]
    r = torch.exp(lp.detach())
    torch.testing.assert_close(values.detach(), -r + 2.0 * (r - 1) ** 2)
    expected_var = float(((r - 1) ** 2 * mask).sum() / mask.sum())
    assert ctx.metrics["plugins/r2vpo/ratio_variance"] == [pytest.approx(expected_var)]
    assert stack.plugins[0]._measurements == [pytest.approx(expected_var)]


def test_dual_ascent_raises_lambda_above_the_target_and_projects_at_zero_and_the_cap():
    assert dual_update(1.0, 0.10, 0.04, 10.0, 100.0) == pytest.approx(1.6)
    assert dual_update(0.1, 0.0, 0.04, 10.0, 100.0) == 0.0
    assert dual_update(99.0, 1.0, 0.04, 10.0, 100.0) == 100.0


def test_step_end_applies_the_mean_of_the_steps_measurements_and_state_round_trips():
    stack = build_stack("r2vpo", {"r2vpo": {"initial_lambda": 1.0, "dual_lr": 2.0, "variance_target": 0.1}})
    plugin = stack.plugins[0]
    plugin._measurements = [0.2, 0.4]
    stack.call("trl_plugins_on_step_end", trainer=None, step=1)
    assert plugin.lam == pytest.approx(1.0 + 2.0 * (0.3 - 0.1)) and plugin._measurements == []
    stack.call("trl_plugins_on_step_end", trainer=None, step=2)  # nothing measured: unchanged
    assert plugin.lam == pytest.approx(1.4)
    fresh = build_stack("r2vpo").plugins[0]
    fresh.trl_plugins_load_state_dict(plugin.trl_plugins_state_dict())
    assert fresh.lam == pytest.approx(1.4)


def test_bad_options_and_stacks_are_refused():
    with pytest.raises(PluginConfigError, match="variance_target"):
        build_plugins(["r2vpo"], {"r2vpo": {"variance_target": -1.0}})
    with pytest.raises(IncompatiblePluginsError, match="r2vpo"):
        build_plugins(["r2vpo", "rover"])
    with pytest.raises(Exception, match="cispo"):
        make_tiny_trainer(plugins=["r2vpo"], loss_type="cispo", max_steps=1)


def test_on_policy_it_is_grpo():
    assert_reduces_to_vanilla("r2vpo", {"initial_lambda": 5.0}, loss_types=("dapo", "grpo"), steps=1)


def test_end_to_end_off_policy_updates_lambda(tmp_path):
    trainer = make_tiny_trainer(plugins=["r2vpo"], plugin_config={"r2vpo": {"dual_lr": 50.0}},
                                reward_funcs=[digit_fraction_reward], max_steps=2, per_device_train_batch_size=2,
                                num_generations=2, steps_per_generation=2, gradient_accumulation_steps=1,
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert [log["plugins/r2vpo/lambda"] for log in logs][0] == 1.0
    variances = [log["plugins/r2vpo/ratio_variance"] for log in logs]
    assert variances[1] > 0  # the second micro-step of a generation batch runs after an update: r != 1
    expected = dual_update(dual_update(1.0, variances[0], 0.04, 50.0, 100.0), variances[1], 0.04, 50.0, 100.0)
    assert trainer.plugin_stack.plugins[0].lam == pytest.approx(expected, rel=1e-5)
