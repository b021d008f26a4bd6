"""Plugin manager: discovery, enabling by name, suggestions, environment variables, stacking rules."""

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

import pytest
import torch

import trl_plugins.runtime.manager as manager
from trl_plugins import (
    IncompatiblePluginsError,
    Moved,
    Plugin,
    PluginConfigError,
    PluginGRPOConfig,
    PluginOptions,
    UnknownPluginError,
    available_plugins,
    build_plugins,
    hookimpl,
    option,
)


@dataclass
class _Opts(PluginOptions):
    strength: float = option(1.0, help="strength")


class FirstPlugin(Plugin):
    name = "first_demo"
    Options = _Opts

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ctx.order.append(self.name)


class SecondPlugin(Plugin):
    name = "second_demo"

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ctx.order.append(self.name)


def test_builtins_are_available_with_stages_and_papers():
    plugins = available_plugins()
    assert {"lp_reg", "hint_scaffold", "canon"} <= set(plugins)
    assert plugins["lp_reg"].stages() == ["advantage", "loss"]
    assert plugins["hint_scaffold"].stages() == ["sampling"]
    assert plugins["seele"].stages() == ["sampling", "advantage", "loss"]  # SEELE's imitation term
    assert plugins["canon"].stages() == ["advantage"]
    for name in ("lp_reg", "hint_scaffold", "canon"):
        assert "arXiv:" in plugins[name].paper


def test_unknown_plugin_suggests_close_match():
    with pytest.raises(UnknownPluginError, match=r"Unknown plugin 'lp_rge'\. Did you mean 'lp_reg'( or '\w+')*\?"):
        build_plugins(["lp_rge"])


def test_config_validates_at_construction():
    with pytest.raises(UnknownPluginError, match="Did you mean 'canon'"):
        PluginGRPOConfig(output_dir="/tmp/x", plugins=["cannon"], use_cpu=True)
    with pytest.raises(PluginConfigError, match=r"Unknown option 'kapa' for plugin 'lp_reg'\. Did you mean 'kappa'"):
        PluginGRPOConfig(output_dir="/tmp/x", plugins=["lp_reg"], plugin_config={"lp_reg": {"kapa": 1}}, use_cpu=True)


def test_plugin_config_for_plugin_not_enabled_is_refused():
    with pytest.raises(PluginConfigError, match=r"plugin_config has options for 'lp_regg'.*Did you mean 'lp_reg'"):
        build_plugins(["lp_reg"], {"lp_regg": {"kappa": 0.1}})


def test_duplicate_plugin_is_refused():
    with pytest.raises(IncompatiblePluginsError, match="enabled twice"):
        build_plugins(["canon", "canon"])


def test_hooks_chain_in_configured_order(temporary_plugin):
    temporary_plugin(FirstPlugin)
    temporary_plugin(SecondPlugin)

    class Ctx:
        order: list

    for names in (["first_demo", "second_demo"], ["second_demo", "first_demo"]):
        ctx = Ctx()
        ctx.order = []
        build_plugins(names).call("trl_plugins_loss", ctx)
        assert ctx.order == names


def test_a_hook_switched_off_by_an_option_is_neither_called_nor_counted(temporary_plugin):
    class Gated(Plugin):
        name = "gated_demo"
        Options = _Opts

        def hook_enabled(self, hook):
            return hook != "trl_plugins_loss" or self.options.strength > 0

        @hookimpl
        def trl_plugins_loss(self, ctx):
            ctx.order.append(self.name)

    temporary_plugin(Gated)

    class Ctx:
        order: list

    for strength, expected in ((1.0, ["gated_demo"]), (0.0, [])):
        stack = build_plugins(["gated_demo"], {"gated_demo": {"strength": strength}})
        ctx = Ctx()
        ctx.order = []
        stack.call("trl_plugins_loss", ctx)
        assert ctx.order == expected and stack.has("trl_plugins_loss") == bool(expected)


def test_options_reach_the_instance(temporary_plugin):
    temporary_plugin(FirstPlugin)
    stack = build_plugins(["first_demo"], {"first_demo": {"strength": 2}})
    assert stack.by_name["first_demo"].options.strength == 2.0


