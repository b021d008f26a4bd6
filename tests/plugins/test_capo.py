"""CAPO: curvature estimates against autograd on a tiny linear-softmax head, the Adam step model, the token mask, the
moment update, neutral settings, option validation and end-to-end runs on the tiny model."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.runtime.head_stats import HeadStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    loss_from_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.capo import (
    HeadAdamModel,
    keep_tokens,
    shift_estimates,
    token_gradients,
    topk_policy,
)

B, C, D, V = 3, 6, 8, 23


# ------------------------------------------------------------------------------------------ brute force
def _brute_token(psi, h, label, ids, adv, delta, lr):
    """Autograd on J(psi) = A pi_psi(o)/pi_psi0(o), pi = softmax over the rows ``ids`` of the head ``psi`` (V, d).

    Returns (g (k, d), m_H, m_F) along the direction ``delta`` (k, d) on those rows (float64)."""
    psi0 = psi.detach()
    pos = int((ids == label).nonzero())

    def logp(p):
        return torch.log_softmax(p[ids] @ h, dim=-1)[pos]

    def J(p):
        return adv * torch.exp(logp(p) - logp(psi0).detach())

    full = torch.zeros_like(psi0)
    full[ids] = delta
    p = psi0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(J(p), p, create_graph=True)
    (hvp,) = torch.autograd.grad((grad * full).sum(), p)
    quad = float((hvp * full).sum())
    first = float((grad.detach() * full).sum())
    _, jvp = torch.autograd.functional.jvp(logp, psi0, full)
    return grad.detach()[ids], lr * first + 0.5 * lr * lr * quad, 0.5 * lr * lr * float(jvp) ** 2


@pytest.mark.parametrize("seed", range(6))
def test_shift_estimates_match_autograd(seed):
    """m_H = lr <g, Delta> + lr^2/2 Delta^T H Delta and m_F = lr^2/2 (d log pi(o) . Delta)^2, H the Hessian of the
    ratio surrogate on the top-k head rows, for an arbitrary direction Delta (the Adam step is one)."""
    gen = torch.Generator().manual_seed(seed)
    Vs, d, k, n = 11, 5, 4, 3
    psi = torch.randn(Vs, d, generator=gen, dtype=torch.float64)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = h @ psi.t()
    ids_all = torch.topk(z, k, dim=-1).indices
    labels = ids_all[torch.arange(n), torch.randint(0, k, (n,), generator=gen)]  # sampled token inside the top-k
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lr = 0.3
    ids, pi, v = topk_policy(z, labels, k)
    g = token_gradients(h, v.double(), adv)
    delta = torch.randn(n, k, d, generator=gen, dtype=torch.float64)
    objective, policy = shift_estimates(g, delta, h, pi.double(), v.double(), adv, lr)
    for i in range(n):
        bg, bh, bf = _brute_token(psi, h[i], labels[i], ids[i], adv[i], delta[i], lr)
        torch.testing.assert_close(g[i], bg)
        assert float(objective[i]) == pytest.approx(bh, rel=1e-9, abs=1e-12)
        assert float(policy[i]) == pytest.approx(bf, rel=1e-9, abs=1e-12)
    # SGD direction: Delta = g gives m_H = lr |g|^2 + ..., so the first-order part is positive
    obj_sgd, pol_sgd = shift_estimates(g, g, h, pi.double(), v.double(), adv, 1e-9)
    assert torch.all(obj_sgd > 0) and torch.all(pol_sgd >= 0)


def test_topk_policy_renormalises_and_label_outside_gives_zero_one_hot():
    z = torch.tensor([[3.0, 1.0, 2.0, -1.0], [0.0, 0.5, 0.2, 4.0]])
    ids, pi, v = topk_policy(z, torch.tensor([2, 0]), 2)
    assert torch.equal(ids, torch.tensor([[0, 2], [3, 1]]))
    torch.testing.assert_close(pi, torch.softmax(torch.tensor([[3.0, 2.0], [4.0, 0.5]]), -1))
    torch.testing.assert_close(v[0], torch.tensor([0.0, 1.0]) - pi[0])
    torch.testing.assert_close(v[1], -pi[1])  # label 0 is not among the top 2


def test_keep_tokens_rules():
    obj = torch.tensor([-0.2, -0.05, 0.0, 0.05, 0.2])
    pol = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.01])
    f, hs = keep_tokens(obj, pol, 0.5, 0.1, True)
    assert f.tolist() == [True, False, False, True, True]
    assert hs.tolist() == [False, True, True, True, False]
    _, ha = keep_tokens(obj, pol, 0.5, 0.1, False)
    assert ha.tolist() == [False, False, True, True, False]
    f0, h0 = keep_tokens(obj, pol, 0.0, 0.0, True)
    assert f0.all() and h0.all()


def test_adam_model_direction_and_update():
    gen = torch.Generator().manual_seed(0)
    adam = HeadAdamModel(0.9, 0.99, 1e-8)
    g = torch.randn(2, 3, 4, generator=gen)
    ids = torch.tensor([[0, 5, 2], [5, 1, 3]])
    assert adam.direction(g, ids) is g  # no moment yet: the raw gradient (official t = 0 behaviour)
    rows, grads = torch.tensor([5, 2]), torch.randn(2, 4, generator=gen)
    adam.update(rows, grads, vocab_size=7)
    assert adam.step == 1
    torch.testing.assert_close(adam.m[5], 0.1 * grads[0])
    torch.testing.assert_close(adam.v[2], 0.01 * grads[1] ** 2)
    assert torch.all(adam.m[[0, 1, 3, 4, 6]] == 0)  # untouched rows keep zero moments
    delta = adam.direction(g, ids)
    for i, j in [(0, 0), (0, 1), (1, 2)]:
        r = int(ids[i, j])
        m = 0.9 * adam.m[r] + 0.1 * g[i, j]
        v = 0.99 * adam.v[r] + 0.01 * g[i, j] ** 2
        torch.testing.assert_close(delta[i, j], (m / (1 - 0.9**2)) / ((v / (1 - 0.99**2)).sqrt() + 1e-8))
    adam2 = HeadAdamModel()
    adam2.load_state_dict(adam.state_dict())
    assert adam2.step == 1 and torch.equal(adam2.m, adam.m)


# ------------------------------------------------------------------------------------------ loss hook
def _head(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, C + 2, D, generator=gen)
    W = torch.randn(V, D, generator=gen)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[2, 4:] = 0
    labels = torch.randint(0, V, (B, C), generator=gen)
    return hidden, W, mask, labels


def _ctx(stats, labels, mask, adv, lr=0.05, mode="train", with_lr=True):
    lp = stats.label_logprob(labels).clone().requires_grad_(True)
    return make_loss_context(lp, advantages=adv, mask=mask, head_stats=stats, completion_ids=labels,
                             loss_type="dr_grpo", mode=mode, run=RunInfo(learning_rate=lr if with_lr else None))


def _brute_estimates(hidden, W, mask, labels, adv, k, lr, adam=None):
    """Per valid token, row-major: (m_H, m_F, kept gradient rows) from brute-force logits, one token at a time."""
    out = []
    hc = hidden[:, -(C + 1):-1]
    for b in range(B):
        for t in range(C):
            if not mask[b, t]:
                continue
            h = hc[b, t][None].float()
            ids, pi, v = topk_policy(h @ W.t(), labels[b, t][None], k)
            g = token_gradients(h, v, adv[b][None])
            delta = adam.direction(g, ids) if adam is not None else g
            out.append((*shift_estimates(g, delta, h, pi, v, adv[b][None], lr), g[0], ids[0]))
    return out


@pytest.mark.parametrize("chunk_size, chunk_tokens", [(1, 1), (3, 2), (64, 64)])
@pytest.mark.parametrize("optimizer_model", ["sgd", "adam"])
def test_loss_hook_matches_brute_force_and_masks(chunk_size, chunk_tokens, optimizer_model):
    hidden, W, mask, labels = _head(1)
    adv = torch.tensor([1.0, -0.5, 2.0])
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=chunk_size)
    opts = {"top_k": 5, "chunk_tokens": chunk_tokens, "optimizer_model": optimizer_model,
            "fisher_tau": 0.02, "hessian_tau": 0.05}
    stack = build_plugins(["capo"], {"capo": opts})
    plugin = stack.plugins[0]
    reference = None
    lr = 0.05 if optimizer_model == "sgd" else 0.01  # Adam's sign-like steps are larger
    if optimizer_model == "adam":  # give the model moments first (second call), keep a copy for the brute force
        stack.call("trl_plugins_loss", _ctx(stats, labels, mask, adv, lr=lr))
        reference = HeadAdamModel()
        reference.load_state_dict({k: (v.clone() if torch.is_tensor(v) else v)
                                   for k, v in plugin.adam.state_dict().items()})
        assert reference.step == 1
    ctx = _ctx(stats, labels, mask, adv, lr=lr)
    stack.call("trl_plugins_loss", ctx)
    brute = _brute_estimates(hidden, W, mask, labels, adv, 5, lr, reference)
    keep = torch.ones(B, C)
    i = 0
    for b in range(B):
        for t in range(C):
            if mask[b, t]:
                f, h_ok = keep_tokens(brute[i][0], brute[i][1], 0.02, 0.05, True)
                keep[b, t] = float(f & h_ok)
                i += 1
    (weights,) = ctx.token_weights
    assert torch.equal(weights, keep)
    assert 0 < keep[mask.bool()].sum() < mask.sum()  # some kept, some rejected: the check is not vacuous
    rejected = 1 - keep[mask.bool()].mean()
    assert ctx.metrics["plugins/capo/rejected_token_fraction"] == [pytest.approx(float(rejected))]
    pol = torch.cat([x[1] for x in brute])
    assert ctx.metrics["plugins/capo/policy_shift_mean"] == [pytest.approx(float(pol.mean()), rel=1e-5)]
    # rejected tokens get no gradient; kept ones do
    (grad,) = torch.autograd.grad(loss_from_context(ctx), ctx.per_token_logps)
    assert torch.equal(grad != 0, keep.bool() & mask.bool())
    if optimizer_model == "adam":
        # the second update moved the rows by the mean gradient of the kept tokens
        rows = {}
        for (_, _, g, ids), kept in zip(brute, keep[mask.bool()].bool()):
            if kept:
                for j, r in enumerate(ids.tolist()):
                    rows.setdefault(r, []).append(g[j])
        assert plugin.adam.step == 2
        for r, gs in rows.items():
            mean = torch.stack(gs).mean(0)
            torch.testing.assert_close(plugin.adam.m[r], 0.9 * reference.m[r] + 0.1 * mean, rtol=1e-5, atol=1e-6)


def test_eval_mode_does_not_move_the_moments():
    hidden, W, mask, labels = _head(2)
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=4)
    stack = build_plugins(["capo"], {"capo": {"top_k": 5}})
    plugin = stack.plugins[0]
    stack.call("trl_plugins_loss", _ctx(stats, labels, mask, torch.tensor([1.0, -1.0, 0.5]), mode="eval"))
    assert plugin.adam.step == 0 and plugin.adam.m is None


def test_infinite_thresholds_keep_everything():
    hidden, W, mask, labels = _head(3)
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=4)
    ctx = _ctx(stats, labels, mask, torch.tensor([3.0, -2.0, 1.0]), lr=10.0)
    build_plugins(["capo"], {"capo": {"fisher_tau": math.inf, "hessian_tau": math.inf}}).call("trl_plugins_loss", ctx)
    assert torch.all(ctx.token_weights[0] == 1)
    assert ctx.metrics["plugins/capo/rejected_token_fraction"] == [0.0]
    assert ctx.metrics["plugins/capo/policy_shift_mean"][0] > 0


def test_zero_thresholds_compute_nothing():
    """Both tests off: no head statistics read (the context has none), no weights, no metric: vanilla."""
    ctx = make_loss_context(shape=(2, 3), loss_type="dr_grpo")
    build_plugins(["capo"], {"capo": {"fisher_tau": 0.0, "hessian_tau": 0.0}}).call("trl_plugins_loss", ctx)
    assert ctx.token_weights == [] and not ctx.metrics


def test_learning_rate_needed():
    hidden, W, mask, labels = _head(4)
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=4)
    with pytest.raises(PluginError, match="learning_rate"):
        build_plugins(["capo"]).call("trl_plugins_loss", _ctx(stats, labels, mask, torch.ones(3), with_lr=False))
    ctx = _ctx(stats, labels, mask, torch.ones(3), with_lr=False)
    build_plugins(["capo"], {"capo": {"learning_rate": 1e-3}}).call("trl_plugins_loss", ctx)
    assert "plugins/capo/rejected_token_fraction" in ctx.metrics


@pytest.mark.parametrize("bad", [
    {"fisher_tau": -1.0}, {"hessian_tau": -0.1}, {"top_k": 0}, {"top_k": 2.5}, {"optimizer_model": "rmsprop"},
    {"learning_rate": 0.0}, {"chunk_tokens": 0}, {"hessian_symmetric": "yes"},
])
def test_option_validation(bad):
    name = next(iter(bad))
    with pytest.raises(PluginConfigError, match=name):
        build_plugins(["capo"], {"capo": bad})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             loss_type="dr_grpo", **config)


def test_zero_thresholds_are_vanilla(tmp_path):
    from trl import GRPOTrainer

    with_plugin = record_run(_trainer(tmp_path, "a", plugins=["capo"],
                                      plugin_config={"capo": {"fisher_tau": 0.0, "hessian_tau": 0.0}}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(with_plugin, vanilla)
    assert any(torch.any(a != 0) for a in vanilla.advantages)  # not vacuous


def test_end_to_end_rejects_with_an_aggressive_step(tmp_path):
    """The tiny model's large hidden states make even lr = 1e-4 aggressive: some tokens are rejected, not all."""
    trainer = _trainer(tmp_path, "run", plugins=["capo"],
                       plugin_config={"capo": {"learning_rate": 1e-4}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    assert all(0 < log["plugins/capo/rejected_token_fraction"] < 1 for log in logs)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert trainer.plugin_stack.plugins[0].adam.step == 2  # one moment update per loss call
    # the seam the default (learning_rate=None) reads: the scheduler's current value, the same the optimizer uses
    assert trainer._run_info().learning_rate == trainer.lr_scheduler.get_last_lr()[0]
    assert trainer._run_info().learning_rate == trainer.optimizer.param_groups[0]["lr"]
