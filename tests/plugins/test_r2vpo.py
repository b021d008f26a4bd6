"""R2VPO: the unclipped surrogate plus lambda (r - 1)^2, lambda following a projected dual ascent on the measured
ratio variance; on-policy it trains exactly as GRPO; off-policy it keeps the gradient of tokens clipping would zero."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.r2vpo import dual_update, r2vpo_token_loss


def test_hand_computed_token_loss_and_gradient():
    lp = torch.tensor([[0.0, 0.5, -0.5]], requires_grad=True)
    r = torch.exp(lp)
    adv = torch.tensor([[2.0, 1.0, -1.0]])
    loss, sq = r2vpo_token_loss(r, adv, lam=3.0)
    e = torch.exp(torch.tensor([0.0, 0.5, -0.5]))
    torch.testing.assert_close(loss.detach()[0], -e * adv[0] + 3.0 * (e - 1) ** 2)
    torch.testing.assert_close(sq.detach()[0], (e - 1) ** 2)
    loss.sum().backward()
    # d/dlp of -r A + lam (r-1)^2 = r (-A + 2 lam (r - 1))
    torch.testing.assert_close(lp.grad[0], e * (-adv[0] + 6.0 * (e - 1)))


def test_tokens_past_the_clip_range_keep_their_gradient():
    """r = 1.5 > 1 + eps with A > 0: TRL's clipped surrogate gives no gradient, R2VPO (lambda = 0) gives -A r."""
    lp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    base = make_loss_context(lp, old_per_token_logps=old, advantages=adv)
    (g_base,) = torch.autograd.grad(loss_from_context(base), lp)
    assert g_base[0, 0] == 0
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv)
    run_hook(build_stack("r2vpo", {"r2vpo": {"initial_lambda": 0.0}}), "trl_plugins_loss", ctx)
    (g,) = torch.autograd.grad(loss_from_context(ctx), lp)
    torch.testing.assert_close(g, torch.tensor([[-1.5 / 2, -1.0 / 2]]))  # dapo: token-mean over 2 tokens


def test_loss_hook_replaces_on_policy_tokens_and_logs_the_variance():
    lp = torch.tensor([[0.2, -0.2, 0.0, 0.1]], requires_grad=True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    off = torch.tensor([[False, False, True, False]])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([1.0]), mask=mask, offpolicy_mask=off)
    stack = build_stack("r2vpo", {"r2vpo": {"initial_lambda": 2.0}})
    run_hook(stack, "trl_plugins_loss", ctx)
    token_mask, values = ctx.replacement
    assert token_mask.tolist() == [[True, True, False, False]]
    r = torch.exp(lp.detach())
    torch.testing.assert_close(values.detach(), -r + 2.0 * (r - 1) ** 2)
    expected_var = float(((r - 1) ** 2 * mask).sum() / mask.sum())
    assert ctx.metrics["plugins/r2vpo/ratio_variance"] == [pytest.approx(expected_var)]
    assert stack.plugins[0]._measurements == [pytest.approx(expected_var)]


def test_dual_ascent_raises_lambda_above_the_target_and_projects_at_zero_and_the_cap():
    assert dual_update(1.0, 0.10, 0.04, 10.0, 100.0) == pytest.approx(1.6)
    assert dual_update(0.1, 0.0, 0.04, 10.0, 100.0) == 0.0
    assert dual_update(99.0, 1.0, 0.04, 10.0, 100.0) == 100.0


def test_step_end_applies_the_mean_of_the_steps_measurements_and_state_round_trips():
    stack = build_stack("r2vpo", {"r2vpo": {"initial_lambda": 1.0, "dual_lr": 2.0, "variance_target": 0.1}})
    plugin = stack.plugins[0]
    plugin._measurements = [0.2, 0.4]
    stack.call("trl_plugins_on_step_end", trainer=None, step=1)
    assert plugin.lam == pytest.approx(1.0 + 2.0 * (0.3 - 0.1)) and plugin._measurements == []
    stack.call("trl_plugins_on_step_end", trainer=None, step=2)  # nothing measured: unchanged
    assert plugin.lam == pytest.approx(1.4)
    fresh = build_stack("r2vpo").plugins[0]
    fresh.trl_plugins_load_state_dict(plugin.trl_plugins_state_dict())
    assert fresh.lam == pytest.approx(1.4)


