"""DLER — Doing Length pEnalty Right (arXiv:2510.15110).

The simplest length penalty is truncation: a response longer than the cap (or cut off unfinished at
``max_completion_length``) gets **zero reward** on every reward column (NaN, "not applicable", stays NaN).

DLER's recipe drops the groups without reward variance and resamples (DAPO's dynamic sampling). Here
(``filter_groups="refill"``, the default) the ``trl_plugins_reject_groups`` hook rejects every fresh group whose
combined reward has zero variance *after* the truncation, and the trainer refills its slot with a new prompt
(``max_refill_rounds`` / ``refill_at_limit``); ``filter_groups="none"`` keeps such groups, which then get zero
advantage (cheaper: no regeneration). The refill stage runs before the reward stage, so the plugin adds a reward
column ``dler_length`` of weight 0 (the completion's token count, negative when cut off unfinished) from which it
applies the truncation there. **[reconstructed]** no official code was reachable: the filter judges the combined
reward's standard deviation (verl's ``seq_final_reward`` metric), a choice the paper does not spell out. The
``dynamic_sampling`` plugin instead judges the rewards before the truncation. Batch-level reward normalisation and
the higher clip of DLER's recipe are GRPOConfig settings (``scale_rewards="batch"``, ``epsilon_high``).

**Difficulty-aware DLER** (``difficulty_aware=true``) tightens the cap on easy prompts:
``cap_g = max(min_cap, round(cap (1 - shrink acc_g)))`` with ``acc_g`` the group's accuracy on the correctness column
(:mod:`trl_plugins_builtin._length`).

``zero_unfinished=false`` and ``filter_groups="none"`` with the default cap (``max_completion_length``, which no
completion exceeds) is the neutral setting. Do not combine DLER with TRL's ``mask_truncated_completions`` blindly: DLER wants truncated outputs
to count with zero reward, the TRL option removes them from the loss (a warning says so).

Reconstructed: the difficulty-aware cap's linear shrink (0.5) and its floor; the filter's criterion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, RefillContext, RewardContext, hookimpl, option
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS
from trl_plugins.api.reasons import IMAGES_REFILL

from ._length import (
    CorrectnessOptions,
    check_reward_columns,
    correct_rows,
    eos_ids,
    group_accuracy,
    is_unfinished,
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
    filter_groups: Literal["refill", "none"] = option(
        "refill",
        help="refill (DLER's recipe: DAPO dynamic sampling): reject the groups whose combined reward has zero variance "
        "after the truncation, the trainer refills their slots (max_refill_rounds, refill_at_limit; adds the "
        "weight-0 reward column dler_length); none: keep them with zero advantage (cheaper, no regeneration).",
    )

#: The weight-0 reward column the refill filter reads: token count, negative when cut off unfinished.
LENGTH_COLUMN = "dler_length"


def dler_caps(accuracy: torch.Tensor, cap: int, shrink: float, min_cap: int) -> torch.Tensor:
    """Difficulty-aware caps per group (N/G,): ``max(min_cap, round(cap * (1 - shrink * acc)))`` (Python rounding)."""
    return torch.tensor(
        [max(min_cap, round(cap * (1.0 - shrink * float(a)))) for a in accuracy], dtype=torch.long
    )


class DlerPlugin(Plugin):
    """DLER's truncation penalty, optionally with difficulty-aware caps (reward stage)."""

    name = "dler"
    image_inputs = IMAGES_REFILL
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.2.0"
    paper = ("DLER: Doing Length pEnalty Right - Incentivizing More Intelligence per Token via Reinforcement Learning, "
             "arXiv:2510.15110")
    summary = "Zero reward past a length cap (truncation penalty), tighter caps on easy prompts when difficulty-aware."
    Options = DlerOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found: the truncation penalty follows the paper; the difficulty-aware cap (shrink, "
        "floor) and the criterion of the recipe's dynamic sampling (zero std of the truncated combined reward) are "
        "reconstructed.",
        variants=("filter_groups",),
    )
    claim_metric = ("truncated_fraction", "responses zeroed by the cap")
    reconstructed = (
        "difficulty_aware: cap * (1 - shrink * group accuracy), shrink=0.5, floor min_cap",
        "filter_groups: zero standard deviation of the combined reward after the truncation (no official code)",
    )

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
        check_reward_columns(self.name, trainer, self.options, own=LENGTH_COLUMN)
        self.eos_ids = eos_ids(trainer)

    def _refills(self) -> bool:
        return self.options.filter_groups == "refill"

    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_reject_groups", "trl_plugins_reward_functions"):
            return self._refills()
        return True

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        plugin = self

        def dler_length(prompts, completions, completion_ids=None, **kwargs):
            return [plugin.signed_length(ids) for ids in completion_ids]

        dler_length.reward_weight = 0.0
        return [dler_length]

    def signed_length(self, ids: list[int]) -> float:
        """The ``dler_length`` value of a completion: its token count, negative when cut off unfinished."""
        n = float(len(ids))
        return -n if is_unfinished(list(ids), self.max_len, self.eos_ids) else n

    def _caps(self, correct: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
        """(N,) the cap of every row (difficulty-aware: per group, from ``correct`` (N,) bool)."""
        o = self.options
        cap = o.cap or self.max_len
        if o.difficulty_aware:
            acc = group_accuracy(correct.to(lengths.device), group_size)
            return dler_caps(acc, cap, o.shrink, o.min_cap).to(lengths.device).repeat_interleave(group_size)
        return torch.full_like(lengths, cap)

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext):
        """DAPO's filter on the rewards after the truncation: fresh groups whose combined reward has zero variance."""
        o, G = self.options, ctx.num_generations
        raw = ctx.rewards_per_func[:, list(ctx.run.reward_func_names).index(LENGTH_COLUMN)].cpu()
        lengths, unfinished = raw.abs().long(), raw < 0
        caps = self._caps(correct_rows(ctx, o).cpu(), lengths, G)
        zero = truncation_mask(lengths, caps, unfinished if o.zero_unfinished else torch.zeros_like(unfinished))
        combined = torch.where(zero, torch.zeros_like(ctx.rewards.cpu()), ctx.rewards.cpu())
        flat = combined.view(-1, G).std(dim=1, unbiased=False) == 0 if G > 1 else torch.zeros(ctx.num_groups, dtype=bool)
        rejected = flat & ctx.fresh.cpu()
        if ctx.round == 0:
            ctx.log_metric("filtered_fraction", float(rejected.float().mean()))
        ctx.reject(rejected)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o, G = self.options, ctx.num_generations
        lengths, unfinished = lengths_and_unfinished(ctx, self.name, self.max_len, self.eos_ids)
        device = lengths.device
        ctx.log_metric("mean_length", lengths.float().mean().item())
        caps = self._caps(correct_rows(ctx, o).to(device), lengths, G)
        zero = truncation_mask(lengths, caps, unfinished if o.zero_unfinished else torch.zeros_like(unfinished))
        ctx.rewards_per_func = zero_rows(ctx.rewards_per_func, zero)
        ctx.log_metric("truncated_fraction", zero.float().mean().item())
        ctx.log_metric("mean_cap", caps.float().mean().item())
