"""DLER — Doing Length pEnalty Right (arXiv:2510.15110).

The simplest length penalty is truncation: a response longer than the cap (or cut off unfinished at
``max_completion_length``) gets **zero reward** on every reward column (NaN, "not applicable", stays NaN). The rest of
DLER's recipe is not in this plugin: batch-level reward normalisation and the higher clip are GRPOConfig settings
(``scale_rewards="batch"``, ``epsilon_high``); DAPO's dynamic sampling (drop groups with zero reward variance and
refill the batch) is the ``dynamic_sampling`` plugin -- without it such groups simply get zero advantage. Stacked,
``dynamic_sampling`` judges the rewards *before* DLER's truncation (the refill stage runs before the reward-stage
transforms and sees no completion lengths), so a group whose only correct answers are truncated (all 0 afterwards) is
kept with zero advantage where DLER's recipe would drop and resample it [not reproduced].

**Difficulty-aware DLER** (``difficulty_aware=true``) tightens the cap on easy prompts:
``cap_g = max(min_cap, round(cap (1 - shrink acc_g)))`` with ``acc_g`` the group's accuracy on the correctness column
(:mod:`trl_plugins_builtin._length`).

``zero_unfinished=false`` with the default cap (``max_completion_length``, which no completion exceeds) is the
neutral setting. Do not combine DLER with TRL's ``mask_truncated_completions`` blindly: DLER wants truncated outputs
to count with zero reward, the TRL option removes them from the loss (a warning says so).

Reconstructed: the difficulty-aware cap's linear shrink (0.5) and its floor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from trl_plugins import OfficialSource
from trl_plugins import Plugin, RewardContext, hookimpl, option
from trl_plugins.reasons import LENGTH_COUNTS_TOOL_TOKENS

from ._length import (
    CorrectnessOptions,
    check_reward_columns,
    correct_rows,
    eos_ids,
    group_accuracy,
    lengths_and_unfinished,
    truncation_mask,
    zero_rows,
)


@dataclass
class DlerOptions(CorrectnessOptions):
    cap: int | None = option(None, min=1, help="Truncation cap in tokens (default: max_completion_length).")
    difficulty_aware: bool = option(
        False, help="Difficulty-aware DLER: cap_g = max(min_cap, round(cap * (1 - shrink * group accuracy))).",
    )
    shrink: float = option(
        0.5, min=0.0, max=1.0, help="difficulty_aware: cap_g = cap * (1 - shrink * group accuracy).",
        reconstructed=True,
    )
    min_cap: int = option(1, min=1, help="difficulty_aware: caps never go below this.", reconstructed=True)
    zero_unfinished: bool = option(
        True, help="Responses cut off at max_completion_length without EOS get zero reward too."
    )


def dler_caps(accuracy: torch.Tensor, cap: int, shrink: float, min_cap: int) -> torch.Tensor:
    """Difficulty-aware caps per group (N/G,): ``max(min_cap, round(cap * (1 - shrink * acc)))`` (Python rounding)."""
    return torch.tensor(
        [max(min_cap, round(cap * (1.0 - shrink * float(a)))) for a in accuracy], dtype=torch.long
    )


class DlerPlugin(Plugin):
    """DLER's truncation penalty, optionally with difficulty-aware caps (reward stage)."""

    name = "dler"
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.1.0"
    paper = ("DLER: Doing Length pEnalty Right - Incentivizing More Intelligence per Token via Reinforcement Learning, "
             "arXiv:2510.15110")
    summary = "Zero reward past a length cap (truncation penalty), tighter caps on easy prompts when difficulty-aware."
    Options = DlerOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found: the truncation penalty follows the paper; the difficulty-aware cap (shrink, "
        "floor) is reconstructed; the recipe's dynamic sampling of truncated groups is not reproduced.",
    )
    claim_metric = ("truncated_fraction", "responses zeroed by the cap")
    reconstructed = ("difficulty_aware: cap * (1 - shrink * group accuracy), shrink=0.5, floor min_cap",)

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.eos_ids: set[int] = set()

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        if getattr(args, "mask_truncated_completions", False):
            warnings.warn(
                f"{self.name} (DLER): mask_truncated_completions=True removes truncated completions from the loss, "
                "while DLER trains on them with zero reward; the paper does not mask them.",
                stacklevel=2,
            )
        check_reward_columns(self.name, trainer, self.options)
        self.eos_ids = eos_ids(trainer)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o, G = self.options, ctx.num_generations
        lengths, unfinished = lengths_and_unfinished(ctx, self.name, self.max_len, self.eos_ids)
        device = lengths.device
        ctx.log_metric("mean_length", lengths.float().mean().item())
        cap = o.cap or self.max_len
        if o.difficulty_aware:
            acc = group_accuracy(correct_rows(ctx, o).to(device), G)
            caps = dler_caps(acc, cap, o.shrink, o.min_cap).to(device).repeat_interleave(G)
        else:
            caps = torch.full_like(lengths, cap)
        zero = truncation_mask(lengths, caps, unfinished if o.zero_unfinished else torch.zeros_like(unfinished))
        ctx.rewards_per_func = zero_rows(ctx.rewards_per_func, zero)
        ctx.log_metric("truncated_fraction", zero.float().mean().item())
        ctx.log_metric("mean_cap", caps.float().mean().item())
