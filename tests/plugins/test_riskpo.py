"""RiskPO: the MVaR paper advantage and the four credit rules on
hand-computed bundles, an independent reference, the spec's properties (constant S, shape of gR, sum-mean credit,
B = 1, order inside a bundle), the advantage hook and a short end-to-end run."""

import math
import random

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import digit_fraction_reward, make_advantage_context, make_tiny_trainer, record_run
from trl_plugins_builtin.riskpo import credit_responses, paper_advantages, riskpo_advantages

# One bundle of two questions, G = 4: q0 = [1, 0, 1, 0], q1 = [1, 1, 0, 0] -> papers S = [2, 1, 1, 0].
# alpha = 0.25, beta = 0.75 on sorted S [0, 1, 1, 2]: q_lo = 0.75, q_hi = 1.25 (linear interpolation).
# gR = ((S - .75)^+ - (S - 1.25)^+) / 0.5 = [1, .5, .5, 0];  gC = -(.75 - S)^+ / .25 = [0, 0, 0, -3]
# A_paper = (1.5 gC + gR) / 2.5 = [0.4, 0.2, 0.2, -1.8]
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
HAND = dict(group_size=4, bundle_size=2, alpha=0.25, beta=0.75, w=1.5, risk="averse", natural_baseline=False,
            norm_by_std=False, eps=0.0)


def _adv(rewards=REWARDS, **overrides):
    kwargs = dict(HAND, credit="uniform")
    kwargs.update(overrides)
    return riskpo_advantages(rewards, **kwargs)[0]


def test_hand_computed_paper_advantage_and_credits():
    paper = torch.tensor([0.4, 0.2, 0.2, -1.8])
    torch.testing.assert_close(_adv(credit="uniform"), torch.cat([paper, paper]))
    # sum_mean: rho(q0) = [.5, -.5, .5, -.5], rho(q1) = [.5, .5, -.5, -.5]; paper sums 1, 0, 0, -1
    # k0: .4 * .5 / 1 = .2; k1, k2: |sum| = 0 -> A/m = .1; k3: -1.8 * -.5 / -1 = -.9
    torch.testing.assert_close(_adv(credit="sum_mean"), torch.tensor([0.2, 0.1, 0.1, -0.9] * 2))
    # std: both questions have unbiased std sqrt(1/3)
    torch.testing.assert_close(_adv(credit="std"), torch.cat([paper, paper]) / math.sqrt(1 / 3))
    # score: 0.5 A on R > 0, 1.5 A on R = 0
    torch.testing.assert_close(_adv(credit="score"), torch.tensor([0.2, 0.3, 0.1, -2.7, 0.2, 0.1, 0.3, -2.7]))


def test_hand_computed_variants():
    # risk-seeking: gC = (S - 1.25)^+ / .25 = [3, 0, 0, 0] -> A = [(4.5 + 1)/2.5, .2, .2, 0]
    torch.testing.assert_close(_adv(risk="seeking"), torch.tensor([2.2, 0.2, 0.2, 0.0] * 2))
    # natural baseline: gR = ([.5, .25, .25, 0] - .5) / .5 = [0, -.5, -.5, -1] -> A = [0, -.2, -.2, (-4.5 - 1)/2.5]
    torch.testing.assert_close(_adv(natural_baseline=True), torch.tensor([0.0, -0.2, -0.2, -2.2] * 2))
    # std normalisation by the bundle's paper-score std sqrt(2/3)
    torch.testing.assert_close(_adv(norm_by_std=True, eps=1e-6),
                               torch.tensor([0.4, 0.2, 0.2, -1.8] * 2) / (math.sqrt(2 / 3) + 1e-6))


