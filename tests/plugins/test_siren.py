"""SIREN: the anchored term (zero at the anchor, c = 0 is the base
loss), the nucleus rule (p above the mass: restricted full entropy; p_max >= p: empty nucleus, H = 0, no gradient),
the strict per-row quantile mask, the gradient 2c(H_agg - H_0) dH_agg and an SGD step lowering H_agg, the
self-anchor, memory (no (B, T, V) tensor), and end-to-end runs."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.runtime.head_stats import HeadStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.siren import aggregate_entropy, anchored_term, peak_mask

B, C, D, V = 3, 7, 8, 29


def _head(seed=0, scale=1.5, grad=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, C + 2, D, generator=g)
    W = torch.randn(V, D, generator=g) * scale
    mask = torch.ones(B, C, dtype=torch.long)
    mask[2, 5:] = 0
    return hidden.requires_grad_(grad), W, mask


def _brute_topp_entropy(hidden, W, top_p, k=None):
    """(B, C) SIREN nucleus entropy from the full logits: ranks with inclusive cumulative mass < p, renormalised."""
    z = hidden.detach().double()[:, -(C + 1):-1] @ W.detach().double().t()
    p = torch.softmax(z, -1)
    sp = p.sort(-1, descending=True).values[..., : (k or V)]
    keep = sp.cumsum(-1) < top_p
    q = torch.where(keep, sp, torch.zeros_like(sp))
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-300)
    H = -(torch.where(keep, q * q.clamp(min=1e-300).log(), torch.zeros_like(q))).sum(-1)
    return torch.where(keep.any(-1), H, torch.zeros_like(H)).float(), p.max(-1).values


# ------------------------------------------------------------------------------------------ masks and aggregation
def test_peak_mask_hand_made():
    h = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 1.0, 2.0, 9.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1], [1, 1, 1, 1, 0]])
    # row 0: q0.8 = 4 + 0.2 (5 - 4) = 4.2; row 1 (valid 3, 1, 2, 0.5): 2 + 0.4 (3 - 2) = 2.4; row 2: ties -> none
    assert peak_mask(h, mask, 0.8).tolist() == [
        [False, False, False, False, True],
        [True, False, False, False, False],
        [False, False, False, False, False],
    ]


def _manual_quantile(values, q):
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("q", [0.5, 0.8])
def test_peak_mask_is_the_strict_per_row_quantile(seed, q):
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.3).long()
    mask[0] = 0  # a row without valid tokens
    out = peak_mask(h, mask, q)
    for b in range(4):
        vals = [float(h[b, t]) for t in range(9) if mask[b, t]]
        tau = _manual_quantile(vals, q) if vals else math.inf
        expected = [bool(mask[b, t]) and float(h[b, t]) > tau for t in range(9)]
        assert out[b].tolist() == expected
    assert not out[0].any()


def test_aggregate_is_seq_mean_token_mean_with_empty_rows_counting_zero():
    h = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    peak = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert float(aggregate_entropy(h, peak)) == pytest.approx((2.5 + 0.0 + 7.0) / 3)


def test_anchored_term():
    h = torch.tensor(2.0, requires_grad=True)
    term = anchored_term(h, 1.5, 0.1)
    term.backward()
    assert float(term.detach()) == pytest.approx(0.1 * 0.25)
    assert float(h.grad) == pytest.approx(2 * 0.1 * 0.5)


# ------------------------------------------------------------------------------------------ nucleus (mode="siren")
def test_top_p_above_the_mass_is_the_entropy_restricted_to_the_top_k():
    hidden, W, mask = _head(1)
    k = 6  # the top-6 mass is < 1 everywhere, so p = 1 keeps all six candidates
    stats = HeadStats(hidden, C, mask, W, chunk_size=4)
    got = stats.top_p_entropy_with_grad(1.0, k, mode="siren")
    brute, _ = _brute_topp_entropy(hidden, W, 1.0, k)
    torch.testing.assert_close(got.detach(), torch.where(mask.bool(), brute, torch.zeros_like(brute)))


def test_dominant_token_gives_an_empty_nucleus_with_zero_gradient():
    hidden, W, mask = _head(2, scale=1.0)
    top_p = 0.4
    stats = HeadStats(hidden, C, mask, W, chunk_size=3)
    H = stats.top_p_entropy_with_grad(top_p, 16, mode="siren")
    brute, p_max = _brute_topp_entropy(hidden, W, top_p)
    empty = (p_max >= top_p) & mask.bool()
    assert empty.any() and (~empty & mask.bool()).any()
    torch.testing.assert_close(H.detach()[mask.bool()], brute[mask.bool()])
    assert torch.all(H.detach()[empty] == 0)
    # the gradient of H at an empty-nucleus position is exactly zero
    (grad,) = torch.autograd.grad(H[empty].sum(), hidden)
    assert torch.all(grad == 0)


# ------------------------------------------------------------------------------------------ loss hook
def _loss_ctx(stats, mask):
    Bn, Cn = mask.shape
    lp = torch.zeros(Bn, Cn, requires_grad=True)
    return make_loss_context(lp, advantages=torch.zeros(Bn, 1), mask=mask, loss_type="dr_grpo", head_stats=stats,
                             entropies=torch.zeros(Bn, Cn), completion_ids=torch.zeros(Bn, Cn, dtype=torch.long))


def _h_agg(hidden, W, mask, top_p=0.8, q=0.8):
    H = HeadStats(hidden, C, mask, W, chunk_size=5).top_p_entropy_with_grad(top_p, 64, mode="siren")
    return aggregate_entropy(H, peak_mask(H, mask, q))


def test_term_is_zero_with_zero_gradient_at_the_anchor():
    hidden, W, mask = _head(3)
    anchor = float(_h_agg(hidden, W, mask).detach())
    ctx = _loss_ctx(HeadStats(hidden, C, mask, W, chunk_size=5), mask)
    sink = ctx.metrics
    build_plugins(["siren"], {"siren": {"coef": 0.7, "anchor": anchor}}).call("trl_plugins_loss", ctx)
    (term,) = ctx.scalar_terms
    assert float(term.detach()) == 0.0
    (grad,) = torch.autograd.grad(term, hidden)
    assert torch.all(grad == 0)
    assert sink["plugins/siren/entropy_gap"] == [0.0]
    assert sink["plugins/siren/anchor"] == [anchor]


def test_coef_zero_adds_exactly_nothing():
    hidden, W, mask = _head(4)
    ctx = _loss_ctx(HeadStats(hidden, C, mask, W, chunk_size=5), mask)
    build_plugins(["siren"], {"siren": {"coef": 0.0, "anchor": 0.1}}).call("trl_plugins_loss", ctx)
    (term,) = ctx.scalar_terms
    assert float(term.detach()) == 0.0
    (grad,) = torch.autograd.grad(term, hidden)
    assert torch.all(grad == 0)


def test_gradient_is_2c_gap_times_grad_of_h_agg():
    hidden, W, mask = _head(5)
    c, anchor = 0.3, 0.25
    ctx = _loss_ctx(HeadStats(hidden, C, mask, W, chunk_size=5), mask)
    build_plugins(["siren"], {"siren": {"coef": c, "anchor": anchor}}).call("trl_plugins_loss", ctx)
    (term,) = ctx.scalar_terms
    (grad,) = torch.autograd.grad(term, hidden)
    h_agg = _h_agg(hidden, W, mask)
    (grad_h,) = torch.autograd.grad(h_agg, hidden)
    assert float(term.detach()) == pytest.approx(c * (float(h_agg.detach()) - anchor) ** 2, rel=1e-5)
    torch.testing.assert_close(grad, 2 * c * (float(h_agg.detach()) - anchor) * grad_h)
    assert grad.abs().sum() > 0


def test_one_sgd_step_above_the_anchor_lowers_h_agg():
    """Tiny linear-softmax model (the head W is the parameter): with H_agg > H_0 a gradient step on the term
    lowers H_agg."""
    hidden, W, mask = _head(6, grad=False)
    W = W.clone().requires_grad_(True)
    h0 = float(_h_agg(hidden, W.detach(), mask).detach())
    anchor = h0 - 0.5
    ctx = _loss_ctx(HeadStats(hidden, C, mask, W, chunk_size=5), mask)
    build_plugins(["siren"], {"siren": {"coef": 1.0, "anchor": anchor}}).call("trl_plugins_loss", ctx)
    (term,) = ctx.scalar_terms
    term.backward()
    assert W.grad.abs().sum() > 0
    with torch.no_grad():
        W_new = W - 0.05 * W.grad
    h1 = float(_h_agg(hidden, W_new, mask).detach())
    assert h1 < h0


# ------------------------------------------------------------------------------------------ self-anchor
def _adv_ctx(stats, n_rows):
    ctx = make_advantage_context(torch.zeros(n_rows), num_generations=1, advantages=torch.zeros(n_rows),
                                 completion_lengths=stats.mask.sum(-1).float(), policy_stats=stats)
    return ctx, ctx.policy_stats_calls


def test_anchor_is_computed_once_from_the_rollout_policy_and_checkpointed():
    hidden, W, mask = _head(7, grad=False)
    head = HeadStats(hidden, C, mask, W, chunk_size=4)
    stats = PolicyStats(per_token_logps=torch.zeros(B, C), entropies=torch.zeros(B, C), mask=mask,
                        completion_ids=torch.zeros(B, C, dtype=torch.long), mean_entropy=torch.zeros(B),
                        head_stats=head)
    stack = build_plugins(["siren"], {"siren": {"top_p": 0.9}})
    ctx, calls = _adv_ctx(stats, B)
    stack.call("trl_plugins_transform_advantages", ctx)
    assert calls == [True]  # one forward with LM-head statistics
    brute, _ = _brute_topp_entropy(hidden, W, 0.9)
    brute = torch.where(mask.bool(), brute, torch.zeros_like(brute))
    expected = float(aggregate_entropy(brute, peak_mask(brute, mask, 0.8)))
    (state,) = [value for _, value in stack.call("trl_plugins_state_dict")]
    assert state["anchor"] == pytest.approx(expected, rel=1e-6)
    ctx, calls = _adv_ctx(stats, B)
    stack.call("trl_plugins_transform_advantages", ctx)
    assert calls == []  # fixed after the first batch
    other = build_plugins(["siren"])
    other.call("trl_plugins_load_state_dict", state=state)
    assert [v for _, v in other.call("trl_plugins_state_dict")] == [state]


# ------------------------------------------------------------------------------------------ memory
class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_memory_never_grows_with_vocabulary_times_length():
    """V = 5000 and 4 x 96 tokens: no op (forward or backward) outputs more than chunk * V elements, the head never
    projects more than `chunk` rows at once, and nothing of the (B, T, V) size is ever created."""
    Bm, Cm, d, Vm, chunk = 4, 96, 16, 5000, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(Bm, Cm + 1, d, generator=g).requires_grad_(True)
    W = (torch.randn(Vm, d, generator=g) * 0.5).requires_grad_(True)
    mask = torch.ones(Bm, Cm, dtype=torch.long)
    stats = HeadStats(hidden, Cm, mask, W, chunk_size=chunk)
    ctx = _loss_ctx(stats, mask)
    stack = build_plugins(["siren"], {"siren": {"coef": 1.0, "anchor": 0.0, "k_max": 32, "top_p": 0.5}})
    recorder = _LargestTensor()
    with recorder:
        stack.call("trl_plugins_loss", ctx)
        (term,) = ctx.scalar_terms
        term.backward()
    assert hidden.grad.abs().sum() > 0 and W.grad.abs().sum() > 0  # gradients did flow
    assert stats.max_rows_projected <= chunk
    assert stats.num_projections == 2 * math.ceil(Bm * Cm / chunk)  # each chunk: forward, and again in backward
    assert recorder.max_numel <= chunk * Vm
    assert recorder.max_numel * 10 < Bm * Cm * Vm
    naive = _LargestTensor()  # the recorder does see a full projection when one is made
    with naive, torch.no_grad():
        hidden[:, :-1] @ W.t()
    assert naive.max_numel == Bm * Cm * Vm


# ------------------------------------------------------------------------------------------ construction
def test_configure_refuses_entropy_bonus_and_trl_entropy_quantile():
    stack = build_plugins(["siren"])
    with pytest.raises(IncompatiblePluginsError, match="siren.*entropy_coef"):
        stack.call("trl_plugins_configure", trainer=None,
                   args=SimpleNamespace(entropy_coef=0.01, top_entropy_quantile=1.0))
    with pytest.raises(IncompatiblePluginsError, match="top_entropy_quantile"):
        stack.call("trl_plugins_configure", trainer=None,
                   args=SimpleNamespace(entropy_coef=0.0, top_entropy_quantile=0.2))
    with pytest.raises(PluginConfigError, match="top_p"):
        build_plugins(["siren"], {"siren": {"top_p": 0.0}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             loss_type="dr_grpo", scale_rewards="none", **config)


def test_coef_zero_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["siren"], plugin_config={"siren": {"coef": 0.0}}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_end_to_end_regularises_and_logs(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["siren"], plugin_config={"siren": {"coef": 1.0}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    anchor = logs[0]["plugins/siren/anchor"]
    # step 1: the loss sees the rollout batch under the rollout policy, so it sits exactly at the anchor
    assert logs[0]["plugins/siren/topp_entropy"] == pytest.approx(anchor, abs=1e-5)
    assert logs[1]["plugins/siren/anchor"] == anchor  # fixed afterwards
    assert logs[1]["plugins/siren/entropy_gap"] != 0.0
    assert all(0 < log["plugins/siren/peak_token_fraction"] < 0.5 for log in logs)
