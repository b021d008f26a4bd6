"""Every built-in plugin has an offline configuration in scripts/gpu_smoke.py: its trainer is built, through the
script's own ``build_trainer`` (SMOKE_CONFIG, SMOKE_ARGS, the arithmetic task), on the tiny model on CPU in fp32
without being refused, and no local-model option it uses points at a hub name (which the offline GPU machines cannot
download); the tool plugins run on builtin:smollm2's tool task instead (TOOL_PLUGINS). Construction only: the
training steps run in scripts/gpu_smoke.py itself."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from trl_plugins.runtime.manager import available_plugins

ROOT = Path(__file__).resolve().parents[1]
BUILTINS = sorted(n for n, cls in available_plugins().items()
                  if cls.distribution() == "trl-plugins (built-in)" and not cls.deprecated())


def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts/gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    return SCRIPT.build_model(tmp_path_factory.mktemp("gpu_smoke"), hidden_size=32, num_layers=1)


def _hub_models(plugin) -> list[str]:
    """The ``<kind>_model`` options of ``plugin`` whose ``<kind>`` is a local model ('hf') but whose value is not a
    local path (a hub name, loaded when the plugin first needs it: an OSError offline)."""
    options = plugin.options
    found = []
    for field in dataclasses.fields(options):
        kind = getattr(options, field.name.removesuffix("_model"), None) if field.name.endswith("_model") else None
        value = getattr(options, field.name)
        if kind == "hf" and isinstance(value, str) and value != "default" and not Path(value).exists():
            found.append(f"{field.name}={value!r}")
    return found


def test_the_smoke_options_name_only_builtin_plugins():
    named = set(SCRIPT.SMOKE_CONFIG) | set(SCRIPT.SMOKE_ARGS) | set(SCRIPT.TOOL_SMOKE_CONFIG) | SCRIPT.TOOL_PLUGINS
    assert named <= set(BUILTINS), sorted(named - set(BUILTINS))
    assert len(BUILTINS) > 50  # the entry points are found (the editable install of the package)


@pytest.mark.parametrize("plugin", [p for p in BUILTINS if p not in SCRIPT.TOOL_PLUGINS])
def test_builtin_plugin_is_built_offline_by_gpu_smoke(plugin, tiny_model_path, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from trl_plugins import PluginError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a hub download fails at once
    try:
        trainer = SCRIPT.build_trainer(f"fp32/{plugin}", [plugin], setting="fp32", model_path=tiny_model_path,
                                       model_kind="tiny", out_dir=tmp_path, steps=1, device="cpu")
    except (PluginError, OSError) as exc:
        pytest.fail(f"scripts/gpu_smoke.py's run of {plugin!r} is refused or reaches for the hub: "
                    f"{type(exc).__name__}: {exc}. Give it offline options in SMOKE_CONFIG / SMOKE_ARGS (or list it "
                    "in TOOL_PLUGINS).")
    hub = [f"{p.name}: {m}" for p in trainer.plugin_stack.plugins for m in _hub_models(p)]
    assert not hub, f"scripts/gpu_smoke.py's run of {plugin!r} would download {hub}; point it at a local model"


def test_a_hub_model_in_a_local_model_option_is_found(tmp_path):
    from trl_plugins import build_plugins

    default = build_plugins(["reasonflux_prm"], {}).plugins[0]  # prm='hf' with its hub default
    assert _hub_models(default) == ["prm_model='Qwen/Qwen2.5-Math-PRM-7B'"]
    local = build_plugins(["reasonflux_prm"], {"reasonflux_prm": {"prm_model": str(tmp_path)}}).plugins[0]
    programmatic = build_plugins(["reasonflux_prm"], {"reasonflux_prm": {"prm": "programmatic"}}).plugins[0]
    assert _hub_models(local) == _hub_models(programmatic) == []
