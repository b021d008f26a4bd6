"""Lp-Reg: selection, replacement loss and
gradient, support of the replacement, neutral settings and end-to-end runs on the tiny model."""

import math
import random

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.runtime.head_stats import OUT_OF_KEEP_SET, HeadStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.lp_reg import PROXY_KEY, THRESHOLD_KEY, lp_reg_token_loss, select_tokens

# ------------------------------------------------------------------------------------------ hand-made batch
# Two rows, five positions. Negatives N (A < 0, mask = 1): row 0 at 0, 1, 3, 4; row 1 at 0, 1, 2, 3 -> |N| = 8.
# (0, 2) has the lowest log-prob of row 0 but A > 0; (1, 4) has the lowest of all but is masked out.
LOGPS = torch.tensor([[-1.0, -5.0, -9.0, -3.0, -2.0], [-4.0, -0.1, -6.0, -2.5, -7.0]])
ADV = torch.tensor([[-1.0, -1.0, 1.0, -1.0, -1.0], [-0.5, -0.5, -0.5, -0.5, -0.5]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])


def _set(*positions):
    out = torch.zeros(2, 5, dtype=torch.bool)
    for b, t in positions:
        out[b, t] = True
    return out


@pytest.mark.parametrize(
    "rho, expected",
    [
        (1.0, _set((0, 0), (0, 1), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3))),  # k = 8: all of N
        (0.5, _set((1, 2), (0, 1), (1, 0), (0, 3))),  # k = 4: -6, -5, -4, -3
        (0.3, _set((1, 2), (0, 1))),  # k = floor(2.4) = 2
        (0.25, _set((1, 2), (0, 1))),  # k = floor(2.0) = 2 (exact boundary)
        (0.2, _set()),  # k = max(1, floor(1.6)) = 1 -> nothing ("only if k > 1")
        (0.01, _set()),  # k = max(1, 0) = 1 -> nothing
        (0.0, _set()),
    ],
)
def test_select_tokens_hand_made(rho, expected):
    assert torch.equal(select_tokens(LOGPS, ADV, MASK, rho), expected)


def test_select_tokens_no_negative_tokens_selects_nothing():
    assert not select_tokens(LOGPS, ADV.abs(), MASK, 1.0).any()
    assert not select_tokens(LOGPS, torch.zeros_like(ADV), MASK, 1.0).any()  # A = 0 is not negative


def _brute_select(logps, adv, mask, rho):
    cand = [(float(logps[b, t]), b, t) for b in range(logps.size(0)) for t in range(logps.size(1))
            if adv[b, t] < 0 and mask[b, t]]
    k = max(1, math.floor(len(cand) * rho))
    out = torch.zeros_like(logps, dtype=torch.bool)
    if k > 1:
        for _, b, t in sorted(cand)[:k]:
            out[b, t] = True
    return out


