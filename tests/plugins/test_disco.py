"""DisCO: sequence weights from the group structure (computed at the
advantage stage), the weighted surrogate's gradient equals the grouped objective's on a tiny model (on-policy), the
squared-hinge KL, the loss hook's replacement and penalty, the configuration checks and an end-to-end run."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.disco import disco_token_loss, disco_weights, kl_hinge_penalty, sequence_scores

# ------------------------------------------------------------------------------------------ weights
# G = 4; group 0 mixed (P = {0, 3}), group 1 all positive, group 2 all negative, group 3 mixed (P = {2})
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
OLD = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -1.0, -1.0, -2.0, -2.0, -2.0, -2.0, -4.0, -1.0, -9.0, -2.0])


def test_disco_b_weights_hand_computed():
    w, pos, mixed = disco_weights(REWARDS, 4, 0.0, "disco_b", 10.0)
    # mixed groups: G/|P| on positives, -G/|N| on negatives; single-class groups: 0
    expected = [2.0, -2.0, -2.0, 2.0] + [0.0] * 8 + [-4 / 3, -4 / 3, 4.0, -4 / 3]
    torch.testing.assert_close(w, torch.tensor(expected))
    assert torch.equal(pos, REWARDS > 0)
    assert mixed.tolist() == [True, False, False, True]


def test_disco_weights_softmax_over_negatives():
    tau = 2.0
    w, _, _ = disco_weights(REWARDS, 4, 0.0, "disco", tau, OLD)
    # group 0: negatives 1, 2 with old scores -2, -0.5
    z = [math.exp(-2.0 / tau), math.exp(-0.5 / tau)]
    expected0 = [2.0, -4 * z[0] / sum(z), -4 * z[1] / sum(z), 2.0]
    # group 3: negatives 12, 13, 15 with old scores -4, -1, -2
    z = [math.exp(-4.0 / tau), math.exp(-1.0 / tau), math.exp(-2.0 / tau)]
    expected3 = [-4 * z[0] / sum(z), -4 * z[1] / sum(z), 4.0, -4 * z[2] / sum(z)]
    torch.testing.assert_close(w, torch.tensor(expected0 + [0.0] * 8 + expected3))


@pytest.mark.parametrize("variant", ["disco", "disco_b"])
def test_weights_sum_to_zero_in_mixed_groups_and_vanish_in_single_class_ones(variant):
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(40, generator=g) > 0.5).float()
    w, _, mixed = disco_weights(rewards, 5, 0.0, variant, 10.0, torch.randn(40, generator=g))
    sums = w.view(-1, 5).sum(1)
    torch.testing.assert_close(sums, torch.zeros(8), atol=1e-5, rtol=0)
    assert torch.all(w.view(-1, 5)[~mixed] == 0)


def test_large_tau_is_disco_b():
    w_inf, _, _ = disco_weights(REWARDS, 4, 0.0, "disco", 1e12, OLD)
    w_b, _, _ = disco_weights(REWARDS, 4, 0.0, "disco_b", 10.0)
    torch.testing.assert_close(w_inf, w_b)


def test_threshold_and_nan_rewards():
    rewards = torch.tensor([0.7, 0.2, float("nan"), 0.9])
    w, pos, _ = disco_weights(rewards, 4, 0.5, "disco_b", 10.0)
    assert pos.tolist() == [True, False, False, True]  # NaN counts as negative
    torch.testing.assert_close(w, torch.tensor([2.0, -2.0, -2.0, 2.0]))


# ------------------------------------------------------------------------------------------ gradient equivalence
def _tiny_policy(seed=0, B=8, T=5, V=7, D=6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    head = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.5)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[6, 1:] = 0

    def logps():
        return torch.log_softmax(hidden @ head.t(), -1).gather(-1, labels[..., None]).squeeze(-1)

    return head, logps, mask


@pytest.mark.parametrize("variant", ["disco", "disco_b"])
@pytest.mark.parametrize("score", ["logL", "Lratio"])
def test_weighted_surrogate_gradient_equals_grouped_objective(variant, score):
    """On-policy (theta = theta_old), grad of the grpo-aggregated weighted surrogate == grad of -J, where
    J = (1/Q) sum_q [mean_P s - tau log sum_N exp(s/tau)] (disco) or [mean_P s - mean_N s] (disco_b)."""
    G, tau = 4, 0.7
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # two mixed groups, Q = 2 ...
    rewards = torch.cat([rewards, torch.ones(4)])  # ... plus one single-class group: Q = 3
    head2, logps2, mask2 = _tiny_policy(B=12)
    lp = logps2()
    old = lp.detach()

    # grouped objective
    s = sequence_scores(lp if score == "logL" else torch.exp(lp - old), mask2)
    J = 0.0
    for q in range(3):
        sq, rq = s[q * G:(q + 1) * G], rewards[q * G:(q + 1) * G]
        P, Nn = sq[rq > 0], sq[rq <= 0]
        if len(P) and len(Nn):
            neg = tau * torch.logsumexp(Nn / tau, 0) if variant == "disco" else Nn.mean()
            J = J + P.mean() - neg
    J = J / 3
    (grad_j,) = torch.autograd.grad(-J, head2)

    # weights at the advantage stage (old scores), then the per-token surrogate aggregated like loss_type='grpo'
    old_scores = sequence_scores(old if score == "logL" else torch.ones_like(old), mask2)
    w, _, _ = disco_weights(rewards, G, 0.0, variant, tau, old_scores)
    lp = logps2()
    per_token = disco_token_loss(lp, old, w.unsqueeze(1), score)
    loss = ((per_token * mask2).sum(-1) / mask2.sum(-1)).mean()
    (grad_s,) = torch.autograd.grad(loss, head2)
    assert grad_j.abs().max() > 1e-4
    torch.testing.assert_close(grad_s, grad_j, atol=1e-6, rtol=1e-5)


def test_single_class_groups_get_zero_gradient():
    head, logps, mask = _tiny_policy(B=8)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4)
    w, _, _ = disco_weights(rewards, 4, 0.0, "disco_b", 10.0)
    lp = logps()
    loss = ((disco_token_loss(lp, lp.detach(), w.unsqueeze(1), "logL") * mask).sum(-1) / mask.sum(-1)).mean()
    (grad,) = torch.autograd.grad(loss, head)
    assert torch.equal(grad, torch.zeros_like(grad))


# ------------------------------------------------------------------------------------------ KL hinge
def test_kl_hinge_value_and_gradient():
    lp_old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.5]], dtype=torch.float64)
    shift = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.4, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    beta, delta = 3.0, 0.01
    lp = (lp_old + shift).requires_grad_(True)
    penalty, kl = kl_hinge_penalty(lp, lp_old, mask, beta, delta)
    penalty_value, kl = float(penalty.detach()), kl.detach()
    d = shift[mask.bool()]
    expected_kl = float((torch.exp(d) - 1 - d).mean())
    assert float(kl) == pytest.approx(expected_kl, rel=1e-12)
    assert penalty_value == pytest.approx(beta * (expected_kl - delta) * expected_kl, rel=1e-12)
    (grad,) = torch.autograd.grad(penalty, lp)
    # gradient of beta/2 max(kl - delta, 0)^2 = beta (kl - delta) dkl/dlp, dkl/dlp = (e^d - 1) / n on valid tokens
    expected = beta * (expected_kl - delta) * (torch.exp(shift) - 1) * mask / mask.sum()
    torch.testing.assert_close(grad, expected)


def test_kl_hinge_has_no_gradient_below_the_budget():
    lp_old = torch.tensor([[-1.0, -2.0]])
    lp = (lp_old + torch.tensor([[0.01, -0.01]])).requires_grad_(True)
    penalty, kl = kl_hinge_penalty(lp, lp_old, torch.ones(1, 2), 1e3, 1e-3)
    assert 0 < float(kl.detach()) <= 1e-3
    (grad,) = torch.autograd.grad(penalty, lp)
    assert float(penalty.detach()) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


# ------------------------------------------------------------------------------------------ hooks
def _loss_ctx(lp, old, adv, mask, offpolicy=None, gradient_accumulation_steps=1):
    B, T = lp.shape
    return make_loss_context(
        lp, old_per_token_logps=old, advantages=adv, mask=mask, offpolicy_mask=offpolicy, loss_type="grpo",
        entropies=torch.zeros(B, T), completion_ids=torch.zeros(B, T, dtype=torch.long),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


@pytest.mark.parametrize("score", ["logL", "Lratio"])
def test_loss_hook_replaces_valid_on_policy_tokens_and_adds_the_penalty(score):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.5]])
    lp = (old + torch.tensor([[0.5, -0.2, 0.1], [0.0, 0.4, 0.2]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    offpolicy = torch.tensor([[False, False, True], [False, False, False]])
    adv = torch.tensor([[2.0], [-1.5]])
    ctx = _loss_ctx(lp, old, adv, mask, offpolicy, gradient_accumulation_steps=4)
    sink = ctx.metrics
    stack = build_plugins(["disco"], {"disco": {"score": score, "beta": 5.0, "delta": 0.001}})
    stack.call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    assert torch.equal(repl, torch.tensor([[True, True, False], [True, True, False]]))
    expected = -adv * (lp if score == "logL" else torch.exp(lp - old))
    torch.testing.assert_close(values, expected)
    (penalty,) = ctx.scalar_terms
    full, kl = kl_hinge_penalty(lp, old, mask, 5.0, 0.001)
    torch.testing.assert_close(penalty, full / 4)  # divided by the gradient-accumulation steps in train mode
    assert kl.item() > 0.001
    assert sink["plugins/disco/kl"] == [pytest.approx(kl.item())]
    assert sink["plugins/disco/kl_penalty_active"] == [1.0]


def _adv_ctx(rewards, G, mean_logps):
    N = rewards.numel()
    T = 3
    stats = PolicyStats(per_token_logps=mean_logps[:, None].expand(N, T).clone(), entropies=torch.zeros(N, T),
                        mask=torch.ones(N, T), completion_ids=torch.zeros(N, T, dtype=torch.long),
                        mean_entropy=torch.zeros(N))
    ctx = make_advantage_context(rewards, num_generations=G, advantages=torch.zeros(N),
                                 completion_lengths=torch.full((N,), float(T)), policy_stats=stats)
    return ctx, ctx.policy_stats_calls, ctx.metrics


@pytest.mark.parametrize(
    "options, forward",
    [({}, True), ({"score": "Lratio"}, False), ({"variant": "disco_b"}, False)],
)
def test_advantage_hook_weights(options, forward):
    ctx, calls, sink = _adv_ctx(REWARDS, 4, OLD)
    build_plugins(["disco"], {"disco": options}).call("trl_plugins_transform_advantages", ctx)
    assert calls == ([False] if forward else [])  # old scores need one no-grad forward only for disco + logL
    variant = options.get("variant", "disco")
    scores = OLD if forward else torch.ones(16)
    expected, _, _ = disco_weights(REWARDS, 4, 0.0, variant, 10.0, scores)
    torch.testing.assert_close(ctx.advantages, expected)
    assert sink["plugins/disco/positive_fraction"] == [pytest.approx(7 / 16)]
    assert sink["plugins/disco/mixed_group_fraction"] == [0.5]


def _configure(**overrides):
    args = SimpleNamespace(loss_type="grpo", top_entropy_quantile=1.0, beta=0.0, off_policy_mask_threshold=None,
                           plugins=["disco"], max_steps=10)
    for k, v in overrides.items():
        setattr(args, k, v)
    stack = build_plugins(args.plugins, {})
    stack.call("trl_plugins_configure", trainer=SimpleNamespace(plugin_stack=stack, max_completion_length=8),
               args=args)


def test_configure_refuses_other_loss_types_and_warns():
    refused = "'disco' does not support loss_type='dapo'.*Use loss_type 'grpo'"
    with pytest.raises(IncompatiblePluginsError, match=refused):
        build_plugins(["disco"]).check_loss_type("dapo")
    with pytest.warns(UserWarning, match="beta"):
        _configure(beta=0.04)
    with pytest.warns(UserWarning, match="top_entropy_quantile"):
        _configure(top_entropy_quantile=0.2)
    # an advantage transform listed before disco would be overwritten: the stack runs disco first, and says so
    with pytest.warns(UserWarning, match=r"'disco' recomputes the advantages from scratch.*before 'hicra'"):
        _configure(plugins=["hicra", "disco"], loss_type="grpo")
    with pytest.raises(IncompatiblePluginsError, match=r"\['canon', 'disco'\] each recompute the advantages"):
        build_plugins(["canon", "disco"])


def test_refused_together_with_another_surrogate_replacer():
    with pytest.raises(IncompatiblePluginsError, match="replace the base surrogate"):
        build_plugins(["disco", "lp_reg"])


# ------------------------------------------------------------------------------------------ end to end
def test_end_to_end(tmp_path):
    """disco_b on a real run: the advantages are DisCO's weights from the rewards; parameters move."""
    trainer = make_tiny_trainer(plugins=["disco"], loss_type="grpo",
                                plugin_config={"disco": {"variant": "disco_b", "success_threshold": 0.1}},
                                reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    for rewards, advantages in zip(run.rewards, run.advantages):
        expected, _, _ = disco_weights(rewards.sum(1), 4, 0.1, "disco_b", 10.0)
        torch.testing.assert_close(advantages, expected)
    assert any(a.abs().max() > 0 for a in run.advantages)  # at least one mixed group
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        for key in ("positive_fraction", "mixed_group_fraction", "kl", "kl_penalty_active"):
            assert f"plugins/disco/{key}" in log
