"""STEER: A = 0 gives Omega = 0 and w = 1; w stays in
[lambda_min, 1]; the argmax token gets exactly lambda_min when max|Omega| >= 0.02; lambda_min = 1 is the base loss;
w is monotone non-increasing in |Omega|; no gradient flows through w. Plus the Omega formula, the linear mapping,
the dual clip, the entropy source and end-to-end runs."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.steer import OLD_ENTROPY_KEY, entropy_change, steer_weights


def test_entropy_change_formula_hand_made():
    lp = torch.tensor([[math.log(0.5), math.log(0.1), math.log(0.9), 0.0]])
    old = torch.tensor([[math.log(0.4), math.log(0.2), math.log(0.9), 0.0]])
    adv = torch.tensor([[1.0, -2.0, 0.0, 1.0]])
    H = torch.tensor([[1.2, 0.3, 2.0, 0.5]])
    omega = entropy_change(lp, old, adv, H)
    expected = [
        (1.0 / 0.4) * 0.5 * 0.5 * (math.log(0.5) + 1.2),
        (-2.0 / 0.2) * 0.1 * 0.9 * (math.log(0.1) + 0.3),
        0.0,  # A = 0
        0.0,  # p = 1: x is clamped to 1 - 1e-8, which is 1.0 in float32 (as in the official fp32 code): x(1-x) = 0
    ]
    assert omega[0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)


def test_non_finite_omega_is_zero():
    lp = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[float("inf"), 1.0]])
    omega = entropy_change(lp, old, adv, torch.tensor([[float("nan"), 0.5]]))
    assert omega[0, 0] == 0 and torch.isfinite(omega).all() and omega[0, 1] != 0


def test_zero_advantage_gives_zero_change_and_weight_one():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g) * 3
    omega = entropy_change(lp, lp - 0.1, torch.zeros(3, 5), torch.rand(3, 5, generator=g))
    assert torch.all(omega == 0)
    assert torch.all(steer_weights(omega.abs(), torch.ones(3, 5), 0.8) == 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lambda_min", [0.5, 0.8, 0.95])
def test_exp_weights_range_argmax_and_monotonicity(seed, lambda_min):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(4, 6, generator=g) * 0.5
    mask = torch.ones(4, 6)
    mask[3, 4:] = 0
    w = steer_weights(a, mask, lambda_min)
    assert torch.all(w >= lambda_min) and torch.all(w <= 1)
    valid = mask.bool()
    a_max = a[valid].max()
    assert float(a_max) >= 0.02
    assert float(w[valid][a[valid].argmax()]) == float(torch.tensor(lambda_min))  # exactly (float32 lambda_min)
    # monotone non-increasing: sort by a, weights must not increase
    order = a[valid].argsort()
    ws = w[valid][order]
    assert torch.all(ws[1:] <= ws[:-1])


def test_exp_weights_use_the_floor_when_changes_are_tiny():
    a = torch.tensor([[0.0, 0.005, 0.01]])
    w = steer_weights(a, torch.ones(1, 3), 0.8)
    k = -math.log(0.8) / 0.02
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-k * 0.005), math.exp(-k * 0.01)])
    assert float(w.min()) > 0.8  # max a < 0.02: nobody reaches lambda_min


def test_invalid_positions_do_not_set_the_scale():
    a = torch.tensor([[0.1, 0.2, 50.0]])
    w = steer_weights(a, torch.tensor([[1, 1, 0]]), 0.8)
    assert float(w[0, 1]) == float(torch.tensor(0.8))  # the masked 50.0 is ignored for the max


def test_linear_mapping():
    a = torch.tensor([[0.0, 0.5, 1.0, 0.25]])
    w = steer_weights(a, torch.ones(1, 4), 0.8, 1.2, mapping="linear")
    assert w[0].tolist() == pytest.approx([1.2, 1.0, 0.8, 1.1])
    flat = steer_weights(torch.full((1, 3), 0.3), torch.ones(1, 3), 0.8, 1.2, mapping="linear")
    assert flat[0].tolist() == pytest.approx([1.0, 1.0, 1.0])  # a_max == a_min: midpoint


# ------------------------------------------------------------------------------------------ loss hook
def _loss_ctx(lp, lp_old, adv, mask, entropies=None, extras=None):
    B, T = lp.shape
    return make_loss_context(lp, old_per_token_logps=lp_old, advantages=adv, mask=mask, entropies=entropies,
                             extras=extras, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28,
                             completion_ids=torch.zeros(B, T, dtype=torch.long))


def _combine(ctx):
    per_token = ctx.per_token_loss
    for w in ctx.token_weights:
        per_token = per_token * w
    for term in ctx.token_terms:
        per_token = per_token + term
    return (per_token * ctx.mask).sum() / ctx.mask.sum()


def _batch(seed=0, B=3, T=6):
    g = torch.Generator().manual_seed(seed)
    lp_old = -torch.rand(B, T, generator=g) * 3
    lp = lp_old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    ent = torch.rand(B, T, generator=g) * 2
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    return lp, lp_old, adv, mask, ent


def test_lambda_min_one_is_exactly_the_base_loss():
    lp, lp_old, adv, mask, ent = _batch()
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask, ent)
    build_plugins(["steer"], {"steer": {"lambda_min": 1.0}}).call("trl_plugins_loss", ctx)
    assert torch.all(ctx.token_weights[0] == 1) and ctx.token_terms == []
    assert torch.equal(_combine(ctx), (ctx.per_token_loss * mask).sum() / mask.sum())


def test_loss_is_weighted_surrogate_and_no_gradient_flows_through_w():
    lp, lp_old, adv, mask, ent = _batch(1)
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask, ent.requires_grad_(True))
    sink = ctx.metrics
    build_plugins(["steer"]).call("trl_plugins_loss", ctx)
    (w,) = ctx.token_weights
    assert not w.requires_grad
    expected_w = steer_weights(entropy_change(lp, lp_old, adv, ent).abs(), mask, 0.8)
    torch.testing.assert_close(w, expected_w)
    assert float(w[mask.bool()].min()) == pytest.approx(0.8)  # the largest |Omega| gets lambda_min
    (grad,) = torch.autograd.grad(_combine(ctx), lp, retain_graph=True)
    (base_grad,) = torch.autograd.grad((ctx.per_token_loss * w * mask).sum() / mask.sum(), lp)
    torch.testing.assert_close(grad, base_grad, rtol=0, atol=0)  # w acts as a constant
    assert sink["plugins/steer/mean_weight"] == [pytest.approx(float(w[mask.bool()].mean()))]


def test_dual_clip_caps_negative_advantage_loss_with_zero_gradient():
    lp_old = torch.tensor([[-3.0, -3.0, -3.0]])
    lp = (lp_old + torch.tensor([[math.log(12.0), math.log(2.0), math.log(12.0)]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])  # r = 12 with A < 0: dual-clipped; r = 2 (A < 0): not; A > 0: not
    mask = torch.ones(1, 3, dtype=torch.long)
    ctx = _loss_ctx(lp, lp_old, adv, mask, torch.ones(1, 3))
    build_plugins(["steer"]).call("trl_plugins_loss", ctx)
    (weights,) = ctx.token_weights
    (term,) = ctx.token_terms
    w = steer_weights(entropy_change(lp, lp_old, adv, torch.ones(1, 3)).abs(), mask, 0.8)
    assert weights[0].tolist() == pytest.approx([0.0, float(w[0, 1]), float(w[0, 2])])
    per_token = ctx.per_token_loss * weights + term
    assert float(per_token.detach()[0, 0]) == pytest.approx(float(w[0, 0]) * 10.0)  # w * min(-A c, L) = w * 10
    assert float(per_token.detach()[0, 1]) == pytest.approx(float(w[0, 1]) * 2.0)
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    assert grad[0, 0] == 0 and grad[0, 1] != 0


def test_entropy_source_old_uses_the_advantage_stage_entropy():
    lp, lp_old, adv, mask, ent = _batch(2)
    stack = build_plugins(["steer"], {"steer": {"entropy_source": "auto"}})
    moving = SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1, loss_type="dapo")
    stack.call("trl_plugins_configure", trainer=SimpleNamespace(num_iterations=2), args=moving)
    stats = PolicyStats(per_token_logps=lp_old, entropies=ent, mask=mask,
                        completion_ids=torch.zeros(3, 6, dtype=torch.long), mean_entropy=torch.zeros(3))
    actx = make_advantage_context(torch.zeros(3), num_generations=1, advantages=adv[:, 0],
                                  completion_lengths=mask.sum(-1).float(), policy_stats=stats)
    stack.call("trl_plugins_transform_advantages", actx)
    assert torch.equal(actx.local_extras[OLD_ENTROPY_KEY], ent)
    ctx = _loss_ctx(lp, lp_old, adv, mask, entropies=torch.zeros(3, 6), extras={OLD_ENTROPY_KEY: ent})
    stack.call("trl_plugins_loss", ctx)
    expected = steer_weights(entropy_change(lp, lp_old, adv, ent).abs(), mask, 0.8)
    torch.testing.assert_close(ctx.token_weights[0], expected)

    on_policy = build_plugins(["steer"])  # auto, one optimizer step per generation batch: current entropy, no forward
    on_policy.call("trl_plugins_configure", trainer=SimpleNamespace(num_iterations=1),
                   args=SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1, loss_type="dapo"))
    actx.local_extras.clear()
    on_policy.call("trl_plugins_transform_advantages", actx)
    assert actx.local_extras == {}


def test_option_validation():
    with pytest.raises(PluginConfigError, match="lambda_min"):
        build_plugins(["steer"], {"steer": {"lambda_min": 0.0}})
    with pytest.raises(PluginConfigError, match="lambda_max"):
        build_plugins(["steer"], {"steer": {"mapping": "linear", "lambda_min": 0.9, "lambda_max": 0.5}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_lambda_min_one_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["steer"], plugin_config={"steer": {"lambda_min": 1.0}}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_end_to_end_reweights_and_logs(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["steer"], num_iterations=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert 0.8 <= log["plugins/steer/mean_weight"] < 1.0
        assert log["plugins/steer/reweighted_token_fraction"] > 0
        assert "plugins/steer/dual_clip_fraction" in log