@pytest.mark.parametrize("seed", range(30))
def test_select_tokens_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B, T = rng.randint(1, 4), rng.randint(1, 9)
    logps = -torch.rand(B, T, generator=g) * 8  # continuous: no ties
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    rho = rng.choice([0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
    assert torch.equal(select_tokens(logps, adv, mask, rho), _brute_select(logps, adv, mask, rho))


# ------------------------------------------------------------------------------------------ replacement loss
def test_lp_reg_token_loss_value_and_gradient():
    """L = -A r + beta * clamp(e^D - D - 1, -10, 10), D = lp_proxy - lp; dL/dlp = -A r + beta (1 - e^D)."""
    lp_old = torch.tensor([[-2.0, -1.0, -3.0, -0.5, -4.0]], dtype=torch.float64)
    lp = (lp_old + torch.tensor([[0.1, -0.2, 0.05, 0.0, 0.3]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[-1.5, -0.5, 2.0, -1.0, -0.7]], dtype=torch.float64)
    # D = +1.4, -0.3 (proxy below lp), +0.45, +0.5, and a huge D that hits the clamp
    proxy = torch.tensor([[-0.5, -1.5, -2.5, 0.0, 20.0 - 3.7]], dtype=torch.float64)
    beta = 0.7
    coef_1 = torch.exp(lp - lp_old)  # TRL's unclipped importance ratio, graph through lp
    loss = lp_reg_token_loss(lp, coef_1, adv, proxy, beta, 10.0)
    loss.sum().backward()

    r = [math.exp(float(a) - float(b)) for a, b in zip(lp.detach()[0], lp_old[0])]
    for t in range(5):
        A, lpt, pt = float(adv[0, t]), float(lp.detach()[0, t]), float(proxy[0, t])
        D = pt - lpt
        k3 = math.exp(D) - D - 1
        expected_value = -A * r[t] + beta * min(k3, 10.0)
        assert float(loss.detach()[0, t]) == pytest.approx(expected_value, rel=1e-12, abs=1e-12)
        kl_grad = beta * (1 - math.exp(D)) if k3 < 10.0 else 0.0  # clamped: no gradient from the KL part
        assert float(lp.grad[0, t]) == pytest.approx(-A * r[t] + kl_grad, rel=1e-10, abs=1e-12)
        if 0 < D and k3 < 10.0:
            assert kl_grad < 0  # below the proxy the KL part raises lp (gradient descent on L)
    assert float(loss.detach()[0, 4]) == pytest.approx(-float(adv[0, 4]) * r[4] + beta * 10.0)


def test_lp_reg_token_loss_clamps_sentinel():
    """Outside K the proxy is the -1e4 sentinel; the k3 value is clamped at 10 (never selected anyway)."""
    lp = torch.tensor([[-3.0]], requires_grad=True)
    loss = lp_reg_token_loss(lp, torch.ones(1, 1), torch.tensor([[-1.0]]), torch.full((1, 1), OUT_OF_KEEP_SET), 1.0, 10.0)
    assert float(loss.detach()) == pytest.approx(1.0 + 10.0)
    loss.sum().backward()
    assert float(lp.grad) == 0.0  # coef_1 is a constant here and the KL part is clamped


def test_lp_reg_token_loss_sequence_level_ratio_broadcasts():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    coef = torch.tensor([[2.0], [0.5]])
    adv = -torch.ones(2, 2)
    out = lp_reg_token_loss(lp, coef, adv, lp, 1.0, 10.0)  # D = 0: only the policy-gradient part
    assert torch.equal(out, torch.tensor([[2.0, 2.0], [0.5, 0.5]]))


# ------------------------------------------------------------------------------------------ loss hook
def _loss_ctx(lp, lp_old, adv, mask, extras=None, head_stats=None, completion_ids=None):
    """The kit's loss context of the recipe's aggregation (dapo: token-mean over the micro-batch)."""
    B, T = lp.shape
    return make_loss_context(
        lp, old_per_token_logps=lp_old, advantages=adv, mask=mask, loss_type="dapo", extras=extras,
        entropies=torch.zeros(B, T), head_stats=head_stats,
        completion_ids=torch.zeros(B, T, dtype=torch.long) if completion_ids is None else completion_ids,
    )


def test_loss_hook_support_of_the_replacement():
    """Only tokens with A < 0, in the bottom-k, in K and with lp < lp_proxy are replaced; grad(L - L_base) is
    non-zero exactly there (spec tests 4 and 5)."""
    lp = LOGPS.clone().requires_grad_(True)
    lp_old = LOGPS - 0.05 * torch.arange(10.0).view(2, 5)  # r != 1
    # rho = 0.5 -> S = {(1,2) -6, (0,1) -5, (1,0) -4, (0,3) -3}
    proxy = torch.tensor(
        [
            [-0.5, -4.0, -1.0, -2.0, -1.5],  # (0,1): lp < proxy -> replaced; (0,3): replaced
            [-4.0, -0.05, OUT_OF_KEEP_SET, -2.0, -1.0],  # (1,0): lp == proxy -> kept; (1,2) lowest but not in K
        ]
    )
    # every token outside S also has lp < proxy, so only the selection excludes it
    assert bool(((LOGPS < proxy) | _set((1, 0), (1, 2))).all())
    ctx = _loss_ctx(lp, lp_old, ADV, MASK, extras={PROXY_KEY: proxy})
    stack = build_plugins(["lp_reg"], {"lp_reg": {"rho": 0.5, "beta": 0.9}})
    stack.call("trl_plugins_loss", ctx)

    assert ctx.replacement is not None
    repl, values = ctx.replacement
    assert torch.equal(repl, _set((0, 1), (0, 3)))
    expected_values = lp_reg_token_loss(lp, ctx.coef_1, ADV, proxy, 0.9, 10.0)
    torch.testing.assert_close(values[repl], expected_values[repl])
    assert ctx.metrics["plugins/lp_reg/selected_token_fraction"] == [pytest.approx(4 / 9)]
    assert ctx.metrics["plugins/lp_reg/regularised_token_fraction"] == [pytest.approx(2 / 9)]

    total = loss_from_context(ctx)
    base = loss_from_context(_loss_ctx(lp, lp_old, ADV, MASK))
    (grad,) = torch.autograd.grad(total - base, lp)
    assert torch.equal(grad != 0, _set((0, 1), (0, 3)))
    # At a replaced token the base is unclipped (A < 0 and r >= 1 - eps), so the policy-gradient parts -A r cancel
    # and what is left is the KL part beta (1 - e^D), over the 9 loss tokens of the token-mean.
    for b, t in [(0, 1), (0, 3)]:
        assert float(ctx.coef_1.detach()[b, t]) >= 0.8
        D = float(proxy[b, t] - LOGPS[b, t])
        assert float(grad[b, t]) == pytest.approx(0.9 * (1 - math.exp(D)) / 9, rel=1e-5)


@pytest.mark.parametrize("rho", [0.01, 0.2])
def test_loss_hook_k_at_most_one_is_neutral(rho):
    lp = LOGPS.clone().requires_grad_(True)
    ctx = _loss_ctx(lp, LOGPS.clone(), ADV, MASK, extras={PROXY_KEY: torch.zeros(2, 5)})  # every lp < proxy
    build_plugins(["lp_reg"], {"lp_reg": {"rho": rho}}).call("trl_plugins_loss", ctx)
    assert ctx.replacement is None


def test_loss_hook_no_negative_advantage_is_neutral():
    lp = LOGPS.clone().requires_grad_(True)
    ctx = _loss_ctx(lp, LOGPS.clone(), ADV.abs(), MASK, extras={PROXY_KEY: torch.zeros(2, 5)})
    build_plugins(["lp_reg"], {"lp_reg": {"rho": 1.0}}).call("trl_plugins_loss", ctx)
    assert ctx.replacement is None


# ------------------------------------------------------------------------------------------ with real LM-head stats
B, C, D, V = 3, 6, 8, 23


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, C + 2, D, generator=g)
    W = torch.randn(V, D, generator=g) * 1.5
    mask = torch.ones(B, C, dtype=torch.long)
    mask[2, 4:] = 0
    z = hidden[:, -(C + 1):-1] @ W.t()  # (B, C, V) brute force logits
    return hidden, W, mask, z


def test_kappa_tiny_on_policy_is_exactly_the_base_loss():
    """kappa -> 0 keeps the whole vocabulary, so lp_proxy == lp and S' is empty (spec test 2)."""
    hidden, W, mask, z = _head()
    labels = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(1))
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=4)
    lp = stats.label_logprob(labels).clone().requires_grad_(True)
    adv = -torch.ones(B, C)  # every token negative, rho = 1: everything selected
    ctx = _loss_ctx(lp, lp.detach().clone(), adv, mask, head_stats=stats, completion_ids=labels)
    build_plugins(["lp_reg"], {"lp_reg": {"kappa": 1e-12, "rho": 1.0, "proxy_source": "current"}}).call(
        "trl_plugins_loss", ctx
    )
    assert torch.equal(stats.min_p_logprob(labels, 1e-12), lp.detach())
    assert ctx.replacement is None
    assert torch.equal(loss_from_context(ctx), loss_from_context(_loss_ctx(lp, lp.detach().clone(), adv, mask)))


