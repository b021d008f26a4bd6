"""``trl-plugins new``: the scaffolded package renders, loads, installs offline, passes its own tests, is listed
with its distribution and trains stacked with a built-in plugin.

The slow test pip-installs four scaffolded packages (one per stage) editable, without dependencies, build
isolation or an index (so no network is needed), and uninstalls them in a ``finally``."""

import importlib.util
import os
import re
import subprocess
import sys
import uuid

import pytest
import torch
import yaml

from trl_plugins import PluginConfigError
from trl_plugins.cli.scaffold import STAGES, PackageNames, render, scaffold
from trl_plugins.testing import (
    build_stack,
    make_advantage_context,
    make_loss_context,
    make_reward_context,
    make_rollout_context,
    run_hook,
)

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")


def test_names_are_derived_and_validated():
    names = PackageNames.from_name("My-Method")
    assert names == PackageNames("my_method", "trl-plugins-my-method", "trl_plugins_my_method", "MyMethodPlugin",
                                 "MyMethodOptions")
    assert PackageNames.from_name("trl-plugins-foo2").name == "foo2"
    for bad in ("9lives", "a__b", "has space!", "", "trailing_", "builtin", "class"):
        with pytest.raises(PluginConfigError, match="Invalid plugin name"):
            PackageNames.from_name(bad)
    with pytest.raises(PluginConfigError, match="Unknown stage 'critic'"):
        render(names, "critic")


def _load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through the module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stage", STAGES)
def test_rendered_package_is_consistent(stage, tmp_path):
    tomllib = pytest.importorskip("tomllib")
    name = f"render_{stage}"
    root = scaffold(name, tmp_path / "pkg", stage)
    names = PackageNames.from_name(name)
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert files == {"pyproject.toml", "README.md", "conftest.py", f"src/{names.package}/__init__.py",
                     f"src/{names.package}/plugin.py", f"tests/test_{name}.py", "examples/stacked.yaml"}
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["project"]["name"] == names.distribution
    assert project["project"]["entry-points"]["trl_plugins"] == {name: f"{names.package}.plugin:{names.cls}"}
    for py in root.rglob("*.py"):
        compile(py.read_text(), str(py), "exec")
    module = _load_module(root / "src" / names.package / "plugin.py", f"_scaffold_probe_{stage}")
    cls = getattr(module, names.cls)
    assert cls.name == name and cls.stages() == [stage] and re.search(r"arXiv:\d{4}\.\d{4,5}", cls.paper)
    assert (cls.__doc__ or "").strip() and (module.__doc__ or "").strip() and cls.summary
    assert all(info.help for info in cls.Options.describe())
    example = yaml.safe_load((root / "examples" / "stacked.yaml").read_text())
    assert example["plugins"] == ["canon", name]
    assert project["project"]["optional-dependencies"]["test"] == ["pytest>=8", "hypothesis>=6"]
    cls.Options.from_dict(example["plugin_config"][name], plugin=name)  # the example's options are valid
    assert "pytest_plugins" in (root / "conftest.py").read_text()
    with pytest.raises(PluginConfigError, match="not an empty directory"):
        scaffold(name, root, stage)


def _neutral_contexts(stage):
    if stage == "sampling":
        return "trl_plugins_after_generation", make_rollout_context([["abcdefghijkl", "ab"]])
    if stage == "reward":
        return "trl_plugins_transform_rewards", make_reward_context([1.0, 0.0, 0.0, 0.0], num_generations=4)
    if stage == "advantage":
        return "trl_plugins_transform_advantages", make_advantage_context([1.0, 0.0, 0.5, 0.0], num_generations=4)
    return "trl_plugins_loss", make_loss_context(shape=(2, 3))


@pytest.mark.parametrize("stage", STAGES)
def test_default_options_are_the_neutral_setting(stage, tmp_path):
    """Without installing: the example plugin's defaults change nothing in its stage's context."""
    name = f"neutral_{stage}"
    root = scaffold(name, tmp_path / "pkg", stage)
    names = PackageNames.from_name(name)
    cls = getattr(_load_module(root / "src" / names.package / "plugin.py", f"_scaffold_neutral_{stage}"), names.cls)
    hook, ctx = _neutral_contexts(stage)
    snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else repr(v)) for k, v in vars(ctx).items()
                if k not in ("metrics", "services", "_active_plugin")}
    run_hook(build_stack(cls, max_completion_length=12), hook, ctx)
    for key, before in snapshot.items():
        after = getattr(ctx, key)
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, after), key
        else:
            assert before == repr(after), key
    assert not any(k.startswith(f"plugins/{name}/") for k in ctx.metrics) or stage == "advantage"