def _reference(rewards, G, B, alpha, beta, w, risk, credit, natural, norm, eps):
    """Independent pure-Python RiskPO (statistics module for quantiles / std)."""
    import statistics

    def quantile(xs, q):
        xs = sorted(xs)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])

    R = [[0.0 if math.isnan(x) else x for x in rewards[g * G:(g + 1) * G]] for g in range(len(rewards) // G)]
    out = []
    for start in range(0, len(R), B):
        qs = R[start:start + B]
        m = len(qs)
        S = [sum(q[k] for q in qs) for k in range(G)]
        lo, hi = quantile(S, alpha), quantile(S, beta)
        sigma = statistics.stdev(S) if G > 1 else 1.0
        A = []
        for s in S:
            g_r = (max(s - lo, 0) - max(s - hi, 0) + ((lo - hi) if natural else 0)) / (beta - alpha + eps)
            g_c = -max(lo - s, 0) / (alpha + eps) if risk == "averse" else max(s - hi, 0) / (1 - beta + eps)
            a = (w * g_c + g_r) / (w + 1)
            A.append(a / (sigma + eps) if norm else a)
        for q in qs:
            mean_q = sum(q) / G
            std_q = statistics.stdev(q) if G > 1 else 1.0
            std_q = 1.0 if std_q <= 1e-3 else std_q
            for k in range(G):
                if credit == "uniform":
                    out.append(A[k])
                elif credit == "std":
                    out.append(A[k] / (std_q + eps))
                elif credit == "score":
                    out.append((0.5 if q[k] > 0 else 1.5) * A[k])
                else:
                    total = sum(qq[k] - sum(qq) / G for qq in qs)
                    out.append(A[k] * (q[k] - mean_q) / total if abs(total) > 1e-6 else A[k] / m)
    for i, x in enumerate(rewards):
        if math.isnan(x):
            out[i] = 0.0
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("seed", range(24))
def test_matches_independent_reference(seed):
    rng = random.Random(seed)
    G = rng.choice([1, 2, 3, 4, 6])
    n_groups = rng.randint(1, 7)
    B = rng.choice([1, 2, 3, 5])  # often not a divisor: a smaller last bundle
    rewards = [rng.choice([0.0, 1.0, 1.0, rng.random(), float("nan")]) for _ in range(G * n_groups)]
    alpha = rng.choice([0.1, 0.2, 0.3])
    beta = rng.choice([0.7, 0.8, 0.9])
    args = (G, B, alpha, beta, rng.choice([0.0, 1.5]), rng.choice(["averse", "seeking"]),
            rng.choice(["uniform", "std", "sum_mean", "score"]), rng.random() < 0.5, rng.random() < 0.5, 1e-6)
    adv, _ = riskpo_advantages(torch.tensor(rewards), *args)
    torch.testing.assert_close(adv, _reference(rewards, *args), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("credit", ["uniform", "std", "sum_mean", "score"])
@pytest.mark.parametrize("natural", [False, True])
def test_constant_paper_scores_give_zero(credit, natural):
    # every question constant within its group -> all papers score the same
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4)
    adv, _ = riskpo_advantages(rewards, 4, 3, 0.2, 0.8, 1.5, "averse", credit, natural, True, 1e-6)
    assert torch.equal(adv, torch.zeros(12))


@pytest.mark.parametrize("seed", range(10))
def test_range_term_is_monotone_and_flat_outside_the_quantiles(seed):
    g = torch.Generator().manual_seed(seed)
    S = torch.randint(0, 6, (9,), generator=g).double() + torch.rand(9, generator=g)
    g_r, q_lo, q_hi = paper_advantages(S, 0.2, 0.8, 0.0, "averse", False, False, 0.0)  # w = 0: A = gR
    order = torch.argsort(S)
    assert torch.all(g_r[order][1:] >= g_r[order][:-1] - 1e-12)
    assert torch.all(g_r[S <= q_lo] == 0)
    torch.testing.assert_close(g_r[S >= q_hi], torch.full_like(g_r[S >= q_hi], float(q_hi - q_lo) / 0.6))


@pytest.mark.parametrize("seed", range(10))
def test_sum_mean_credits_of_a_paper_sum_to_its_advantage(seed):
    g = torch.Generator().manual_seed(seed)
    m, G = 3, 5
    rewards = (torch.rand(m, G, generator=g) > 0.5).double()
    paper = torch.randn(G, generator=g).double()
    credits = credit_responses(paper, rewards, "sum_mean", 1e-6)
    torch.testing.assert_close(credits.sum(0), paper)


def test_bundle_of_one_is_a_per_question_quantile_clipped_advantage():
    rewards = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0, 0.3, 0.3, 0.8, 0.1, 0.6])  # two questions, G = 5
    adv, _ = riskpo_advantages(rewards, 5, 1, 0.2, 0.8, 1.5, "averse", "uniform", False, False, 0.0)
    for q in range(2):
        R = rewards[q * 5:(q + 1) * 5].double()
        lo, hi = torch.quantile(R, 0.2), torch.quantile(R, 0.8)
        clipped = R.clamp(lo, hi) - lo  # (R - lo)^+ - (R - hi)^+
        expected = (1.5 * -(lo - R).clamp(min=0) / 0.2 + clipped / 0.6) / 2.5
        torch.testing.assert_close(adv[q * 5:(q + 1) * 5], expected.float())