@pytest.mark.parametrize("mode", ["minp", "fixed"])
def test_tokens_outside_keep_set_never_regularised(mode):
    """Labels outside K (sentinel proxy) are never replaced even when they are the lowest-probability negatives."""
    hidden, W, mask, z = _head(2)
    kappa = 0.3 if mode == "minp" else 0.05
    logp_full = torch.log_softmax(z, -1)
    labels = torch.where(torch.arange(C) % 2 == 0, z.argmin(-1), z.argmax(-1))  # rarest / likeliest token
    stats = HeadStats(hidden, C, mask, W, None, chunk_size=5)
    lp = logp_full.gather(-1, labels[..., None]).squeeze(-1).clone().requires_grad_(True)
    adv = -torch.ones(B, C)
    ctx = _loss_ctx(lp, lp.detach().clone(), adv, mask, head_stats=stats, completion_ids=labels)
    build_plugins(["lp_reg"], {"lp_reg": {"kappa": kappa, "rho": 1.0, "threshold_mode": mode,
                                          "proxy_source": "current"}}).call("trl_plugins_loss", ctx)
    proxy = stats.min_p_logprob(labels, kappa, mode)
    outside = (proxy == OUT_OF_KEEP_SET) & mask.bool()
    assert outside.any()
    inside = mask.bool() & ~outside
    assert torch.all(proxy[inside] >= lp.detach()[inside] - 1e-6)  # renormalising over K raises the probability
    lowest = lp.detach().masked_fill(~mask.bool(), 0).flatten().argmin()
    assert outside.flatten()[lowest]  # the lowest-probability negative token is outside K ...
    repl = ctx.replacement[0] if ctx.replacement is not None else torch.zeros_like(outside)
    assert not (repl & outside).any()  # ... and is never regularised
    # the kept labels (argmax) do have lp < lp_proxy unless K is the whole vocabulary: they are replaced
    assert torch.equal(repl, mask.bool() & ~outside & (lp.detach() < proxy))
    assert repl.any()


