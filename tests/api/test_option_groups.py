"""Shared option groups and shared reasons: the options several built-in plugins have (an external model's endpoint
block, the off-policy gamma, the warm-up) are declared once, in a group they derive from, with the group's check;
the refusal and "pick one" reasons they share are framework constants, not copies or imports from a peer plugin."""

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api import reasons
from trl_plugins.components.client import ENDPOINT_FIELDS, EndpointOptions, endpoint_options
from trl_plugins.runtime.manager import BUILTIN_PACKAGE, builtin_modules
from trl_plugins.api.option_groups import OffPolicyOptions, WarmupOptions

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "plugins"


def builtin_plugin_classes():
    import importlib

    from trl_plugins import Plugin

    out = {}
    for module_name in builtin_modules():
        module = importlib.import_module(f"{BUILTIN_PACKAGE}.{module_name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Plugin) and value.__module__ == module.__name__:
                out[value.name] = value
    return out


def declared_in(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own annotations declare option ``name`` (the first, i.e. the last override)."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def test_endpoint_blocks_come_from_one_group():
    checked = 0
    for name, cls in builtin_plugin_classes().items():
        fields = {f.name for f in dataclasses.fields(cls.Options)}
        prefixes = {o[: -len("_base_url")] for o in fields if o.endswith("_base_url")}
        for prefix in prefixes:
            if not all(f"{prefix}_{s}" in fields for s in ENDPOINT_FIELDS):
                continue
            for suffix in ENDPOINT_FIELDS:
                owner = declared_in(cls.Options, f"{prefix}_{suffix}")
                assert issubclass(owner, EndpointOptions) and owner.__name__.endswith("EndpointOptions"), (
                    f"{name}: option {prefix}_{suffix!s} is declared by {owner.__name__}, not by an endpoint group "
                    "(trl_plugins.components.client.endpoint_options)"
                )
                checked += 1
    assert checked >= 5 * 9  # scope (teacher, prm), posterior_grpo, critique_grpo, fbos_rl, ruscarl, dagrpo, luffy, kepo


def test_offpolicy_gamma_and_warmup_come_from_their_groups():
    classes = builtin_plugin_classes()
    offpolicy = {n for n, c in classes.items() if issubclass(c.Options, OffPolicyOptions)}
    assert {"ampo", "critique_grpo", "fbos_rl", "kepo", "luffy", "scope"} <= offpolicy
    for name, cls in classes.items():
        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        if "offpolicy_shaping_gamma" in fields.get("gamma", SimpleNamespace(metadata={})).metadata.get("help", ""):
            assert declared_in(cls.Options, "gamma") is OffPolicyOptions, name
        if "warmup_steps" in fields:
            assert declared_in(cls.Options, "warmup_steps") is WarmupOptions, name
    for path in PLUGINS_DIR.glob("*.py"):  # the check has one home: OffPolicyOptions.check_gamma
        assert "check_offpolicy_gamma(" not in path.read_text(), path.name


def test_the_groups_keep_every_option_name_and_default():
    """Configs written before the groups existed still mean the same."""
    expected = {
        "scope": {"teacher_model": "default", "teacher_timeout": 120.0, "teacher_max_retries": 4, "gamma": 0.1,
                  "warmup_steps": 0, "prm_model": "Qwen/Qwen2.5-Math-PRM-7B", "prm_timeout": 60.0},
        "critique_grpo": {"critic_model": "default", "critic_base_url": None, "critic_api_key_env": None,
                          "critic_timeout": 120.0, "critic_max_retries": 4, "gamma": 0.1, "warmup_steps": 0},
        "fbos_rl": {"judge_model": "default", "judge_timeout": 120.0, "judge_max_retries": 4, "gamma": 0.1,
                    "warmup_steps": 0},
        "ruscarl": {"judge_model": "default", "judge_timeout": 120.0, "judge_max_retries": 4},
        "dagrpo": {"judge_model": "default", "judge_timeout": 120.0, "judge_max_retries": 4},
        "luffy": {"teacher_model": "default", "teacher_timeout": 120.0, "gamma": 0.1},
        "kepo": {"teacher_timeout": 120.0, "gamma": 0.1},
        "ampo": {"gamma": 0.1},
        "posterior_grpo": {"prm_model": "Qwen/Qwen2.5-Math-PRM-7B", "prm_timeout": 60.0, "prm_max_retries": 4},
    }
    classes = builtin_plugin_classes()
    for name, defaults in expected.items():
        fields = {f.name: f.default for f in dataclasses.fields(classes[name].Options)}
        assert {k: fields[k] for k in defaults} == defaults, name


def test_group_checks():
    options = build_plugins(["fbos_rl"], {"fbos_rl": {"gamma": 0.2}}).by_name["fbos_rl"].options
    with pytest.raises(IncompatiblePluginsError, match=r"fbos_rl: gamma=0.2 but the run's offpolicy_shaping_gamma=0.1"):
        options.check_gamma("fbos_rl", SimpleNamespace(offpolicy_shaping_gamma=0.1))
    options.check_gamma("fbos_rl", SimpleNamespace(offpolicy_shaping_gamma=0.2))
    assert WarmupOptions(warmup_steps=2).warming_up(1) and not WarmupOptions(warmup_steps=2).warming_up(2)
    with pytest.raises(PluginConfigError, match=r"'dagrpo' with scorer='judge' and judge='endpoint' needs "
                                                r"judge_base_url .*; or set judge='hf'"):
        build_plugins(["dagrpo"], {"dagrpo": {"scorer": "judge"}})
    build_plugins(["dagrpo"], {"dagrpo": {"scorer": "judge", "judge": "hf"}})  # no endpoint, no URL needed
    group = endpoint_options("grader", "grader", timeout=5.0)
    assert [f.name for f in dataclasses.fields(group)] == [f"grader_{s}" for s in ENDPOINT_FIELDS]
    config = group(grader_base_url="http://127.0.0.1:9/v1").endpoint_config("grader", max_concurrency=2)
    assert (config.base_url, config.timeout, config.max_concurrency) == ("http://127.0.0.1:9/v1", 5.0, 2)
    with pytest.raises(PluginConfigError, match="grader_timeout"):
        group.from_dict({"grader_timeout": 0.0}, plugin="p")


def test_shared_reasons_are_framework_constants():
    """A refusal or conflict reason that two plugins give is a constant of trl_plugins.api.reasons; no plugin imports a
    'pick one' reason from a peer plugin."""
    constants = {v for k, v in vars(reasons).items() if k.isupper() and isinstance(v, str)}
    seen: dict[str, list[str]] = {}
    for name, cls in builtin_plugin_classes().items():
        for text in (cls.multi_turn, *cls.conflicts().values()):
            if isinstance(text, str):
                seen.setdefault(text, []).append(name)
    made = re.compile(re.escape(reasons.edits_completions("@")).replace("@", ".+"))
    for text, names in seen.items():
        if len(set(names)) > 1:
            assert text in constants or made.fullmatch(text), (
                f"{sorted(set(names))} repeat a reason that is not in trl_plugins.api.reasons: {text!r}"
            )
    for path in PLUGINS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                picked = [a.name for a in node.names if a.name.endswith("PICK_ONE")]
                assert not picked, f"{path.name} imports {picked} from the peer plugin {node.module!r}"


def test_plugins_read_the_run_from_the_contexts_not_the_trainer_state():
    """The hooks give what a plugin needs of the run (``ctx.run``, ``step``); nothing keeps ``trainer.state``."""
    for path in PLUGINS_DIR.glob("*.py"):
        text = path.read_text()
        assert "trainer.state" not in text and 'getattr(trainer, "state"' not in text, path.name
