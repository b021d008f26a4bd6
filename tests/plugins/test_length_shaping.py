"""The deprecated spellings (one release): ``length_shaping`` with ``mode: X`` and ``hint_scaffold`` with
``schedule: seele`` build the plugin the mode became, with the options renamed, under the old name; they warn
(DeprecationWarning and the log) naming the new plugin and the option mapping, and train exactly as the new plugin
does (same completions, rewards, advantages, losses, gradients and parameters; the same metrics under the old name)."""

import logging

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import assert_runs_equal, make_tiny_trainer, record_run

#: old spelling -> (new plugin, its options): every mode, with options that make it act.
SPELLINGS = {
    "laser": ({"mode": "laser", "target_length": 6, "alpha": 0.3}, "laser", {"variant": "laser", "target_length": 6,
                                                                             "alpha": 0.3}),
    "laser_d": ({"correct_threshold": 0.2, "window": 2}, "laser", {"correct_threshold": 0.2, "window": 2}),
    "laser_de": ({"mode": "laser_de", "explore_gate": "none"}, "laser", {"variant": "laser_de",
                                                                         "explore_gate": "none"}),
    "dler": ({"mode": "dler", "cap": 10}, "dler", {"cap": 10}),
    "dler_difficulty": ({"mode": "dler_difficulty", "shrink": 0.9, "correct_threshold": 0.2}, "dler",
                        {"difficulty_aware": True, "shrink": 0.9, "correct_threshold": 0.2}),
    "decs": ({"mode": "decs", "decs_beta": 0.5, "decs_curriculum": False}, "decs", {"beta": 0.5, "curriculum": False}),
    "pear": ({"mode": "pear", "pear_alpha": 0.5, "pear_only_correct": False}, "pear",
             {"alpha": 0.5, "only_correct": False}),
    "siri": ({"mode": "siri", "siri_period": 2, "siri_min_cap": 5}, "siri", {"period": 2, "min_cap": 5}),
    "hbpo": ({"mode": "hbpo", "hbpo_budgets": [4, 12], "hbpo_intra_weight": 1.0}, "hbpo",
             {"budgets": [4, 12], "intra_weight": 1.0}),
}


@pytest.mark.parametrize("mode", list(SPELLINGS))
def test_every_mode_builds_its_plugin_with_renamed_options_and_warns(mode, caplog):
    old, new, options = SPELLINGS[mode]
    with pytest.warns(DeprecationWarning, match=rf"'length_shaping' with mode='{mode}' is deprecated.*plugin '{new}'"):
        with caplog.at_level(logging.WARNING, logger="trl_plugins.runtime.manager"):
            plugin = build_plugins(["length_shaping"], {"length_shaping": old}).plugins[0]
    assert any(f"plugin '{new}'" in r.getMessage() for r in caplog.records)  # the log says it too
    expected = build_plugins([new], {new: options}).plugins[0]
    assert type(plugin) is type(expected) and plugin.options == expected.options
    assert plugin.name == "length_shaping"  # metrics, reward column and checkpoint state keep their keys


def test_the_warning_names_the_option_mapping_and_the_ignored_options():
    with pytest.warns(DeprecationWarning) as record:
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "decs", "decs_beta": 0.2, "alpha": 0.3}})
    message = str(record[0].message)
    assert 'plugin_config: {"decs": {"beta": 0.2}}' in message
    assert "decs_beta -> beta" in message and "decs_kappa_lr -> kappa_lr" in message
    assert "Ignored (no effect with mode='decs'): alpha" in message
    with pytest.warns(DeprecationWarning, match=r"'hint_scaffold' with schedule='seele'.*plugin 'seele'.*"
                                                r"seele_rounds -> rounds"):
        build_plugins(["hint_scaffold"], {"hint_scaffold": {"schedule": "seele", "seele_rounds": 2}})


def test_bad_old_spellings_are_refused():
    with pytest.raises(PluginConfigError, match="Option 'mode' of plugin 'length_shaping' got 'laser-d'.*'laser_d'"):
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "laser-d"}})
    with pytest.raises(PluginConfigError, match="Unknown option 'decs_bta' for plugin 'length_shaping'.*'decs_beta'"):
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "decs", "decs_bta": 0.2}})
    with pytest.warns(DeprecationWarning):  # a bad value is refused by the new plugin, the message says where it came
        with pytest.raises(PluginConfigError, match="'beta' of plugin 'decs' got -1.0.*decs_beta -> beta"):
            build_plugins(["length_shaping"], {"length_shaping": {"mode": "decs", "decs_beta": -1.0}})
    with pytest.raises(IncompatiblePluginsError, match="same plugin twice; enable only 'laser'"):
        build_plugins(["length_shaping", "laser"])
    with pytest.warns(DeprecationWarning):
        with pytest.raises(IncompatiblePluginsError, match="'length_shaping' and 'dars'.*budget sentences"):
            build_plugins(["length_shaping", "dars"], {"length_shaping": {"mode": "hbpo", "hbpo_budgets": [4, 12]}})


RUN = dict(max_steps=2, num_generations=4, per_device_train_batch_size=8, max_completion_length=16)


def _same_run(old_name, old, new, options, tmp_path, **run):
    with pytest.warns(DeprecationWarning):
        legacy = record_run(make_tiny_trainer(plugins=[old_name], plugin_config={old_name: old},
                                              output_dir=str(tmp_path / "old"), **run))
    current = record_run(make_tiny_trainer(plugins=[new], plugin_config={new: options},
                                           output_dir=str(tmp_path / "new"), **run))
    assert_runs_equal(legacy, current)
    for a, b in zip(legacy.logs, current.logs):  # the same metrics, under the old name
        renamed = {k.replace(f"/{old_name}/", f"/{new}/"): v for k, v in a.items()}
        assert {k: v for k, v in renamed.items() if f"/{new}/" in k} == {k: v for k, v in b.items() if f"/{new}/" in k}
    return legacy


@pytest.mark.parametrize("mode", ["laser_de", "dler_difficulty", "decs", "pear", "siri", "hbpo"])
def test_old_spelling_trains_exactly_as_the_new_plugin(mode, tmp_path):
    from trl_plugins.tasks.arithmetic import accuracy_reward
    from trl_plugins.testing import digit_fraction_reward

    old, new, options = SPELLINGS[mode]
    funcs = [accuracy_reward] if mode == "decs" else [digit_fraction_reward]
    run = _same_run("length_shaping", old, new, options, tmp_path, reward_funcs=funcs, **RUN)
    assert any("plugins/length_shaping/" in k for log in run.logs for k in log)


def test_hint_scaffold_schedule_seele_trains_exactly_as_seele(tmp_path):
    old = {"schedule": "seele", "seele_rounds": 2, "seele_imitation_coef": 0.01}
    run = _same_run("hint_scaffold", old, "seele", {"rounds": 2, "imitation_coef": 0.01}, tmp_path, max_steps=1,
                    max_completion_length=16)
    assert any("plugins/hint_scaffold/hint_token_fraction" in log for log in run.logs)


def test_checkpoint_state_of_hint_scaffold_seele_still_loads():
    with pytest.warns(DeprecationWarning):
        plugin = build_plugins(["hint_scaffold"], {"hint_scaffold": {"schedule": "seele"}}).plugins[0]
    plugin.trl_plugins_load_state_dict(state={"seele_rates": {"q": 0.25}, "teacher_tiers": {}})
    assert plugin.rates == {"q": 0.25} and torch.tensor(plugin.trl_plugins_state_dict()["rates"]["q"]) == 0.25
