"""The :class:`Plugin` base class: metadata, options and per-run state of one method."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl_plugins.api.faithfulness import OfficialSource
from trl_plugins.api.hookspecs import HOOK_STAGES, STAGE_ORDER
from trl_plugins.api.loss_types import LOSS_PATH_HOOKS, SUPPORTED_LOSS_TYPES
from trl_plugins.api.options import PluginOptions, option_choices

#: Chained stage quantities a plugin may recompute from scratch (``Plugin.overwrites``) -> the hook that chains them.
OVERWRITABLE: dict[str, str] = {
    "advantages": "trl_plugins_transform_advantages",
    "rewards": "trl_plugins_transform_rewards",
}


@dataclass(frozen=True)
class Moved:
    """Where a deprecated spelling of a plugin now lives (kept for one release; see :attr:`Plugin.moved`).

    Attributes:
        plugin: the name of the plugin that now implements the spelling.
        options: that plugin's options the old spelling implied (e.g. ``{"variant": "laser_de"}`` for a mode).
        renamed: ``{old option: new option}`` for every option of the old spelling that the new plugin takes (those
            that keep their name are listed too); the old plugin's other options did nothing with this spelling and
            are dropped (the deprecation warning names them).
    """

    plugin: str
    options: Mapping[str, Any] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)


class Plugin:
    """Base class of every trl-plugins plugin (first-party and third-party alike).

    Subclasses set the class attributes below, declare an ``Options`` dataclass (see
    :mod:`trl_plugins.api.options`) and implement hooks from :mod:`trl_plugins.api.hookspecs` as methods decorated with
    :data:`trl_plugins.hookimpl`. One instance is made per trainer, with validated options in ``self.options``.

    Class attributes:
        name: the name users enable (``plugins: [name]``); lower-case, ``[a-z0-9_]``.
        version: the plugin's version string.
        paper: citation with arXiv id, e.g. ``"Lp-Reg, arXiv:2510.03222"``.
        summary: one line for ``trl-plugins list``.
        needs_head_stats: the loss hook uses ``ctx.head_stats()`` (chunked LM-head statistics).
        needs_hidden_states: the advantage hook uses ``ctx.hidden_states(reduce, layer)`` (per-token hidden states of
            one layer, reduced chunk by chunk by the plugin's callback; :class:`~trl_plugins.api.contexts.HiddenChunk`).
        hidden_states_layer: the layer the plugin asks for (transformers' ``hidden_states`` numbering: 0 the
            embeddings, ``i`` decoder block ``i``, -1 the final output; default -1). Instances may set their own.
        unsupported_engines: engines (DDP, FSDP1/2, ZeRO-1/2/3; :mod:`trl_plugins.api.engines`) the plugin cannot run
            under, each with its reason; refused at construction.
        replaces_surrogate: the loss hook calls ``ctx.replace_tokens``; at most one such plugin per stack.
        needs_whole_groups: the loss hook needs every micro-batch to hold whole groups (all G rows of each group in it,
            consecutive: ``ctx.group_rows``). The trainer then shuffles groups instead of rows before splitting the
            generation batch, and refuses at construction a ``per_device_train_batch_size`` (or, with evaluation,
            ``per_device_eval_batch_size``) that is not a multiple of the group size (:mod:`trl_plugins.runtime.whole_groups`).
        needs_reference_model: the advantage hook calls ``ctx.reference_logprobs()`` (log-probs under the reference
            policy); with full fine-tuning and ``beta == 0`` the trainer then keeps a frozen copy of the initial policy.
        replaces: the stage quantities the plugin replaces outright rather than adjusts (e.g. ``"the advantages"``,
            ``"the base surrogate on ..."``); shown in ``trl-plugins show`` and ``docs/compatibility.md``.
        overwrites: the chained stage quantities the plugin recomputes from scratch, discarding what the plugins
            before it in the chain did to them (keys of :data:`OVERWRITABLE`: ``"advantages"``, ``"rewards"``). The
            stack runs such a plugin's hook first in that stage's chain (with a warning naming the plugins it moved
            ahead of), and refuses two plugins that overwrite the same quantity. Instances may narrow it by option
            (:meth:`overwritten`).
        conflicts_with: plugins that act on the same quantity ("pick one"), refused together: a mapping
            ``{name: reason}``, or a tuple of names sharing ``conflict_reason``. The reason is the error message's:
            say what both do and why stacking them is wrong, in a self-contained sentence.
        conflict_reason: the reason for every name of a tuple ``conflicts_with``.
        conflicts_with_hooks: hooks whose implementers this plugin refuses to be stacked with, whatever their name:
            ``{hook name: reason}`` (e.g. ``{"trl_plugins_reject_groups": "..."}`` refuses every refill plugin).
            Checked with :attr:`conflicts_with` when the stack is built; the other plugin's hook counts when it is
            enabled (:meth:`hook_enabled`).
        loss_types: the ``loss_type`` values the plugin is defined for (checked when the trainer is built); empty:
            every loss type the run accepts (see :meth:`supported_loss_types`).
        loss_types_reason: why other loss types are refused, shown in the error.
        reconstructed: details the paper does not state and that this plugin reconstructs (shown by
            ``trl-plugins show``).
        official: the :class:`~trl_plugins.api.faithfulness.OfficialSource` the plugin was checked against (repository @
            commit, verdict, options deviating from the official defaults), or one saying that no official code was
            reachable and what is reconstructed; every built-in plugin declares it (``docs/faithfulness.md``).
        claim_metric: ``(metric, what it measures)``: the plugin's headline metric (a name it logs with
            ``ctx.log_metric``, without the ``plugins/<name>/`` prefix), the quantity its paper's claim is about.
            Shown in the console's progress bar and summary and in ``trl-plugins compare`` tables; empty: the
            first metric the plugin logs.
        multi_turn: whether the plugin works with multi-turn tool rollouts (TRL ``tools`` /
            ``environment_factory``): True, or the reason it does not (a self-contained sentence; the plugin is then
            refused at construction with it); None (the default): not stated -- allowed, with a warning.
        image_inputs: whether the plugin works when the prompts carry images (a training dataset with TRL's
            ``image`` / ``images`` column, for a vision-language model): True, or the reason it does not (a
            self-contained sentence, e.g. "its extra rollouts are generated from the prompt text alone"; the plugin
            is then refused at construction with it); None (the default): not stated -- allowed, with a warning.
        moved_by, moved: deprecated spellings that became plugins of their own (one release of grace): the values of
            the option ``moved_by`` that moved, each with its :class:`Moved`. With such a value the stack builds the
            new plugin instead, under this plugin's name (so metrics, reward columns and checkpoint state keep their
            keys), with the options renamed, and warns (``DeprecationWarning`` and the log) naming the new plugin and
            the option mapping. A plugin all of whose ``moved_by`` values moved is deprecated as a whole.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0.1.0"
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Options: ClassVar[type[PluginOptions]] = PluginOptions
    needs_head_stats: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False
    hidden_states_layer: int = -1
    #: Engines this plugin cannot run under, with the reason: ``{"zero3": "why"}`` (names of
    #: :data:`trl_plugins.api.engines.ENGINES`). The trainer refuses the stack at construction under such an engine,
    #: naming plugin, engine and reason.
    unsupported_engines: ClassVar[dict[str, str]] = {}
    replaces_surrogate: ClassVar[bool] = False
    needs_whole_groups: ClassVar[bool] = False
    needs_reference_model: ClassVar[bool] = False
    replaces: ClassVar[tuple[str, ...]] = ()
    overwrites: ClassVar[tuple[str, ...]] = ()
    conflicts_with: ClassVar[tuple[str, ...] | Mapping[str, str]] = ()
    conflict_reason: ClassVar[str] = ""
    conflicts_with_hooks: ClassVar[Mapping[str, str]] = {}
    loss_types: ClassVar[tuple[str, ...]] = ()
    loss_types_reason: ClassVar[str] = ""
    reconstructed: ClassVar[tuple[str, ...]] = ()
    official: ClassVar[OfficialSource | None] = None
    claim_metric: ClassVar[tuple[str, str] | tuple[()]] = ()
    multi_turn: ClassVar[bool | str | None] = None
    image_inputs: ClassVar[bool | str | None] = None
    moved_by: ClassVar[str] = ""
    moved: ClassVar[Mapping[Any, Moved]] = {}

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

    def overwritten(self) -> tuple[str, ...]:
        """The quantities (keys of :data:`OVERWRITABLE`) this instance recomputes from scratch with its options;
        default :attr:`overwrites`. Override when an option decides it (e.g. a baseline that reads the incoming
        advantages or not)."""
        return tuple(self.overwrites)

    def multi_turn_refusal(self) -> str | None:
        """Why this plugin, with its options, cannot run on multi-turn tool rollouts (None: it can). Defaults to
        :attr:`multi_turn` when that is a reason; override to decide from the options."""
        return self.multi_turn if isinstance(self.multi_turn, str) else None

    def image_inputs_refusal(self) -> str | None:
        """Why this plugin, with its options, cannot run on image prompts (None: it can). Defaults to
        :attr:`image_inputs` when that is a reason; override to decide from the options."""
        return self.image_inputs if isinstance(self.image_inputs, str) else None

    def hook_enabled(self, hook: str) -> bool:
        """Whether this instance, with its options, takes part in ``hook`` (default: every hook it implements).
        Override to switch a hook off for some options, e.g. a sampling hook used by one mode only: a disabled hook is
        not called and does not count for the trainer's stage paths (a sampling hook otherwise routes the run
        through the sampling stage and the plugin loss path)."""
        return True

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
    def conflicts(cls) -> dict[str, str]:
        """``{plugin name: reason}`` of the plugins this one refuses to be stacked with."""
        if isinstance(cls.conflicts_with, Mapping):
            return dict(cls.conflicts_with)
        return {name: cls.conflict_reason or "they act on the same quantity" for name in cls.conflicts_with}

    @classmethod
    def deprecated(cls) -> bool:
        """Every value of the :attr:`moved_by` option moved to another plugin: the name is only an old spelling."""
        choices = option_choices(cls.Options, cls.moved_by) if cls.moved else None
        return bool(choices) and set(choices) <= set(cls.moved)

    @classmethod
    def supported_loss_types(cls) -> tuple[str, ...] | None:
        """The ``loss_type`` values a run with this plugin accepts; None: any of TRL's (TRL computes the loss).

        Plugins with sampling or loss hooks run the plugin loss path (:mod:`trl_plugins.runtime.loss`), which implements
        ``SUPPORTED_LOSS_TYPES``; :attr:`loss_types` narrows that further.
        """
        if cls.loss_types:
            return tuple(cls.loss_types)
        if any(hook in LOSS_PATH_HOOKS for hook in cls.hook_names()):
            return SUPPORTED_LOSS_TYPES
        return None

    @classmethod
    def distribution(cls) -> str:
        """The installed distribution that ships the plugin (filled in by the manager)."""
        return getattr(cls, "_distribution", "") or "local"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.options}>"


