"""Small named registries: how a component finds the task-specific oracle that a config value names.

A component that grades with task knowledge it does not have (the programmatic PRM's step verifier, the rule-based
judge's rubric verdicts, a verifier's natural-language feedback, ...) owns one :class:`Registry`, and a plugin option
names the entry (``prm_verifier: arithmetic``). Nothing in the framework or the plugins imports a task: a task is a
leaf that the registries reach by name. An entry is

* a **built-in name** of the owning component's table, ``name -> "package.module:attr"``, imported on first use
  (the bundled arithmetic task's oracles are listed this way, so the task loads only in a run that names one);
* a name given to :meth:`Registry.register` (a third-party task registers its oracles when it is imported:
  ``STEP_VERIFIERS.register("my_task", my_verifier)``);
* or, wherever a name is accepted, a ``"package.module:attr"`` path, imported as given.

An unknown name raises :class:`~trl_plugins.api.errors.PluginConfigError` listing the known names, with close matches.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

from trl_plugins.api.errors import PluginConfigError, suggest

T = TypeVar("T")

__all__ = ["Registry", "import_path"]


def import_path(path: str, what: str = "object") -> Any:
    """The attribute named by ``"package.module:attr"`` (``attr`` may be dotted); a clear error otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginConfigError(f"{what} {path!r} is not of the form 'package.module:attr'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginConfigError(f"{what} {path!r}: module {module_name!r} cannot be imported ({exc}).") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginConfigError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}.") from exc
    return obj


class Registry(Generic[T]):
    """Named entries of one kind, owned by a component (see the module docstring).

    Args:
        kind: what an entry is, for error messages (e.g. ``"programmatic PRM step verifier"``).
        builtin: the owner's table of built-in names, ``name -> "package.module:attr"``, resolved on first use.
        contract: the interface an entry implements, shown in errors (e.g. ``"fn(problem, steps) -> scores"``).
            Entries are callables: :meth:`get` refuses anything else.
    """

    def __init__(self, kind: str, builtin: Mapping[str, str] | None = None, contract: str = ""):
        self.kind = kind
        self.contract = contract
        self._lazy: dict[str, str] = dict(builtin or {})
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T | None = None, *, replace: bool = False) -> Any:
        """Register ``entry`` under ``name`` (usable as a decorator: ``@REGISTRY.register("name")``).

        A name already registered (or built in) is refused unless ``replace``."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} names are non-empty strings without ':'; got {name!r}")

        def add(obj: T) -> T:
            self._callable(obj, name)
            if not replace and name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True to override).")
            self._lazy.pop(name, None)
            self._entries[name] = obj
            return obj

        return add if entry is None else add(entry)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests)."""
        self._entries.pop(name, None)
        self._lazy.pop(name, None)

    def get(self, name: str | T) -> T:
        """The entry for a registered name or a ``"package.module:attr"`` path; a non-string is returned as given
        (an entry passed directly)."""
        if not isinstance(name, str):
            return name
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            entry = self._callable(import_path(self._lazy[name], f"{self.kind} {name!r}"), name)
            self._entries[name] = entry
            return entry
        if ":" in name:
            return self._callable(import_path(name, self.kind), name)
        raise self._unknown(name)

    def check(self, name: str, where: str = "") -> None:
        """Refuse a name that is neither registered, built in, nor a ``"module:attr"`` path, without importing anything
        (option validation at construction); ``where`` prefixes the message (e.g. ``"Option 'x' of plugin 'y': "``)."""
        if isinstance(name, str) and name not in self and ":" not in name:
            raise self._unknown(name, where)

    def _unknown(self, name: str, where: str = "") -> PluginConfigError:
        known = ", ".join(repr(n) for n in self.names()) or "(none)"
        contract = f" ({self.contract})" if self.contract else ""
        return PluginConfigError(
            f"{where}Unknown {self.kind} {name!r}.{suggest(name, self.names())} Known: {known}; or a "
            f"'package.module:attr' path to your own{contract}."
        )

    def names(self) -> list[str]:
        """Every registered and built-in name, sorted."""
        return sorted({*self._entries, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _callable(self, entry: Any, name: str) -> Any:
        if not callable(entry):
            raise PluginConfigError(f"{self.kind} {name!r} is not callable (got {type(entry).__name__}).")
        return entry

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()!r})"

