"""Exceptions raised by trl-plugins. Every message names the bad value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PluginError(Exception):
    """Base class of every error trl-plugins raises on purpose."""


class UnknownPluginError(PluginError, KeyError):
    """A plugin name that no installed plugin provides."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


class PluginConfigError(PluginError, ValueError):
    """A plugin option that is unknown, of the wrong type or out of range."""


class IncompatiblePluginsError(PluginError, ValueError):
    """Two enabled plugins (or a plugin and a GRPOConfig setting) that must not be combined."""


class GenerationBudgetExceeded(PluginError, RuntimeError):
    """A plugin asked the generation service for more completions than the configured budget allows."""


class ModelNotFoundError(PluginError, ValueError):
    """A model name that is no built-in, no local path and not loadable, or a built-in that could not be built."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return a ' Did you mean ...?' hint for `name` among `choices`, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"