def test_bad_options_and_stacks_are_refused():
    with pytest.raises(PluginConfigError, match="variance_target"):
        build_plugins(["r2vpo"], {"r2vpo": {"variance_target": -1.0}})
    with pytest.raises(IncompatiblePluginsError, match="r2vpo"):
        build_plugins(["r2vpo", "rover"])
    with pytest.raises(Exception, match="cispo"):
        make_tiny_trainer(plugins=["r2vpo"], loss_type="cispo", max_steps=1)


def test_on_policy_it_is_grpo():
    assert_reduces_to_vanilla("r2vpo", {"initial_lambda": 5.0}, loss_types=("dapo", "grpo"), steps=1)


def test_end_to_end_off_policy_updates_lambda(tmp_path):
    trainer = make_tiny_trainer(plugins=["r2vpo"], plugin_config={"r2vpo": {"dual_lr": 50.0}},
                                reward_funcs=[digit_fraction_reward], max_steps=2, per_device_train_batch_size=2,
                                num_generations=2, steps_per_generation=2, gradient_accumulation_steps=1,
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert [log["plugins/r2vpo/lambda"] for log in logs][0] == 1.0
    variances = [log["plugins/r2vpo/ratio_variance"] for log in logs]
    assert variances[1] > 0  # the second micro-step of a generation batch runs after an update: r != 1
    expected = dual_update(dual_update(1.0, variances[0], 0.04, 50.0, 100.0), variances[1], 0.04, 50.0, 100.0)
    assert trainer.plugin_stack.plugins[0].lam == pytest.approx(expected, rel=1e-5)


# ============================================================================================ replay buffer
from trl_plugins.testing import make_prompt_context, make_rollout_context, stub_rows  # noqa: E402
from trl_plugins_builtin.r2vpo import BEHAVIOUR_LOGPS, REPLAY, behaviour_ratio, replay_slots  # noqa: E402


def test_behaviour_ratio_token_and_sequence_level_with_finite_gradients():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], requires_grad=True)
    nan = float("nan")
    behaviour = torch.tensor([[-1.5, -1.0, nan], [nan, nan, nan]])  # row 0 replayed (2 stored tokens), row 1 fresh
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ratio, replayed = behaviour_ratio(lp, behaviour, mask, sequence=False)
    assert replayed.tolist() == [True, False]
    torch.testing.assert_close(ratio.detach()[0, :2], torch.exp(torch.tensor([0.5, -1.0])))
    torch.testing.assert_close(ratio.detach()[1], torch.ones(3))
    ratio.sum().backward()
    assert torch.isfinite(lp.grad).all()
    seq, _ = behaviour_ratio(lp.detach(), behaviour, mask, sequence=True)
    assert seq.shape == (2, 1)
    torch.testing.assert_close(seq[:, 0], torch.tensor([float(torch.exp(torch.tensor(-0.25))), 1.0]))


def test_replay_slots_are_the_last_ones_and_one_slot_is_always_sampled():
    assert replay_slots(4, 2, 10) == [2, 3]
    assert replay_slots(4, 2, 1) == [3]
    assert replay_slots(2, 5, 10) == [1]
    assert replay_slots(1, 1, 10) == []
    assert replay_slots(4, 0, 10) == []


