"""Typed per-plugin options.

A plugin declares its options as a dataclass deriving from :class:`PluginOptions`; every field is made with
:func:`option`, which carries the help text, allowed choices / range, and whether the default is a documented
reconstruction (a detail the paper does not state). ``PluginOptions.from_dict`` validates a user mapping:
unknown keys (with close-match suggestions), wrong types and out-of-range values are refused with a message
that names the plugin, the key, the bad value and what is allowed. Floats must be finite (NaN and +-inf pass no range
check, so they are refused) unless the option is declared with ``allow_nonfinite=True``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from trl_plugins.api.errors import PluginConfigError, suggest

_MISSING = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    help: str,
    choices: typing.Sequence[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    reconstructed: bool = False,
    allow_nonfinite: bool = False,
    default_factory: Any = _MISSING,
) -> Any:
    """A documented plugin option (a dataclass field).

    Args:
        default: the default value (the paper's, where it states one).
        help: one or two sentences for ``trl-plugins show`` and the generated docs.
        choices: allowed values (a ``Literal`` annotation gives them too).
        min, max: inclusive numeric range (``min_exclusive`` makes the lower bound strict).
        reconstructed: True when the paper does not state this detail and the default is our documented
            reconstruction; ``trl-plugins show`` marks such options.
        allow_nonfinite: accept NaN / +-inf for a float option (e.g. ``inf`` meaning "no limit"); refused otherwise.
    """
    metadata = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "reconstructed": reconstructed,
        "allow_nonfinite": allow_nonfinite,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class OptionInfo:
    """Description of one option, as shown by ``trl-plugins show``."""

    name: str
    type: str
    default: Any
    help: str
    choices: tuple | None
    min: float | None
    max: float | None
    reconstructed: bool
    min_exclusive: bool = False

    def range_text(self) -> str | None:
        """The allowed range as ``trl-plugins show`` prints it: ``[0.0, 1.0]``, ``(0.0, 1.0]``, ``> 0.0``, ``<= 5``."""
        lo, hi = self.min, self.max
        if lo is not None and hi is not None:
            return f"{'(' if self.min_exclusive else '['}{lo}, {hi}]"
        if lo is not None:
            return f"{'>' if self.min_exclusive else '>='} {lo}"
        if hi is not None:
            return f"<= {hi}"
        return None


@dataclasses.dataclass
class PluginOptions:
    """Base class of plugin option dataclasses. Subclasses may override :meth:`validate` for cross-field checks.

    ``reconstructed_options`` names options a subclass inherits from a shared option group (e.g. ``gamma`` of
    :class:`~trl_plugins.api.option_groups.OffPolicyOptions`) whose default is, for this plugin, a reconstruction.
    """

    reconstructed_options: typing.ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, values: typing.Mapping[str, Any] | None, plugin: str = "?") -> PluginOptions:
        """Build validated options from a user mapping (YAML / ``plugin_config``)."""
        values = dict(values or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        for key in values:
            if key not in fields:
                allowed = ", ".join(sorted(fields)) or "(none)"
                raise PluginConfigError(
                    f"Unknown option {key!r} for plugin {plugin!r}.{suggest(key, fields)} Allowed options: {allowed}."
                )
        converted = {}
        for key, value in values.items():
            converted[key] = _check_value(plugin, key, value, hints[key], fields[key].metadata)
        instance = cls(**converted)
        instance.validate()
        return instance

    def validate(self) -> None:
        """Cross-field checks; raise :class:`PluginConfigError` with a clear message."""

    @classmethod
    def describe(cls) -> list[OptionInfo]:
        """One :class:`OptionInfo` per option, in declaration order."""
        hints = typing.get_type_hints(cls)
        infos = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not _MISSING else (
                f.default_factory() if f.default_factory is not _MISSING else None
            )
            md = f.metadata
            choices = md.get("choices") or _literal_choices(hints[f.name])
            infos.append(
                OptionInfo(
                    name=f.name,
                    type=_type_name(hints[f.name]),
                    default=default,
                    help=md.get("help", ""),
                    choices=choices,
                    min=md.get("min"),
                    max=md.get("max"),
                    reconstructed=bool(md.get("reconstructed", False)) or f.name in cls.reconstructed_options,
                    min_exclusive=bool(md.get("min_exclusive", False)),
                )
            )
        return infos

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def option_choices(options_cls: type[PluginOptions], name: str) -> tuple | None:
    """The allowed values of option ``name`` of an options class (its ``choices`` or ``Literal``); None: not a choice."""
    info = next((i for i in options_cls.describe() if i.name == name), None)
    return None if info is None else info.choices


def option_default(options_cls: type[PluginOptions], name: str) -> Any:
    """The default value of option ``name`` of an options class."""
    return next(i.default for i in options_cls.describe() if i.name == name)


def _literal_choices(tp: Any) -> tuple | None:
    if get_origin(tp) is Literal:
        return get_args(tp)
    if _is_optional(tp):
        return _literal_choices(_strip_optional(tp))
    return None


def _is_optional(tp: Any) -> bool:
    origin = get_origin(tp)
    return (origin is typing.Union or origin is types.UnionType) and type(None) in get_args(tp)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else typing.Union[tuple(args)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "str"
    if _is_optional(tp):
        return _type_name(_strip_optional(tp)) + " | None"
    origin = get_origin(tp)
    if origin in (list, tuple):
        args = get_args(tp)
        return f"{origin.__name__}[{_type_name(args[0]) if args else 'Any'}]"
    return getattr(tp, "__name__", str(tp))


def _fail(plugin: str, key: str, value: Any, allowed: str) -> PluginConfigError:
    return PluginConfigError(f"Option {key!r} of plugin {plugin!r} got {value!r}; allowed: {allowed}.")


def _check_value(plugin: str, key: str, value: Any, tp: Any, md: typing.Mapping[str, Any]) -> Any:
    """Type-check and coerce one value; range and choice checks from the option metadata."""
    or_none = ""
    if _is_optional(tp):
        if value is None:
            return None
        tp, or_none = _strip_optional(tp), " or None"
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            hint = suggest(str(value), [str(c) for c in choices])
            raise PluginConfigError(
                f"Option {key!r} of plugin {plugin!r} got {value!r}; allowed: "
                f"{', '.join(repr(c) for c in choices)}{or_none}.{hint}"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(plugin, key, value, "true or false" + or_none)
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(plugin, key, value, "an integer" + or_none)
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(plugin, key, value, "a number" + or_none)
        value = float(value)
        if not math.isfinite(value) and not md.get("allow_nonfinite"):
            raise _fail(plugin, key, value, "a finite number" + or_none + _range_note(md))
    elif tp is str:
        if not isinstance(value, str):
            raise _fail(plugin, key, value, "a string" + or_none)
    elif origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _fail(plugin, key, value, f"a list ({_type_name(tp)}){or_none}")
        args = get_args(tp)
        if args and args[0] is not Ellipsis:
            value = [_check_value(plugin, f"{key}[{i}]", v, args[0], {}) for i, v in enumerate(value)]
        value = list(value) if origin is list else tuple(value)
    choices = md.get("choices")
    if choices is not None and value not in choices:
        raise _fail(plugin, key, value, ", ".join(repr(c) for c in choices) + or_none)
    lo, hi = md.get("min"), md.get("max")
    if lo is not None and (value < lo or (md.get("min_exclusive") and value == lo)):
        bound = f"> {lo}" if md.get("min_exclusive") else f">= {lo}"
        raise _fail(plugin, key, value, f"a value {bound}" + (f" and <= {hi}" if hi is not None else "") + or_none)
    if hi is not None and value > hi:
        bound = (" and > " if md.get("min_exclusive") else " and >= ") + str(lo) if lo is not None else ""
        raise _fail(plugin, key, value, f"a value <= {hi}{bound}{or_none}")
    return value


def _range_note(md: typing.Mapping[str, Any]) -> str:
    lo, hi = md.get("min"), md.get("max")
    parts = ([f"{'>' if md.get('min_exclusive') else '>='} {lo}"] if lo is not None else []) + (
        [f"<= {hi}"] if hi is not None else []
    )
    return f" ({' and '.join(parts)})" if parts else ""
