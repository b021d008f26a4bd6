"""The :class:`Plugin` base class: metadata, options and per-run state of one method."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from .hookspecs import HOOK_STAGES, STAGE_ORDER
from .options import PluginOptions


class Plugin:
    """Base class of every trl-plugins plugin (first-party and third-party alike).

    Subclasses set the class attributes below, declare an ``Options`` dataclass (see
    :mod:`trl_plugins.options`) and implement hooks from :mod:`trl_plugins.hookspecs` as methods decorated with
    :data:`trl_plugins.hookimpl`. One instance is made per trainer, with validated options in ``self.options``.

    Class attributes:
        name: the name users enable (``plugins: [name]``); lower-case, ``[a-z0-9_]``.
        version: the plugin's version string.
        paper: citation with arXiv id, e.g. ``"Lp-Reg, arXiv:2510.03222"``.
        summary: one line for ``trl-plugins list``.
        needs_head_stats: the loss hook uses ``ctx.head_stats()`` (chunked LM-head statistics).
        replaces_surrogate: the loss hook calls ``ctx.replace_tokens``; at most one such plugin per stack.
        conflicts_with: names of plugins that act on the same quantity ("pick one"); refused together.
        conflict_reason: why, shown in the error.
        reconstructed: details the paper does not state and that this plugin reconstructs (shown by
            ``trl-plugins show``).
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0.1.0"
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Options: ClassVar[type[PluginOptions]] = PluginOptions
    needs_head_stats: ClassVar[bool] = False
    replaces_surrogate: ClassVar[bool] = False
    conflicts_with: ClassVar[tuple[str, ...]] = ()
    conflict_reason: ClassVar[str] = ""
    reconstructed: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: PluginOptions | None = None):
        self.options = options if options is not None else self.Options()

    def report_fallback(self, ctx: Any, key: str, happened: bool, message: str) -> None:
        """Make a silent fallback visible: log ``fallback_<key>`` (1.0 when it ``happened`` in this batch, else 0.0)
        through ``ctx.log_metric``, and the first time it happens warn with ``message`` (once per plugin instance).

        Call it on every process with the same ``happened`` (decide it on gathered data) so the metric agrees."""
        ctx.log_metric(f"fallback_{key}", 1.0 if happened else 0.0)
        warned = self.__dict__.setdefault("_warned_fallbacks", set())
        if happened and key not in warned:
            warned.add(key)
            warnings.warn(f"{self.name}: {message}", RuntimeWarning, stacklevel=2)

    def required_columns(self) -> list[str]:
        """Dataset columns this plugin reads (checked against the training dataset at construction)."""
        return []

    @classmethod
    def hook_names(cls) -> list[str]:
        """Names of the hooks this plugin implements."""
        return [h for h in HOOK_STAGES if callable(getattr(cls, h, None)) and _is_hookimpl(getattr(cls, h))]

    @classmethod
    def stages(cls) -> list[str]:
        """The training stages this plugin hooks (lifecycle hooks are not a stage), in pipeline order."""
        used = {HOOK_STAGES[h] for h in cls.hook_names()}
        return [s for s in STAGE_ORDER if s in used]

    @classmethod
    def distribution(cls) -> str:
        """The installed distribution that ships the plugin (filled in by the manager)."""
        return getattr(cls, "_distribution", "") or "local"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.options}>"


def _is_hookimpl(func: Any) -> bool:
    return hasattr(func, "trl_plugins_impl")