def test_pick_one_conflict_is_refused_with_reason(temporary_plugin):
    class ClipCov(Plugin):
        name = "clip_cov"

    temporary_plugin(ClipCov)
    with pytest.raises(IncompatiblePluginsError, match=r"'lp_reg' and 'clip_cov' cannot be stacked: .*entropy"):
        build_plugins(["lp_reg", "clip_cov"])


def test_conflicts_declared_as_a_mapping_give_each_pair_its_reason(temporary_plugin):
    class Picky(Plugin):
        name = "picky_demo"
        conflicts_with = {"canon": "both rewrite the advantages", "steer": "both weight the tokens"}

    temporary_plugin(Picky)
    assert Picky.conflicts() == {"canon": "both rewrite the advantages", "steer": "both weight the tokens"}
    with pytest.raises(IncompatiblePluginsError) as info:
        build_plugins(["steer", "picky_demo"])
    assert str(info.value) == (
        "Plugins 'picky_demo' and 'steer' cannot be stacked: both weight the tokens. Enable only one of them."
    )
    build_plugins(["picky_demo", "gtpo"])  # not declared: stacks


def test_two_surrogate_replacers_are_refused(temporary_plugin):
    class Replacer(Plugin):
        name = "replacer_demo"
        replaces_surrogate = True
        replaces = ("the base surrogate on every token",)

    temporary_plugin(Replacer)
    with pytest.raises(IncompatiblePluginsError, match="replace the base surrogate") as info:
        build_plugins(["lp_reg", "replacer_demo"])
    assert "'replacer_demo' replaces the base surrogate on every token" in str(info.value)
    assert "'lp_reg' replaces the base surrogate on low-probability negative-advantage tokens" in str(info.value)


def test_loss_types_declared_by_a_plugin_are_enforced_with_its_reason(temporary_plugin):
    class GrpoOnly(Plugin):
        name = "grpo_only_demo"
        loss_types = ("grpo", "bnpo")
        loss_types_reason = "its score is a per-response mean"

    temporary_plugin(GrpoOnly)
    stack = build_plugins(["canon", "grpo_only_demo"])
    stack.check_loss_type("bnpo")
    with pytest.raises(IncompatiblePluginsError) as info:
        stack.check_loss_type("dapo")
    assert str(info.value) == (
        "Plugin 'grpo_only_demo' does not support loss_type='dapo': its score is a per-response mean. Use loss_type "
        "'grpo' or 'bnpo', or disable grpo_only_demo."
    )
    assert GrpoOnly.supported_loss_types() == ("grpo", "bnpo")
    assert build_plugins(["canon"]).by_name["canon"].supported_loss_types() is None  # TRL's loss: any of TRL's


def test_misspelt_hook_is_refused_at_registration_with_the_fix(temporary_plugin):
    class Misspelt(Plugin):
        name = "misspelt_demo"

        @hookimpl
        def trl_plugins_los(self, ctx):
            pass

    with pytest.raises(PluginConfigError, match="'trl_plugins_los' is decorated with @hookimpl but is no hook. "
                       "Did you mean 'trl_plugins_loss'"):
        temporary_plugin(Misspelt)
    assert "misspelt_demo" not in available_plugins()


def test_hook_method_without_hookimpl_is_refused_at_registration(temporary_plugin):
    class Undecorated(Plugin):
        name = "undecorated_demo"

        def trl_plugins_transform_advantages(self, ctx):  # no @hookimpl: pluggy would never call it
            ctx.advantages = ctx.advantages * 0

    with pytest.raises(PluginConfigError, match="'trl_plugins_transform_advantages' is named like a hook but is not "
                       "decorated with @hookimpl.*add `@hookimpl`"):
        temporary_plugin(Undecorated)


@pytest.mark.parametrize("method, expected", [
    ("transform_advantages", "Did you mean 'trl_plugins_transform_advantages'"),  # the prefix forgotten
    ("trl_plugins_transform_advantage", "Did you mean 'trl_plugins_transform_advantages'"),  # undecorated typo
])
def test_hook_names_without_prefix_or_misspelt_are_refused(method, expected):
    cls = type("Typo", (Plugin,), {"name": "typo_demo", method: lambda self, ctx: None})
    with pytest.raises(PluginConfigError, match=expected):
        manager.register_plugin(cls)
    assert "typo_demo" not in available_plugins()


