"""SIRI — Scaling Iterative RL with Interleaved compression (arXiv:2509.25176).

The maximal rollout length oscillates during training -- compression phases with a short cap, expansion phases with a
long one -- set on the generation itself (:meth:`~trl_plugins.PluginGRPOTrainer.set_generation_length_cap`, HF
generation and vLLM) at the start of training, on resume and after every optimizer step, with the length-capping
reward: every reward column of a response longer than the current cap, or cut off at it without EOS, is 0 (NaN, "not
applicable", stays NaN; evaluation batches use ``max_completion_length``).

Schedulers: ``cosine`` (the official models') and ``stair``; the caps and the period are options (the paper's
8K/16K-token settings are far beyond small models; defaults: ``max_completion_length // 2`` and
``max_completion_length``, 100 steps per cycle, reconstructed). Starting phase: cosine starts at the long cap, stair
with compression [reconstructed]. SIRI has no setting equal to vanilla GRPO (responses cut off at the cap always get
zero reward): disable the plugin for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS

from ._length import eos_ids, lengths_and_unfinished, truncation_mask, zero_rows


@dataclass
class SiriOptions(PluginOptions):
    schedule: Literal["cosine", "stair"] = option(
        "cosine", help="Length scheduler. cosine: cap = min + (max - min)(1 + cos(2 pi step / period)) / 2 (the "
        "official models' scheduler); stair: min for the first half of each period, max for the second.",
    )
    min_cap: int | None = option(
        None, min=1, help="Compression cap in tokens (default: max_completion_length // 2).", reconstructed=True,
    )
    max_cap: int | None = option(None, min=1, help="Expansion cap in tokens (default: max_completion_length).")
    period: int = option(100, min=1, help="Optimizer steps per compression-expansion cycle.", reconstructed=True)


def siri_cap(step: int, low: int, high: int, period: int, schedule: str) -> int:
    """SIRI's length cap at ``step``: ``cosine`` starts at ``high``, reaches ``low`` at half a period and returns
    (``round(low + (high - low)(1 + cos(2 pi step / period)) / 2)``); ``stair`` holds ``low`` for the first half of each
    period (compression) and ``high`` for the second (expansion)."""
    phase = (step % period) / period
    if schedule == "stair":
        return low if phase < 0.5 else high
    return int(round(low + (high - low) * (1 + math.cos(2 * math.pi * phase)) / 2))


class SiriPlugin(Plugin):
    """SIRI's oscillating rollout length cap with the length-capping reward (lifecycle and reward stage)."""

    name = "siri"
    image_inputs = True
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.1.0"
    paper = "SIRI: Scaling Iterative Reinforcement Learning with Interleaved Compression, arXiv:2509.25176"
    summary = "Oscillating rollout length cap (compression / expansion phases) with zero reward beyond it."
    Options = SiriOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found: the compress / expand period and the cap floor are reconstructed.",
    )
    claim_metric = ("truncated_fraction", "responses zeroed by the cap")
    reconstructed = ("default caps max_completion_length // 2 and max_completion_length, period 100 steps, starting "
                     "phase",)

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.eos_ids: set[int] = set()

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        self.eos_ids = eos_ids(trainer)

    def cap(self, step: int) -> int:
        """The rollout length cap at optimizer step ``step`` (compression and expansion phases alternate)."""
        o = self.options
        high = min(o.max_cap or self.max_len, self.max_len)
        low = min(o.min_cap or max(1, self.max_len // 2), high)
        return siri_cap(step, low, high, o.period, o.schedule)

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        # at the start of training and on resume: the cap of the current step
        trainer.set_generation_length_cap(self.cap(trainer.global_step))
        return None

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        trainer.set_generation_length_cap(self.cap(int(step)))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        cap = self.cap(ctx.step) if ctx.mode == "train" else self.max_len
        lengths, unfinished = lengths_and_unfinished(ctx, self.name, cap, self.eos_ids)
        zero = truncation_mask(lengths, torch.full_like(lengths, cap), unfinished)
        ctx.rewards_per_func = zero_rows(ctx.rewards_per_func, zero)
        ctx.log_metric("cap", float(cap))
        ctx.log_metric("truncated_fraction", zero.float().mean().item())
