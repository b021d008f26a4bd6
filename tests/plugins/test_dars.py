"""DARS: the official ET / HW schedules, extra groups for hard prompts placed in freed slots, the merged-accuracy
filter, pooled R - mean advantages, DARS-B's schedule check, bad options, and an end-to-end run."""

import collections
import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import build_stack, make_advantage_context, make_refill_context, make_tiny_trainer, run_hook
from trl_plugins_builtin.dars import extra_rollouts

HOOK = "trl_plugins_reject_groups"


# ------------------------------------------------------------------------------------------ schedules
def test_schedule_worked_example_and_fixed_points():
    assert extra_rollouts(0.25, 8, 32, "ET") == 3  # S = 0.375, (4 - 3) / 0.375 = 2.67 -> 3
    assert extra_rollouts(0.5, 8, 32, "ET") == 0 and extra_rollouts(0.9, 8, 64, "HW") == 0
    assert extra_rollouts(0.0, 8, 1000, "ET") == extra_rollouts(0.5 / 8, 8, 1000, "ET")  # a = 0 counts as 0.5 / N


def test_schedule_is_non_increasing_capped_and_hw_at_least_et():
    accs = [i / 100 for i in range(1, 50)]
    for schedule in ("ET", "HW"):
        values = [extra_rollouts(a, 8, 10_000, schedule) for a in accs]
        assert all(x >= y for x, y in zip(values, values[1:]))
        assert max(extra_rollouts(a, 8, 32, schedule) for a in accs) == 32 - 8
    assert all(extra_rollouts(a, 8, 10_000, "HW") >= extra_rollouts(a, 8, 10_000, "ET") for a in accs)
    # with std normalisation: S = 2 sqrt(a(1-a)), peak N
    a = 0.25
    s = 2 * math.sqrt(a * (1 - a))
    assert extra_rollouts(a, 8, 1000, "ET", use_std=True) == math.ceil((8 - 8 * s) / s)


# ------------------------------------------------------------------------------------------ refill rounds
def _groups(*rates, G=4):
    """(S*G,) binary rewards with round(rate * G) successes per group."""
    rows = []
    for rate in rates:
        k = round(rate * G)
        rows += [1.0] * k + [0.0] * (G - k)
    return torch.tensor(rows)


def test_round_zero_drops_solved_groups_and_gives_their_slots_to_the_hardest_prompts():
    # G=4, N_max 16: group 0 all wrong (a := 1/8, delta_N 6 -> 2 groups), group 1 a=0.25 (delta_N 2 -> 1 group),
    # groups 2 and 3 solved (dropped at once). Two freed slots: prompt 0 gets both its extra groups; prompt 1's extra
    # group does not fit even with its own slot, so prompt 1 leaves the batch (never a part of a prompt's extras)
    ctx = make_refill_context(_groups(0.0, 0.25, 1.0, 1.0), num_generations=4)
    stack = build_stack("dars", {"dars": {"n_max": 16}}, num_generations=4, per_device_train_batch_size=16)
    run_hook(stack, HOOK, ctx)
    assert extra_rollouts(0.0, 4, 16) == 6 and extra_rollouts(0.25, 4, 16) == 2
    assert ctx.rejected.tolist() == [False, True, True, True]
    assert ctx.replacements == [("repeat", 0), ("repeat", 0)]
    assert ctx.metrics["plugins/dars/extra_groups"] == [2.0]
    assert ctx.metrics["plugins/dars/evicted_prompts"] == [1.0]


def _official_extra_groups(accs, N, n_max, G):
    """The official second sampling (ray_dars_trainer.py:1006-1017, restated): every prompt of the batch gets delta_N
    extra rollouts; here in whole groups of G."""
    return [math.ceil(extra_rollouts(a, N, n_max) / G) for a in accs]


def test_every_kept_prompt_gets_all_its_official_extra_rollouts():
    # S=8, G=4, N_max 16: prompts 0 and 2 at accuracy 0 need 2 extra groups each, prompt 1 (a=0.25) one; prompts 3-5
    # are solved (3 freed slots), 6 and 7 (a >= 0.5) need none. 3 freed + prompt 1's own slot = 4 = 2 + 2: both
    # zero-accuracy prompts get all their extras; the plugin before 2026-11-27 gave prompt 2 one of its two groups
    accs = (0.0, 0.25, 0.0, 1.0, 1.0, 1.0, 0.75, 0.5)
    ctx = make_refill_context(_groups(*accs), num_generations=4)
    stack = build_stack("dars", {"dars": {"n_max": 16}}, num_generations=4, per_device_train_batch_size=32)
    run_hook(stack, HOOK, ctx)
    official = _official_extra_groups(accs, 4, 16, 4)
    assert official == [2, 1, 2, 0, 0, 0, 0, 0]
    asked = collections.Counter(g for kind, g in ctx.replacements if kind == "repeat")
    assert asked == {0: official[0], 2: official[2]}
    assert ctx.rejected.tolist() == [False, True, False, True, True, True, False, False]
    assert ctx.metrics["plugins/dars/evicted_prompts"] == [1.0]


