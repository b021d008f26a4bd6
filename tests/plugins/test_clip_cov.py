"""Clip-Cov: covariance proxy, empty window, number and validity of
the picked tokens, zero gradient exactly there, invariance to centring A, seeded determinism, the generation-batch
scope, construction checks and end-to-end runs on the tiny model."""

import math
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
from trl_plugins_builtin.clip_cov import (
    PICK_KEY,
    already_clipped,
    covariance_candidates,
    num_to_pick,
    random_pick,
    token_covariance,
)

# Two rows, four positions; (1, 3) is padding.
LP = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -4.0, -1.5, -9.0]])
ADV = torch.tensor([[2.0, 2.0, 2.0, 2.0], [-1.0, -1.0, -1.0, -1.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def _manual_cov(adv, lp, mask):
    cells = [(b, t) for b in range(adv.size(0)) for t in range(adv.size(1)) if mask[b, t]]
    mean_a = sum(float(adv[b, t]) for b, t in cells) / len(cells)
    mean_lp = sum(float(lp[b, t]) for b, t in cells) / len(cells)
    out = torch.zeros_like(adv)
    for b, t in cells:
        out[b, t] = (float(adv[b, t]) - mean_a) * (float(lp[b, t]) - mean_lp)
    return out


def test_token_covariance_hand_made():
    cov = token_covariance(ADV, LP, MASK)
    torch.testing.assert_close(cov, _manual_cov(ADV, LP, MASK))
    assert cov[1, 3] == 0  # padding
    # mean A = (8 - 3) / 7, mean lp = -12.2 / 7; e.g. (0, 2): (2 - 5/7) * (-0.5 + 12.2/7)
    assert float(cov[0, 2]) == pytest.approx((2 - 5 / 7) * (-0.5 + 12.2 / 7), rel=1e-6)


def test_token_covariance_is_invariant_to_centring_and_carries_no_grad():
    lp = LP.clone().requires_grad_(True)
    cov = token_covariance(ADV, lp, MASK)
    assert not cov.requires_grad
    torch.testing.assert_close(token_covariance(ADV + 3.7, LP, MASK), cov)


def test_already_clipped_hand_made():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1]])
    # A>0 r>1+eps: clipped; A>0 r<1-eps: not (min keeps r A); A<0 r<1-eps: clipped; A<0 r>1+eps: not; inside: not
    assert already_clipped(adv, ratio, 0.2, 0.2).tolist() == [[True, False, True, False, False]]


