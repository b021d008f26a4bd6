"""Shared pieces of the length-efficient reasoning plugins (``laser``, ``dler``, ``decs``, ``pear``, ``siri``,
``hbpo``): the correctness options and rule, completion lengths and "cut off unfinished", and the truncation penalty
(every reward column of a row set to 0) that DLER and SIRI share.

Lengths are completion tokens (EOS included, as TRL's completion mask counts them); correctness is
``value >= correct_threshold`` on the correctness column (NaN counts as incorrect): ``correctness_column``, by default
the first reward function that is not a placeholder column (the success rule of :mod:`trl_plugins.api.success`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_plugins.api import PluginConfigError, PluginError, PluginOptions, RewardContext, option
from trl_plugins.api.success import SuccessRule


@dataclass
class CorrectnessOptions(PluginOptions):
    correctness_column: str | None = option(
        None, help="Reward column that says whether a response is correct (default: the first reward function that is "
        "not a placeholder column; other columns never count)."
    )
    correct_threshold: float = option(1.0, help="A response is correct when its correctness value is >= this.")


def correct_rows(ctx: RewardContext, options: CorrectnessOptions) -> torch.Tensor:
    """(N,) bool: ``correctness value >= correct_threshold`` per row of the global batch (NaN: incorrect)."""
    values = ctx.verifier(SuccessRule(options.correctness_column))  # default: first non-placeholder reward function
    return torch.nan_to_num(values, nan=-math.inf) >= options.correct_threshold


def check_reward_columns(plugin: str, trainer, options: CorrectnessOptions, own: str | None = None,
                         format_column: str | None = None) -> None:
    """Refuse a ``correctness_column`` / ``format_column`` that is no reward column, and a run without a correctness
    reward function besides the plugin's ``own`` column (at construction)."""
    names = list(trainer.reward_func_names)
    for key, column in (("correctness_column", options.correctness_column), ("format_column", format_column)):
        if column is not None and column not in names:
            raise PluginConfigError(
                f"{plugin}: {key}={column!r} is not a reward column (columns: {', '.join(names)})."
            )
    if options.correctness_column is None and not [n for n in names if n != own]:
        raise PluginConfigError(
            f"{plugin} needs a correctness reward function (e.g. accuracy_reward) besides its own column."
        )


def eos_ids(trainer) -> set[int]:
    """The token ids that end a completion: TRL's EOS ids (or the tokenizer's) and the pad id."""
    ids = set(getattr(trainer, "eos_token_ids", None) or [trainer.processing_class.eos_token_id])
    pad = getattr(trainer.processing_class, "pad_token_id", None)
    if pad is not None:
        ids.add(pad)
    return ids


def local_completion_ids(ctx: RewardContext, plugin: str) -> list:
    """The local rows' completion token ids (refused when the reward stage has none)."""
    if ctx.local_completion_ids is None:
        raise PluginError(f"{plugin} needs the completions' token ids at the reward stage.")
    return ctx.local_completion_ids


def is_unfinished(ids: list[int], cap: int, eos: set[int]) -> bool:
    """Cut off at ``cap`` tokens without an end token."""
    return len(ids) >= cap and (not ids or ids[-1] not in eos)


def lengths_and_unfinished(ctx: RewardContext, plugin: str, cap: int, eos: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) long completion lengths and (N,) bool "cut off at ``cap`` unfinished" of the global batch (one gather)."""
    local = [(len(ids), is_unfinished(ids, cap, eos)) for ids in local_completion_ids(ctx, plugin)]
    gathered = ctx.gather_object(local)
    device = ctx.rewards_per_func.device
    return (torch.tensor([n for n, _ in gathered], dtype=torch.long, device=device),
            torch.tensor([u for _, u in gathered], dtype=torch.bool, device=device))


def group_accuracy(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool -> (N/G,) fraction correct per group."""
    return correct.float().view(-1, group_size).mean(dim=1)


def truncation_mask(lengths: torch.Tensor, caps: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows whose reward the truncation penalty sets to zero (longer than their cap, or unfinished)."""
    return (lengths > caps) | unfinished


def zero_rows(rewards: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N, K) ``rewards`` with every applicable column of the ``rows`` (N,) bool set to 0 (NaN = not applicable
    stays NaN)."""
    return torch.where(rows.unsqueeze(1) & ~torch.isnan(rewards), 0.0, rewards)
