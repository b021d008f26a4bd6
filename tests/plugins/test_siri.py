"""siri (SIRI): the cosine and stair schedules by hand; the length-capping reward zeroes rows longer than
the current cap or cut off at it (NaN stays NaN); the cap is set on the trainer's generation at the start, on resume
and after every optimizer step; on the tiny model the second generation batch is generated under the compressed cap."""

from types import SimpleNamespace

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import make_reward_context, make_tiny_trainer, record_run
from trl_plugins_builtin.siri import siri_cap

EOS = 99


def test_cosine_and_stair_schedules():
    assert [siri_cap(s, 4, 12, 8, "cosine") for s in (0, 2, 4, 6, 8)] == [12, 8, 4, 8, 12]
    assert [siri_cap(s, 4, 12, 4, "stair") for s in (0, 1, 2, 3, 4)] == [4, 4, 12, 12, 4]


def _plugin(**options):
    plugin = build_plugins(["siri"], {"siri": options}).plugins[0]
    plugin.max_len, plugin.eos_ids = 12, {EOS}
    return plugin


def test_length_capping_reward_uses_the_cap_of_the_step():
    plugin = _plugin(min_cap=4, period=8)  # cap 4 at step 4
    ids = [[7, 7, EOS], [7] * 4, [7] * 5 + [EOS], [7, 7, 7, EOS]]
    ctx = make_reward_context([[1.0, 0.5], [1.0, float("nan")], [1.0, 0.5], [0.0, 0.5]], num_generations=2,
                              completions=["c"] * 4, local_completion_ids=ids, step=4)
    ctx.set_active_plugin("siri")
    plugin.trl_plugins_transform_rewards(ctx)
    out = ctx.rewards_per_func
    assert out[0].tolist() == [1.0, 0.5]  # short and finished
    assert out[1, 0] == 0 and torch.isnan(out[1, 1])  # cut off at the cap without EOS
    assert out[2].tolist() == [0.0, 0.0]  # longer than the cap
    assert out[3].tolist() == [0.0, 0.5]  # exactly at the cap, finished: kept
    assert ctx.metrics["plugins/siri/cap"] == [4.0]
    ctx = make_reward_context([[1.0, 0.5], [1.0, 0.5]], num_generations=2, completions=["c"] * 2,
                              local_completion_ids=[[7] * 5 + [EOS], [7, EOS]], step=0)  # cap 12 at step 0
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func.tolist() == [[1.0, 0.5], [1.0, 0.5]]


def test_cap_is_set_on_the_generation_at_start_and_after_each_step():
    plugin = _plugin(min_cap=4, period=8, schedule="stair")
    caps = []
    # the stub trainer's global_step stands for PluginGRPOTrainer.global_step (5 steps done when the run resumes)
    trainer = SimpleNamespace(global_step=5, set_generation_length_cap=caps.append)
    assert plugin.trl_plugins_train_sampler(trainer=trainer, sampler=None, dataset=None) is None
    plugin.trl_plugins_on_step_end(trainer=trainer, step=6)
    assert caps == [12, 12]
    plugin.trl_plugins_on_step_end(trainer=trainer, step=8)
    assert caps[-1] == 4


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="'schedule' of plugin 'siri' got 'sine'"):
        build_plugins(["siri"], {"siri": {"schedule": "sine"}})
    with pytest.raises(PluginConfigError, match="'period' of plugin 'siri' got 0"):
        build_plugins(["siri"], {"siri": {"period": 0}})
    with pytest.raises(PluginConfigError, match="'min_cap' of plugin 'siri' got 0"):
        build_plugins(["siri"], {"siri": {"min_cap": 0}})


def test_end_to_end_second_batch_is_generated_under_the_compressed_cap(tmp_path):
    from trl_plugins.tasks.arithmetic import accuracy_reward

    trainer = make_tiny_trainer(reward_funcs=[accuracy_reward], max_steps=2, output_dir=str(tmp_path / "s"),
                                max_completion_length=12, plugins=["siri"],
                                plugin_config={"siri": {"period": 2, "min_cap": 3}})
    run = record_run(trainer)
    assert trainer.generation_config.max_new_tokens == 12  # back to the expansion cap after step 2
    assert run.completion_ids[-1].size(1) <= 3  # step 1 (half a period): compression cap 3
    logs = [log for log in run.logs if "loss" in log]
    assert [log["plugins/siri/cap"] for log in logs] == [12.0, 3.0]
