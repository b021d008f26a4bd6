"""AEPO (loss half): entropy-aware advantages, the gradient-preserving upper clip and the dual clip on small tensors,
the neutral setting, construction checks and runs on the tiny model."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (assert_reduces_to_vanilla, digit_fraction_reward, loss_from_context, make_loss_context,
                                 make_tiny_trainer, record_run)
from trl_plugins_builtin.aepo import entropy_scaled_advantages

OFF = {"balanced_clipping": False, "entropy_advantage_coef": 0.0, "dual_clip": None}


def test_entropy_scaled_advantages_hand_made():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, unbiased std sqrt(2.5); the masked 99 does not count
    z = (ent - 3.0) / valid.std()
    torch.testing.assert_close(entropy_scaled_advantages(adv, ent, mask, 0.2), adv * (1 + 0.2 * z))
    assert entropy_scaled_advantages(adv, ent, mask, 0.2)[0, 2] == 1.0  # the mean entropy keeps A


def test_entropy_scaled_advantages_constant_entropy_and_no_gradient():
    adv = torch.tensor([[1.0, -1.0]])
    ent = torch.full((1, 2), 0.7, requires_grad=True)
    out = entropy_scaled_advantages(adv, ent, torch.ones(1, 2), 0.2)
    assert torch.equal(out, adv) and not out.requires_grad  # std 0 -> 1, z = 0; z is detached


# rows: A > 0 with r above 1 + eps_high at (0, 1); A < 0 with r above the dual-clip constant 3 at (1, 2) and below
# 1 - eps_low at (1, 0) (a hard lower clip, kept)
LP = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
OLD = LP - torch.tensor([[0.0, 0.5, 0.1], [-0.5, 0.0, 1.5]])  # r = e^0.5 = 1.65, e^0.1 = 1.105, e^-0.5, e^1.5 = 4.48
ADV = torch.tensor([1.0, -2.0])


def _ctx(lp, **kw):
    return make_loss_context(lp, old_per_token_logps=OLD, advantages=ADV, loss_type="dapo", epsilon_low=0.2,
                             epsilon_high=0.28, entropies=torch.ones(2, 3), **kw)


def test_upper_clip_keeps_the_gradient_and_dual_clip_caps_negatives():
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {"entropy_advantage_coef": 0.0}}).call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    expected = torch.zeros(2, 3, dtype=torch.bool)
    expected[0, 1] = expected[1, 2] = True
    assert torch.equal(repl, expected)
    base_ctx = _ctx(lp)
    # the upper-clipped token keeps its value -A (1 + eps_high); the dual-clipped one becomes -A c = 6 < 2 e^1.5
    assert values[0, 1].item() == pytest.approx(base_ctx.per_token_loss[0, 1].item())
    assert values[1, 2].item() == pytest.approx(6.0)
    assert base_ctx.per_token_loss[1, 2].item() == pytest.approx(2 * torch.e ** 1.5, rel=1e-5)
    (grad,) = torch.autograd.grad(loss_from_context(ctx), lp)
    (base_grad,) = torch.autograd.grad(loss_from_context(base_ctx), lp)
    assert base_grad[0, 1] == 0 and grad[0, 1].item() == pytest.approx(-1.0 * 1.28 / 6)  # dapo: over 6 tokens
    assert grad[1, 2] == 0 and base_grad[1, 2] != 0
    assert grad[1, 0] == 0 and base_grad[1, 0] == 0  # the lower clip stays hard
    keep = ~expected
    torch.testing.assert_close(grad[keep], base_grad[keep])
    assert ctx.metrics["plugins/aepo/preserved_clip_fraction"] == [pytest.approx(1 / 6)]
    assert ctx.metrics["plugins/aepo/dual_clip_fraction"] == [pytest.approx(1 / 6)]


def test_each_part_alone():
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {**OFF, "balanced_clipping": True}}).call("trl_plugins_loss", ctx)
    assert ctx.replacement[0].nonzero().tolist() == [[0, 1]]
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {**OFF, "dual_clip": 5.0}}).call("trl_plugins_loss", ctx)  # r = 4.48 < 5
    assert ctx.replacement is None


def test_entropy_advantage_hook_shapes_the_surrogate():
    ent = torch.tensor([[0.5, 1.0, 1.5], [2.0, 2.5, 3.0]])
    lp = LP.clone().requires_grad_(True)
    ctx = make_loss_context(lp, advantages=ADV, entropies=ent, loss_type="dapo")
    ctx.advantages = ctx.advantages.expand(-1, 3).clone()
    build_plugins(["aepo"], {"aepo": {**OFF, "entropy_advantage_coef": 0.2}}).call("trl_plugins_loss_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, entropy_scaled_advantages(ADV.view(2, 1).expand(2, 3), ent,
                                                                         torch.ones(2, 3), 0.2))


def test_neutral_options_switch_every_hook_off():
    stack = build_plugins(["aepo"], {"aepo": OFF})
    assert not stack.has("trl_plugins_loss") and not stack.has("trl_plugins_loss_advantages")


def test_option_validation_and_loss_types(tmp_path):
    with pytest.raises(PluginConfigError, match="dual_clip"):
        build_plugins(["aepo"], {"aepo": {"dual_clip": 1.0}})
    with pytest.raises(PluginConfigError, match="entropy_advantage_coef"):
        build_plugins(["aepo"], {"aepo": {"entropy_advantage_coef": -0.1}})
    with pytest.raises(IncompatiblePluginsError, match="aepo.*cispo"):
        make_tiny_trainer(plugins=["aepo"], loss_type="cispo", output_dir=str(tmp_path))
    with pytest.raises(IncompatiblePluginsError, match="aepo.*reg_grpo|reg_grpo.*aepo"):
        build_plugins(["aepo", "reg_grpo"])


def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_setting_is_vanilla():
    """The neutral setting switches every hook off: the run equals trl.GRPOTrainer exactly (kit check)."""
    assert_reduces_to_vanilla("aepo", OFF, loss_types=("grpo", "dapo"))

def test_end_to_end_off_policy_micro_step(tmp_path):
    """steps_per_generation=2 with one accumulation step: the second micro-step has r != 1, so the clips can act."""
    trainer = _trainer(tmp_path, "r", plugins=["aepo"], steps_per_generation=2, learning_rate=0.05)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/aepo/preserved_clip_fraction" in log for log in logs)
