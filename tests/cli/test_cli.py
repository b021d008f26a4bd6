"""The ``trl-plugins`` command: list, show, new, docs, and the argument forwarding of train and demo."""

from importlib import metadata

import pytest

from trl_plugins.cli import main
from trl_plugins.cli.docs import check


def test_console_script_is_registered():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("trl-plugins") == "trl_plugins.cli:main"


def test_list_shows_builtins_with_stages_papers_and_distribution(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "VERSION", "STAGES", "PAPER"] and lines[0].rstrip().endswith("DISTRIBUTION")
    canon = next(line for line in lines if line.startswith("canon "))
    assert "advantage" in canon and "arXiv:2509.23962" in canon and canon.rstrip().endswith("trl-plugins (built-in)")


def test_show_prints_options_and_paper(capsys):
    assert main(["show", "lp_reg"]) == 0
    out = capsys.readouterr().out
    assert "Paper:   Low-probability Tokens Sustain Exploration" in out and "Options:" in out and "kappa (float, default 0.02)" in out
    assert "[reconstructed]" in out and "Method:" in out


def test_show_prints_the_compatibility_of_the_plugin(capsys):
    assert main(["show", "disco"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # notes are wrapped
    assert "Stacking:" in out and "Replaces the advantages (DisCO sequence weights)" in out
    assert "Loss types: grpo only: the DisCO score is a token-mean per response" in out
    assert main(["show", "gtpo"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Cannot be stacked with llds: both protect the likelihood of tokens in good responses" in out
    assert "Loss types: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo." in out


def test_show_unknown_plugin_suggests(capsys):
    assert main(["show", "lp_rge"]) == 2
    assert "Did you mean 'lp_reg'" in capsys.readouterr().err


def test_new_scaffolds_and_prints_the_next_commands(tmp_path, capsys):
    target = tmp_path / "pkg"
    assert main(["new", "cli-probe", "--dir", str(target), "--stage", "loss"]) == 0
    out = capsys.readouterr().out
    assert "trl-plugins-cli-probe" in out and "pip install -e" in out and "trl-plugins train" in out
    plugin = (target / "src" / "trl_plugins_cli_probe" / "plugin.py").read_text()
    assert "def trl_plugins_loss(self, ctx: LossContext)" in plugin and 'name = "cli_probe"' in plugin
    assert main(["new", "cli_probe", "--dir", str(target)]) == 2  # not empty
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["new", "canon", "--dir", str(tmp_path / "other")]) == 2  # a built-in has that name
    assert "already exists (trl-plugins (built-in))" in capsys.readouterr().err
    assert main(["new", "Bad Name!", "--dir", str(tmp_path / "bad")]) == 2
    assert "Invalid plugin name" in capsys.readouterr().err
    assert main(["new", "x", "--stage", "critic", "--dir", str(tmp_path / "x")]) == 2
    assert "Unknown stage 'critic'; allowed: sampling, reward, advantage, loss." in capsys.readouterr().err
    assert main(["new", "x", "--stage", "advantag", "--dir", str(tmp_path / "x")]) == 2
    assert "Did you mean 'advantage'" in capsys.readouterr().err


def test_new_takes_several_stages(tmp_path, capsys):
    """A two-stage method: one class with both stages' hooks and options, and both stages' tests."""
    target = tmp_path / "two"
    assert main(["new", "two_stage_probe", "--dir", str(target), "--stage", "loss", "--stage", "advantage"]) == 0
    plugin = (target / "src" / "trl_plugins_two_stage_probe" / "plugin.py").read_text()
    assert plugin.count("class TwoStageProbePlugin(Plugin)") == 1 and plugin.count("@hookimpl") == 3  # + configure
    tests = (target / "tests" / "test_two_stage_probe.py").read_text()
    assert "def test_hook_on_a_hand_made_context_advantage(" in tests
    assert "def test_hook_on_a_hand_made_context_loss(" in tests
    assert "['advantage', 'loss']" in tests
    other = tmp_path / "three"
    assert main(["new", "three_stage_probe", "--dir", str(other), "--stage", "sampling,reward,loss"]) == 0
    assert "sampling, reward, loss stages" in (other / "pyproject.toml").read_text()


def test_new_defaults_to_the_advantage_stage_in_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["new", "cli_default"]) == 0
    plugin = (tmp_path / "trl-plugins-cli-default" / "src" / "trl_plugins_cli_default" / "plugin.py").read_text()
    assert "trl_plugins_transform_advantages" in plugin


def test_docs_writes_and_checks(tmp_path, capsys):
    assert main(["docs", "--out", str(tmp_path)]) == 0
    assert "page(s) written" in capsys.readouterr().out
    assert check(tmp_path) == []
    assert main(["docs", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "hooks.md").write_text("stale\n")
    assert main(["docs", "--out", str(tmp_path), "--check"]) == 1
    assert "hooks.md is out of date" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "demo"])
def test_train_and_demo_forward_their_options(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_docs_renders_the_page_of_a_third_party_plugin(tmp_path, capsys, temporary_plugin):
    from dataclasses import dataclass

    from trl_plugins import Plugin, PluginOptions, hookimpl, option

    @dataclass
    class Opts(PluginOptions):
        strength: float = option(0.5, min=0.0, help="How strongly it acts.")

    class ThirdPartyDoc(Plugin):
        name = "third_party_doc"
        paper = "Someone's method, arXiv:2501.00001"
        summary = "A third-party plugin."
        Options = Opts

        @hookimpl
        def trl_plugins_transform_advantages(self, ctx):
            pass

    temporary_plugin(ThirdPartyDoc)
    assert main(["docs", "--plugin", "third_party_doc", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "plugins" / "third_party_doc.md").read_text()
    assert "# `third_party_doc`" in page and "| `strength` | float | `0.5` | >= 0.0 | How strongly it acts. |" in page
    assert "[arXiv:2501.00001](https://arxiv.org/abs/2501.00001)" in page
    assert "../compatibility.md" not in page  # no link to pages a third-party repository does not have
    assert f"Wrote {tmp_path / 'plugins' / 'third_party_doc.md'}" in capsys.readouterr().out
    assert main(["docs", "--plugin", "third_party_doc", "--out", str(tmp_path), "--check"]) == 0
    assert main(["docs", "--plugin", "third_party_dco"]) == 2
    assert "Did you mean 'third_party_doc'" in capsys.readouterr().err


def test_plugin_config_json_on_the_command_line_replaces_the_files(tmp_path):
    """The README's `--plugins ... --plugin_config '{...}'` form: names and a JSON object keyed by plugin name."""
    from trl import ModelConfig, TrlParser

    from trl_plugins.runtime.config import PluginGRPOConfig
    from trl_plugins.cli.train import TrainScriptArguments, parse_config

    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nplugins: [hint_scaffold, canon]\n"
                      "plugin_config:\n  canon: {metric: length}\n")
    parser = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig))
    _, args, _ = parse_config(parser, ["--config", str(config), "--plugins", "hint_scaffold", "lp_reg",
                                       "--plugin_config", '{"lp_reg": {"kappa": 0.05}}'])
    assert args.plugins == ["hint_scaffold", "lp_reg"] and args.plugin_config == {"lp_reg": {"kappa": 0.05}}