def test_candidates_window_and_empty_window():
    cov = torch.tensor([[0.5, 1.0, 1.5, 4.9, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    assert covariance_candidates(cov, mask, 1.0, 5.0).tolist() == [[False, False, True, True, False, False]]
    assert not covariance_candidates(cov, mask, 5.0, 1.0).any()
    assert not covariance_candidates(cov, mask, 2.0, 2.0).any()


@pytest.mark.parametrize("num_valid, ratio, expected", [(100, 2e-4, 1), (10_000, 2e-4, 2), (49, 0.1, 4), (0, 0.5, 1)])
def test_num_to_pick(num_valid, ratio, expected):
    assert num_to_pick(num_valid, ratio) == expected


@pytest.mark.parametrize("n", [0, 1, 3, 5, 50])
def test_random_pick_size_and_subset(n):
    g = torch.Generator().manual_seed(0)
    candidates = torch.rand(4, 6, generator=g) > 0.5
    picked = random_pick(candidates, n, torch.Generator().manual_seed(1))
    assert int(picked.sum()) == min(n, int(candidates.sum()))
    assert not (picked & ~candidates).any()


def test_random_pick_is_deterministic_with_a_seed():
    candidates = torch.ones(5, 7, dtype=torch.bool)
    a = random_pick(candidates, 6, torch.Generator().manual_seed(7))
    b = random_pick(candidates, 6, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    others = [random_pick(candidates, 6, torch.Generator().manual_seed(s)) for s in range(8, 12)]
    assert any(not torch.equal(a, o) for o in others)  # it is random, not a fixed rule


# ------------------------------------------------------------------------------------------ loss hook
def _loss_ctx(lp, lp_old, adv, mask, eps=0.2, extras=None):
    B, T = lp.shape
    return make_loss_context(
        lp, old_per_token_logps=lp_old, advantages=adv, mask=mask, loss_type="dapo", epsilon_low=eps,
        epsilon_high=eps, extras=extras, entropies=torch.zeros(B, T), completion_ids=torch.zeros(B, T, dtype=torch.long),
    )


def _total(ctx):
    per_token = ctx.per_token_loss
    for w in ctx.token_weights:
        per_token = per_token * w
    return (per_token * ctx.mask).sum() / ctx.mask.sum()


def _batch(seed=0, B=4, T=8):
    g = torch.Generator().manual_seed(seed)
    lp_old = -torch.rand(B, T, generator=g) * 4
    lp = lp_old + 0.3 * torch.randn(B, T, generator=g)  # some ratios outside [0.8, 1.2]
    adv = torch.randn(B, 1, generator=g).expand(B, T) * 2
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 6:] = 0
    return lp, lp_old, adv, mask


def test_empty_window_is_exactly_the_base_loss():
    lp, lp_old, adv, mask = _batch()
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask)
    build_plugins(["clip_cov"], {"clip_cov": {"lb": 3.0, "ub": 1.0, "ratio": 1.0}}).call("trl_plugins_loss", ctx)
    assert len(ctx.token_weights) == 1 and torch.all(ctx.token_weights[0] == 1)
    assert torch.equal(_total(ctx), (ctx.per_token_loss * mask).sum() / mask.sum())


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.3, 1.0])
def test_picked_tokens_count_validity_and_zero_gradient(ratio):
    """min(n, |C|) tokens are picked, each in the window and not already clipped; the gradient is exactly 0 there and
    unchanged elsewhere."""
    lp, lp_old, adv, mask = _batch(1)
    lp = lp.requires_grad_(True)
    ctx = _loss_ctx(lp, lp_old, adv, mask)
    sink = ctx.metrics
    build_plugins(["clip_cov"], {"clip_cov": {"lb": -1.0, "ub": 1.0, "ratio": ratio}}).call("trl_plugins_loss", ctx)
    picked = ctx.token_weights[0] == 0
    cov = _manual_cov(adv, lp.detach(), mask)
    clipped = already_clipped(adv, ctx.coef_1.detach(), 0.2, 0.2)
    candidates = mask.bool() & ~clipped & (cov > -1.0) & (cov < 1.0)
    assert clipped.any() and (candidates.sum() < mask.sum())  # both exclusions are exercised
    n = max(1, math.floor(ratio * int(mask.sum())))
    assert int(picked.sum()) == min(n, int(candidates.sum())) > 0
    assert not (picked & ~candidates).any()
    assert torch.all(torch.isin(ctx.token_weights[0], torch.tensor([0.0, 1.0])))
    assert sink["plugins/clip_cov/clipped_token_fraction"] == [pytest.approx(float(picked.sum()) / float(mask.sum()))]

    (grad,) = torch.autograd.grad(_total(ctx), lp, retain_graph=True)
    (base_grad,) = torch.autograd.grad((ctx.per_token_loss * mask).sum() / mask.sum(), lp)
    assert torch.all(grad[picked] == 0)
    assert torch.any(base_grad[picked] != 0)  # the base would have moved them
    torch.testing.assert_close(grad[~picked], base_grad[~picked], rtol=0, atol=0)


def test_selection_is_invariant_to_centring_the_advantages():
    """On-policy (r = 1, nothing clipped) the pick depends on A only through A - mean(A)."""
    lp, _, adv, mask = _batch(2)
    picks = []
    for shift in (0.0, 5.0, -2.5):
        ctx = _loss_ctx(lp.clone(), lp.clone(), adv + shift, mask)
        build_plugins(["clip_cov"], {"clip_cov": {"lb": -0.5, "ub": 2.0, "ratio": 0.2}}).call("trl_plugins_loss", ctx)
        picks.append(ctx.token_weights[0] == 0)
    assert picks[0].any()
    assert all(torch.equal(picks[0], p) for p in picks[1:])