def test_a_two_stage_package_passes_its_unit_and_property_tests(tmp_path):
    """Without pip (src on the path, the entry point in a hand-written dist-info): the combined plugin's entry-point,
    option, hand-made-context and hypothesis tests of both stages pass (the slow test below runs the training ones)."""
    root = scaffold("two_stage_unit", tmp_path / "pkg", ["advantage", "loss"])
    info = tmp_path / "site" / "trl_plugins_two_stage_unit-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-plugins-two-stage-unit\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[trl_plugins]\ntwo_stage_unit = trl_plugins_two_stage_unit.plugin:TwoStageUnitPlugin\n")
    path = [str(root / "src"), str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    env = dict(ENV, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root), "-k",
         "not reduces_to_vanilla and not trains_stacked"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\b8 passed\b", done.stdout), done.stdout[-2000:]


def _run(cmd, cwd, timeout):
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def _stacked_config(roots, names, tiny_path, out):
    """The sampling package's example YAML, with all four scaffolded plugins stacked with canon, made tiny."""
    config = yaml.safe_load((roots[0] / "examples" / "stacked.yaml").read_text())
    plugin_config = {}
    for root, n in zip(roots, names):
        plugin_config.update(yaml.safe_load((root / "examples" / "stacked.yaml").read_text())["plugin_config"])
    config.update(
        plugins=["canon"] + [n.name for n in names], plugin_config=plugin_config, model_name_or_path=str(tiny_path),
        output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
        task_size=8, task_levels=[1], reward_funcs=["accuracy", "trl_plugins.testing.digit_fraction_reward"],
        use_cpu=True, bf16=False, disable_tqdm=True,
    )
    return config


@pytest.mark.slow
def test_scaffolded_packages_install_pass_their_tests_and_train_stacked(tmp_path):
    pytest.importorskip("setuptools", reason="building the editable install offline (no build isolation) needs it")
    from trl_plugins.tasks.tiny import build_and_save

    tag = uuid.uuid4().hex[:6]
    names = [PackageNames.from_name(f"probe_{stage}_{tag}") for stage in STAGES]
    roots = [scaffold(n.name, tmp_path / n.distribution, stage) for n, stage in zip(names, STAGES)]
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    for root in roots:
        install += ["-e", str(root)]
    try:
        done = _run(install, tmp_path, 600)
        assert done.returncode == 0, done.stdout + done.stderr

        # 1. each package's own tests, with the testing kit, in a fresh interpreter
        done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, roots)], tmp_path, 1800)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
        assert re.search(r"\b26 passed\b", done.stdout), done.stdout[-2000:]

        # 2. listed with their distributions
        done = _run([sys.executable, "-m", "trl_plugins.cli", "list"], tmp_path, 600)
        assert done.returncode == 0, done.stderr
        for n, stage in zip(names, STAGES):
            line = next(line for line in done.stdout.splitlines() if line.startswith(n.name + " "))
            assert stage in line and line.rstrip().endswith(f"{n.distribution} 0.1.0"), line
        assert "failed to load" not in done.stdout

        # 3. trained together, stacked with the built-in canon, through `trl-plugins train`
        tiny = build_and_save(tmp_path / "tiny")
        config_path = tmp_path / "stacked.yaml"
        config_path.write_text(yaml.safe_dump(_stacked_config(roots, names, tiny, tmp_path / "run")))
        done = _run([sys.executable, "-m", "trl_plugins.cli", "train", str(config_path)], tmp_path, 900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        metrics = {"sampling": "retried_rows", "reward": "mean_bonus", "advantage": "positive_fraction",
                   "loss": "mean_weight"}
        logged = (tmp_path / "run" / "metrics.jsonl").read_text()  # the console shows headlines, the file all
        for n, stage in zip(names, STAGES):
            assert f"plugins/{n.name}/{metrics[stage]}" in logged, logged[-4000:]
        assert "plugins/canon/lam" in logged and "Summary: 1 steps" in done.stdout
    finally:
        _run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *(n.distribution for n in names)], tmp_path, 300)