# ------------------------------------------------------------------------------------------------ working directory
PLANTED = "import pathlib\npathlib.Path(__file__).with_name('{marker}').write_text('ran')\n"


@pytest.mark.slow
def test_a_module_in_the_working_directory_never_shadows_an_installed_package(tmp_path):
    """``trl-plugins train`` run where a ``matplotlib.py`` lies, as ``python -c`` / ``python -m`` start it (the
    working directory first on sys.path): the config's own reward module from that folder still loads, and its
    ``import matplotlib`` gets the installed package, not the planted file."""
    import subprocess
    import sys
    from pathlib import Path

    import trl_plugins

    (tmp_path / "matplotlib.py").write_text(PLANTED.format(marker="PLANTED_RAN"))
    (tmp_path / "my_rewards.py").write_text(
        "import pathlib\nimport matplotlib\n"
        "pathlib.Path(__file__).with_name('matplotlib_used').write_text(matplotlib.__file__)\n"
        "def reward(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    (tmp_path / "config.yaml").write_text(
        "model_name_or_path: builtin:tiny\nreport_to: none\nuse_cpu: true\nmax_steps: 1\n"
        "reward_funcs: [my_rewards.reward]\ndataset_name: ./no_such_dataset\n"  # refused before the model loads
    )
    root = str(Path(trl_plugins.__file__).parents[1])
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from trl_plugins.cli import main; sys.exit(main(sys.argv[1:]))",
         "train", "config.yaml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": root},
    )
    assert result.returncode == 2, result.stderr
    assert "Could not load dataset_name='./no_such_dataset'" in result.stderr  # the reward module was imported first
    assert not (tmp_path / "PLANTED_RAN").exists()
    used = (tmp_path / "matplotlib_used").read_text()
    assert "site-packages" in used and str(tmp_path) not in used


def test_the_commands_run_with_the_working_directory_last_on_sys_path(tmp_path, monkeypatch):
    import os
    import sys

    import trl_plugins.cli.compare as compare

    seen = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    monkeypatch.setattr(compare, "_main", lambda argv: seen.append(list(sys.path)) or 0)
    before = list(sys.path)
    assert main(["compare", "--demo"]) == 0
    assert seen[0][-1] == os.getcwd() and "" not in seen[0] and seen[0].count(str(tmp_path)) == 1
    assert sys.path == before  # restored after the command
