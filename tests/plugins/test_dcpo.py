"""DCPO: A' = (1 - alpha) A + alpha c w with w = pi_tau(o) / pi_1(o) from the chunked head statistics, tau and alpha
steered by the previous update's entropy estimate; max_alpha = 0 is vanilla."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.runtime.head_stats import HeadStats
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    group_normalized_advantages,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.dcpo import dcpo_advantages, dcpo_alpha, temperature_logprobs

N, C, D, V = 4, 5, 8, 37


def _stats(seed=0, run_temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C + 2, D, generator=g)
    W = torch.randn(V, D, generator=g)
    mask = torch.ones(N, C)
    mask[3, 2:] = 0
    labels = torch.randint(0, V, (N, C), generator=g)
    head = HeadStats(hidden, C, mask, W, None, temperature=run_temperature, chunk_size=3)
    z = hidden[:, -(C + 1):-1] @ W.t()  # raw (N, C, V) logits, brute force
    stats = PolicyStats(per_token_logps=head.label_logprob(labels), entropies=head.entropy(), mask=mask,
                        completion_ids=labels, mean_entropy=torch.zeros(N), head_stats=head)
    return stats, z, labels, mask


def _brute_weights(z, labels, mask, tau):
    lp_1 = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    lp_tau = torch.log_softmax(z / tau, -1).gather(-1, labels[..., None]).squeeze(-1)
    return torch.exp(lp_tau - lp_1) * mask


# ------------------------------------------------------------------------------------------ formula
def test_alpha_is_capped_divided_by_the_correct_fraction_and_squashed():
    assert dcpo_alpha(0.3, 0.5, 0.1, 0.25) == pytest.approx(0.4 / 1.4)
    assert dcpo_alpha(0.45, 0.5, 0.1, 0.5) == pytest.approx(0.1 / 1.1)
    assert dcpo_alpha(0.9, 0.5, 0.1, 0.0) == 0.0  # no correct rollout: reconstructed alpha = 0


def test_hand_computed_advantages():
    A = torch.tensor([1.0, -1.0])
    w = torch.tensor([[2.0, 0.5], [3.0, 1.0]])
    out = dcpo_advantages(A, torch.tensor([True, False]), w, 0.25)
    torch.testing.assert_close(out, torch.tensor([[0.75 + 0.5, 0.75 + 0.125], [-0.75, -0.75]]))


@pytest.mark.parametrize("run_temperature", [1.0, 0.7])
@pytest.mark.parametrize("tau", [0.8, 1.2])
def test_temperature_logprobs_match_brute_force_on_raw_logits(run_temperature, tau):
    stats, z, labels, mask = _stats(1, run_temperature)
    lp_1, lp_tau = temperature_logprobs(stats.head_stats, labels, tau)
    brute_1 = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1) * mask
    brute_tau = torch.log_softmax(z / tau, -1).gather(-1, labels[..., None]).squeeze(-1) * mask
    torch.testing.assert_close(lp_1, brute_1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_tau, brute_tau, atol=1e-5, rtol=1e-5)


def test_sharper_target_raises_likely_tokens_and_lowers_unlikely_ones():
    stats, z, labels, mask = _stats(2)
    argmax = z.argmax(-1)
    argmin = z.argmin(-1)
    lp_1, lp_tau = temperature_logprobs(stats.head_stats, argmax, 0.8)
    assert torch.all((lp_tau - lp_1)[mask.bool()] > 0)
    lp_1, lp_tau = temperature_logprobs(stats.head_stats, argmin, 0.8)
    assert torch.all((lp_tau - lp_1)[mask.bool()] < 0)


# ------------------------------------------------------------------------------------------ hooks
def _adv_ctx(stats, rewards):
    return make_advantage_context(torch.tensor(rewards), num_generations=2, policy_stats=stats)


def test_first_batch_uses_entropy_zero_so_the_flatter_target():
    stats, z, labels, mask = _stats(3)
    rewards = [1.0, 0.0, 0.5, 0.0]  # correct (> 0.05): rows 0 and 2 -> p = 0.5
    ctx = _adv_ctx(stats, rewards)
    trl = ctx.advantages.clone()
    run_hook("dcpo", "trl_plugins_transform_advantages", ctx)
    alpha = dcpo_alpha(0.0, 0.5, 0.1, 0.5)
    w = _brute_weights(z, labels, mask, 1.2)
    expected = (1 - alpha) * trl.unsqueeze(1) + alpha * torch.tensor([1.0, 0, 1, 0]).unsqueeze(1) * w
    torch.testing.assert_close(ctx.advantages, expected, atol=1e-5, rtol=1e-5)
    assert ctx.metrics["plugins/dcpo/tau"] == [1.2] and ctx.metrics["plugins/dcpo/alpha"] == [pytest.approx(alpha)]


def test_entropy_estimate_of_the_previous_update_selects_tau():
    stack = build_stack("dcpo")
    lp = torch.full((2, 4), -0.9, requires_grad=True)  # token-mean of -lp = 0.9 > 0.5: sharper target next batch
    run_hook(stack, "trl_plugins_loss", make_loss_context(lp))
    stats, z, labels, mask = _stats(4)
    ctx = _adv_ctx(stats, [1.0, 0.0, 0.0, 0.0])
    trl = ctx.advantages.clone()
    run_hook(stack, "trl_plugins_transform_advantages", ctx)
    assert ctx.metrics["plugins/dcpo/tau"] == [0.8]
    assert ctx.metrics["plugins/dcpo/entropy_estimate"] == [pytest.approx(0.9)]
    alpha = dcpo_alpha(0.9, 0.5, 0.1, 0.25)
    w = _brute_weights(z, labels, mask, 0.8)
    torch.testing.assert_close(ctx.advantages[0], (1 - alpha) * trl[0] + alpha * w[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ctx.advantages[1:], ((1 - alpha) * trl[1:]).unsqueeze(1).expand(3, C))
    plugin = stack.plugins[0]
    fresh = build_stack("dcpo").plugins[0]
    fresh.trl_plugins_load_state_dict(plugin.trl_plugins_state_dict())
    assert fresh.entropy == pytest.approx(0.9)


def test_max_alpha_zero_needs_no_forward_and_keeps_trls_advantages():
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2)
    before = ctx.advantages.clone()
    run_hook("dcpo", "trl_plugins_transform_advantages", ctx, {"dcpo": {"max_alpha": 0.0}})
    assert torch.equal(ctx.advantages, before) and ctx.policy_stats_calls == []


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="temperature_high >= 1 >= temperature_low"):
        build_plugins(["dcpo"], {"dcpo": {"temperature_high": 0.9}})
    with pytest.raises(PluginConfigError, match="entropy_target"):
        build_plugins(["dcpo"], {"dcpo": {"entropy_target": -1.0}})


# ------------------------------------------------------------------------------------------ real trainer
def test_max_alpha_zero_is_vanilla():
    assert_reduces_to_vanilla("dcpo", {"max_alpha": 0.0}, loss_types=("dapo",), steps=1)


def test_end_to_end_failed_rows_keep_scaled_trl_advantages(tmp_path):
    trainer = make_tiny_trainer(plugins=["dcpo"], plugin_config={"dcpo": {"success_threshold": 0.2}},
                                reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    mixed = []
    for rewards, advantages, log in zip(run.rewards, run.advantages, logs):
        alpha = log["plugins/dcpo/alpha"]
        assert alpha > 0 and advantages.dim() == 2
        trl = group_normalized_advantages(rewards.sum(1), 4)
        failed = rewards[:, 0] <= 0.2
        mixed.append(bool(failed.any() and (~failed).any()))
        assert log["plugins/dcpo/correct_fraction"] == pytest.approx(float((~failed).float().mean()))
        # correct rows carry the per-token target term: not constant along the row
        assert all(advantages[i].std() > 0 for i in torch.nonzero(~failed).flatten().tolist())
        torch.testing.assert_close(advantages[failed], ((1 - alpha) * trl[failed]).unsqueeze(1).expand_as(
            advantages[failed]), atol=1e-5, rtol=1e-4)
    assert any(mixed)
    assert logs[0]["plugins/dcpo/entropy_estimate"] == 0.0 and logs[1]["plugins/dcpo/entropy_estimate"] > 0
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())


def test_other_entropy_controls_are_refused_with_the_reason():
    from trl_plugins import IncompatiblePluginsError

    with pytest.raises(IncompatiblePluginsError, match="'dcpo' and 'siren' cannot be stacked: each is a complete"):
        build_plugins(["dcpo", "siren"])
    with pytest.raises(IncompatiblePluginsError, match="entropy_coef=0.01"):
        build_stack("dcpo", entropy_coef=0.01)