def test_loss_of_a_replayed_row_takes_its_ratio_against_the_stored_behaviour_log_probs():
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    old = lp.detach().clone()  # TRL's old log-probs: the current policy (ratio 1)
    behaviour = torch.tensor([[-1.5, -1.0], [float("nan")] * 2])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([1.0, -1.0]),
                            extras={BEHAVIOUR_LOGPS: behaviour})
    run_hook(build_stack("r2vpo", {"r2vpo": {"initial_lambda": 2.0, "replay_groups": 1}}), "trl_plugins_loss", ctx)
    _, values = ctx.replacement
    r = torch.exp(torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(values.detach()[0], -r + 2.0 * (r - 1) ** 2)  # re-weighted, not discarded
    torch.testing.assert_close(values.detach()[1], torch.tensor([1.0, 1.0]))  # fresh row: r = 1, A = -1


def test_stored_groups_fill_the_last_slots_of_a_later_batch_with_their_advantages_and_log_probs():
    from trl_plugins.testing import make_advantage_context

    s = build_stack("r2vpo", {"r2vpo": {"replay_groups": 1}}, num_generations=2)
    (plugin,) = list(s)
    rows = stub_rows(2, 2)
    adv0 = make_advantage_context([1.0, 0.0, 1.0, 1.0], num_generations=2, step=0, rows=rows)
    run_hook(s, "trl_plugins_transform_advantages", adv0)
    assert len(plugin.buffer) == 1  # group 0 (non-zero advantages) stored, group 1 (all zero) not
    (stored,) = plugin.buffer.values()
    assert [e["advantage"] for e in stored] == pytest.approx([float(a) for a in adv0.advantages[:2]])
    assert all(len(e["logps"]) == len(e["ids"]) for e in stored) and stored[0]["prompt"] == rows[0]["prompt"]

    pctx = make_prompt_context(stub_rows(2, 2, first_group=5), num_generations=2, step=1)
    run_hook(s, "trl_plugins_generation_prompts", pctx)
    assert pctx.deferred == [False, False, True, True]  # the last group slot is replayed, not sampled
    rctx = make_rollout_context([["a", "b"], ["", ""]], rows=stub_rows(2, 2, first_group=5), step=1,
                                deferred=[2, 3])
    run_hook(s, "trl_plugins_after_generation", rctx)
    assert rctx.completion_ids[2] == stored[0]["ids"] and rctx.training_prompts[2] == stored[0]["prompt"]
    assert rctx.annotations[3][REPLAY][1] == 1 and not any(rctx.offpolicy[2])

    adv1 = make_advantage_context([0.0, 1.0, 0.0, 0.0], num_generations=2, step=1, rows=stub_rows(2, 2),
                                  annotations=[{}, {}] + [dict(a) for a in rctx.annotations[2:]])
    run_hook(s, "trl_plugins_transform_advantages", adv1)
    assert adv1.advantages[2:].tolist() == pytest.approx([e["advantage"] for e in stored])
    behaviour = adv1.local_extras[BEHAVIOUR_LOGPS]
    assert torch.isnan(behaviour[:2]).all()
    n = len(stored[0]["logps"])
    assert behaviour[2, :n].tolist() == pytest.approx(stored[0]["logps"])
    assert adv1.metrics["plugins/r2vpo/replayed_groups"] == [1.0]


def test_stale_groups_are_evicted_after_replay_max_age():
    from trl_plugins.testing import make_advantage_context

    s = build_stack("r2vpo", {"r2vpo": {"replay_groups": 1, "replay_max_age": 2}}, num_generations=2)
    (plugin,) = list(s)
    run_hook(s, "trl_plugins_transform_advantages",
             make_advantage_context([1.0, 0.0, 1.0, 1.0], num_generations=2, step=0, rows=stub_rows(2, 2)))
    pctx = make_prompt_context(num_groups=2, num_generations=2, step=2)
    run_hook(s, "trl_plugins_generation_prompts", pctx)
    assert any(pctx.deferred)
    pctx = make_prompt_context(num_groups=2, num_generations=2, step=3)
    run_hook(s, "trl_plugins_generation_prompts", pctx)
    assert not any(pctx.deferred) and len(plugin.buffer) == 0


def test_replay_off_by_default_enables_no_sampling_hook_and_is_refused_where_it_cannot_run():
    (plugin,) = list(build_plugins(["r2vpo"]))
    assert not plugin.hook_enabled("trl_plugins_generation_prompts")
    assert plugin.multi_turn_refusal() is None and plugin.image_inputs_refusal() is None
    (on,) = list(build_plugins(["r2vpo"], {"r2vpo": {"replay_groups": 1}}))
    assert on.hook_enabled("trl_plugins_after_generation")
    assert "edits completions" in on.multi_turn_refusal() and "image" in on.image_inputs_refusal()


@pytest.mark.parametrize("options, match", [
    ({"replay_groups": -1}, "replay_groups"),
    ({"replay_max_age": 0}, "replay_max_age"),
    ({"replay_capacity": 0}, "replay_capacity"),
])
def test_bad_replay_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["r2vpo"], {"r2vpo": options})