@pytest.mark.parametrize("credit", ["uniform", "std", "sum_mean", "score"])
def test_invariant_to_question_order_inside_a_bundle(credit):
    g = torch.Generator().manual_seed(3)
    G, n_groups = 4, 6
    rewards = (torch.rand(n_groups * G, generator=g) > 0.4).float()
    adv, _ = riskpo_advantages(rewards, G, 3, 0.2, 0.8, 1.5, "averse", credit, False, True, 1e-6)
    perm = [2, 0, 1, 4, 5, 3]  # permutes questions inside each bundle of 3, keeping each question's rows in order
    rows = torch.cat([torch.arange(q * G, (q + 1) * G) for q in perm])
    adv_perm, _ = riskpo_advantages(rewards[rows], G, 3, 0.2, 0.8, 1.5, "averse", credit, False, True, 1e-6)
    torch.testing.assert_close(adv_perm, adv[rows])


def test_nan_reward_rows_get_zero_and_count_as_zero():
    rewards = REWARDS.clone()
    rewards[1] = float("nan")  # was 0.0: same paper scores
    adv = _adv(rewards, credit="uniform")
    assert adv[1] == 0.0
    torch.testing.assert_close(adv[[0, 2, 3, 4, 5, 6, 7]], _adv(credit="uniform")[[0, 2, 3, 4, 5, 6, 7]])


def test_options_validation():
    with pytest.raises(PluginConfigError, match="alpha < beta"):
        build_plugins(["riskpo"], {"riskpo": {"alpha": 0.8, "beta": 0.8}})
    with pytest.raises(PluginConfigError, match="credit"):
        build_plugins(["riskpo"], {"riskpo": {"credit": "mean"}})


def test_hook_replaces_advantages_and_logs():
    N = REWARDS.numel()
    ctx = make_advantage_context(REWARDS, num_generations=4, advantages=torch.full((N,), 9.0),
                                 completion_lengths=torch.ones(N))
    sink = ctx.metrics
    stack = build_plugins(["riskpo"], {"riskpo": {"alpha": 0.25, "beta": 0.75, "bundle_size": 2,
                                                  "credit": "uniform", "norm_by_std": False, "eps": 0.0}})
    stack.call("trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, torch.tensor([0.4, 0.2, 0.2, -1.8] * 2))
    assert sink["plugins/riskpo/q_low"] == [pytest.approx(0.75)]
    assert sink["plugins/riskpo/q_high"] == [pytest.approx(1.25)]
    assert sink["plugins/riskpo/paper_score"] == [pytest.approx(1.0)]
    assert sink["plugins/riskpo/below_q_low_fraction"] == [pytest.approx(0.25)]
    assert sink["plugins/riskpo/abs_advantage"] == [pytest.approx(0.65)]


def test_end_to_end(tmp_path):
    trainer = make_tiny_trainer(plugins=["riskpo"], plugin_config={"riskpo": {"bundle_size": 2}},
                                reward_funcs=[digit_fraction_reward], per_device_train_batch_size=4,
                                num_generations=2, max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    for rewards, advantages in zip(run.rewards, run.advantages):
        expected, _ = riskpo_advantages(rewards.sum(1), 2, 2, 0.2, 0.8, 1.5, "averse", "sum_mean", False, True, 1e-6)
        assert expected.abs().max() > 0
        torch.testing.assert_close(advantages, expected)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        for key in ("q_low", "q_high", "paper_score", "below_q_low_fraction", "abs_advantage"):
            assert f"plugins/riskpo/{key}" in log


def test_configure_warns_when_a_batch_holds_fewer_prompts_than_a_bundle(tmp_path):
    with pytest.warns(UserWarning, match="fewer than bundle_size"):
        make_tiny_trainer(plugins=["riskpo"], output_dir=str(tmp_path))  # 4 rows / G = 4: one prompt < 5
