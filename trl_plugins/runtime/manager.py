"""Plugin discovery, enabling by name, validation and ordered (chained) hook calls.

Discovery: built-in plugins (the ``trl_plugins_builtin`` package) plus every entry point in the group
``trl_plugins`` of the installed distributions, plus classes registered in code with :func:`register_plugin`.

Environment variables (read at discovery time, like pytest's ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``):

``TRL_PLUGINS_DISABLE_AUTOLOAD=1``
    Load no entry-point plugins at all; only built-ins and plugins registered in code are available. Read as a
    boolean like pip / pytest do (``1/true/yes/on`` disable, ``0/false/no/off`` or empty do not; other values are
    refused).
``TRL_PLUGINS_LOAD=name1,name2``
    Load only these entry-point plugins (built-ins stay available). An empty value loads none.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import pkgutil
import warnings
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import pluggy

from trl_plugins.api import hookspecs
from trl_plugins.api.errors import IncompatiblePluginsError, PluginConfigError, UnknownPluginError, suggest
from trl_plugins.api.options import option_default
from trl_plugins.api.hookspecs import HOOK_STAGES
from trl_plugins.api.plugin import OVERWRITABLE, Plugin, hook_method_problems
from trl_plugins.runtime.plugin_settings import merge_plugin_settings

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "trl_plugins"
BUILTIN_PACKAGE = "trl_plugins_builtin"
DISABLE_AUTOLOAD_ENV = "TRL_PLUGINS_DISABLE_AUTOLOAD"
LOAD_ENV = "TRL_PLUGINS_LOAD"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off", "n", "f"})
_registered: dict[str, type[Plugin]] = {}
_load_errors: dict[str, str] = {}


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Make a plugin class available by name without packaging it (usable as a class decorator)."""
    _validate_class(cls, source="register_plugin")
    _registered[cls.name] = cls
    return cls


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin` (mainly for tests)."""
    _registered.pop(name, None)


def _validate_class(cls: Any, source: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise PluginConfigError(f"{source}: {cls!r} is not a subclass of trl_plugins.Plugin.")
    if not cls.name or not cls.name.replace("_", "").isalnum() or cls.name.lower() != cls.name:
        raise PluginConfigError(
            f"{source}: plugin class {cls.__name__} has an invalid name {cls.name!r}; use lower-case [a-z0-9_]."
        )
    problems = hook_method_problems(cls)
    if problems:
        raise PluginConfigError(f"{source}: plugin {cls.name!r} ({cls.__module__}.{cls.__qualname__}): "
                                + " ".join(problems))
    unknown = [q for q in cls.overwrites if q not in OVERWRITABLE]
    if unknown:
        raise PluginConfigError(
            f"{source}: plugin {cls.name!r} declares overwrites={tuple(cls.overwrites)!r}; {unknown[0]!r} is not a "
            f"chained quantity.{suggest(unknown[0], OVERWRITABLE)} Allowed: {', '.join(OVERWRITABLE)}."
        )
    hooks = [h for h in cls.conflicts_with_hooks if h not in hookspecs.HOOK_STAGES]
    if hooks:
        raise PluginConfigError(
            f"{source}: plugin {cls.name!r} declares conflicts_with_hooks with {hooks[0]!r}, which is no hook."
            f"{suggest(hooks[0], hookspecs.HOOK_STAGES)}"
        )
    if cls.moved and cls.moved_by not in {f.name for f in dataclasses.fields(cls.Options)}:
        raise PluginConfigError(
            f"{source}: plugin {cls.name!r} declares moved spellings of moved_by={cls.moved_by!r}, which is not one "
            "of its options."
        )


def builtin_modules() -> list[str]:
    """Modules of the built-in plugin package (one per paper)."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def _builtin_plugins() -> dict[str, type[Plugin]]:
    found = {}
    for module_name in builtin_modules():
        module = importlib.import_module(f"{BUILTIN_PACKAGE}.{module_name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Plugin) and value is not Plugin and value.name:
                if value.__module__ == module.__name__:
                    _validate_class(value, source=f"built-in module {module.__name__}")
                    value._distribution = "trl-plugins (built-in)"
                    found[value.name] = value
    return found


def autoload_disabled() -> bool:
    """``TRL_PLUGINS_DISABLE_AUTOLOAD`` read like a boolean environment variable of pip / pytest.

    Case-insensitive ``1``, ``true``, ``yes``, ``on``, ``y``, ``t`` disable auto-loading; empty, ``0``, ``false``,
    ``no``, ``off``, ``n``, ``f`` (or unset) leave it on. Any other value is refused (:class:`PluginConfigError`).
    """
    raw = os.environ.get(DISABLE_AUTOLOAD_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE_WORDS:
        return True
    if value in _FALSE_WORDS:
        return False
    raise PluginConfigError(
        f"{DISABLE_AUTOLOAD_ENV}={raw!r} is not a boolean; use 1/true/yes/on to disable entry-point plugins or "
        "0/false/no/off (or unset it) to load them."
    )


def _entry_point_plugins() -> dict[str, type[Plugin]]:
    _load_errors.clear()  # errors describe this load only: a plugin skipped now must not report an earlier failure
    if autoload_disabled():
        return {}
    only = os.environ.get(LOAD_ENV)
    allowed = None if only is None else {n.strip() for n in only.split(",") if n.strip()}
    found = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.startswith("trl_plugins_builtin."):
            continue  # built-ins are imported directly (they work from a source checkout too)
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            cls = ep.load()
            _validate_class(cls, source=f"entry point {ep.name!r} ({ep.value})")
        except Exception as exc:  # a broken third-party plugin must not break `list` or other plugins
            _load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        dist = getattr(ep, "dist", None)
        cls._distribution = f"{dist.name} {dist.version}" if dist is not None else ep.value
        if cls.name in found and found[cls.name] is not cls:
            message = (
                f"Two entry points provide the plugin name {cls.name!r}: {found[cls.name].distribution()} and "
                f"{cls.distribution()} ({ep.value}); the second is NOT loaded. Uninstall one of them."
            )
            _load_errors[cls.name] = message
            warnings.warn(message, UserWarning, stacklevel=3)
            continue
        found[cls.name] = cls
    return found


def available_plugins() -> dict[str, type[Plugin]]:
    """All plugin classes that can be enabled by name: built-ins, entry points, then code registrations.

    An entry-point plugin never replaces a built-in of the same name: it is left out, with a warning naming both
    distributions, and listed as not loaded by ``trl-plugins list`` (a plugin registered in code with
    :func:`register_plugin` does replace it: that is an explicit choice in the user's own code).
    """
    plugins = _builtin_plugins()
    for name, cls in _entry_point_plugins().items():
        if name in plugins:
            message = (
                f"Entry point {name!r} of {cls.distribution()} ({cls.__module__}.{cls.__qualname__}) has the name of "
                f"the built-in plugin {name!r} ({plugins[name].distribution()}); it is NOT loaded and {name!r} stays "
                "the built-in. Give the third-party plugin another name (its `name` attribute and entry point)."
            )
            _load_errors[name] = message
            warnings.warn(message, UserWarning, stacklevel=2)
            continue
        plugins[name] = cls
    plugins.update(_registered)
    return dict(sorted(plugins.items()))


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with the error (shown by ``trl-plugins list``)."""
    return dict(_load_errors)


def get_plugin_class(name: str) -> type[Plugin]:
    plugins = available_plugins()
    if name not in plugins:
        if name in _load_errors:
            raise UnknownPluginError(f"Plugin {name!r} is installed but failed to load: {_load_errors[name]}")
        hint = suggest(name, plugins)
        if isinstance(name, str) and name.lower() != name and name.lower() in plugins:
            hint = f" Did you mean {name.lower()!r}? (plugin names are lower-case)"
        elif isinstance(name, str) and not hint:
            hint = suggest(name.lower(), plugins)
        note = ""
        if autoload_disabled():
            note = (f" Entry-point plugins are not loaded because {DISABLE_AUTOLOAD_ENV}="
                    f"{os.environ[DISABLE_AUTOLOAD_ENV]!r}; unset it to load installed third-party plugins.")
        elif os.environ.get(LOAD_ENV) is not None:
            note = (f" Only the entry-point plugins named in {LOAD_ENV}={os.environ[LOAD_ENV]!r} are loaded; add "
                    f"{name!r} there to load it.")
        raise UnknownPluginError(
            f"Unknown plugin {name!r}.{hint} Available plugins: {', '.join(plugins) or '(none)'}.{note}"
        )
    return plugins[name]


class PluginStack:
    """The enabled plugins of one trainer, in configured order, behind one pluggy manager.

    ``call(hook, **kwargs)`` calls the hook of every plugin that implements it, in the configured order (not
    pluggy's LIFO order), and returns the list of non-None results.
    """

    def __init__(self, plugins: list[Plugin]):
        self.plugins = plugins
        self.by_name = {p.name: p for p in plugins}
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for plugin in plugins:
            try:
                self.pm.register(plugin, name=plugin.name)
            except pluggy.PluginValidationError as exc:
                raise PluginConfigError(f"Plugin {plugin.name!r} has an invalid hook: {exc}") from exc
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginConfigError(
                f"{exc} Known hooks: {', '.join(hookspecs.HOOK_STAGES)}."
            ) from exc
        self._order = {id(p): i for i, p in enumerate(plugins)}
        first = overwriters_first(plugins)
        self._impls: dict[str, list] = {}
        for hook in hookspecs.HOOK_STAGES:
            impls = [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin.hook_enabled(hook)]
            # within a chain, a plugin that recomputes the quantity from scratch runs first (overwriters_first)
            self._impls[hook] = sorted(
                impls, key=lambda impl: (id(impl.plugin) not in first.get(hook, ()), self._order[id(impl.plugin)])
            )

    def __bool__(self) -> bool:
        return bool(self.plugins)

    def __iter__(self):
        return iter(self.plugins)

    def has(self, hook: str) -> bool:
        return bool(self._impls[hook])

    def implementers(self, hook: str) -> list[Plugin]:
        return [impl.plugin for impl in self._impls[hook]]

    def call(self, hook: str, ctx: Any = None, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on each implementing plugin in order; contexts learn which plugin is active."""
        results = []
        if ctx is not None:
            kwargs["ctx"] = ctx
        announce = getattr(ctx, "set_active_plugin", None)
        for impl in self._impls[hook]:
            if announce is not None:
                announce(impl.plugin.name)
            result = impl.function(*[kwargs[a] for a in impl.argnames])
            if result is not None:
                results.append((impl.plugin, result))
        if announce is not None:
            announce(None)
        return results

    def call_each(self, hook: str, after_each: Any, **kwargs: Any) -> None:
        """Call ``hook`` on each implementing plugin in order, then ``after_each(plugin_name, error)`` with the exception
        it raised (None when it returned); ``after_each`` decides whether to raise (e.g. on every process together)."""
        for impl in self._impls[hook]:
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:  # handed to after_each, which raises it
                after_each(impl.plugin.name, exc)
                raise  # after_each must raise for an error; never go on past a failed hook
            after_each(impl.plugin.name, None)

    def check_loss_type(self, loss_type: str) -> None:
        """Refuse a ``loss_type`` an enabled plugin is not defined for (at trainer construction)."""
        check_loss_type(self.plugins, loss_type)

    def check_multi_turn(self) -> None:
        """Refuse plugins that cannot run on multi-turn tool rollouts (TRL ``tools`` / ``environment_factory``), with
        their stated reason (:attr:`Plugin.multi_turn`); warn about plugins that do not say."""
        self._check_capability("multi_turn", "multi-turn tool rollouts", "(tools / environment_factory)", "tools")

    def check_image_inputs(self) -> None:
        """Refuse plugins that cannot run on image prompts (a dataset with TRL's ``image`` / ``images`` column), with
        their stated reason (:attr:`Plugin.image_inputs`); warn about plugins that do not say."""
        self._check_capability("image_inputs", "image prompts", "(an 'image' / 'images' dataset column)", "images")

    def _check_capability(self, attribute: str, feature: str, detail: str, short: str) -> None:
        """The rule of a declared capability (``Plugin.<attribute>``: True, a reason, or None = not stated)."""
        for plugin in self.plugins:
            reason = getattr(plugin, f"{attribute}_refusal")()
            if reason:
                raise IncompatiblePluginsError(f"Plugin {plugin.name!r} does not work with {feature} {detail}: {reason}")
            if getattr(plugin, attribute) is None:
                warnings.warn(
                    f"Plugin {plugin.name!r} does not state whether it works with {feature} (Plugin.{attribute}); it "
                    f"runs, but its author has not checked it with {short}.",
                    stacklevel=4,
                )

    @property
    def needs_head_stats(self) -> bool:
        return any(p.needs_head_stats for p in self.plugins if self.has_loss(p))

    @property
    def needs_hidden_states(self) -> bool:
        """Whether an enabled plugin calls the hidden-state service (:attr:`Plugin.needs_hidden_states`)."""
        return any(p.needs_hidden_states for p in self.plugins)

    @property
    def needs_whole_groups(self) -> bool:
        """Whether a plugin whose loss hooks are enabled needs whole groups in every micro-batch
        (:attr:`Plugin.needs_whole_groups`)."""
        return any(
            p.needs_whole_groups and any(p.hook_enabled(h) for h in p.hook_names() if HOOK_STAGES.get(h) == "loss")
            for p in self.plugins
        )

    def has_loss(self, plugin: Plugin) -> bool:
        return "loss" in plugin.stages()


def build_plugins(names: Iterable[str], plugin_config: Mapping[str, Mapping[str, Any]] | None = None) -> PluginStack:
    """Instantiate the plugins ``names`` (in order) with validated options and check the stack.

    Raises:
        UnknownPluginError: a name no installed plugin provides (with close-match suggestions).
        PluginConfigError: options for a plugin that is not enabled, unknown / mistyped / out-of-range options.
        IncompatiblePluginsError: duplicates, "pick one" conflicts, two plugins replacing the surrogate.
    """
    names, plugin_config = merge_plugin_settings(names, plugin_config)
    seen = set()
    for name in names:
        if name in seen:
            raise IncompatiblePluginsError(f"Plugin {name!r} is enabled twice in plugins={names!r}.")
        seen.add(name)
    classes = [get_plugin_class(name) for name in names]
    for key in plugin_config:
        if key not in seen:
            hint = suggest(key, names)
            raise PluginConfigError(
                f"plugin_config has options for {key!r}, which is not in plugins={names!r}.{hint} "
                "Enable it in `plugins` or remove its options."
            )
    instances = [_instantiate(cls, plugin_config.get(cls.name), names) for cls in classes]
    check_compatibility(instances)
    return PluginStack(instances)


def _instantiate(cls: type[Plugin], values: Mapping[str, Any] | None, names: list[str]) -> Plugin:
    """One plugin instance with validated options; a deprecated spelling (:attr:`Plugin.moved`) builds the plugin it
    moved to, under the old name, and warns."""
    moved = moved_spelling(cls, values)
    if moved is None:
        return cls(cls.Options.from_dict(values, plugin=cls.name))
    target, options, message = moved
    if target.name in names:
        raise IncompatiblePluginsError(
            f"{message} Plugins {cls.name!r} and {target.name!r} are then the same plugin twice; enable only "
            f"{target.name!r}."
        )
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    logger.warning(message)
    try:
        parsed = target.Options.from_dict(options, plugin=target.name)
    except PluginConfigError as exc:
        raise PluginConfigError(f"{exc} ({message})") from None
    plugin = target(parsed)
    plugin.name = cls.name  # metrics, reward columns and checkpoint state keep the old keys for this release
    return plugin


def moved_spelling(cls: type[Plugin], values: Mapping[str, Any] | None) -> tuple[type[Plugin], dict, str] | None:
    """``(new plugin class, its options, deprecation message)`` when ``values`` (a user option mapping of ``cls``)
    spell a mode that moved to a plugin of its own (:attr:`Plugin.moved`); None otherwise.

    The old options are renamed by the :class:`~trl_plugins.api.plugin.Moved` entry; old options that the spelling never
    used are dropped (and named in the message); an option the old plugin never had is refused, as before.
    """
    if not cls.moved:
        return None
    values = dict(values or {})
    value = values.get(cls.moved_by, option_default(cls.Options, cls.moved_by))
    try:
        moved = cls.moved.get(value)
    except TypeError:  # an unhashable value: refused by the options check
        moved = None
    if moved is None:
        if cls.deprecated():  # a value that is no choice: the option check names the allowed ones
            cls.Options.from_dict({cls.moved_by: value}, plugin=cls.name)
        return None
    known = {f.name for f in dataclasses.fields(cls.Options)} | {k for m in cls.moved.values() for k in m.renamed}
    for key in values:
        if key not in known:
            raise PluginConfigError(
                f"Unknown option {key!r} for plugin {cls.name!r}.{suggest(key, known)} Allowed options: "
                f"{', '.join(sorted(known))}."
            )
    options = dict(moved.options)
    options.update({moved.renamed[key]: v for key, v in values.items() if key in moved.renamed})
    dropped = [key for key in values if key not in moved.renamed and key != cls.moved_by]
    target = get_plugin_class(moved.plugin)
    renamed = ", ".join(f"{old} -> {new}" for old, new in moved.renamed.items() if old != new)
    message = (
        f"Plugin {cls.name!r} with {cls.moved_by}={value!r} is deprecated and will be removed in the next release: it "
        f"is now the plugin {target.name!r}. Write plugins: [{target.name}] and plugin_config: "
        f"{json.dumps({target.name: options}, default=str)}. Options renamed: {renamed or '(none)'}; the others keep "
        "their names."
        + (f" Ignored (no effect with {cls.moved_by}={value!r}): {', '.join(dropped)}." if dropped else "")
        + f" Until then it runs {target.name!r} under the name {cls.name!r} (metrics, reward columns and checkpoint "
        "state keep their keys)."
    )
    return target, options, message


def check_compatibility(plugins: list[Plugin]) -> None:
    """Refuse "pick one" pairs (by name and by hook) and more than one surrogate-replacing plugin; the error states
    the reason."""
    names = {p.name for p in plugins}
    for p in plugins:
        refused = {other: reason for other, reason in p.conflicts().items() if other in names}
        for hook, reason in p.conflicts_with_hooks.items():
            refused.update({q.name: reason for q in plugins
                            if q is not p and hook in q.hook_names() and q.hook_enabled(hook)})
        for other, reason in refused.items():
            raise IncompatiblePluginsError(
                f"Plugins {p.name!r} and {other!r} cannot be stacked: {reason}. Enable only one of them."
            )
    replacing = [p for p in plugins if p.replaces_surrogate]
    if len(replacing) > 1:
        what = "; ".join(f"{p.name!r} replaces {', '.join(p.replaces) or 'the base surrogate'}" for p in replacing)
        raise IncompatiblePluginsError(
            f"Plugins {[p.name for p in replacing]} each replace the base surrogate on a token subset ({what}); at "
            "most one may do so in a stack, since a token's loss can have only one replacement. Enable only one of "
            "them."
        )


def overwriters_first(plugins: list[Plugin]) -> dict[str, set[int]]:
    """``{hook: ids of the plugins that run first in its chain}``: those that overwrite its quantity.

    A plugin declaring ``overwrites=("advantages",)`` (e.g. ``canon``) recomputes the advantages from the rewards, so
    every advantage hook that ran before it would be discarded (a transform) or would have read values that no
    longer hold (a reader). Its hook is therefore moved to the front of that chain, and a warning names the plugins
    it now runs before; the order of every other hook stays that of ``plugins``. Two plugins overwriting the same
    quantity are refused (the first one's work would always be lost).
    """
    first: dict[str, set[int]] = {}
    for quantity, hook in OVERWRITABLE.items():
        chain = [p for p in plugins if hook in p.hook_names()]
        owners = [p for p in chain if quantity in p.overwritten()]
        if len(owners) > 1:
            raise IncompatiblePluginsError(
                f"Plugins {[p.name for p in owners]} each recompute the {quantity} from scratch, so stacked only the "
                f"last one's {quantity} would count and the others' work would be discarded. Enable only one of them."
            )
        if not owners:
            continue
        owner = owners[0]
        before = [p.name for p in chain[: chain.index(owner)]]
        if before:
            warnings.warn(
                f"Plugin {owner.name!r} recomputes the {quantity} from scratch, so it runs first in the {quantity} "
                f"chain (before {', '.join(repr(n) for n in before)}, which come earlier in plugins="
                f"{[p.name for p in plugins]}); otherwise their work on the {quantity} would be discarded. Put "
                f"{owner.name!r} first in `plugins` to silence this warning.",
                UserWarning,
                stacklevel=3,
            )
        first[hook] = {id(owner)}
    return first


def check_loss_type(plugins: Iterable[Plugin], loss_type: str) -> None:
    """Refuse a ``loss_type`` some plugin is not defined for (its ``loss_types``), with the plugin's reason."""
    for p in plugins:
        if p.loss_types and loss_type not in p.loss_types:
            raise IncompatiblePluginsError(
                f"Plugin {p.name!r} does not support loss_type={loss_type!r}: {p.loss_types_reason or 'not defined'}."
                f" Use loss_type {' or '.join(repr(t) for t in p.loss_types)}, or disable {p.name}."
            )
