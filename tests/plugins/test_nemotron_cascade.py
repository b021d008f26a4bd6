"""nemotron_cascade: the stage schedule, the per-domain draws and the zeroed reward columns on small inputs, the
stage switch of the sampler at the step boundary, bad schedules refused at construction, and tiny-model runs (no
stages is vanilla; a two-stage run trains on level-1 prompts with one reward, then on level-2 prompts with both)."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin.nemotron_cascade import domain_chunk, masked_rewards, stage_of_step


def test_stage_of_step():
    assert [stage_of_step(s, [2, 3]) for s in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]
    assert [stage_of_step(s, []) for s in range(3)] == [0, 0, 0]


def test_domain_chunk_draws_only_the_domain_without_replacement_while_it_lasts():
    rows = torch.tensor([3, 5, 8, 13])
    for seed in range(10):
        chunk = domain_chunk(rows, 3, torch.Generator().manual_seed(seed))
        assert len(set(chunk)) == 3 and set(chunk) <= {3, 5, 8, 13}
    long = domain_chunk(rows, 10, torch.Generator().manual_seed(0))
    assert len(long) == 10 and set(long) == {3, 5, 8, 13}
    assert sorted(long[:4]) == [3, 5, 8, 13] and sorted(long[4:8]) == [3, 5, 8, 13]  # whole permutations first


def test_masked_rewards_zero_the_other_columns():
    rewards = torch.tensor([[1.0, 0.5, 2.0], [0.0, 0.25, 3.0]])
    names = ["acc", "fmt", "len"]
    torch.testing.assert_close(masked_rewards(rewards, names, ["acc", "len"]),
                               torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]]))
    assert masked_rewards(rewards, names, []) is rewards


def _plugin(**options):
    plugin = build_plugins(["nemotron_cascade"], {"nemotron_cascade": options}).by_name["nemotron_cascade"]
    plugin._rows = [torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])]
    return plugin


@pytest.mark.parametrize("steps_per_chunk, switch", [(1.0, 3), (2.0, 2), (0.5, 6)])
def test_sampler_switches_domain_at_the_step_boundary(steps_per_chunk, switch):
    plugin = _plugin(stages=["a", "b"], stage_steps=[3])
    plugin._steps_per_chunk = steps_per_chunk
    for chunk in range(10):
        drawn = plugin.draw_chunk(chunk, 2)
        assert all(i % 2 == (0 if chunk < switch else 1) for i in drawn), (chunk, drawn)
        assert drawn == plugin.draw_chunk(chunk, 2)  # a function of (seed, chunk): identical on every process


def test_reward_transform_masks_the_columns_of_the_stage():
    plugin = _plugin(stages=["a", "b"], stage_steps=[1], stage_rewards=[["acc"], []])
    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5]])
    ctx = make_reward_context(rewards.clone(), num_generations=2, reward_func_names=["acc", "fmt"], step=0)
    plugin.trl_plugins_transform_rewards(ctx)
    torch.testing.assert_close(ctx.rewards_per_func, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    ctx = make_reward_context(rewards.clone(), num_generations=2, reward_func_names=["acc", "fmt"], step=1)
    plugin.trl_plugins_transform_rewards(ctx)
    torch.testing.assert_close(ctx.rewards_per_func, rewards)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stages": ["a", "b"], "stage_steps": []}, "Option 'stage_steps' of plugin 'nemotron_cascade' got \\[\\]"),
        ({"stages": ["a", "b"], "stage_steps": [0]}, "allowed: positive counts"),
        ({"stages": ["a", "a"], "stage_steps": [1]}, "allowed: distinct domain names"),
        ({"stages": ["a", "b"], "stage_steps": [1], "stage_rewards": [["x"]]}, "Option 'stage_rewards'"),
        ({"stages": ["a"], "stage_max_lengths": [-1]}, "Option 'stage_max_lengths'"),
        ({"stages": "math"}, "Option 'stages' of plugin 'nemotron_cascade' got 'math'"),
    ],
)
def test_bad_schedules_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["nemotron_cascade"], {"nemotron_cascade": options})


def test_stacking_with_another_sampler_is_refused():
    with pytest.raises(IncompatiblePluginsError, match="'nemotron_cascade' and 'adaptive_sampler' cannot be stacked"):
        build_plugins(["nemotron_cascade", "adaptive_sampler"], {})


# ------------------------------------------------------------------------------------------ trainer runs
def test_no_stages_is_vanilla():
    assert_reduces_to_vanilla("nemotron_cascade", None, loss_types=("grpo", "dapo"), steps=1)


def test_unknown_domain_or_reward_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(PluginConfigError, match="no training row has level='3'"):
        make_tiny_trainer(plugins=["nemotron_cascade"], dataset=tiny_dataset(8, levels=(1, 2)),
                          plugin_config={"nemotron_cascade": {"stages": ["1", "3"], "stage_steps": [1],
                                                              "domain_column": "level"}},
                          output_dir=str(tmp_path / "a"))
    with pytest.raises(PluginConfigError, match="stage_rewards names \\['judge'\\]"):
        make_tiny_trainer(plugins=["nemotron_cascade"], dataset=tiny_dataset(8, levels=(1, 2)),
                          plugin_config={"nemotron_cascade": {"stages": ["1", "2"], "stage_steps": [1],
                                                              "domain_column": "level",
                                                              "stage_rewards": [["judge"], []]}},
                          output_dir=str(tmp_path / "b"))


def test_a_two_stage_run_follows_the_cascade(tmp_path):
    dataset = tiny_dataset(8, levels=(1, 2))
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    options = {"stages": ["1", "2"], "stage_steps": [2], "domain_column": "level",
               "stage_rewards": [["digit_fraction_reward"], []], "stage_max_lengths": [3, 0]}
    trainer = make_tiny_trainer(plugins=["nemotron_cascade"], plugin_config={"nemotron_cascade": options},
                                reward_funcs=[always_one, digit_fraction_reward], dataset=dataset,
                                num_generations=2, max_completion_length=6, max_steps=4, log_level="error",
                                output_dir=str(tmp_path))
    seen_levels = []
    original = trainer.plugin_stack.by_name["nemotron_cascade"].draw_chunk

    def draw(chunk, size):
        drawn = original(chunk, size)
        seen_levels.append((chunk, {dataset[i]["level"] for i in drawn}))
        return drawn

    trainer.plugin_stack.by_name["nemotron_cascade"].draw_chunk = draw
    run = record_run(trainer)
    assert [levels for chunk, levels in seen_levels if chunk < 2] == [{1}, {1}]
    assert all(levels == {2} for chunk, levels in seen_levels if chunk >= 2)
    logs = [log for log in run.logs if "loss" in log]
    assert [log["plugins/nemotron_cascade/stage"] for log in logs] == [0.0, 0.0, 1.0, 1.0]
    assert all(log["plugins/nemotron_cascade/stage_domain_fraction"] == 1.0 for log in logs)
    # stage 0 trains on the partial-credit column only: the other column is zeroed before TRL reads it
    assert [log["rewards/always_one/mean"] for log in logs] == [0.0, 0.0, 1.0, 1.0]
    # stage 0 generates at most 3 tokens, stage 1 up to max_completion_length again
    assert all(ids.shape[1] <= 3 for ids in run.completion_ids[:2])
    assert trainer.generation_config.max_new_tokens == 6
