"""The shape of the ``plugins`` and ``plugin_config`` settings, checked before any plugin is looked up.

Accepted forms (YAML, command line or Python):

* ``plugins: [lp_reg, canon]`` -- a list of names (the configured order); ``--plugins lp_reg,canon`` -- one string;
* ``plugins: {lp_reg: {kappa: 0.05}, canon: null}`` -- a mapping of names to their options (insertion order is the
  configured order); the options are validated exactly as if given under ``plugin_config``;
* ``plugin_config: {lp_reg: {kappa: 0.05}}`` -- a mapping of plugin names to option mappings, or the same as a JSON
  string (``--plugin_config '{"lp_reg": {"kappa": 0.05}}'``).

Anything else (a number where options belong, a list of options, a non-string plugin name, JSON that does not parse,
the same plugin's options given twice) is a :class:`~trl_plugins.api.errors.PluginConfigError` naming the setting, the
bad value and the expected shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trl_plugins.api.errors import PluginConfigError

EXAMPLE = "e.g. plugin_config: {lp_reg: {kappa: 0.02}}"


def _kind(value: Any) -> str:
    return type(value).__name__


def parse_plugin_config(value: Any, setting: str = "plugin_config") -> dict[str, dict[str, Any] | None]:
    """``plugin_config`` as a ``{plugin name: option mapping or None}`` dict; a JSON string is parsed first.

    ``setting`` names the setting in messages (``plugins`` for the mapping form of ``plugins``).
    """
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PluginConfigError(
                f"{setting} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): {value!r}. "
                f"""Write it as a JSON object, e.g. --{setting} '{{"lp_reg": {{"kappa": 0.02}}}}'."""
            ) from None
    if not isinstance(value, Mapping):
        raise PluginConfigError(
            f"{setting} must be a mapping from plugin name to its options ({EXAMPLE}); got {value!r} "
            f"({_kind(value)})."
        )
    checked: dict[str, dict[str, Any] | None] = {}
    for name, options in value.items():
        if not isinstance(name, str):
            raise PluginConfigError(
                f"{setting} keys must be plugin names (strings); got {name!r} ({_kind(name)}) ({EXAMPLE})."
            )
        if options is not None and not isinstance(options, Mapping):
            raise PluginConfigError(
                f"{setting}[{name!r}] must be a mapping of option names to values ({EXAMPLE}); got {options!r} "
                f"({_kind(options)})."
            )
        checked[name] = None if options is None else dict(options)
    return checked


def parse_plugins(value: Any) -> tuple[list[str], dict[str, dict[str, Any] | None]]:
    """``plugins`` as (names in order, options given inline by the mapping form)."""
    if value is None:
        return [], {}
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()], {}
    if isinstance(value, Mapping):
        inline = parse_plugin_config(dict(value), setting="plugins")
        return list(inline), {name: options for name, options in inline.items() if options is not None}
    if not isinstance(value, (list, tuple)):
        raise PluginConfigError(
            f"plugins must be a list of plugin names (e.g. plugins: [lp_reg, canon]) or a mapping of names to options; "
            f"got {value!r} ({_kind(value)})."
        )
    for item in value:
        if not isinstance(item, str):
            raise PluginConfigError(
                f"plugins must hold plugin names (strings); got {item!r} ({_kind(item)}) in plugins={list(value)!r}. "
                "Give options under plugin_config, or write plugins as a mapping {name: {option: value}}."
            )
    return list(value), {}


def merge_plugin_settings(plugins: Any, plugin_config: Any) -> tuple[list[str], dict[str, dict[str, Any] | None]]:
    """Both settings in their canonical form: (plugin names, ``{name: options}``), inline options merged in.

    Raises:
        PluginConfigError: a malformed setting, or one plugin's options given both inline and in ``plugin_config``.
    """
    names, inline = parse_plugins(plugins)
    config = parse_plugin_config(plugin_config)
    for name, options in inline.items():
        if config.get(name):
            raise PluginConfigError(
                f"Options for plugin {name!r} are given twice: in the plugins mapping ({options!r}) and in "
                f"plugin_config ({config[name]!r}). Give them in one place."
            )
        config[name] = options
    return names, config
