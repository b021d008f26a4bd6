"""fleming_r1: the mined chunk on small inputs, the failure streaks, simulated loops in which the persistently failed
prompts fill two thirds of each stage-2 batch and leave it once solved, a resumed loop that draws what the unbroken
loop drew, bad options refused, and tiny-model runs (the neutral setting is vanilla; the mining acts on a real run)."""

import pytest
import torch
from trl.trainer.utils import RepeatSampler

from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.components.prompt_history import HistoryRepeatSampler
from trl_plugins.runtime.checkpoints import load_plugin_state, save_plugin_state
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    simulate_sampler_loop,
    tiny_dataset,
)
from trl_plugins_builtin.fleming_r1 import mined_chunk, persistent_failures


def _mask(n, members):
    return torch.tensor([i in members for i in range(n)])


# ------------------------------------------------------------------------------------------ pure functions
def test_persistent_failures_needs_min_failures_in_a_row():
    streak = torch.tensor([0, 1, 2, 3])
    assert persistent_failures(streak, 2).tolist() == [False, False, True, True]
    assert persistent_failures(streak, 1).tolist() == [False, True, True, True]


@pytest.mark.parametrize(
    "failed, size, share, n_wrong",
    [
        ({1, 3, 5}, 4, 2 / 3, 3),  # round(2.67) = 3: the whole failed pool, one other prompt
        ({1, 3, 5, 7, 8}, 3, 2 / 3, 2),  # 1 : 2 exactly
        ({4}, 4, 2 / 3, 1),  # a pool smaller than its share: all of it, the rest from the others
        ({1, 3, 5}, 4, 0.0, 0),  # share 0: the failed prompts get no reserved place
        ({0, 1, 2, 3, 4, 5, 6}, 4, 1.0, 4),  # all failures
        (set(), 4, 2 / 3, 0),  # nothing failed yet: uniform
    ],
)
def test_mined_chunk_takes_its_share_from_the_failed_pool(failed, size, share, n_wrong):
    n = 10
    for seed in range(20):
        chunk, got = mined_chunk(_mask(n, failed), size, share, torch.Generator().manual_seed(seed))
        assert got == n_wrong and len(chunk) == size == len(set(chunk))
        assert set(chunk[:n_wrong]) <= failed
        assert all(i not in failed for i in chunk[n_wrong:])  # enough other prompts here: the rest is 'right'


def test_mined_chunk_falls_back_to_failed_prompts_when_too_few_others_remain():
    failed = _mask(4, {0, 1, 2})
    chunk, n_wrong = mined_chunk(failed, 4, 0.25, torch.Generator().manual_seed(0))
    assert n_wrong == 1 and sorted(chunk) == [0, 1, 2, 3] and 3 in chunk[1:]


def test_mined_chunk_is_uniform_within_each_pool():
    failed = _mask(8, {0, 1, 2, 3})
    counts = torch.zeros(8)
    for seed in range(2000):
        chunk, _ = mined_chunk(failed, 3, 2 / 3, torch.Generator().manual_seed(seed))  # 2 failed + 1 other
        counts[chunk] += 1
    torch.testing.assert_close(counts[:4] / 2000, torch.full((4,), 0.5), atol=0.05, rtol=0)
    torch.testing.assert_close(counts[4:] / 2000, torch.full((4,), 0.25), atol=0.05, rtol=0)


# ------------------------------------------------------------------------------------------ simulated loops
def _plugin(n, seed=0, delay=2, **options):
    plugin = build_plugins(["fleming_r1"], {"fleming_r1": options}).by_name["fleming_r1"]
    plugin.reset_state(n)
    plugin._seed, plugin._delay = seed, delay
    return plugin


def simulate(plugin, start, stop, bs, G, success_of):
    return simulate_sampler_loop(plugin, start, stop, bs, G, success_of)


def _hard(idx, k):
    """Prompts 0, 1, 2 never solved (one rollout in four at most), the others always."""
    return 0.25 if idx < 3 else 1.0


def test_persistent_failures_fill_two_thirds_of_each_stage2_batch():
    plugin = _plugin(12, min_failures=2)
    drawn = simulate(plugin, 0, 60, bs=3, G=4, success_of=_hard)
    assert plugin.failed_pool().tolist() == [True] * 3 + [False] * 9
    assert (plugin.fail_streak[3:] == 0).all()
    # once all three are known failures (two failed groups each, applied `delay` chunks later), every chunk holds two
    known = max(sorted(c for c, chunk in drawn.items() if i in chunk)[1] for i in range(3)) + plugin._delay + 1
    assert known < 40
    for c in range(known, 61):
        assert sum(i < 3 for i in drawn[c]) == 2, (c, drawn[c])
    # vanilla draws would hold 3/12 of failures on average; here 2/3 of the batch
    late = [i for c in range(known, 61) for i in drawn[c]]
    assert sum(i < 3 for i in late) / len(late) == pytest.approx(2 / 3)


def test_one_failed_group_is_not_persistent_and_a_solved_group_leaves_the_pool():
    plugin = _plugin(6, min_failures=2, delay=1)
    apply = plugin._apply
    apply({"indices": [0, 1], "accuracy": [0.0, 0.25]})
    assert not plugin.failed_pool().any()  # one failure each
    apply({"indices": [0, 1], "accuracy": [0.0, 0.5]})  # 0.5 is not below failed_below = 0.5
    assert plugin.failed_pool().tolist() == [True, False, False, False, False, False]
    apply({"indices": [0], "accuracy": [0.75]})
    assert not plugin.failed_pool().any() and plugin.fail_streak[0] == 0
    assert plugin.draws.tolist() == [3, 2, 0, 0, 0, 0]


