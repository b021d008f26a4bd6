"""Collectives that fail together: gathers across processes, and raising on every process when one of them failed.

With several processes every collective (an all-gather, a generation call of vLLM server mode, a ZeRO-3 forward)
must be entered by every process, the same number of times, in the same order. A step that fails on one process only
-- a reward function returning NaN for one row, a judge timing out, a row without a reference solution -- must
therefore not let that process leave alone: the others would wait in their next collective until its timeout. The
rule used throughout trl-plugins: the failure becomes a flag that rides in a collective every process enters anyway;
after it, the failing process raises its own error and the others a :class:`~trl_plugins.api.errors.PluginError` naming
the process that failed and its error (class and message: one more collective, entered only when a flag is set).

Every function here is **collective**: call it on every process, the same number of times, in the same order.

* For plugins (``ctx`` is a stage context with ``gather`` / ``gather_object``): :func:`gather_id_lists`,
  :func:`gather_floats`, :func:`fail_together`, :func:`run_together`, :func:`gather_objects_together`. A group's rows
  may live on different processes (TRL splits the generation batch without respecting group boundaries), so a
  plugin that moves a completion from one row of a group to another gathers the candidates first.
* For the framework (a bare all-gather ``gather``: (k,) long tensor -> (P * k,) tensor, e.g. the accelerator's):
  :func:`gather_ints_together`, :func:`raise_together`, :func:`raise_for_flags` and :class:`HeldRewardErrors`, which
  holds reward-function errors until the next framework collective (the reward guard of
  :mod:`trl_plugins.guards.rewards_guard` and ``RolloutContext.score`` hand their errors to it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from trl_plugins.api.errors import PluginError

__all__ = [
    "HeldRewardErrors", "fail_together", "gather_floats", "gather_id_lists", "gather_ints_together",
    "gather_objects_together", "raise_for_flags", "raise_together", "run_together",
]


def context_device(ctx: Any) -> torch.device:
    """The device of a context's collectives (``ctx.device``: the accelerator's; CPU for the kit's contexts and for
    stand-ins without a device)."""
    device = getattr(ctx, "device", None)
    return device if device is not None else torch.device("cpu")


# ------------------------------------------------------------------------------------------------ flags
#: Bytes of a failing process's error message sent to the other processes (:func:`gather_ints_together`).
CAUSE_BYTES = 600


def raise_for_flags(flags: Sequence[int], what: str, error: BaseException | None, cause: str | None = None) -> None:
    """Given every process's gathered failure flag (P,): raise this process's ``error``, or a
    :class:`~trl_plugins.api.errors.PluginError` naming the first failing process (and its error, ``cause``, when it was
    sent); return when no flag is set."""
    if error is not None:
        raise error
    failed = [p for p, f in enumerate(flags) if f]
    if failed:
        said = f" with {cause}" if cause else " (its own traceback has the cause)"
        raise PluginError(f"{what}: process {failed[0]} failed{said}; every process stops with it.")


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return ""
    return f"{type(error).__name__}: {error}".replace("\n", " ")


def _gather_cause(gather: Any, device: torch.device, error: BaseException | None, flags: Sequence[int]) -> str:
    """The first failing process's error (class and message, at most :data:`CAUSE_BYTES` bytes), all-gathered in one
    more collective -- entered by every process, since every process saw the same flags."""
    data = _error_text(error).encode("utf-8")[:CAUSE_BYTES]
    local = torch.zeros(CAUSE_BYTES + 1, dtype=torch.long, device=device)
    local[0] = len(data)
    if data:
        local[1 : len(data) + 1] = torch.tensor(list(data), dtype=torch.long)
    rows = gather(local).view(-1, CAUSE_BYTES + 1).cpu()
    first = next(p for p, f in enumerate(flags) if f)
    size = int(rows[first, 0])
    text = bytes(rows[first, 1 : size + 1].tolist()).decode("utf-8", errors="ignore")
    return text + ("..." if size == CAUSE_BYTES else "")


def gather_ints_together(
    gather: Any, values: Sequence[int], device: torch.device, what: str, error: BaseException | None
) -> torch.Tensor:
    """(P, k) long tensor: every process's ``values`` (k ints), all-gathered in one collective together with whether
    this process failed (``error``); when any process failed, every process raises (:func:`raise_for_flags`).

    ``gather``: a bare all-gather, (k + 1,) long tensor -> ((P * (k + 1)),) tensor (the accelerator's).
    """
    local = torch.tensor([*values, int(error is not None)], dtype=torch.long, device=device)
    gathered = gather(local).view(-1, len(values) + 1).cpu()
    flags = gathered[:, -1].tolist()
    if any(flags):  # every process knows it: one more collective carries the failing process's error to the others
        raise_for_flags(flags, what, error, _gather_cause(gather, device, error, flags))
    return gathered[:, :-1]


def raise_together(gather: Any, device: torch.device, what: str, error: BaseException | None) -> None:
    """:func:`fail_together` on a bare tensor all-gather (:func:`gather_ints_together` with no values)."""
    gather_ints_together(gather, [], device, what, error)


class HeldRewardErrors:
    """Reward-function errors of this process, held back while :attr:`holding` until the next framework collective.

    With several processes the trainer holds the errors of the reward guards (:mod:`trl_plugins.guards.rewards_guard`)
    and of ``RolloutContext.score``: a failing call records its error and returns placeholder zeros, the remaining
    reward functions of the step return zeros without running, every process reaches the next collective, and
    :meth:`gather_with_flag` raises there on every process together. Thread-safe: TRL runs async reward functions
    on its own event-loop thread.
    """

    def __init__(self):
        self.holding = False
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def hold(self, error: BaseException) -> bool:
        """Record ``error`` and return True while holding; return False (the caller raises) otherwise."""
        if not self.holding:
            return False
        with self._lock:
            self._errors.append(error)
        return True

    @contextmanager
    def holding_while(self, enabled: bool) -> Iterator[None]:
        """Hold errors inside the block when ``enabled`` (several processes); forget any stale ones first."""
        self.take()
        self.holding = enabled
        try:
            yield
        finally:
            self.holding = False

    @property
    def failed(self) -> bool:
        """Holding an error already: later reward functions of the same call are skipped (placeholder zeros)."""
        return self.holding and bool(self._errors)

    def take(self) -> BaseException | None:
        """The first held error (None when every call succeeded); forgets all of them."""
        with self._lock:
            first = self._errors[0] if self._errors else None
            self._errors.clear()
        return first

    def gather_with_flag(self, gather: Any, values: Sequence[int], device: Any, what: str) -> torch.Tensor:
        """(P, k): :func:`gather_ints_together` of ``values`` with the held error (taken: forgotten afterwards)."""
        return gather_ints_together(gather, values, device, what, self.take())


# ------------------------------------------------------------------------------------------------ for plugins
def gather_id_lists(ctx: Any, lists: Sequence[Sequence[int]]) -> list[list[int]]:
    """All-gather one token-id list per local row into one per global row (N lists, global order).

    Two collectives through ``ctx.gather`` (lengths, then the right-padded ids).

    Args:
        ctx: a context with ``gather`` ((B, ...) -> (N, ...)), e.g. :class:`~trl_plugins.RolloutContext`.
        lists: B lists of ints (any length, possibly empty).
    """
    device = context_device(ctx)
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long, device=device)
    all_lengths = ctx.gather(lengths).cpu()
    width = max(int(all_lengths.max().item()) if all_lengths.numel() else 0, 1)
    padded = torch.full((len(lists), width), -1, dtype=torch.long)
    for j, ids in enumerate(lists):
        if ids:
            padded[j, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    all_ids = ctx.gather(padded.to(device)).cpu()
    return [all_ids[n, : int(all_lengths[n])].tolist() for n in range(all_ids.size(0))]


def gather_floats(ctx: Any, values: Sequence[float], fill: float = float("nan")) -> torch.Tensor:
    """All-gather one float per local row into an (N,) tensor (one collective). ``None`` entries become ``fill``."""
    local = torch.tensor([fill if v is None else float(v) for v in values], dtype=torch.float32)
    return ctx.gather(local.to(context_device(ctx))).cpu()


def fail_together(ctx: Any, plugin: str, error: BaseException | None) -> None:
    """Raise on every process when any process failed (one collective through ``ctx.gather``); return when none did.

    A plugin that calls a collective (``ctx.gather``, ``ctx.service.generate``) after a step that can fail on one
    process only -- a row without a reference solution, a judge that timed out -- must not let that process leave
    alone: the others would wait in the next collective forever. The failing process re-raises its own ``error``;
    the others raise a :class:`~trl_plugins.api.errors.PluginError` naming the process that failed.
    """
    raise_together(ctx.gather, context_device(ctx), plugin, error)


def run_together(ctx: Any, plugin: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on this process, then :func:`fail_together` with its exception (collective)."""
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # re-raised below, on every process
        fail_together(ctx, plugin, exc)
        raise  # unreachable: fail_together re-raises exc
    fail_together(ctx, plugin, None)
    return result


def gather_objects_together(ctx: Any, plugin: str, fn: Any, *args: Any, **kwargs: Any) -> list:
    """``fn(*args, **kwargs)`` -> this process's (B,) list, gathered into the (N,) list (``ctx.gather_object``).

    For reward-stage plugins, whose context gathers Python lists: when ``fn`` fails on some process, every process
    raises together as with :func:`fail_together` -- the failure flag rides in the same collective, so this costs
    nothing over a plain ``ctx.gather_object``. ``ctx.local_rows`` gives B (the same on every process).
    """
    rows = len(ctx.local_rows)
    try:
        local, error = list(fn(*args, **kwargs)), None
    except Exception as exc:  # re-raised below, on every process
        local, error = [None] * rows, exc
    if error is None and len(local) != rows:
        raise PluginError(f"{plugin}: {len(local)} values for {rows} rows")  # a bug of the plugin, same everywhere
    gathered = ctx.gather_object([(error is not None, value) for value in local])
    firsts = gathered[::rows] if rows else []  # the first row of each process carries its flag
    raise_for_flags([flag for flag, _ in firsts], plugin, error)
    return [value for _, value in gathered]
