"""Tool guard: a tool that raises, hangs or returns garbage is retried, then stops the run with a clear error.

TRL's tool loop (``GRPOTrainer._tool_call_loop``) turns *every* exception of a tool into an ``{"error": ...}``
message for the model. That is right when the model called the tool badly (wrong arguments, an expression that does
not parse): the model should learn from it. It is wrong when the tool itself is broken (a search backend that is
down, a sandbox that hangs, a function returning ``None``): the model is then trained on infrastructure noise, and
nothing tells the user. The guard separates the two, as the reward guard does for judges:

* **the model's fault** -- arguments that do not fit the tool's signature, or a :class:`ToolInputError` raised by
  the tool -- goes back to the model unchanged (TRL's behaviour, no retry);
* **the tool's fault** -- any other exception, no result within ``tool_timeout`` seconds, or a result that is not
  text / a finite number / JSON-serialisable data (TRL would feed its ``str()`` to the model) -- is retried up to
  ``tool_retries`` times with exponential backoff (``tool_retry_backoff`` seconds, doubled each time); when every
  attempt fails, ``tool_failure="raise"`` (default) stops the step with a :class:`ToolError` naming the tool, the
  row (local and global index), the arguments and the cause, on every process together (the failure rides a
  gathered flag, :mod:`trl_plugins.api.collectives`); ``tool_failure="feedback"`` gives the error to the model as TRL
  does.

The trainer wraps the per-row tool dictionaries TRL builds for each batch (``_sync_tool_dicts`` /
``_async_tool_dicts``), so the tools rendered into the prompt (names, signatures, docstrings) are the user's own.
After the first fatal failure of a step the remaining tool calls of that step return at once (the step is lost).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl_plugins.api.errors import PluginConfigError, PluginError

__all__ = [
    "TOOL_FAILURE_MODES", "EnvironmentResetError", "ResetGuard", "ToolError", "ToolGuard", "ToolInputError", "ToolPolicy",
    "check_tool_result",
]

TOOL_FAILURE_MODES = ("raise", "feedback")
#: The longest tool_retry_backoff (seconds) and the longest single wait between two attempts.
MAX_BACKOFF = 3600.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ToolInputError(ValueError):
    """Raised by a tool when the *model's* call is wrong (bad arguments, an expression that does not parse).

    The guard passes it to the model as an error message (TRL's behaviour) without retrying or stopping the run.
    """


class ToolError(PluginError):
    """A tool failed on every attempt (raised, timed out, or returned garbage)."""


@dataclass(frozen=True)
class ToolPolicy:
    """How tool failures are treated (from :class:`~trl_plugins.PluginGRPOConfig`'s ``tool_*`` fields)."""

    timeout: float | None = 60.0
    retries: int = 2
    backoff: float = 0.5
    failure: str = "raise"

    def __post_init__(self):
        if self.timeout is not None and not (_is_number(self.timeout) and math.isfinite(self.timeout)
                                             and self.timeout > 0):
            raise PluginConfigError(
                f"tool_timeout must be a finite number of seconds > 0, or None for no limit; got {self.timeout!r}."
            )
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise PluginConfigError(f"tool_retries must be an integer >= 0; got {self.retries!r}.")
        if not (_is_number(self.backoff) and math.isfinite(self.backoff) and 0 <= self.backoff <= MAX_BACKOFF):
            raise PluginConfigError(
                f"tool_retry_backoff must be a finite number of seconds in [0, {MAX_BACKOFF:g}]; got {self.backoff!r}."
            )
        if self.failure not in TOOL_FAILURE_MODES:
            raise PluginConfigError(f"tool_failure must be one of {list(TOOL_FAILURE_MODES)}; got {self.failure!r}.")

    @classmethod
    def from_args(cls, args: Any) -> ToolPolicy:
        return cls(
            timeout=getattr(args, "tool_timeout", 60.0),
            retries=getattr(args, "tool_retries", 2),
            backoff=getattr(args, "tool_retry_backoff", 0.5),
            failure=getattr(args, "tool_failure", "raise"),
        )


def check_tool_result(result: Any) -> str | None:
    """Why ``result`` is garbage (a sentence), or None when it is a usable tool result.

    Usable: a string, a bool, an int, a finite float, or JSON-serialisable lists / dicts (a list of content blocks
    ``{"type": ...}`` for multimodal tools is accepted as is). Garbage: ``None``, NaN / inf, and objects whose
    ``str()`` is not meant for a model (an object repr).
    """
    if result is None:
        return "returned None"
    if isinstance(result, (str, bool, int)):
        return None
    if isinstance(result, float):
        return None if math.isfinite(result) else f"returned {result!r}"
    if isinstance(result, list) and result and all(isinstance(p, dict) and "type" in p for p in result):
        return None  # multimodal content blocks (TRL passes them through)
    if isinstance(result, (list, dict, tuple)):
        try:
            json.dumps(result, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"returned a {type(result).__name__} that is not JSON-serialisable data ({exc})"
        return None
    return f"returned a {type(result).__name__} object ({_short(repr(result))}), not text, a number or data"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _binds(func: Callable, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit ``func``'s signature (the model's fault), or None."""
    try:
        inspect.signature(func).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    except ValueError:  # no signature available: let the call decide
        return None
    return None


@dataclass
class ToolGuard:
    """Wraps tools row by row and records the first fatal failure of a batch (thread-safe).

    Attributes:
        policy: the :class:`ToolPolicy`.
        errors: fatal :class:`ToolError` s of the current batch, first one first.
    """

    policy: ToolPolicy = field(default_factory=ToolPolicy)
    errors: list[ToolError] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin_batch(self) -> None:
        with self._lock:
            self.errors.clear()

    def take(self) -> ToolError | None:
        """The first fatal error of the batch (None when every tool worked); forgets them."""
        with self._lock:
            first = self.errors[0] if self.errors else None
            self.errors.clear()
        return first

    @property
    def failed(self) -> bool:
        return bool(self.errors) and self.policy.failure == "raise"

    # ------------------------------------------------------------------------------------------------ wrapping
    def wrap_sync(self, name: str, func: Callable, row: int, global_row: int) -> Callable:
        """``func`` with retries, timeout and result check; errors name ``row`` / ``global_row``."""

        @functools.wraps(func)
        def guarded(**arguments):
            mismatch = _binds(func, arguments) is not None
            last = None
            for attempt in range(self.policy.retries + 1):
                time.sleep(self._before_attempt(name, attempt))
                try:
                    result = self._call_with_timeout(func, arguments)
                except ToolInputError:
                    raise
                except TypeError as exc:
                    if mismatch:  # arguments that do not fit the signature: the model's fault, its message unchanged
                        raise exc from None
                    last = exc
                    continue
                except Exception as exc:  # the tool's fault: retried below
                    last = exc
                    continue
                last = self._bad_result(result)
                if last is None:
                    return result
            raise self._fatal(name, arguments, row, global_row, last)

        return guarded

    def wrap_async(self, name: str, func: Callable, row: int, global_row: int) -> Callable:
        """Async counterpart of :meth:`wrap_sync` (``asyncio.wait_for`` enforces the timeout)."""

        @functools.wraps(func)
        async def guarded(**arguments):
            mismatch = _binds(func, arguments) is not None
            last = None
            for attempt in range(self.policy.retries + 1):
                await asyncio.sleep(self._before_attempt(name, attempt))
                try:
                    result = await asyncio.wait_for(func(**arguments), self.policy.timeout)
                except ToolInputError:
                    raise
                except TypeError as exc:
                    if mismatch:  # the model's fault (see wrap_sync)
                        raise exc from None
                    last = exc
                    continue
                except asyncio.TimeoutError:
                    last = TimeoutError(f"no result within {self.policy.timeout} s")
                    continue
                except Exception as exc:  # the tool's fault: retried
                    last = exc
                    continue
                last = self._bad_result(result)
                if last is None:
                    return result
            raise self._fatal(name, arguments, row, global_row, last)

        return guarded

    def _before_attempt(self, name: str, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (0: none; then the doubling backoff); raises when an earlier
        tool call of this step already failed (the step stops, so no further call is made)."""
        if self.failed:
            raise ToolError(f"tool {name!r} skipped: an earlier tool call of this step failed")
        return min(self.policy.backoff * 2 ** min(attempt - 1, 60), MAX_BACKOFF) if attempt else 0.0

    @staticmethod
    def _bad_result(result: Any) -> Exception | None:
        """The error a garbage result counts as (retried like a raise), or None when the result is usable."""
        problem = check_tool_result(result)
        return None if problem is None else ValueError(f"the tool {problem}")

    def _call_with_timeout(self, func: Callable, arguments: dict) -> Any:
        if self.policy.timeout is None:
            return func(**arguments)
        box: dict[str, Any] = {}

        def run():
            try:
                box["result"] = func(**arguments)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=run, daemon=True, name="trl-plugins-tool")
        worker.start()
        worker.join(self.policy.timeout)
        if worker.is_alive():  # a hung tool cannot be killed; its daemon thread is abandoned
            raise TimeoutError(f"no result within {self.policy.timeout} s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _fatal(self, name: str, arguments: dict, row: int, global_row: int, cause: BaseException | None) -> ToolError:
        attempts = self.policy.retries + 1
        error = ToolError(
            f"Tool {name!r} failed on local row {row} (global row {global_row}) after {attempts} attempt"
            f"{'s' if attempts > 1 else ''}: {type(cause).__name__}: {cause} (arguments: {_short(repr(arguments))}). "
            "A tool that raises, hangs or returns garbage stops the run (tool_failure='raise'); raise "
            "trl_plugins.ToolInputError for calls that are the model's fault, or set tool_failure='feedback' to give "
            "such errors to the model as TRL does."
        )
        error.__cause__ = cause
        with self._lock:
            self.errors.append(error)
        return error

    def wrap_row_dicts(self, sync_dicts: list[dict], async_dicts: list[dict], global_rows: list[int]) -> None:
        """Wrap TRL's per-row tool dictionaries in place (row ``i`` of the batch is global row ``global_rows[i]``)."""
        for i, (sync_tools, async_tools) in enumerate(zip(sync_dicts, async_dicts)):
            for name, func in list(sync_tools.items()):
                sync_tools[name] = self.wrap_sync(name, func, i, global_rows[i])
            for name, func in list(async_tools.items()):
                async_tools[name] = self.wrap_async(name, func, i, global_rows[i])


# ------------------------------------------------------------------------------------------------ environment resets
class EnvironmentResetError(PluginError):
    """An environment's ``reset`` raised for a row: the rollout of that row cannot start."""


_RESET_GUARDED = "_trl_plugins_reset_guarded"


class ResetGuard:
    """Holds the first exception of an environment's ``reset`` (TRL calls it per row before generating) so the trainer
    can raise it on every process together at the start of generation instead of on the failing process alone.

    :meth:`guard` wraps the ``reset`` of every pooled environment instance and every factory (instances made later),
    once; :meth:`take` returns the held error, naming the environment class, the row and the cause.
    """

    def __init__(self):
        self._failure: tuple[Any, BaseException] | None = None

    def guard(self, factories: dict | None, pool: dict | None) -> dict | None:
        """The factories, wrapped; every instance already in ``pool`` ({name: [instances]}) gets a guarded reset."""
        if factories is None:
            return None
        for instances in (pool or {}).values():
            for instance in instances:
                self._wrap(instance)
        return {name: self._wrap_factory(factory) for name, factory in factories.items()}

    def _wrap_factory(self, factory: Callable) -> Callable:
        if getattr(factory, _RESET_GUARDED, False):
            return factory

        @functools.wraps(factory)
        def make(*args, **kwargs):
            return self._wrap(factory(*args, **kwargs))

        setattr(make, _RESET_GUARDED, True)
        return make

    def _wrap(self, instance: Any) -> Any:
        reset = getattr(instance, "reset", None)
        if reset is None or getattr(reset, _RESET_GUARDED, False):
            return instance

        @functools.wraps(reset)
        def guarded_reset(**kwargs):
            if self._failure is not None:
                return None  # the step is lost: the remaining rows do not start their environments
            try:
                return reset(**kwargs)
            except Exception as exc:  # raised by the trainer on every process together (take)
                self._failure = (instance, exc)
                return None

        setattr(guarded_reset, _RESET_GUARDED, True)
        try:
            instance.reset = guarded_reset  # an instance attribute: TRL calls environment.reset(**row)
        except AttributeError:  # __slots__ / a read-only attribute: left unguarded (raises as in TRL)
            pass
        return instance

    def take(self, environments: list | None, start: int, process: int) -> EnvironmentResetError | None:
        """The held failure as an error naming class, row (``environments``: this batch's instances in row order,
        ``start``: the global index of the first local row) and cause; None when every reset succeeded. Forgets it."""
        if self._failure is None:
            return None
        instance, exc = self._failure
        self._failure = None
        local = next((i for i, env in enumerate(environments or []) if env is instance), None)
        where = (f"row {start + local} (local row {local} on process {process})" if local is not None
                 else f"a row on process {process}")
        return EnvironmentResetError(
            f"environment_factory: {type(instance).__name__}.reset raised {type(exc).__name__}: {_short(str(exc), 200)} "
            f"for {where}, so its rollout could not start; every process stops with it. Fix the environment's reset "
            "or the dataset row it was given (reset receives the row's columns as keyword arguments)."
        )
