"""CANON: the advantage formula, its identities, the tie rule,
the plugin's advantage hook on a hand-built context, and the lam = 0.5 == Dr.GRPO identity end to end."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    build_stack,
    digit_fraction_reward,
    make_advantage_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.canon import canon_advantages


def _reference(rewards, metric, G, lam, alpha, b, version):
    """Independent pure-Python CANON: sort each group by (metric, position), low half = first floor(G/2)."""
    out = []
    for start in range(0, len(rewards), G):
        R = [0.0 if math.isnan(x) else x for x in rewards[start:start + G]]
        if G < 2:
            out += [0.0] * G
            continue
        order = sorted(range(G), key=lambda j: (metric[start + j], j))
        low, high = set(order[: G // 2]), set(order[G // 2:])
        mu_low = sum(R[j] for j in low) / len(low)
        mu_high = sum(R[j] for j in high) / len(high)
        for j in range(G):
            if math.isnan(rewards[start + j]):
                out.append(0.0)
            elif j in high:
                inter = (R[j] - alpha * mu_low + b) if version == "entropy" else (alpha * R[j] - mu_low + b)
                out.append(lam * inter + (1 - lam) * (R[j] - mu_high))
            else:
                inter = (alpha * R[j] - mu_high - b) if version == "entropy" else (R[j] - alpha * mu_high - b)
                out.append(lam * inter + (1 - lam) * (R[j] - mu_low))
    return torch.tensor(out)


# ------------------------------------------------------------------------------------------ formula
def test_hand_computed_entropy_version():
    # metric order (ascending): rows 1, 3 | 2, 0 -> C- = {1, 3}, C+ = {0, 2}; mu- = 0.125, mu+ = 0.75
    R = torch.tensor([1.0, 0.0, 0.5, 0.25])
    e = torch.tensor([0.9, 0.1, 0.5, 0.3])
    adv, gaps = canon_advantages(R, e, 4, lam=0.6, alpha=2.0, b=0.1, version="entropy")
    # C+: 0.6 (R - 2 * 0.125 + 0.1) + 0.4 (R - 0.75);  C-: 0.6 (2 R - 0.75 - 0.1) + 0.4 (R - 0.125)
    torch.testing.assert_close(adv, torch.tensor([0.61, -0.56, 0.11, -0.16]))
    torch.testing.assert_close(gaps, torch.tensor([0.625]))


def test_hand_computed_length_version():
    # same split; alpha now multiplies R_i in C+ and mu+ in C-
    R = torch.tensor([1.0, 0.0, 0.5, 0.25])
    lengths = torch.tensor([9.0, 1.0, 5.0, 3.0])
    adv, gaps = canon_advantages(R, lengths, 4, lam=0.6, alpha=2.0, b=0.1, version="length")
    # C+: 0.6 (2 R - 0.125 + 0.1) + 0.4 (R - 0.75);  C-: 0.6 (R - 2 * 0.75 - 0.1) + 0.4 (R - 0.125)
    torch.testing.assert_close(adv, torch.tensor([1.285, -1.01, 0.485, -0.76]))
    torch.testing.assert_close(gaps, torch.tensor([0.625]))


@pytest.mark.parametrize("seed", range(20))
def test_matches_independent_reference(seed):
    rng = random.Random(seed)
    G = rng.choice([1, 2, 3, 4, 5, 8])
    n = G * rng.randint(1, 4)
    rewards = [rng.choice([0.0, 1.0, 0.5, rng.random(), float("nan")]) for _ in range(n)]
    metric = [float(rng.randint(0, 3)) for _ in range(n)]  # many ties
    lam, alpha, b = rng.random(), rng.choice([1.0, 0.5, 2.0]), rng.choice([0.0, 0.3])
    version = rng.choice(["entropy", "length"])
    adv, _ = canon_advantages(torch.tensor(rewards), torch.tensor(metric), G, lam, alpha, b, version)
    torch.testing.assert_close(adv, _reference(rewards, metric, G, lam, alpha, b, version).float())


@pytest.mark.parametrize("version", ["entropy", "length"])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_lam_half_is_dr_grpo(version, G):
    """lam = 0.5, alpha = 1, b = 0, even G: A = R - mean(R); bit-exact for binary rewards (dyadic arithmetic)."""
    g = torch.Generator().manual_seed(G)
    metric = torch.rand(3 * G, generator=g)
    binary = (torch.rand(3 * G, generator=g) > 0.5).float()
    adv, _ = canon_advantages(binary, metric, G, 0.5, 1.0, 0.0, version)
    assert torch.equal(adv, binary - binary.view(-1, G).mean(1).repeat_interleave(G))
    dense = torch.rand(3 * G, generator=g)
    adv, _ = canon_advantages(dense, metric, G, 0.5, 1.0, 0.0, version)
    torch.testing.assert_close(adv, dense - dense.view(-1, G).mean(1).repeat_interleave(G), atol=1e-6, rtol=0)


@pytest.mark.parametrize("version", ["entropy", "length"])
@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 1.0])
def test_constant_reward_group_gives_zeros(version, lam):
    metric = torch.tensor([0.3, 0.1, 0.9, 0.2, 5.0, 1.0])
    adv, gaps = canon_advantages(torch.full((6,), 0.7), metric, 6, lam, 1.0, 0.0, version)
    torch.testing.assert_close(adv, torch.zeros(6))
    torch.testing.assert_close(gaps, torch.zeros(1))


@pytest.mark.parametrize("version", ["entropy", "length"])
@pytest.mark.parametrize("seed", range(5))
def test_group_sums_to_zero_for_even_G(version, seed):
    g = torch.Generator().manual_seed(seed)
    G = 2 * (seed + 1)
    rewards, metric = torch.rand(4 * G, generator=g), torch.rand(4 * G, generator=g)
    lam = float(torch.rand(1, generator=g))
    adv, _ = canon_advantages(rewards, metric, G, lam, 1.0, 0.0, version)
    torch.testing.assert_close(adv.view(-1, G).sum(1), torch.zeros(4), atol=1e-6, rtol=0)


def test_singleton_group_gives_zero():
    adv, gaps = canon_advantages(torch.tensor([1.0, 0.0, 0.3]), torch.tensor([0.1, 0.2, 0.3]), 1, 1.0, 1.0, 0.0,
                                 "entropy")
    assert torch.equal(adv, torch.zeros(3)) and torch.equal(gaps, torch.zeros(3))


def test_ties_are_split_by_position():
    R = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # all tied: C- = positions {0, 1}, C+ = {2, 3}; lam = 1: A = R - other half's mean
    adv, _ = canon_advantages(R, torch.ones(4), 4, 1.0, 1.0, 0.0, "entropy")
    assert torch.equal(adv, torch.tensor([1.0, 0.0, -0.5, -0.5]))
    # partial ties [2, 1, 1, 3]: stable order 1, 2, 0, 3 -> C- = {1, 2}, C+ = {0, 3}
    adv, _ = canon_advantages(R, torch.tensor([2.0, 1.0, 1.0, 3.0]), 4, 1.0, 1.0, 0.0, "entropy")
    assert torch.equal(adv, torch.tensor([1.0, -0.5, -0.5, 0.0]))
    # ties across positions do not depend on values elsewhere in the batch (each group on its own)
    adv2, _ = canon_advantages(torch.cat([R, R]), torch.tensor([2.0, 1.0, 1.0, 3.0, 2.0, 1.0, 1.0, 3.0]), 4, 1.0,
                               1.0, 0.0, "entropy")
    assert torch.equal(adv2, torch.cat([adv, adv]))


def test_nan_reward_rows_get_zero():
    R = torch.tensor([1.0, float("nan"), 0.0, 0.5])
    adv, _ = canon_advantages(R, torch.tensor([0.1, 0.2, 0.3, 0.4]), 4, 0.7, 1.0, 0.0, "entropy")
    assert adv[1] == 0.0
    assert not torch.isnan(adv).any()
    # the other rows see the NaN as 0 in the half means (TRL combines rewards with nansum, i.e. 0 too)
    expected, _ = canon_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5]), torch.tensor([0.1, 0.2, 0.3, 0.4]), 4, 0.7,
                                   1.0, 0.0, "entropy")
    torch.testing.assert_close(adv[[0, 2, 3]], expected[[0, 2, 3]])


# ------------------------------------------------------------------------------------------ plugin hook
G = 4
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.0])
ENTROPY = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.2, 0.4, 0.1, 0.3])
LENGTHS = torch.tensor([1.0, 9.0, 3.0, 5.0, 8.0, 2.0, 6.0, 4.0])  # a different order than ENTROPY


def _ctx(step=0):
    N = REWARDS.numel()
    stats = PolicyStats(per_token_logps=torch.zeros(N, 3), entropies=torch.zeros(N, 3), mask=torch.ones(N, 3),
                        completion_ids=torch.zeros(N, 3, dtype=torch.long), mean_entropy=ENTROPY)
    ctx = make_advantage_context(
        REWARDS, num_generations=G,
        advantages=torch.full((N,), 123.0),  # TRL's values: must be replaced
        completion_lengths=LENGTHS, policy_stats=stats, step=step,
    )
    return ctx, ctx.policy_stats_calls, ctx.metrics


def _configured(options, loss_type="dr_grpo", max_steps=10):
    stack = build_plugins(["canon"], {"canon": options})
    stack.call("trl_plugins_configure", trainer=SimpleNamespace(max_completion_length=16),
               args=SimpleNamespace(loss_type=loss_type, max_steps=max_steps))
    return stack


def test_hook_entropy_metric_uses_policy_entropy():
    stack = _configured({"lam": 0.8, "alpha": 1.5, "b": 0.2})
    ctx, calls, sink = _ctx()
    stack.call("trl_plugins_transform_advantages", ctx)
    assert calls == [False]  # one (cached) no-grad forward, without LM-head stats
    expected, gaps = canon_advantages(REWARDS, ENTROPY, G, 0.8, 1.5, 0.2, "entropy")
    assert torch.equal(ctx.advantages, expected)
    assert not torch.equal(expected, canon_advantages(REWARDS, LENGTHS, G, 0.8, 1.5, 0.2, "entropy")[0])
    assert sink["plugins/canon/lam"] == [0.8]
    assert sink["plugins/canon/high_minus_low_reward"] == [pytest.approx(gaps.mean().item())]
    assert sink["plugins/canon/abs_advantage"] == [pytest.approx(expected.abs().mean().item())]


def test_hook_length_metric_uses_completion_lengths_without_forward():
    stack = _configured({"metric": "length", "lam": 0.8, "alpha": 1.5, "b": 0.2})
    ctx, calls, _ = _ctx()
    stack.call("trl_plugins_transform_advantages", ctx)
    assert calls == []
    assert torch.equal(ctx.advantages, canon_advantages(REWARDS, LENGTHS, G, 0.8, 1.5, 0.2, "length")[0])


def test_hook_lam_schedule_and_max_length_division():
    stack = _configured({"lam": 1.0, "lam_schedule": "linear", "lam_final": 0.5, "divide_by_max_length": True},
                        loss_type="dapo", max_steps=10)
    ctx, _, sink = _ctx(step=5)
    stack.call("trl_plugins_transform_advantages", ctx)
    expected, _ = canon_advantages(REWARDS, ENTROPY, G, 0.75, 1.0, 0.0, "entropy")
    torch.testing.assert_close(ctx.advantages, expected / 16)
    assert sink["plugins/canon/lam"] == [0.75]
    ctx, _, sink = _ctx(step=50)  # past max_steps: lam_final
    stack.call("trl_plugins_transform_advantages", ctx)
    assert sink["plugins/canon/lam"] == [0.5]


def test_configure_warns_without_dr_grpo():
    with pytest.warns(UserWarning, match="dr_grpo"):
        _configured({}, loss_type="dapo")


def test_option_validation():
    with pytest.raises(PluginConfigError, match="lam"):
        build_plugins(["canon"], {"canon": {"lam": 1.5}})
    with pytest.raises(PluginConfigError, match="metric"):
        build_plugins(["canon"], {"canon": {"metric": "perplexity"}})


# ------------------------------------------------------------------------------------------ end to end
def test_lam_half_end_to_end_is_group_mean_centering(tmp_path):
    """CANON lam = 0.5 on a real run (entropy metric from the extra no-grad forward) gives the advantages of TRL's
    Dr.GRPO-style centering (scale_rewards='none'): rewards minus the group mean."""
    trainer = make_tiny_trainer(plugins=["canon"], plugin_config={"canon": {"lam": 0.5}},
                                reward_funcs=[digit_fraction_reward], max_steps=2, loss_type="dr_grpo",
                                scale_rewards="none", output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    G = trainer.num_generations
    assert len(run.advantages) == len(run.rewards) == 2
    for rewards, advantages in zip(run.rewards, run.advantages):
        r = rewards.sum(1)  # one reward function, weight 1
        expected = r - r.view(-1, G).mean(1).repeat_interleave(G)
        assert expected.abs().max() > 0  # not a vacuous comparison
        torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/canon/lam"] == 0.5
        assert "plugins/canon/high_minus_low_reward" in log and "plugins/canon/abs_advantage" in log


# ------------------------------------------------------------------------------------------ annealed schedule
def _official_annealed(rewards, entropy, G):
    """The official annealed estimator restated: m = 1 - mean(all rewards); high half (upper ceil(G/2) by
    entropy): (1 - m)(R - mu_low) + m (R - mu_high); low half: (1 - m)(R - mu_high) + m (R - mu_low)."""
    m = 1 - sum(rewards) / len(rewards)
    out = []
    for start in range(0, len(rewards), G):
        R, H = rewards[start:start + G], entropy[start:start + G]
        order = sorted(range(G), key=lambda j: (H[j], j))
        low, high = order[: G // 2], order[G // 2:]
        mu_low, mu_high = sum(R[j] for j in low) / len(low), sum(R[j] for j in high) / len(high)
        for j in range(G):
            if j in high:
                out.append((1 - m) * (R[j] - mu_low) + m * (R[j] - mu_high))
            else:
                out.append((1 - m) * (R[j] - mu_high) + m * (R[j] - mu_low))
    return torch.tensor(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_annealed_schedule_is_the_official_batch_accuracy_weight(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(12, generator=g) > 0.4).float()  # 0/1 accuracy rewards, as in the official recipe
    entropy = torch.rand(12, generator=g)
    stack = build_stack("canon", {"canon": {"lam_schedule": "annealed"}}, loss_type="dr_grpo")
    stats = PolicyStats(per_token_logps=torch.zeros(12, 2), entropies=torch.zeros(12, 2), mask=torch.ones(12, 2),
                        completion_ids=torch.zeros(12, 2, dtype=torch.long), mean_entropy=entropy)
    ctx = make_advantage_context(rewards, num_generations=4, policy_stats=stats)
    run_hook(stack, "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, _official_annealed(rewards.tolist(), entropy.tolist(), 4))
    assert ctx.metrics["plugins/canon/lam"] == [pytest.approx(rewards.mean().item())]


def test_annealed_lam_values():
    stack = build_stack("canon", {"canon": {"lam_schedule": "annealed"}}, loss_type="dr_grpo")
    reverse = build_stack("canon", {"canon": {"lam_schedule": "annealed_reverse"}}, loss_type="dr_grpo")
    rewards = torch.tensor([1.0, 0.0, 1.0, float("nan")])
    assert stack.plugins[0].current_lam(0, rewards) == pytest.approx(2 / 3)  # NaN rows ignored
    assert reverse.plugins[0].current_lam(0, rewards) == pytest.approx(1 / 3)
    assert stack.plugins[0].current_lam(0, torch.tensor([2.0, 1.5])) == 1.0  # clamped to [0, 1]
    assert stack.plugins[0].current_lam(0, torch.tensor([-1.0, -2.0])) == 0.0


def test_lam_final_only_with_the_linear_schedule():
    with pytest.raises(PluginConfigError, match="lam_final=0.5 with lam_schedule='constant'"):
        build_plugins(["canon"], {"canon": {"lam_final": 0.5}})
    with pytest.raises(PluginConfigError, match="lam_final=None with lam_schedule='linear'"):
        build_plugins(["canon"], {"canon": {"lam_schedule": "linear"}})
    with pytest.raises(PluginConfigError, match="lam_schedule"):
        build_plugins(["canon"], {"canon": {"lam_schedule": "cosine"}})