def _adv_ctx(stats, advantages):
    return make_advantage_context(torch.zeros(advantages.size(0)), num_generations=3, advantages=advantages,
                                  completion_lengths=stats.mask.sum(-1).float(), policy_stats=stats)


def test_advantage_stage_proxy_and_generation_batch_threshold():
    """proxy_source='old' stores min-p proxies of the pre-update policy; selection_scope='generation_batch' stores
    the k-th smallest old log-prob among negatives (k = floor(|N| rho)), and the loss hook selects at or below it."""
    hidden, W, mask, z = _head(3)
    labels = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(4))
    head = HeadStats(hidden, C, mask, W, None, chunk_size=7)
    old = head.label_logprob(labels)
    stats = PolicyStats(per_token_logps=old, entropies=torch.zeros(B, C), mask=mask, completion_ids=labels,
                        mean_entropy=torch.zeros(B), head_stats=head)
    adv = torch.tensor([-1.0, 0.5, -0.2])  # rows 0 and 2 negative: 6 + 4 = 10 negative tokens
    ctx = _adv_ctx(stats, adv)
    build_plugins(["lp_reg"], {"lp_reg": {"kappa": 0.1, "rho": 0.35, "selection_scope": "generation_batch"}}).call(
        "trl_plugins_transform_advantages", ctx
    )
    torch.testing.assert_close(ctx.local_extras[PROXY_KEY], head.min_p_logprob(labels, 0.1, "minp"))
    negatives = old[(adv < 0)[:, None].expand(B, C) & mask.bool()]
    assert negatives.numel() == 10
    k = math.floor(10 * 0.35)  # 3
    threshold = ctx.local_extras[THRESHOLD_KEY]
    assert threshold.shape == (B,)
    assert torch.all(threshold == negatives.sort().values[k - 1])

    # the loss stage selects exactly the k lowest old log-probs among negatives (no ties here)
    lp = old.clone().requires_grad_(True)
    lctx = _loss_ctx(lp, old, adv[:, None].expand(B, C), mask,
                     extras={PROXY_KEY: torch.zeros(B, C), THRESHOLD_KEY: threshold})
    build_plugins(["lp_reg"], {"lp_reg": {"rho": 0.35, "selection_scope": "generation_batch"}}).call(
        "trl_plugins_loss", lctx
    )
    assert int(lctx.replacement[0].sum()) == k
    assert torch.equal(lctx.replacement[0], select_tokens(old, adv[:, None].expand(B, C), mask, 0.35))

    # k <= 1: threshold -inf, nothing selected
    ctx = _adv_ctx(stats, adv)
    build_plugins(["lp_reg"], {"lp_reg": {"rho": 0.15, "selection_scope": "generation_batch"}}).call(
        "trl_plugins_transform_advantages", ctx
    )
    assert torch.all(ctx.local_extras[THRESHOLD_KEY] == -math.inf)