def test_seeded_pick_is_deterministic_and_checkpointed():
    lp, lp_old, adv, mask = _batch(3)

    def pick(stack):
        ctx = _loss_ctx(lp.clone(), lp_old, adv, mask)
        stack.call("trl_plugins_loss", ctx)
        return ctx.token_weights[0] == 0

    options = {"clip_cov": {"lb": -5.0, "ub": 5.0, "ratio": 0.1, "seed": 11}}
    args = SimpleNamespace(entropy_coef=0.0, loss_type="dapo", seed=0)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(process_index=0))
    a, b = build_plugins(["clip_cov"], options), build_plugins(["clip_cov"], options)
    for s in (a, b):
        s.call("trl_plugins_configure", trainer=trainer, args=args)
    first = pick(a)
    assert torch.equal(first, pick(b))
    (state,) = [value for _, value in a.call("trl_plugins_state_dict")]
    second = pick(a)
    c = build_plugins(["clip_cov"], options)
    c.call("trl_plugins_load_state_dict", state=state)
    assert torch.equal(pick(c), second)  # resumed generator continues the stream


# ------------------------------------------------------------------------------------------ generation-batch scope
def test_generation_batch_scope_picks_globally_and_respects_the_current_clip():
    B, T = 4, 5
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    mask[3, 3:] = 0
    adv = torch.tensor([1.5, -0.5, -1.0, 0.7])
    stats = PolicyStats(per_token_logps=old, entropies=torch.zeros(B, T), mask=mask,
                        completion_ids=torch.zeros(B, T, dtype=torch.long), mean_entropy=torch.zeros(B))
    ctx = make_advantage_context(torch.zeros(B), num_generations=2, advantages=adv,
                                 completion_lengths=mask.sum(-1).float(), policy_stats=stats)
    options = {"clip_cov": {"lb": -0.3, "ub": 10.0, "ratio": 0.25, "scope": "generation_batch"}}
    stack = build_plugins(["clip_cov"], options)
    stack.call("trl_plugins_transform_advantages", ctx)
    picked = ctx.local_extras[PICK_KEY]
    cov = _manual_cov(adv[:, None].expand(B, T), old, mask)
    candidates = mask.bool() & (cov > -0.3) & (cov < 10.0)
    assert int(picked.sum()) == min(math.floor(0.25 * 18), int(candidates.sum())) == 4
    assert not (picked & ~candidates).any()

    # loss stage: a picked token that the current ratio already clips keeps its (clipped) surrogate
    lp = old.clone()
    b, t = picked.nonzero()[0].tolist()
    lp[b, t] = old[b, t] + (0.5 if adv[b] > 0 else -0.5)  # r outside [0.8, 1.2] on the side that clips
    lctx = _loss_ctx(lp.requires_grad_(True), old, adv[:, None].expand(B, T), mask, extras={PICK_KEY: picked})
    stack.call("trl_plugins_loss", lctx)
    zeroed = lctx.token_weights[0] == 0
    expected = picked.clone()
    expected[b, t] = False
    assert torch.equal(zeroed, expected)


# ------------------------------------------------------------------------------------------ construction
def test_configure_refuses_entropy_bonus_and_unclipped_loss_types():
    stack = build_plugins(["clip_cov"])
    trainer = SimpleNamespace(accelerator=SimpleNamespace(process_index=0))
    with pytest.raises(IncompatiblePluginsError, match="clip_cov.*entropy_coef"):
        stack.call("trl_plugins_configure", trainer=trainer,
                   args=SimpleNamespace(entropy_coef=0.01, loss_type="dapo", seed=0))
    with pytest.raises(IncompatiblePluginsError, match="'clip_cov' does not support loss_type='cispo': .*clipped"):
        stack.check_loss_type("cispo")
    stack.check_loss_type("dapo")


def test_option_validation():
    with pytest.raises(PluginConfigError, match="ratio"):
        build_plugins(["clip_cov"], {"clip_cov": {"ratio": 2.0}})
    with pytest.raises(PluginConfigError, match="scope"):
        build_plugins(["clip_cov"], {"clip_cov": {"scope": "batch"}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_empty_window_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["clip_cov"],
                              plugin_config={"clip_cov": {"lb": 5.0, "ub": 1.0, "ratio": 1.0}}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)
    assert [log["plugins/clip_cov/clipped_token_fraction"] for log in run.logs if "loss" in log] == [0.0, 0.0]


def test_end_to_end_clips_and_logs(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["clip_cov"], plugin_config={"clip_cov": {"lb": 0.0, "ratio": 0.1}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert 0 < log["plugins/clip_cov/clipped_token_fraction"] <= log["plugins/clip_cov/candidate_token_fraction"]
