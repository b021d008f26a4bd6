"""KL-Cov: beta_kl = 0 gives -A r everywhere, the selected set is
the top-k of the manual covariance, the KL term vanishes when lp == lp_old, the gradient at a selected token is
-A r + beta_kl sign(lp - lp_old); the generation-batch scope; the on-policy subtlety end to end."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.kl_cov import SELECT_KEY, kl_cov_token_loss, num_to_select, top_covariance


def _manual_cov(adv, lp, mask):
    cells = [(b, t) for b in range(adv.size(0)) for t in range(adv.size(1)) if mask[b, t]]
    mean_a = sum(float(adv[b, t]) for b, t in cells) / len(cells)
    mean_lp = sum(float(lp[b, t]) for b, t in cells) / len(cells)
    out = torch.full_like(adv, -math.inf)
    for b, t in cells:
        out[b, t] = (float(adv[b, t]) - mean_a) * (float(lp[b, t]) - mean_lp)
    return out


def _loss_ctx(lp, lp_old, adv, mask, extras=None, offpolicy=None):
    B, T = lp.shape
    return make_loss_context(
        lp, old_per_token_logps=lp_old, advantages=adv, mask=mask, offpolicy_mask=offpolicy, extras=extras,
        loss_type="dapo", entropies=torch.zeros(B, T), completion_ids=torch.zeros(B, T, dtype=torch.long),
    )


def _batch(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    lp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    lp = lp_old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside the clip range
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 5:] = 0
    return lp, lp_old, adv, mask


@pytest.mark.parametrize("num_valid, ratio, expected", [(100, 2e-3, 1), (1000, 2e-3, 2), (19, 0.25, 4)])
def test_num_to_select(num_valid, ratio, expected):
    assert num_to_select(num_valid, ratio) == expected


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
def test_selected_set_is_top_k_of_manual_covariance(seed, ratio):
    lp, lp_old, adv, mask = _batch(seed)
    ctx = _loss_ctx(lp.clone().requires_grad_(True), lp_old, adv, mask)
    build_plugins(["kl_cov"], {"kl_cov": {"ratio": ratio}}).call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    assert torch.all(repl)  # the whole surrogate is replaced (no off-policy tokens here)
    k = max(1, math.floor(ratio * int(mask.sum())))
    cov = _manual_cov(adv, lp, mask)
    order = sorted(((float(cov[b, t]), b, t) for b in range(3) for t in range(7) if mask[b, t]), reverse=True)
    expected = torch.zeros_like(mask, dtype=torch.bool)
    for _, b, t in order[:k]:
        expected[b, t] = True
    kl_part = values.detach() - (-adv * ctx.coef_1.detach())
    selected = kl_part.abs() > 0
    assert torch.equal(selected, expected)
    assert torch.equal(top_covariance(cov.nan_to_num(neginf=0.0), mask, k), expected)


def test_beta_zero_is_unclipped_policy_gradient_everywhere():
    lp, lp_old, adv, mask = _batch(1)
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask)
    build_plugins(["kl_cov"], {"kl_cov": {"ratio": 0.5, "beta_kl": 0.0}}).call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    r = torch.exp(lp.detach() - lp_old)
    torch.testing.assert_close(values.detach(), -adv * r, rtol=0, atol=0)
    clip_region = (r < 0.8) | (r > 1.2)
    assert clip_region.any()  # the base surrogate differs there: no clip anywhere in KL-Cov
    assert not torch.allclose(values.detach()[clip_region], ctx.per_token_loss.detach()[clip_region])


def test_kl_term_vanishes_when_on_policy():
    lp, _, adv, mask = _batch(2)
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp.detach().clone(), adv, mask)
    build_plugins(["kl_cov"], {"kl_cov": {"ratio": 1.0, "beta_kl": 3.0}}).call("trl_plugins_loss", ctx)
    _, values = ctx.replacement
    torch.testing.assert_close(values.detach(), -adv, rtol=0, atol=0)  # r = 1, |lp - lp_old| = 0
    (grad,) = torch.autograd.grad((values * mask).sum(), lp)
    torch.testing.assert_close(grad, -adv * mask, rtol=0, atol=0)  # d|x|/dx at 0 is 0 in torch


def test_gradient_at_selected_tokens():
    """dL/dlp = -A r + beta_kl sign(lp - lp_old) at a selected token, -A r elsewhere (autograd vs closed form)."""
    lp, lp_old, adv, mask = _batch(3)
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask)
    build_plugins(["kl_cov"], {"kl_cov": {"ratio": 0.3, "beta_kl": 0.7}}).call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    selected = (values.detach() + adv * ctx.coef_1.detach()).abs() > 0
    assert selected.any()
    (grad,) = torch.autograd.grad((values * mask).sum(), lp)
    r = torch.exp(lp.detach() - lp_old)
    expected = (-adv * r + torch.where(selected, 0.7 * torch.sign(lp.detach() - lp_old), torch.zeros_like(r))) * mask
    torch.testing.assert_close(grad, expected)


def test_kl_cov_token_loss_values():
    lp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([[2.0, -1.0]])
    r = torch.exp(lp - old)
    out = kl_cov_token_loss(lp, old, r, adv, torch.tensor([[True, False]]), 0.5)
    assert out[0].tolist() == pytest.approx([-2.0 * math.exp(0.5) + 0.25, math.exp(-1.0)])


def test_offpolicy_tokens_keep_their_shaped_branch():
    lp, lp_old, adv, mask = _batch(4)
    off = torch.zeros_like(mask, dtype=torch.bool)
    off[0, 3:] = True
    ctx = _loss_ctx(lp.clone().requires_grad_(True), lp_old, adv, mask, offpolicy=off)
    build_plugins(["kl_cov"], {"kl_cov": {"ratio": 1.0}}).call("trl_plugins_loss", ctx)
    repl, _ = ctx.replacement
    assert torch.equal(repl, ~off)


def test_generation_batch_scope_selects_top_k_globally():
    B, T = 4, 5
    g = torch.Generator().manual_seed(9)
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 2:] = 0
    adv = torch.tensor([0.9, -1.2, 0.3, -0.4])
    stats = PolicyStats(per_token_logps=old, entropies=torch.zeros(B, T), mask=mask,
                        completion_ids=torch.zeros(B, T, dtype=torch.long), mean_entropy=torch.zeros(B))
    ctx = make_advantage_context(torch.zeros(B), num_generations=2, advantages=adv,
                                 completion_lengths=mask.sum(-1).float(), policy_stats=stats)
    stack = build_plugins(["kl_cov"], {"kl_cov": {"ratio": 0.2, "scope": "generation_batch"}})
    stack.call("trl_plugins_transform_advantages", ctx)
    selected = ctx.local_extras[SELECT_KEY]
    cov = _manual_cov(adv[:, None].expand(B, T), old, mask)
    k = math.floor(0.2 * 17)
    threshold = cov[mask.bool()].sort(descending=True).values[k - 1]
    assert int(selected.sum()) == k == 3
    assert torch.equal(selected, mask.bool() & (cov >= threshold))

    lctx = _loss_ctx(old.clone().requires_grad_(True), old - 0.1, adv[:, None].expand(B, T), mask,
                     extras={SELECT_KEY: selected})
    stack.call("trl_plugins_loss", lctx)
    _, values = lctx.replacement
    kl = (values.detach() + adv[:, None] * lctx.coef_1.detach()).abs() > 1e-9
    assert torch.equal(kl, selected)


def test_configure_and_conflicts():
    with pytest.raises(IncompatiblePluginsError, match="kl_cov.*entropy_coef"):
        build_plugins(["kl_cov"]).call("trl_plugins_configure", trainer=None,
                                       args=SimpleNamespace(entropy_coef=0.1, loss_type="dapo"))
    with pytest.raises(IncompatiblePluginsError, match="'kl_cov' does not support loss_type='sapo': .*clipped"):
        build_plugins(["kl_cov"]).check_loss_type("sapo")
    with pytest.raises(PluginConfigError, match="beta_kl"):
        build_plugins(["kl_cov"], {"kl_cov": {"beta_kl": -1.0}})


@pytest.mark.parametrize("num_iterations, steps_per_generation, warns", [(1, 2, True), (2, 2, False), (1, 4, False)])
def test_configure_warns_when_the_policy_cannot_move(num_iterations, steps_per_generation, warns):
    """With lp_old = lp at every loss (one update per generation batch) the penalty is zero: say so."""
    args = SimpleNamespace(entropy_coef=0.0, loss_type="dapo", gradient_accumulation_steps=2,
                           steps_per_generation=steps_per_generation)
    trainer = SimpleNamespace(num_iterations=num_iterations)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_plugins(["kl_cov"]).call("trl_plugins_configure", trainer=trainer, args=args)
    assert any("penalty is zero" in str(w.message) for w in caught) == warns


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_on_policy_end_to_end_is_vanilla(tmp_path):
    """The spec's subtlety: with lp_old = sg(lp) the |.| penalty has zero value and gradient and r = 1, so KL-Cov with
    its defaults equals TRL's clipped GRPO exactly."""
    from trl import GRPOTrainer

    with pytest.warns(UserWarning, match="penalty is zero"):  # the user is told the run is vanilla GRPO
        trainer = _trainer(tmp_path, "a", plugins=["kl_cov"], plugin_config={"kl_cov": {"ratio": 0.5}})
    run = record_run(trainer)
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)
    assert all(log["plugins/kl_cov/selected_token_fraction"] > 0 for log in run.logs if "loss" in log)


def test_end_to_end_with_a_moving_policy(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["kl_cov"], num_iterations=2, plugin_config={"kl_cov": {"ratio": 0.2}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    assert logs[0]["plugins/kl_cov/selected_abs_logp_change"] == 0.0  # first pass: on-policy
    assert logs[1]["plugins/kl_cov/selected_abs_logp_change"] > 0.0  # second pass over the same batch
    assert all(0 < log["plugins/kl_cov/selected_token_fraction"] < 1 for log in logs)
