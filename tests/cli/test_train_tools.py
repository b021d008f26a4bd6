"""``trl-plugins train`` with TRL's tools and environment_factory (YAML dotted paths), refused clearly when wrong."""

import pytest
import yaml

from trl_plugins.cli import main

BASE = {"model_name_or_path": "builtin:tiny", "report_to": "none", "use_cpu": True, "max_steps": 1,
        "dataset_name": "builtin:tools", "reward_funcs": ["tool_answer"]}


def undocumented_tool(query: str) -> str:
    return query


class NoReset:
    def search(self, query: str) -> str:
        """Search.

        Args:
            query: words.
        """
        return query


class NoTools:
    def reset(self, **row) -> None:
        return None

    def _helper(self) -> str:
        return ""


def _train(tmp_path, capsys, monkeypatch, **config):
    import trl_plugins.cli.train as train_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded: the config was not refused first")

    monkeypatch.setattr(train_module, "load_model", never)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "out"), **config}))
    return main(["train", str(path)]), capsys.readouterr().err


@pytest.mark.parametrize(
    "config,fragments",
    [
        ({"tools": ["search"]}, ["Tool 'search' must be a dotted import path"]),
        ({"tools": ["trl_plugins.tasks.tools.serch"]}, ["module 'trl_plugins.tasks.tools' has no 'serch'",
                                                        "Did you mean 'search'"]),
        ({"tools": ["no_such_pkg.tools.search"]}, ["Could not import Tool 'no_such_pkg.tools.search'"]),
        ({"tools": ["tests.cli.test_train_tools.undocumented_tool"]}, ["cannot be described to the model"]),
        ({"tools": ["trl_plugins.tasks.tools.KINDS"]}, ["is a dict, not a function"]),
        ({"environment_factory": "tests.cli.test_train_tools.NoReset"}, ["class NoReset has no reset() method"]),
        ({"environment_factory": "trl_plugins.tasks.tools.Nope"}, ["has no 'Nope'"]),
        ({"environment_factory": "tests.cli.test_train_tools.NoTools"}, ["class NoTools has no tool method",
                                                                      "every rollout would be single-turn"]),
        ({"tool_failure": "ignore"}, ["tool_failure must be one of ['raise', 'feedback']"]),
    ],
)
def test_bad_tool_settings_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, config, fragments):
    status, err = _train(tmp_path, capsys, monkeypatch, **config)
    assert status == 2
    for fragment in fragments:
        assert fragment in err


@pytest.mark.slow
@pytest.mark.parametrize("agent", [{"environment_factory": "trl_plugins.tasks.tools.ToolEnvironment"},
                                   {"tools": ["trl_plugins.tasks.tools.search", "trl_plugins.tasks.tools.calculator"]}])
def test_train_runs_the_bundled_tool_environment(tmp_path, agent):
    from trl_plugins.cli.train import main as train_main

    config = {**BASE, **agent, "output_dir": str(tmp_path / "out"), "task_size": 8, "per_device_train_batch_size": 4,
              "num_generations": 4, "max_completion_length": 24, "plugins": ["lp_reg"], "save_strategy": "no",
              "bf16": False, "logging_steps": 1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert train_main(["--config", str(path)]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists() or any((tmp_path / "out").glob("*.safetensors"))
