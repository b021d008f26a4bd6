"""adaptive_sampler: variance-aware (MMR1), domain-aware (RuleReasoner) and pruning (RAPO) prompt selection.

Pure scores and probabilities; the sampler's layout (TRL's repeat structure, identical on every process); simulated
training loops in which solved prompts get pruned and high-variance prompts are drawn more; a resumed loop that draws
what the unbroken loop drew; tiny-model runs: the neutral setting is vanilla, a seeded run is deterministic and the
state round-trips through a real checkpoint."""

import math
import os

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from trl_plugins.runtime.checkpoints import load_plugin_state, save_plugin_state
from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    simulate_sampler_loop,
    tiny_dataset,
)
from trl_plugins.runtime.trainer import PLUGIN_STATE_FILE
from trl_plugins_builtin.adaptive_sampler import (
    AdaptiveRepeatSampler,
    domain_weights_from_buffer,
    rapo_advantage_scale,
    sampling_probabilities,
    variance_scores,
)


# ------------------------------------------------------------------------------------------ pure functions
def test_variance_scores():
    acc = torch.tensor([math.nan, 0.0, 0.5, 1.0, 0.25], dtype=torch.float64)
    div = torch.tensor([math.nan, 1.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(variance_scores(acc, div, 0.5, 1.0, 0.0),
                               torch.tensor([1.0, 0.0, 1.0, 0.0, 0.75], dtype=torch.float64))
    torch.testing.assert_close(variance_scores(acc, div, 0.5, 1.0, 1.0),
                               torch.tensor([1.0, 0.5, 0.5, 0.0, 0.625], dtype=torch.float64))


def test_domain_weights_follow_the_official_formula():
    target = (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4  # H(4) / 4 with target_base 1 and a buffer of 4
    w = domain_weights_from_buffer([{"a": [1.0, 1.0], "b": [0.0, 0.0]}], ["a", "b", "c"], 1.0, 4, 0.1, 0.3)
    logits = torch.tensor([0.1 / 0.3, (target + 0.1) / 0.3, (target + 0.1) / 0.3], dtype=torch.float64)
    assert list(w) == ["a", "b", "c"]  # c never seen: value = target
    torch.testing.assert_close(torch.tensor(list(w.values()), dtype=torch.float64), torch.softmax(logits, 0))
    # two updates: the older one decays by 1/2; r_a = (1 * 0 + 0.5 * 1) / 2 counts
    w2 = domain_weights_from_buffer([{"a": [1.0]}, {"a": [0.0]}], ["a"], 1.0, 4, 0.1, 0.3)
    assert w2 == {"a": 1.0}
    two = domain_weights_from_buffer([{"a": [1.0], "b": [1.0]}, {"a": [0.0], "b": [1.0]}], ["a", "b"], 1.0, 4, 0.1, 0.3)
    v_a, v_b = max(0.0, target - 0.25), max(0.0, target - 0.75)
    expected = torch.softmax(torch.tensor([(v_a + 0.1) / 0.3, (v_b + 0.1) / 0.3], dtype=torch.float64), 0)
    torch.testing.assert_close(torch.tensor([two["a"], two["b"]], dtype=torch.float64), expected)


def test_sampling_probabilities_pool_variance_and_domains():
    vps = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    pool = torch.tensor([True, True, True, False])
    q0 = sampling_probabilities(vps, pool, 0.0)
    torch.testing.assert_close(q0, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))
    q1 = sampling_probabilities(vps, pool, 1.0)
    torch.testing.assert_close(q1, torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=torch.float64))
    qh = sampling_probabilities(vps, pool, 0.5)
    torch.testing.assert_close(qh, 0.5 * q0 + 0.5 * q1)
    # domains: d0 = {0, 1}, d1 = {2, 3} (3 pruned) with weights 0.25 / 0.75 -> base 0.125, 0.125, 0.75, 0
    qd = sampling_probabilities(vps, pool, 0.0, torch.tensor([0, 0, 1, 1]), torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(qd, torch.tensor([0.125, 0.125, 0.75, 0.0], dtype=torch.float64))
    # no variance anywhere: the weighted part falls back to the base
    torch.testing.assert_close(sampling_probabilities(torch.zeros(4, dtype=torch.float64), pool, 0.7), q0)


# ------------------------------------------------------------------------------------------ sampler and loops
def _plugin(n, seed=0, delay=2, **options):
    plugin = build_plugins(["adaptive_sampler"], {"adaptive_sampler": options}).by_name["adaptive_sampler"]
    plugin.reset_state(n, [])
    plugin._seed, plugin._delay = seed, delay
    return plugin


@pytest.mark.filterwarnings("ignore:adaptive_sampler")  # no outcome is ever reported here
def test_sampler_keeps_trl_repeat_layout_and_is_identical_on_every_process():
    trl_sampler = RepeatSampler(list(range(10)), mini_repeat_count=3, batch_size=2, repeat_count=2, seed=0)
    a, b = _plugin(10), _plugin(10)  # two processes with the same state and seed
    sa = AdaptiveRepeatSampler(a, 10, mini_repeat_count=3, batch_size=2, repeat_count=2)
    sb = AdaptiveRepeatSampler(b, 10, mini_repeat_count=3, batch_size=2, repeat_count=2)
    seq = list(sa)
    assert len(seq) == len(sa) == len(trl_sampler) == 5 * 2 * 3 * 2
    assert seq == list(sb)
    for c in range(5):
        block = seq[c * 12:(c + 1) * 12]
        chunk = a.chunks[c]
        assert len(set(chunk)) == 2
        assert block == [chunk[0]] * 3 + [chunk[1]] * 3 + [chunk[0]] * 3 + [chunk[1]] * 3
    sa.set_epoch(1)
    assert list(sa)[:6] == [a.chunks[5][0]] * 3 + [a.chunks[5][1]] * 3  # epoch 1 starts at chunk 5


def simulate(plugin, start, stop, bs, G, success_of):
    return simulate_sampler_loop(plugin, start, stop, bs, G, success_of)


def _success(idx, k):
    """Prompts 0, 1 always solved; 2, 3 half solved; 4, 5 never solved."""
    return 1.0 if idx < 2 else (0.5 if idx < 4 else 0.0)


def test_solved_prompts_are_pruned_and_high_variance_prompts_drawn_more():
    plugin = _plugin(6, variance_mix=0.5, prune_after=1)
    drawn = simulate(plugin, 0, 80, bs=2, G=4, success_of=_success)
    assert plugin.pruned.tolist() == [True, True, False, False, False, False]
    # once an outcome is applied (chunk c + delay), a solved prompt is never drawn again
    for idx in (0, 1):
        first = min(c for c, chunk in drawn.items() if idx in chunk)
        assert not any(idx in drawn[c] for c in drawn if c > first + plugin._delay)
    late = [i for c, chunk in drawn.items() if c >= 10 for i in chunk]
    variance_draws = late.count(2) + late.count(3)
    zero_draws = late.count(4) + late.count(5)
    assert variance_draws > 2 * zero_draws > 0  # q = 0.375 vs 0.125 each once everything has been seen
    assert plugin.accuracy[2:].tolist() == [0.5, 0.5, 0.0, 0.0]
    torch.testing.assert_close(plugin.probabilities(),
                               torch.tensor([0.0, 0.0, 0.375, 0.375, 0.125, 0.125], dtype=torch.float64))


def test_exhausted_pool_falls_back_to_all_prompts():
    plugin = _plugin(3, prune_after=1, variance_mix=0.0)
    simulate(plugin, 0, 40, bs=2, G=2, success_of=lambda idx, k: 1.0)
    assert plugin.pruned.all()
    assert len(set(plugin.draw_chunk(41, 2))) == 2


def test_domain_weights_update_every_interval():
    plugin = build_plugins(["adaptive_sampler"], {"adaptive_sampler": {
        "domain_column": "d", "domain_update_interval": 2, "variance_mix": 0.0, "prune_solved": False}}
    ).by_name["adaptive_sampler"]
    plugin.reset_state(4, ["easy", "hard"], [0, 0, 1, 1])
    plugin._delay = 2
    assert plugin.domain_weights == {"easy": 0.5, "hard": 0.5}  # official "average" initialisation
    simulate(plugin, 0, 6, bs=2, G=2, success_of=lambda idx, k: 1.0 if idx < 2 else 0.0)
    assert len(plugin.domain_buffer) == 2  # outcomes of batches 1 and 3 (every second one); 5 is not applied yet
    assert plugin.pending.keys() == {5}
    assert plugin.domain_weights == domain_weights_from_buffer(plugin.domain_buffer, ["easy", "hard"], 1.0, 4, 0.1, 0.3)
    assert plugin.domain_weights["hard"] > plugin.domain_weights["easy"]


def test_resumed_loop_draws_what_the_unbroken_loop_drew(tmp_path):
    unbroken = _plugin(8, seed=3, variance_mix=0.7)
    drawn = simulate(unbroken, 0, 12, bs=2, G=4, success_of=lambda idx, k: (idx % 4) / 4)

    first = _plugin(8, seed=3, variance_mix=0.7)
    simulate(first, 0, 6, bs=2, G=4, success_of=lambda idx, k: (idx % 4) / 4)
    state = first.trl_plugins_state_dict()  # what a checkpoint after 6 batches holds
    resumed = _plugin(8, seed=3, variance_mix=0.7)
    resumed.trl_plugins_load_state_dict(load_plugin_state(save_plugin_state(state, str(tmp_path))))
    for c in range(6):  # the Trainer skips the consumed batches: the sampler draws (and drops) them again
        resumed.draw_chunk(c, 2)
    again = simulate(resumed, 6, 12, bs=2, G=4, success_of=lambda idx, k: (idx % 4) / 4)
    assert all(again[c] == drawn[c] for c in range(6, 13))
    for key in ("accuracy", "draws", "streak", "pruned"):
        torch.testing.assert_close(getattr(resumed, key), getattr(unbroken, key), equal_nan=True)


def test_lagging_feedback_warns():
    plugin = _plugin(4, delay=1)
    plugin.draw_chunk(0, 2)
    with pytest.warns(UserWarning, match="feedback_delay"):
        plugin.draw_chunk(1, 2)  # the outcome of chunk 0 is not in yet


def test_option_validation():
    with pytest.raises(PluginConfigError, match="variance_mix"):
        build_plugins(["adaptive_sampler"], {"adaptive_sampler": {"variance_mix": 1.5}})
    with pytest.raises(PluginConfigError, match="prune_after"):
        build_plugins(["adaptive_sampler"], {"adaptive_sampler": {"prune_after": 0}})
    with pytest.raises(PluginConfigError, match="advantage_scaling"):
        build_plugins(["adaptive_sampler"], {"adaptive_sampler": {"advantage_scaling": "yes"}})


def test_rapo_advantage_scale_is_inverse_good_group_frequency():
    # 4 groups of G=2: [1,0] good, [1,1] solved, [0,0] failed, [0.3, NaN] one reward only -> 1 good of 4 -> x4
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.3, float("nan")])
    scale, n_good, n_groups = rapo_advantage_scale(rewards, 2)
    assert (n_good, n_groups) == (1, 4)
    assert torch.equal(scale, torch.tensor([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    scale, n_good, _ = rapo_advantage_scale(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)  # no good group: unchanged
    assert n_good == 0 and torch.equal(scale, torch.ones(4))
    scale, _, _ = rapo_advantage_scale(torch.tensor([1.0, 0.0, 0.5, 0.2]), 2)  # every group good: factor 1
    assert torch.equal(scale, torch.ones(4))


def _advantages_after(options, rewards, **ctx_kwargs):
    plugin = build_plugins(["adaptive_sampler"], {"adaptive_sampler": options}).by_name["adaptive_sampler"]
    ctx = make_advantage_context(rewards, num_generations=2, **ctx_kwargs)
    plugin.trl_plugins_transform_advantages(ctx)
    return ctx


def test_advantage_scaling_hook_scales_good_groups_and_is_off_by_default():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # groups: good, solved, failed, good -> factor 4/2
    base = make_advantage_context(rewards, num_generations=2).advantages.clone()
    assert base.abs().sum() > 0
    ctx = _advantages_after({"advantage_scaling": True}, rewards)
    assert torch.allclose(ctx.advantages, base * 2.0)
    metrics = {k.rsplit("/", 1)[-1]: v for k, v in ctx.metrics.items()}
    assert metrics["good_group_fraction"] == [0.5]
    assert metrics["advantage_scale"] == [2.0]
    per_token = base.unsqueeze(-1).repeat(1, 3)  # (N, T) advantages from an earlier plugin scale per row
    ctx = _advantages_after({"advantage_scaling": True}, rewards, advantages=per_token)
    assert torch.allclose(ctx.advantages, per_token * 2.0)
    assert torch.equal(_advantages_after({}, rewards).advantages, base)  # default: TRL's advantages untouched
    ctx = _advantages_after({"advantage_scaling": True}, rewards, mode="eval")
    assert torch.equal(ctx.advantages, base)  # eval batches untouched


# ------------------------------------------------------------------------------------------ trainer runs
def test_neutral_setting_keeps_trls_sampler_and_is_vanilla(tmp_path):
    neutral = {"variance_mix": 0.0, "prune_solved": False, "advantage_scaling": False}
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=1, log_level="error")
    trainer = make_tiny_trainer(plugins=["adaptive_sampler"], plugin_config={"adaptive_sampler": neutral},
                                output_dir=str(tmp_path / "a"), **common)
    with_plugin = record_run(trainer)
    vanilla = record_run(make_tiny_trainer(trainer_cls=GRPOTrainer, output_dir=str(tmp_path / "b"), **common))
    assert_runs_equal(with_plugin, vanilla)
    assert type(trainer._get_train_sampler()) is RepeatSampler


def _seeded_run(path, save):
    def solved_by_level(completions, level, **kwargs):  # level-1 prompts always "solved", level-2 never
        return [1.0 if lv == 1 else 0.0 for lv in level]

    trainer = make_tiny_trainer(
        plugins=["adaptive_sampler"], plugin_config={"adaptive_sampler": {"domain_column": "level",
                                                                          "domain_update_interval": 1}},
        reward_funcs=[solved_by_level], dataset=tiny_dataset(8, levels=(1, 2)), num_generations=2,
        max_completion_length=6, max_steps=3, log_level="error", output_dir=str(path),
        **({"save_strategy": "steps", "save_steps": 3} if save else {}),
    )
    return trainer, record_run(trainer)


def test_seeded_run_is_deterministic_and_state_round_trips_through_a_checkpoint(tmp_path):
    trainer, run = _seeded_run(tmp_path / "a", save=True)
    trainer2, run2 = _seeded_run(tmp_path / "b", save=False)
    plugin, plugin2 = (t.plugin_stack.by_name["adaptive_sampler"] for t in (trainer, trainer2))
    assert plugin.chunks == plugin2.chunks and len(plugin.chunks) >= 3
    for a, b in zip(run.completion_ids, run2.completion_ids):
        assert torch.equal(a, b)
    # outcomes were learned from the gathered rewards: level-1 prompts (even indices) are solved and pruned
    dataset = trainer.train_dataset
    for idx in range(8):
        if plugin.draws[idx] > 0:
            assert plugin.accuracy[idx] == (1.0 if dataset[idx]["level"] == 1 else 0.0)
            assert bool(plugin.pruned[idx]) == (dataset[idx]["level"] == 1)
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 3 and all("plugins/adaptive_sampler/pruned_fraction" in log for log in logs)
    # the checkpoint holds the plugin's state, and loading it restores the same future draws
    state = torch.load(os.path.join(str(tmp_path / "a"), "checkpoint-3", PLUGIN_STATE_FILE), weights_only=True)
    fresh = build_plugins(["adaptive_sampler"], {"adaptive_sampler": {"domain_column": "level"}}).by_name[
        "adaptive_sampler"]
    fresh.trl_plugins_load_state_dict(state["adaptive_sampler"])
    fresh._seed, fresh._delay = plugin._seed, plugin._delay
    for key in ("accuracy", "draws", "streak", "pruned", "domain_of"):
        torch.testing.assert_close(getattr(fresh, key), getattr(plugin, key), equal_nan=True)
    assert fresh.domain_weights == plugin.domain_weights and fresh.pending.keys() == plugin.pending.keys()
    assert [fresh.draw_chunk(c, 2) for c in (3, 4)] == [plugin.draw_chunk(c, 2) for c in (3, 4)]


def test_resume_without_the_plugin_state_is_refused_with_the_cause():
    """A run resumed at step > 0 whose checkpoint brought no adaptive_sampler state stops at its first outcome
    with the real cause (not 'the batch does not hold the prompts its sampler drew'); restored state passes."""
    ctx = make_reward_context([0.0] * 4, num_generations=4, step=5)
    plugin = _plugin(8)
    with pytest.raises(PluginError, match="resumed at step 5 without this plugin's saved state"):
        plugin.trl_plugins_transform_rewards(ctx)
    restored = _plugin(8)
    restored.trl_plugins_load_state_dict(plugin.trl_plugins_state_dict())
    assert restored.trl_plugins_transform_rewards(ctx) is None  # no chunk 0 drawn yet: nothing to record
    ctx = make_reward_context([0.0] * 4, num_generations=4, step=0)  # a fresh run starts at step 0 without state
    assert _plugin(8).trl_plugins_transform_rewards(ctx) is None


# ============================================================================================ RAPO replay buffers
def test_replay_buffers_need_tool_rollouts():
    from trl_plugins.testing import make_tiny_trainer

    with pytest.raises(PluginConfigError, match=r"replay_buffer.*allowed without tools.*false"):
        make_tiny_trainer(plugins=["adaptive_sampler"], plugin_config={"adaptive_sampler": {"replay_buffer": True}})


def test_replay_buffers_are_off_by_default_so_no_sampling_stage_runs():
    (plugin,) = list(build_plugins(["adaptive_sampler"]))
    assert not plugin.hook_enabled("trl_plugins_after_generation")
    assert plugin.trl_plugins_state_dict()["replay"] == {}


@pytest.mark.slow
def test_rapo_replay_buffer_refills_an_all_fail_tool_group_with_the_latest_success(tmp_path):
    """One prompt, G=4, two steps on the bundled tool environment: step 0 succeeds everywhere (the latest success,
    row 3, is stored with its behaviour log-probs), step 1 fails everywhere and gets it in slot 0."""
    from trl_plugins.api.contexts import BEHAVIOUR_LOGPS_KEY
    from trl_plugins.tasks.tools import make_tool_dataset
    from trl_plugins.testing import gold_then_wrong_script, make_tool_trainer, record_run

    script, bind = gold_then_wrong_script(make_tool_dataset(1), from_step=1)
    tr = make_tool_trainer(n=1, plugins=["adaptive_sampler"], max_steps=2, script=script, loss_type="dr_grpo",
                           output_dir=str(tmp_path), plugin_config={"adaptive_sampler": {
                               "replay_buffer": True, "prune_solved": False, "variance_mix": 0.0}})
    bind(tr)
    seen = []
    loss = tr.compute_grpo_loss
    tr.compute_grpo_loss = lambda model, inputs: (seen.append(inputs.get(BEHAVIOUR_LOGPS_KEY)), loss(model, inputs))[1]
    run = record_run(tr)
    (plugin,) = list(tr.plugin_stack)
    ((entry,),) = plugin.replay.values()
    stored = entry["episode"]
    L = len(stored["completion_ids"])
    assert run.completion_ids[0][3, :L].tolist() == stored["completion_ids"] and entry["step"] == 0
    assert run.completion_ids[1][0, :L].tolist() == stored["completion_ids"]
    assert run.rewards[1][:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (run.advantages[1][0] > 0) and (run.advantages[1][1:] < 0).all()  # the group's variance is back
    behaviour = [b for b in seen if b is not None]
    assert behaviour and torch.isfinite(behaviour[0]).any(dim=1).sum() == 1
    logged = [h["plugins/adaptive_sampler/replayed_group_fraction"] for h in tr.state.log_history
              if "plugins/adaptive_sampler/replayed_group_fraction" in h]
    assert logged == [0.0, 1.0]