def test_end_to_end_replay_trains_stored_groups_and_checkpoints_the_buffer(tmp_path):
    trainer = make_tiny_trainer(plugins=["r2vpo"], plugin_config={"r2vpo": {"replay_groups": 1}},
                                reward_funcs=[digit_fraction_reward], max_steps=3, per_device_train_batch_size=8,
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    replayed = [log["plugins/r2vpo/replayed_groups"] for log in run.logs if "plugins/r2vpo/replayed_groups" in log]
    assert replayed[0] == 0 and max(replayed[1:]) == 1.0
    # on-policy otherwise (r = 1 on fresh tokens): a non-zero ratio variance comes from the replayed stale tokens
    variances = [log["plugins/r2vpo/ratio_variance"] for log in run.logs if "plugins/r2vpo/ratio_variance" in log]
    assert variances[0] == pytest.approx(0.0, abs=1e-10) and max(variances[1:]) > 0
    (plugin,) = list(trainer.plugin_stack.plugins)
    state = plugin.trl_plugins_state_dict()
    assert state["buffer"]
    (fresh,) = list(build_plugins(["r2vpo"], {"r2vpo": {"replay_groups": 1}}))
    fresh.trl_plugins_load_state_dict(state)
    assert fresh.buffer == plugin.buffer and fresh._next_key == plugin._next_key


def test_two_processes_defer_the_same_global_slot_from_the_same_buffer():
    """2 groups of G=2 over 2 processes (one group each): both plan the last slot, held by process 1, from one key."""
    from trl_plugins.api.services import RunInfo
    from trl_plugins.testing import make_advantage_context

    source = build_stack("r2vpo", {"r2vpo": {"replay_groups": 1}}, num_generations=2)
    run_hook(source, "trl_plugins_transform_advantages",
             make_advantage_context([1.0, 0.0, 0.0, 1.0], num_generations=2, step=0, rows=stub_rows(2, 2)))
    state = list(source)[0].trl_plugins_state_dict()
    assert len(state["buffer"]) == 2
    deferred = []
    for rank in (0, 1):
        s = build_stack("r2vpo", {"r2vpo": {"replay_groups": 1}}, num_generations=2)
        list(s)[0].trl_plugins_load_state_dict(state)
        pctx = make_prompt_context(stub_rows(1, 2, first_group=rank), num_generations=2, step=1, process_index=rank,
                                   run=RunInfo(num_processes=2))
        run_hook(s, "trl_plugins_generation_prompts", pctx)
        deferred.append((pctx.deferred or [False, False], dict(list(s)[0]._plan)))
    assert deferred[0] == ([False, False], {})
    assert deferred[1][0] == [True, True] and sorted(deferred[1][1]) == [2, 3]
    assert {key for key, _ in deferred[1][1].values()} <= set(state["buffer"])


def test_the_replay_buffer_is_refused_with_tools():
    from trl_plugins.testing import make_tool_trainer

    with pytest.raises(IncompatiblePluginsError, match="r2vpo"):
        make_tool_trainer(plugins=["r2vpo"], plugin_config={"r2vpo": {"replay_groups": 1}}, max_steps=1)