@pytest.mark.parametrize("seed", range(20))
def test_no_prompt_is_kept_with_part_of_its_extras(seed):
    """Random batches of 16 groups of 8 (the issue's simulation): each prompt either keeps its slot and gets exactly
    its official extra groups, or leaves the batch; the extras fit into the freed slots; a zero-accuracy prompt is
    never kept without its extras."""
    g = torch.Generator().manual_seed(seed)
    accs = [float(k) / 8 for k in torch.randint(0, 9, (16,), generator=g).tolist()]
    ctx = make_refill_context(_groups(*accs, G=8), num_generations=8)
    stack = build_stack("dars", {}, num_generations=8, per_device_train_batch_size=128)
    run_hook(stack, HOOK, ctx)
    official = _official_extra_groups(accs, 8, 32, 8)
    asked = collections.Counter(s for kind, s in ctx.replacements if kind == "repeat")
    rejected = ctx.rejected.tolist()
    for slot, extra in enumerate(official):
        if rejected[slot]:
            assert asked[slot] == 0
        else:
            assert asked[slot] == extra
    assert sum(asked.values()) <= sum(rejected)
    assert not any(a == 0.0 and not r and asked[s] == 0 for s, (a, r) in enumerate(zip(accs, rejected)))


def _round_zero_stack():
    stack = build_stack("dars", {"dars": {"n_max": 16}}, num_generations=4, per_device_train_batch_size=16)
    first = make_refill_context(_groups(0.0, 0.0, 1.0, 1.0), num_generations=4)
    run_hook(stack, HOOK, first)
    return stack, first


def test_round_zero_drops_a_hard_group_that_finds_no_slot():
    _, first = _round_zero_stack()
    assert first.replacements == [("repeat", 0), ("repeat", 0)]  # equal difficulty: the lower slot first
    assert first.rejected.tolist() == [False, True, True, True]  # group 1 found no slot at accuracy 0: dropped


@pytest.mark.parametrize("pool_rates, rejected", [
    ((0.0, 0.0, 0.0), [True, False, True, True]),  # prompt 0 stayed at accuracy 0 with its extras: dropped whole
    ((0.0, 0.25, 0.0), [False, False, False, False]),  # one success in the pool: kept
])
def test_next_round_judges_the_pool_on_its_merged_accuracy(pool_rates, rejected):
    stack, _ = _round_zero_stack()
    # the trainer put prompt 0 again in slots 2 and 3 (key 0) and a stream prompt in slot 1 (new key 4)
    a, b, c = pool_rates
    second = make_refill_context(_groups(a, 0.5, b, c), num_generations=4, round=1,
                                 fresh=[False, True, True, True], prompt_keys=[0, 4, 0, 0])
    run_hook(stack, HOOK, second)
    assert second.rejected.tolist() == rejected
    assert second.replacements == []  # the stream prompt at 0.5 needs no extra rollouts


def test_pooled_advantage_is_reward_minus_pool_mean_without_std():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ctx = make_advantage_context(rewards, num_generations=4, prompt_keys=[0, 1, 0])
    run_hook("dars", "trl_plugins_transform_advantages", ctx)
    pool0 = torch.cat([rewards[0:4], rewards[8:12]])
    expected = rewards.clone()
    expected[0:4] -= pool0.mean()
    expected[8:12] -= pool0.mean()
    expected[4:8] -= rewards[4:8].mean()
    torch.testing.assert_close(ctx.advantages, expected)
    assert ctx.metrics["plugins/dars/pooled_prompts"] == [1.0]


def test_use_std_divides_by_the_pool_std():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    ctx = make_advantage_context(rewards, num_generations=4)
    run_hook("dars", "trl_plugins_transform_advantages", ctx, {"dars": {"use_std": True}})
    torch.testing.assert_close(ctx.advantages, (rewards - 0.75) / (rewards.std() + 1e-6))


# ------------------------------------------------------------------------------------------ configuration
def test_breadth_requires_the_dars_b_update_schedule():
    with pytest.raises(IncompatiblePluginsError, match="num_iterations=1"):
        build_stack("dars", {"dars": {"breadth": True}})
    build_stack("dars", {"dars": {"breadth": True}}, num_iterations=2)  # one update per pass: accepted


@pytest.mark.parametrize("options, match", [
    ({"schedule": "linear"}, "schedule"),
    ({"n_max": 0}, "n_max"),
    ({"upper_threshold": 1.5}, "upper_threshold"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["dars"], {"dars": options})


def test_n_max_below_the_group_size_is_refused():
    with pytest.raises(IncompatiblePluginsError, match="n_max=2 is below num_generations=4"):
        build_stack("dars", {"dars": {"n_max": 2}})


def test_end_to_end_refills_and_pools():
    def coin(completions, **kwargs):
        return [float(sum(map(ord, c if isinstance(c, str) else c[-1]["content"])) % 3 == 0) for c in completions]

    trainer = make_tiny_trainer(plugins=["dars"], reward_funcs=[coin], num_generations=2,
                                per_device_train_batch_size=8, max_steps=2, max_refill_rounds=3)
    trainer.train()
    logs = {k: v for log in trainer.state.log_history for k, v in log.items()}
    assert "plugins/dars/extra_groups" in logs and "plugins/framework/refill_rounds" in logs
    assert trainer.generation_service.total > 0  # hard prompts were sampled again


@pytest.mark.parametrize("order", [["dars", "dynamic_sampling"], ["dynamic_sampling", "dars"]])
def test_dynamic_sampling_is_refused_with_the_reason(order):
    """DAPO's round-0 filter would drop the all-fail groups before dars spends its extra rollouts on them."""
    with pytest.raises(IncompatiblePluginsError, match="before dars spends its extra rollouts"):
        build_plugins(order)
