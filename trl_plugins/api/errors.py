"""Exceptions raised by trl-plugins. Every message names the bad value and what is allowed."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any


class PluginError(Exception):
    """Base class of every error trl-plugins raises on purpose.

    Credentials written inside a URL of the message (``https://user:secret@host``, ``?api_key=...``) are redacted
    (:func:`redact_secrets`): messages are printed, logged and gathered to every process.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact_secrets(a) if isinstance(a, str) else a for a in args))


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


# ---------------------------------------------------------------------------------------------- redaction
#: Query / fragment parameter names whose values are credentials (matched anywhere in the name, any case).
SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|auth|signature|^sig$|credential|session|cookie|bearer",
                          re.IGNORECASE)
REDACTED = "***"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_USERINFO = re.compile(r"(?<![\w/@:.-])[^\s'\"<>`/@:]+:[^\s'\"<>`/@]+@(?=[\w\[])")  # user:pass@host, no scheme
_PARAM = re.compile(r"(^|[?&;#])([^=&;#?]+)=([^&;#]*)")


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``***``: the user-info part (``user:pass@``) and the values of query
    or fragment parameters named like a credential (``api_key``, ``token``, ``access_token``, ``password``,
    ``sig`` ...). Everything else (scheme, host, port, path, other parameters) is kept, so the message still says
    where the request went."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _USERINFO.sub(f"{REDACTED}@", url)
    end = len(rest)
    for mark in "/?#":
        index = rest.find(mark)
        if index != -1:
            end = min(end, index)
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = f"{REDACTED}@" + authority.rsplit("@", 1)[1]
    cut = min((i for i in (tail.find("?"), tail.find("#")) if i != -1), default=len(tail))
    path, params = tail[:cut], tail[cut:]
    params = _PARAM.sub(
        lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if SECRET_PARAM.search(m.group(2)) else m.group(0), params
    )
    return f"{scheme}://{authority}{path}{params}"


def redact_secrets(value: Any) -> Any:
    """The one redaction helper: every URL inside ``value`` passed through :func:`redact_url`.

    ``value`` may be a text (each URL in it is redacted; a trailing ``.``, ``,``, ``)`` ... stays outside the
    URL) or a dict / list / tuple holding texts (a new container is returned; the given one is not changed);
    anything else is returned unchanged. Used for every :class:`PluginError` message (so every ``EndpointError``)
    and for the saved and printed training arguments (``training_args.bin``, ``repr(args)``, ``args.to_dict()``).
    """
    if isinstance(value, str):
        if "://" not in value and "@" not in value:
            return value

        def one(match: re.Match) -> str:
            url = match.group(0)
            stripped = url.rstrip(".,;:)]}!")
            return redact_url(stripped) + url[len(stripped):]

        return _USERINFO.sub(f"{REDACTED}@", _URL.sub(one, value)) if "@" in value else _URL.sub(one, value)
    if type(value) is dict:
        return {key: redact_secrets(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(redact_secrets(item) for item in value)
    return value
