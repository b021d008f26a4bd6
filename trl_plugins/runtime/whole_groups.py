"""Whole groups per loss micro-batch, for loss plugins that compare the G rows of a group (``needs_whole_groups``).

TRL shuffles the rows of each process's generation batch and splits it into ``steps_per_generation`` micro-batches
of ``per_device_train_batch_size`` rows, so a micro-batch holds rows of many groups and rarely a whole one. When a
loss plugin declares :attr:`~trl_plugins.api.plugin.Plugin.needs_whole_groups`, the trainer shuffles whole groups
instead (:func:`group_permutation`, drawn like TRL's, used by the seam's ``prepare_inputs``): every micro-batch then holds
``per_device_train_batch_size / G`` whole groups, each as G consecutive rows in index-in-group order. That needs

* ``per_device_train_batch_size % G == 0``: a process's rows start at a group boundary (TRL's repeat sampler lays
  groups out consecutively, process after process) and each micro-batch ends at one;
* with evaluation, ``per_device_eval_batch_size % G_eval == 0`` (the eval batch is not shuffled, but a process must
  hold whole groups).

:func:`check_whole_groups` refuses other settings at construction with the reason. The permutation is drawn from
torch's global generator on each process, as TRL's row shuffle is: no collective is involved, so it is safe under
every engine.
"""

from __future__ import annotations

from typing import Any

import torch

from trl_plugins.api.errors import IncompatiblePluginsError


def check_whole_groups(names: list[str], args: Any, num_generations: int, num_generations_eval: int | None) -> None:
    """Refuse batch sizes that cannot hold whole groups of size G (``names``: the plugins that need them)."""
    who = ", ".join(repr(n) for n in names)
    pdtbs = args.per_device_train_batch_size
    if pdtbs % num_generations != 0:
        raise IncompatiblePluginsError(
            f"Plugin {who} compares the rows of a group in the loss, so every micro-batch must hold whole groups: "
            f"per_device_train_batch_size={pdtbs} is not a multiple of num_generations={num_generations}. "
            f"Allowed: a multiple of {num_generations} (e.g. {num_generations * max(1, pdtbs // num_generations)}); "
            "use steps_per_generation or gradient_accumulation_steps for a larger generation batch."
        )
    evaluating = str(getattr(args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO")
    g_eval = num_generations_eval or num_generations
    if evaluating and args.per_device_eval_batch_size % g_eval != 0:
        raise IncompatiblePluginsError(
            f"Plugin {who} compares the rows of a group in the loss, so every evaluation batch must hold whole "
            f"groups: per_device_eval_batch_size={args.per_device_eval_batch_size} is not a multiple of "
            f"num_generations_eval={g_eval}. Allowed: a multiple of {g_eval}."
        )


def group_permutation(num_rows: int, group_size: int) -> torch.Tensor:
    """(num_rows,) row permutation that moves whole groups of ``group_size`` consecutive rows, keeping their order.

    It draws the same ``torch.randperm(num_rows)`` as TRL's row shuffle (so the random stream after it is TRL's) and
    orders the groups as their first rows appear in that row permutation.

    >>> _ = torch.manual_seed(0); group_permutation(6, 2).tolist()
    [2, 3, 4, 5, 0, 1]
    """
    if num_rows % group_size != 0:
        raise ValueError(f"{num_rows} rows do not split into groups of {group_size}.")
    groups = torch.randperm(num_rows) // group_size
    first = torch.full((num_rows // group_size,), num_rows, dtype=torch.long)
    first.scatter_reduce_(0, groups, torch.arange(num_rows), reduce="amin")
    order = torch.argsort(first)
    return (order.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()


def permute_rows(batch: dict, permutation: torch.Tensor) -> dict:
    """``batch`` with every per-row value (tensors with a first dimension, lists) reordered by ``permutation``."""
    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}
