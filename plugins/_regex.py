"""Regular-expression options of the built-in plugins (``rlsp``'s and ``armed``'s ``answer_pattern``): compiled once,
refused at construction with the value and the reason when they do not compile."""

from __future__ import annotations

import re

from trl_plugins.api import PluginConfigError


def compile_option(plugin: str, option: str, pattern: str) -> re.Pattern:
    """``re.compile(pattern)``, or a :class:`PluginConfigError` naming the plugin, the option and the value."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise PluginConfigError(
            f"Option {option!r} of plugin {plugin!r} got {pattern!r}, which is not a regular expression ({exc}); "
            "allowed: a Python regular expression."
        ) from exc
