"""Helpers for sampling-stage plugins that work across processes (groups can straddle processes).

A group's rows may live on different processes (TRL splits the generation batch without respecting group
boundaries), so a plugin that moves a completion from one row of a group to another -- a refinement replacing slot
0, a feedback-guided success copied onto the failed attempt it came from -- must gather the candidates first. Every
function here is **collective**: call it on every process, the same number of times, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .answers import completion_text

__all__ = [
    "check_offpolicy_gamma", "completion_text", "context_device", "fail_together", "gather_floats", "gather_id_lists",
    "gather_objects_together", "raise_for_flags", "raise_together", "run_together",
]


def check_offpolicy_gamma(plugin: str, gamma: float, args: Any) -> None:
    """Refuse (at construction) a plugin whose shaping gamma differs from the run's ``offpolicy_shaping_gamma``.

    The shaped off-policy branch ``-A p/(p+gamma)`` of the loss is shared by every plugin of a run, so a plugin's
    documented gamma (LUFFY: 0.1) is a check on the run setting, not a second knob.
    """
    import math

    from .errors import IncompatiblePluginsError

    run_gamma = getattr(args, "offpolicy_shaping_gamma", 0.1)
    if not math.isclose(float(run_gamma), float(gamma)):
        raise IncompatiblePluginsError(
            f"{plugin}: gamma={gamma} but the run's offpolicy_shaping_gamma={run_gamma}. The shaped off-policy branch "
            f"p/(p+gamma) is shared by every plugin of a run; set offpolicy_shaping_gamma: {gamma} in the config (or "
            f"the plugin's gamma to {run_gamma})."
        )


def context_device(ctx: Any) -> torch.device:
    """The device collectives need (the trainer's accelerator device; CPU for hand-built contexts)."""
    trainer = getattr(ctx, "trainer", None)
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.device if accelerator is not None else torch.device("cpu")


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
    """Raise on every process when any process failed (one collective); return when none did.

    A plugin that calls a collective (``ctx.gather``, ``ctx.service.generate``) after a step that can fail on one
    process only -- a row without a reference solution, a judge that timed out -- must not let that process leave
    alone: the others would wait in the next collective forever. The failing process re-raises its own ``error``;
    the others raise a :class:`~trl_plugins.errors.PluginError` naming the process that failed.
    """
    raise_together(ctx.gather, context_device(ctx), plugin, error)


def raise_together(gather: Any, device: torch.device, what: str, error: BaseException | None) -> None:
    """:func:`fail_together` on a bare tensor all-gather (``gather``: (1,) tensor -> (P,) tensor; collective)."""
    flags = gather(torch.tensor([0 if error is None else 1], dtype=torch.long, device=device)).cpu().tolist()
    raise_for_flags(flags, what, error)


def raise_for_flags(flags: Sequence[int], what: str, error: BaseException | None) -> None:
    """Given every process's gathered failure flag (P,): raise this process's ``error``, or a
    :class:`~trl_plugins.errors.PluginError` naming the first failing process; return when no flag is set."""
    from .errors import PluginError

    if error is not None:
        raise error
    failed = [p for p, f in enumerate(flags) if f]
    if failed:
        raise PluginError(
            f"{what}: process {failed[0]} failed (its own traceback has the cause); every process stops with it."
        )


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
    from .errors import PluginError

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