def test_every_builtin_passes_the_registration_checks():
    for name, cls in available_plugins().items():
        assert manager.hook_method_problems(cls) == [], name


class _DoubleAdvantages(Plugin):
    name = "double_demo"

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ctx.advantages = ctx.advantages * 2.0


def test_an_overwriting_plugin_runs_first_in_its_chain_with_a_warning(temporary_plugin):
    """canon recomputes the advantages from the rewards: listed after a transform, it would discard it."""
    from trl_plugins.testing import make_advantage_context, run_hook

    temporary_plugin(_DoubleAdvantages)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    alone = run_hook("canon", "trl_plugins_transform_advantages", make_advantage_context(rewards, num_generations=4))
    assert alone.advantages.abs().sum() > 0
    with pytest.warns(UserWarning, match=r"'canon' recomputes the advantages from scratch, so it runs first.*"
                      r"before 'double_demo'"):
        stack = build_plugins(["double_demo", "canon"])
    assert [p.name for p in stack.implementers("trl_plugins_transform_advantages")] == ["canon", "double_demo"]
    assert [p.name for p in stack] == ["double_demo", "canon"]  # the configured order stays for everything else
    ctx = run_hook(stack, "trl_plugins_transform_advantages", make_advantage_context(rewards, num_generations=4))
    assert torch.equal(ctx.advantages, alone.advantages * 2.0)  # the transform was kept, not discarded


def test_two_plugins_overwriting_one_quantity_are_refused():
    with pytest.raises(IncompatiblePluginsError, match=r"\['canon', 'riskpo'\] each recompute the advantages"):
        build_plugins(["canon", "riskpo"])
    # an option that makes r3l amplify TRL's advantages instead of recomputing them lifts the refusal
    with pytest.raises(IncompatiblePluginsError, match="each recompute the advantages"):
        build_plugins(["r3l", "canon"])
    build_plugins(["canon", "r3l"], {"r3l": {"baseline": "trl"}})


def test_overwrites_must_name_a_chained_quantity():
    cls = type("Bad", (Plugin,), {"name": "bad_overwrites_demo", "overwrites": ("advantage",)})
    with pytest.raises(PluginConfigError, match="'advantage' is not a chained quantity. Did you mean 'advantages'"):
        manager.register_plugin(cls)


class _FakeDist:
    name = "trl-plugins-fake"
    version = "9.9"


class _FakeEntryPoint:
    def __init__(self, name, value, target):
        self.name, self.value, self._target, self.dist = name, value, target, _FakeDist()

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


class ThirdParty(Plugin):
    name = "third_party_demo"
    paper = "Example, arXiv:0000.00000"


@pytest.fixture
def fake_entry_points(monkeypatch):
    eps = [
        _FakeEntryPoint("third_party_demo", "fake_pkg:ThirdParty", ThirdParty),
        _FakeEntryPoint("broken_demo", "broken_pkg:Broken", ImportError("no module named broken_pkg")),
    ]
    monkeypatch.setattr(manager.metadata, "entry_points", lambda group: eps if group == "trl_plugins" else [])
    monkeypatch.setattr(manager, "_load_errors", {})
    return eps