# ------------------------------------------------------------------------------------------ construction
def test_refuses_entropy_bonus(tmp_path):
    with pytest.raises(IncompatiblePluginsError, match="lp_reg.*entropy_coef"):
        make_tiny_trainer(plugins=["lp_reg"], entropy_coef=0.01, output_dir=str(tmp_path))


def test_option_validation():
    with pytest.raises(PluginConfigError, match="kappa"):
        build_plugins(["lp_reg"], {"lp_reg": {"kappa": 0.0}})
    with pytest.raises(PluginConfigError, match="rho"):
        build_plugins(["lp_reg"], {"lp_reg": {"rho": 1.5}})
    with pytest.raises(PluginConfigError, match="selection_scope"):
        build_plugins(["lp_reg"], {"lp_reg": {"selection_scope": "batch"}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_rho_is_vanilla(tmp_path):
    """Default rho = 0.01 on a 4x12-token batch gives k = 1 <= 1: the run equals trl.GRPOTrainer exactly."""
    from trl import GRPOTrainer

    with_plugin = record_run(_trainer(tmp_path, "a", plugins=["lp_reg"]))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(with_plugin, vanilla)
    assert any(torch.any(a < 0) for a in vanilla.advantages)  # the check is not vacuous
    fractions = [log["plugins/lp_reg/selected_token_fraction"] for log in with_plugin.logs if "loss" in log]
    assert fractions == [0.0, 0.0]


@pytest.fixture(scope="module")
def regularising_run(tmp_path_factory):
    """kappa = 0.5, rho = 0.5 on the near-uniform tiny model: some selected tokens are in K and below the proxy."""
    trainer = _trainer(tmp_path_factory.mktemp("lp"), "run", plugins=["lp_reg"],
                       plugin_config={"lp_reg": {"kappa": 0.5, "rho": 0.5}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return before, record_run(trainer)


def test_end_to_end_regularises(regularising_run):
    before, run = regularising_run
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert "plugins/lp_reg/selected_token_fraction" in log
        assert "plugins/lp_reg/regularised_token_fraction" in log
        assert 0 < log["plugins/lp_reg/regularised_token_fraction"] <= log["plugins/lp_reg/selected_token_fraction"]


def test_generation_batch_scope_and_current_proxy_end_to_end(tmp_path, regularising_run):
    """The other code paths run, and here (num_iterations = 1, one micro-batch per generation batch, so the current
    policy is the old one) they give the same losses as the default (microbatch, old)."""
    _, reference = regularising_run
    run = record_run(_trainer(tmp_path, "gb", plugins=["lp_reg"], plugin_config={
        "lp_reg": {"kappa": 0.5, "rho": 0.5, "selection_scope": "generation_batch", "proxy_source": "current"}}))
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses))
    assert [log["plugins/lp_reg/regularised_token_fraction"] for log in run.logs if "loss" in log] == [
        log["plugins/lp_reg/regularised_token_fraction"] for log in reference.logs if "loss" in log
    ]