def _is_hookimpl(func: Any) -> bool:
    return hasattr(func, "trl_plugins_impl")


def hook_method_problems(cls: type) -> list[str]:
    """Mistakes in the hook methods of a plugin class that would otherwise pass silently, each with its fix.

    * a method named like a hook (``trl_plugins_...``) without ``@hookimpl``: pluggy would never call it;
    * a ``trl_plugins_...`` name, or an ``@hookimpl`` method, that is no hook (a misspelling), with the closest
      hook names;
    * a method named like a hook without its ``trl_plugins_`` prefix (``transform_advantages``).
    Attributes of :class:`Plugin` itself are not inspected.
    """
    from trl_plugins.api.errors import suggest

    problems = []
    suffixes = {hook[len("trl_plugins_"):]: hook for hook in HOOK_STAGES}
    for attr in sorted(dir(cls)):
        if attr.startswith("__") or hasattr(Plugin, attr):
            continue
        value = getattr(cls, attr, None)
        if not callable(value):
            continue
        marked = _is_hookimpl(value)
        if attr in HOOK_STAGES:
            if not marked:
                problems.append(
                    f"method {attr!r} is named like a hook but is not decorated with @hookimpl, so it would never be "
                    "called; add `@hookimpl` (from trl_plugins import hookimpl) above it."
                )
        elif attr.startswith("trl_plugins_") or marked:
            hint = suggest(attr, HOOK_STAGES) or suggest("trl_plugins_" + attr, HOOK_STAGES)
            problems.append(
                f"method {attr!r} {'is decorated with @hookimpl' if marked else 'has the hook prefix'} but is no "
                f"hook.{hint or ' Hooks: ' + ', '.join(HOOK_STAGES) + '.'} Rename it (or rename it without the "
                "trl_plugins_ prefix if it is a helper)."
            )
        elif attr in suffixes:
            problems.append(
                f"method {attr!r} looks like the hook {suffixes[attr]!r} without its prefix; hooks are named "
                f"trl_plugins_<hook> and decorated with @hookimpl. Did you mean {suffixes[attr]!r}?"
            )
    return problems