def test_entry_point_plugins_are_discovered(fake_entry_points, monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    plugins = available_plugins()
    assert plugins["third_party_demo"] is ThirdParty
    assert ThirdParty.distribution() == "trl-plugins-fake 9.9"
    assert "broken_demo" in manager.load_errors()
    with pytest.raises(UnknownPluginError, match="installed but failed to load: ImportError"):
        build_plugins(["broken_demo"])


def test_disable_autoload_env_var(fake_entry_points, monkeypatch):
    monkeypatch.setenv("TRL_PLUGINS_DISABLE_AUTOLOAD", "1")
    plugins = available_plugins()
    assert "third_party_demo" not in plugins
    assert {"lp_reg", "hint_scaffold", "canon"} <= set(plugins)  # built-ins stay


def test_restrict_autoload_env_var(fake_entry_points, monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.setenv("TRL_PLUGINS_LOAD", "")
    assert "third_party_demo" not in available_plugins()
    monkeypatch.setenv("TRL_PLUGINS_LOAD", "third_party_demo")
    assert "third_party_demo" in available_plugins()


@pytest.mark.parametrize("env, expected", [
    ({"TRL_PLUGINS_DISABLE_AUTOLOAD": "1"}, "not loaded because TRL_PLUGINS_DISABLE_AUTOLOAD='1'"),
    ({"TRL_PLUGINS_LOAD": "third_party_demo"}, "named in TRL_PLUGINS_LOAD='third_party_demo' are loaded"),
])
def test_a_failure_of_an_earlier_load_is_not_reported_once_that_plugin_is_skipped(env, expected, fake_entry_points,
                                                                                    monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    available_plugins()
    assert "broken_demo" in manager.load_errors()  # loaded once, in this process, and failed
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UnknownPluginError, match=re.escape(expected)):
        build_plugins(["broken_demo"])
    assert "broken_demo" not in manager.load_errors()


def test_builtins_are_registered_as_entry_points():
    """Built-ins use the same entry-point group a third-party package uses (pyproject)."""
    names = {ep.name for ep in metadata.entry_points(group="trl_plugins")}
    assert {"lp_reg", "hint_scaffold", "canon"} <= names


def test_every_builtin_module_is_registered_as_an_entry_point():
    """pyproject's entry points and the built-in package stay in step."""
    from trl_plugins.runtime.manager import _builtin_plugins

    names = {ep.name for ep in metadata.entry_points(group="trl_plugins")}
    assert set(_builtin_plugins()) <= names


def test_the_loss_path_hooks_are_the_ones_the_trainer_switches_on():
    from trl_plugins.api.loss_types import LOSS_PATH_HOOKS
    from trl_plugins.runtime.trainer import LOSS_HOOKS, SAMPLING_HOOKS

    assert set(LOSS_PATH_HOOKS) == set(SAMPLING_HOOKS + LOSS_HOOKS)  # what Plugin.supported_loss_types() reads


class ShadowingLpReg(Plugin):
    name = "lp_reg"
    paper = "Not Lp-Reg"


class AnotherThirdParty(Plugin):
    name = "third_party_demo"


def test_an_entry_point_named_like_a_builtin_does_not_replace_it(fake_entry_points, monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    fake_entry_points.append(_FakeEntryPoint("lp_reg", "evil_pkg:ShadowingLpReg", ShadowingLpReg))
    with pytest.warns(UserWarning, match=r"Entry point 'lp_reg' of trl-plugins-fake 9\.9 .*ShadowingLpReg\) has the "
                                         r"name of the built-in plugin 'lp_reg' \(trl-plugins \(built-in\)\); it is "
                                         r"NOT loaded"):
        plugins = available_plugins()
    assert plugins["lp_reg"] is not ShadowingLpReg and plugins["lp_reg"].__module__ == "trl_plugins_builtin.lp_reg"
    assert "NOT loaded" in manager.load_errors()["lp_reg"]
    assert plugins["third_party_demo"] is ThirdParty  # the other entry points still load


def test_two_entry_points_with_one_name_keep_the_first_and_warn(fake_entry_points, monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    fake_entry_points.append(_FakeEntryPoint("third_party_demo", "other_pkg:AnotherThirdParty", AnotherThirdParty))
    with pytest.warns(UserWarning, match=r"Two entry points provide the plugin name 'third_party_demo'.*"
                                         r"other_pkg:AnotherThirdParty\); the second is NOT loaded"):
        assert available_plugins()["third_party_demo"] is ThirdParty


@pytest.mark.parametrize("value,disabled", [
    ("", False), ("0", False), ("no", False), ("off", False), ("FALSE", False), ("False", False), (" n ", False),
    ("1", True), ("yes", True), ("ON", True), ("true", True), ("True", True), ("t", True),
])
def test_disable_autoload_reads_booleans_like_pip_and_pytest(value, disabled, fake_entry_points, monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    monkeypatch.setenv("TRL_PLUGINS_DISABLE_AUTOLOAD", value)
    assert ("third_party_demo" not in available_plugins()) is disabled


def test_disable_autoload_refuses_other_values(fake_entry_points, monkeypatch):
    monkeypatch.setenv("TRL_PLUGINS_DISABLE_AUTOLOAD", "sometimes")
    with pytest.raises(PluginConfigError, match=r"TRL_PLUGINS_DISABLE_AUTOLOAD='sometimes' is not a boolean"):
        available_plugins()
    monkeypatch.setenv("TRL_PLUGINS_DISABLE_AUTOLOAD", "1")
    with pytest.raises(UnknownPluginError, match=r"Unknown plugin 'third_party_demo'.*not loaded because "
                                                 r"TRL_PLUGINS_DISABLE_AUTOLOAD='1'; unset it"):
        build_plugins(["third_party_demo"])


# ------------------------------------------------------------------------------------------ declarative stacking rules
class _RefusesRefill(Plugin):
    name = "refuses_refill_demo"
    conflicts_with_hooks = {"trl_plugins_reject_groups": "it samples rows a refill would regenerate without its edits"}

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        return None


def test_conflicts_with_hooks_refuses_every_plugin_implementing_the_hook(temporary_plugin):
    temporary_plugin(_RefusesRefill)
    for refill in ("dynamic_sampling", "dars"):
        with pytest.raises(IncompatiblePluginsError, match=f"'refuses_refill_demo' and '{refill}' cannot be stacked: "
                                                           "it samples rows a refill"):
            build_plugins([refill, "refuses_refill_demo"])
    build_plugins(["refuses_refill_demo", "canon"])  # no refill hook: stacks


def test_bad_declarations_are_refused_at_registration():
    typo = type("HookTypo", (Plugin,), {"name": "hook_typo_demo",
                                         "conflicts_with_hooks": {"trl_plugins_reject_group": "x"}})
    with pytest.raises(PluginConfigError, match="'trl_plugins_reject_group', which is no hook.*reject_groups"):
        manager.register_plugin(typo)
    moved = type("MovedTypo", (Plugin,), {"name": "moved_typo_demo", "moved_by": "mode",
                                          "moved": {"x": Moved("canon")}})
    with pytest.raises(PluginConfigError, match="moved_by='mode', which is not one of its options"):
        manager.register_plugin(moved)


@dataclass
class _OldOptions(PluginOptions):
    kind: Literal["plain", "scaled"] = option("plain", help="scaled moved to the plugin canon.")
    old_lam: float = option(0.5, help="Only for kind=plain.")


class _OldSpelling(Plugin):
    name = "old_spelling_demo"
    Options = _OldOptions
    moved_by = "kind"
    moved = {"scaled": Moved("canon", {"lam": 0.25}, {"canon_b": "b"})}

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        return None


def test_a_moved_spelling_builds_the_new_plugin_under_the_old_name(temporary_plugin):
    temporary_plugin(_OldSpelling)
    assert build_plugins(["old_spelling_demo"]).plugins[0].__class__ is _OldSpelling  # kind=plain did not move
    with pytest.warns(DeprecationWarning, match=r"'old_spelling_demo' with kind='scaled' is deprecated.*plugin "
                                                r"'canon'.*canon_b -> b.*Ignored.*: old_lam"):
        plugin = build_plugins(["old_spelling_demo"], {"old_spelling_demo": {"kind": "scaled", "canon_b": 0.1,
                                                                             "old_lam": 1.0}}).plugins[0]
    assert plugin.name == "old_spelling_demo" and type(plugin).name == "canon"
    assert plugin.options.lam == 0.25 and plugin.options.b == 0.1
    with pytest.raises(PluginConfigError, match="Unknown option 'canon_bb' for plugin 'old_spelling_demo'.*'canon_b'"):
        build_plugins(["old_spelling_demo"], {"old_spelling_demo": {"kind": "scaled", "canon_bb": 0.1}})