def test_stage1_is_uniform_until_mining_start_batch():
    plugin = _plugin(12, mining_start_batch=30, min_failures=1)
    drawn = simulate(plugin, 0, 50, bs=3, G=4, success_of=_hard)
    early = [i for c in range(10, 30) for i in drawn[c]]
    assert sum(i < 3 for i in early) / len(early) < 0.5  # uniform: 1/4 expected
    assert all(sum(i < 3 for i in drawn[c]) == 2 for c in range(30, 50))


def test_share_follows_the_option_on_the_same_history():
    for share, expected in ((1 / 3, 1), (2 / 3, 2), (1.0, 3)):
        plugin = _plugin(12, wrong_share=share, min_failures=1)
        drawn = simulate(plugin, 0, 40, bs=3, G=4, success_of=_hard)
        assert all(sum(i < 3 for i in drawn[c]) == expected for c in range(30, 40)), share


def test_resumed_loop_draws_what_the_unbroken_loop_drew(tmp_path):
    def success(idx, k):
        return (idx % 4) / 4

    unbroken = _plugin(10, seed=3, min_failures=1)
    drawn = simulate(unbroken, 0, 14, bs=3, G=4, success_of=success)
    first = _plugin(10, seed=3, min_failures=1)
    simulate(first, 0, 7, bs=3, G=4, success_of=success)
    resumed = _plugin(10, seed=3, min_failures=1)
    resumed.trl_plugins_load_state_dict(load_plugin_state(save_plugin_state(first.trl_plugins_state_dict(),
                                                                             str(tmp_path))))
    for c in range(7):  # the Trainer skips the consumed batches: the sampler draws (and drops) them again
        resumed.draw_chunk(c, 3)
    again = simulate(resumed, 7, 14, bs=3, G=4, success_of=success)
    assert all(again[c] == drawn[c] for c in range(7, 15))
    assert torch.equal(resumed.fail_streak, unbroken.fail_streak) and torch.equal(resumed.draws, unbroken.draws)


def test_resume_without_the_plugin_state_is_refused_with_the_cause():
    ctx = make_reward_context([0.0] * 4, num_generations=4, step=5)
    with pytest.raises(PluginError, match="fleming_r1: training resumed at step 5 without this plugin's saved state"):
        _plugin(8).trl_plugins_transform_rewards(ctx)


def test_a_batch_that_is_not_the_drawn_chunk_is_refused():
    plugin = _plugin(8)
    plugin.draw_chunk(0, 2)
    with pytest.raises(PluginError, match="has 4 rows but its chunk holds 2 prompts x 4"):
        plugin.trl_plugins_transform_rewards(make_reward_context([0.0] * 4, num_generations=4, step=0))


def test_sampler_keeps_trl_repeat_layout():
    plugin = _plugin(10)
    sampler = HistoryRepeatSampler(plugin.draw_chunk, 10, mini_repeat_count=3, batch_size=2, repeat_count=2)
    trl_sampler = RepeatSampler(list(range(10)), mini_repeat_count=3, batch_size=2, repeat_count=2, seed=0)
    with pytest.warns(UserWarning, match="feedback_delay"):  # no outcome is ever reported here
        seq = list(sampler)
    assert len(seq) == len(sampler) == len(trl_sampler)
    for c in range(5):
        chunk = plugin.ledger.chunks[c]
        assert seq[c * 12:(c + 1) * 12] == ([chunk[0]] * 3 + [chunk[1]] * 3) * 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"wrong_share": 1.5}, "Option 'wrong_share' of plugin 'fleming_r1' got 1.5"),
        ({"wrong_share": -0.1}, "Option 'wrong_share' of plugin 'fleming_r1' got -0.1"),
        ({"min_failures": 0}, "Option 'min_failures' of plugin 'fleming_r1' got 0"),
        ({"failed_below": 0.0}, "Option 'failed_below' of plugin 'fleming_r1' got 0.0"),
        ({"mining_start_batch": -1}, "Option 'mining_start_batch' of plugin 'fleming_r1' got -1"),
        ({"feedback_delay": 0}, "Option 'feedback_delay' of plugin 'fleming_r1' got 0"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["fleming_r1"], {"fleming_r1": options})


# ------------------------------------------------------------------------------------------ trainer runs
def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("fleming_r1", {"wrong_share": 0.0}, loss_types=("grpo", "dapo"), steps=1)


def test_tiny_run_mines_the_prompts_it_keeps_failing(tmp_path):
    def solved_by_level(completions, level, **kwargs):  # level-1 prompts always "solved", level-2 never
        return [1.0 if lv == 1 else 0.0 for lv in level]

    dataset = tiny_dataset(8, levels=(1, 2))
    trainer = make_tiny_trainer(
        plugins=["fleming_r1"], plugin_config={"fleming_r1": {"min_failures": 1, "feedback_delay": 2}},
        reward_funcs=[solved_by_level], dataset=dataset, num_generations=2, max_completion_length=6, max_steps=6,
        log_level="error", output_dir=str(tmp_path),
    )
    run = record_run(trainer)
    plugin = trainer.plugin_stack.by_name["fleming_r1"]
    hard = {i for i in range(8) if dataset[i]["level"] == 2}
    seen = {i for i in range(8) if plugin.draws[i] > 0}
    assert plugin.failed_pool().nonzero().flatten().tolist() == sorted(hard & seen)
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 6 and all("plugins/fleming_r1/mined_fraction" in log for log in logs)
    assert logs[-1]["plugins/fleming_r1/mined_fraction"] > 0


def test_stacking_with_another_sampler_is_refused():
    from trl_plugins import IncompatiblePluginsError

    with pytest.raises(IncompatiblePluginsError, match="'fleming_r1' and 'adaptive_sampler' cannot be stacked"):
        build_plugins(["fleming_r1", "adaptive_sampler"], {})
