"""DARS / DARS-B — Difficulty Adaptive Rollout Sampling with breadth scaling (arXiv:2508.13755).

GRPO's advantage mass per prompt, ``N * S(a)`` with ``S(a) = 2a(1-a)`` (``2 sqrt(a(1-a))`` with std normalisation),
peaks at accuracy ``a = 0.5`` and vanishes for hard prompts. DARS spends extra rollouts on low-accuracy prompts to
lift their mass. Facts from the official code (yangzhch6/DARS @9b21b71, ``ray_dars_trainer.py``):

1. Round 1: ``N`` rollouts per prompt; ``a`` = mean binary reward of the prompt.
2. ``delta_N(a)``: ``a <= 1e-6`` counts as ``a = 0.5 / N``; ``a >= 0.5`` gives 0; without std ``S = 2a(1-a)`` and
   ``A_peak = N / 2``, with std ``S = 2 sqrt(a(1-a))`` and ``A_peak = N``;
   equal treatment (ET): ``ceil((A_peak - N S) / S)``; hardness weighted (HW): ``ceil((2(1-a) A_peak - N S) / S)``;
   both capped at ``N_max - N``.
3. Round 2: ``delta_N`` more rollouts of the prompt (temperature 1), merged with round 1 into one enlarged group.
4. The merged groups with accuracy 0 or ``>= upper_threshold`` (1.0) are dropped.
5. Advantage ``R - mean`` over the enlarged group (``grpo_use_std=False``: no std).
6. Breadth (DARS-B): train batch 3072 prompts, PPO mini-batch = batch (one update per pass), 2 PPO epochs.
   Official scripts: N = 8, N_max = 32 (ET) / 64 (HW).

In TRL the group size G is fixed and the batch has a fixed number of group slots, so this plugin runs DARS through
the refill stage (``trl_plugins_reject_groups``):

* round 0: each group's accuracy ``a`` (the verifier column, ``success_threshold``) gives ``delta_N(a)``; the plugin
  asks for ``ceil(delta_N / G)`` extra groups of the same prompt (``ctx.repeat``).
  **[reconstructed]** extra rollouts come in whole groups of G (the official code adds ``delta_N`` single rollouts);
  ``extra_rounding="floor"`` spends at most ``delta_N``;
* as officially (``ray_dars_trainer.py:1006-1017``), every prompt that stays in the batch gets **all** its extra
  rollouts, zero-accuracy prompts included; a prompt is never trained with part of its extras, and a zero-accuracy
  prompt's slot never goes to another prompt while it is kept. Extra groups take the slots of the groups the DARS
  filter drops (point 4; ``ray_dars_trainer.py:1084-1092``): all-correct groups at once, and pools (a prompt's groups
  together) whose merged accuracy is 0 or ``>= upper_threshold`` once their extra groups are in.
  **[reconstructed]** the official train batch grows by the extra rollouts; here the batch has a fixed number of group
  slots, so when the prompts' extras need more slots than the filter frees, prompts are admitted hardest first (most
  extra groups; then by slot) as long as the admitted prompts' extras fit into the freed slots plus the slots of the
  prompts not admitted; those leave the batch before training (``plugins/dars/evicted_prompts``) -- as if the
  generation batch had held fewer prompts. Free slots left over are refilled from the trainer's refill stream, and
  those new prompts get the same treatment in the next round;
* advantage: ``R - mean`` over the pool (``AdvantageContext.pool_ids``), divided by the pool's std only with
  ``use_std`` (point 5). This replaces TRL's advantages (``scale_rewards`` does not apply);
* breadth (``breadth=True``): the plugin cannot change the batch size; it checks at construction that the run does
  the official update schedule -- two passes over each generation batch (``num_iterations=2``), one optimizer step
  per pass (``steps_per_generation == gradient_accumulation_steps``) -- and the breadth itself is the batch you
  configure (the paper: 3072 prompts; scale ``per_device_train_batch_size`` / ``gradient_accumulation_steps``).

The refill stage's limits apply (``max_refill_rounds``, ``refill_at_limit``); every rollout is counted
(``plugins/framework/refill_rollouts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    RefillContext,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import REFILLS_GROUPS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_REFILL


def extra_rollouts(acc: float, n: int, n_max: int, schedule: str = "ET", use_std: bool = False) -> int:
    """delta_N(a): extra rollouts DARS gives a prompt of accuracy ``acc`` after ``n`` rollouts (cap ``n_max - n``)."""
    if acc <= 1e-6:
        acc = 0.5 / n
    if acc >= 0.5:
        return 0
    if use_std:
        s_acc, peak = 2.0 * math.sqrt(acc * (1.0 - acc)), float(n)
    else:
        s_acc, peak = 2.0 * acc * (1.0 - acc), 0.5 * n
    target = peak if schedule == "ET" else 2.0 * (1.0 - acc) * peak
    return max(0, min(math.ceil((target - n * s_acc) / s_acc), n_max - n))


def admit_prompts(extras: list[int], free: int) -> list[bool]:
    """Which prompts keep their slot and get all their ``extras[i]`` extra groups, in a batch where ``free`` slots are
    freed by the filter and a prompt not admitted frees its own slot.

    Hardest first (most extra groups; then the given order): the longest run of prompts whose extras fit into ``free``
    plus the slots of the prompts after the run, then any later prompt whose extras still fit into what is left (it
    keeps its own slot). Never a part of a prompt's extras. [reconstructed: the official batch grows instead]"""
    order = sorted(range(len(extras)), key=lambda i: (-extras[i], i))
    admitted = [False] * len(extras)
    spent, k = 0, 0
    while k < len(order) and spent + extras[order[k]] <= free + len(order) - k - 1:
        spent += extras[order[k]]
        admitted[order[k]] = True
        k += 1
    left = free + len(order) - k - spent  # every prompt after the run counted as evicted
    for i in order[k:]:
        if extras[i] + 1 <= left:  # admitting it keeps its own slot too
            admitted[i] = True
            left -= extras[i] + 1
    return admitted


@dataclass
class DarsOptions(SuccessOptions):
    schedule: Literal["ET", "HW"] = option(
        "ET", help="ET: equal treatment (official resampling_func=1); HW: hardness weighted (resampling_func=2)."
    )
    n_max: int | None = option(
        None, min=1,
        help="Most rollouts per prompt (round 1 plus extras); None = the official scripts' 32 for ET, 64 for HW.",
    )
    use_std: bool = option(
        False, help="Std-normalised GRPO (official grpo_use_std, default False): changes S(a) and the advantage."
    )
    upper_threshold: float = option(
        1.0, min=0.0, max=1.0,
        help="Pools whose merged accuracy is >= this (or 0) are dropped and refilled (official upper_threshold).",
    )
    extra_rounding: Literal["ceil", "floor"] = option(
        "ceil",
        help="Extra groups per prompt: ceil(delta_N / G) or floor(delta_N / G). [reconstructed] the official code "
        "adds delta_N single rollouts; groups here have exactly G rows.",
        reconstructed=True,
    )
    breadth: bool = option(
        False,
        help="DARS-B: require the official update schedule (num_iterations=2, steps_per_generation == "
        "gradient_accumulation_steps); the breadth is the batch size you configure (paper: 3072 prompts).",
    )


class DarsPlugin(Plugin):
    image_inputs = IMAGES_REFILL
    multi_turn = REFILLS_GROUPS
    claim_metric = ("extra_groups", "extra rollout groups spent on hard prompts")
    overwrites = ("advantages",)  # pooled R - mean over the prompt's enlarged group, from the rewards
    name = "dars"
    version = "0.2.0"
    paper = "DARS / DARS-B (Depth-Breadth Synergy in RLVR), arXiv:2508.13755"
    summary = "Extra groups of rollouts for low-accuracy prompts (ET / HW schedule); pooled R - mean advantages."
    Options = DarsOptions
    official = OfficialSource(
        "yangzhch6/DARS", "9b21b71", verdict="faithful",
        files=("verl/verl/trainer/ppo/ray_dars_trainer.py",),
        note="A fixed-size batch: prompts whose full extra rollouts find no slot leave the batch (evicted_prompts); "
        "the official batch grows.",
    )
    replaces = ("the advantages",)
    conflicts_with = {
        "dynamic_sampling": (
            "dars applies DAPO's filter itself (pools of accuracy 0 or >= upper_threshold are dropped) after its extra "
            "rollouts; dynamic_sampling would drop the all-fail groups in round 0, before dars spends its extra "
            "rollouts on them -- the hard prompts DARS exists for"
        ),
    }
    reconstructed = (
        "extra rollouts in whole groups of G (extra_rounding)",
        "a fixed-size batch: prompts whose full extras find no slot leave the batch (official: the batch grows)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending: set[int] = set()  # prompt keys whose extra groups were asked for in the previous round

    @property
    def n_max(self) -> int:
        if self.options.n_max is not None:
            return self.options.n_max
        return 32 if self.options.schedule == "ET" else 64

    @hookimpl
    def trl_plugins_configure(self, trainer, args) -> None:
        G = trainer.num_generations
        if self.n_max < G:
            raise IncompatiblePluginsError(f"dars: n_max={self.n_max} is below num_generations={G}; use n_max >= G.")
        if self.options.breadth:
            wrong = []
            if args.num_iterations != 2:
                wrong.append(f"num_iterations={args.num_iterations} (official: 2 PPO epochs)")
            if args.steps_per_generation != args.gradient_accumulation_steps:
                wrong.append(
                    f"steps_per_generation={args.steps_per_generation} != gradient_accumulation_steps="
                    f"{args.gradient_accumulation_steps} (official: one update per pass over the batch)"
                )
            if wrong:
                raise IncompatiblePluginsError(f"dars with breadth=True needs the DARS-B schedule: {'; '.join(wrong)}.")

    def _extra_groups(self, acc: float, G: int) -> int:
        delta = extra_rollouts(acc, G, self.n_max, self.options.schedule, self.options.use_std)
        return math.ceil(delta / G) if self.options.extra_rounding == "ceil" else delta // G

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext) -> None:
        if ctx.round == 0:
            self._pending = set()
        G = ctx.num_generations
        success = ctx.group_success(self.options.success_rule).float()  # (S, G)
        keys = ctx.prompt_keys.tolist()
        fresh = ctx.fresh.tolist()
        upper = self.options.upper_threshold
        for key in self._pending:  # the pools whose extra groups arrived: merged accuracy over the prompt's groups
            slots = [g for g in range(ctx.num_groups) if keys[g] == key]
            acc = float(success[slots].mean())
            if acc <= 0.0 or acc >= upper:
                ctx.reject(slots)
        plans = []
        for g in range(ctx.num_groups):
            if not fresh[g] or keys[g] in self._pending:
                continue
            acc = float(success[g].mean())
            extra = self._extra_groups(acc, G)
            if extra > 0:
                plans.append((g, extra))
            elif acc <= 0.0 or acc >= upper:  # no extras: the group is its own pool, filtered at once
                ctx.reject([g])
        admitted = admit_prompts([extra for _, extra in plans], int(ctx.rejected.sum()))
        self._pending = set()
        for (g, extra), admit in zip(plans, admitted):
            if admit:
                ctx.repeat(g, extra)
                self._pending.add(keys[g])  # judged next round, with its extra groups
        for (g, _), admit in zip(plans, admitted):
            if not admit:
                ctx.reject([g])
        ctx.log_metric("extra_groups", float(sum(extra for (_, extra), a in zip(plans, admitted) if a)))
        ctx.log_metric("evicted_prompts", float(sum(not a for a in admitted)))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext) -> None:
        pools = ctx.pool_ids()
        rewards = ctx.rewards
        _, inverse = torch.unique(pools, return_inverse=True)
        P = int(inverse.max()) + 1
        valid = ~torch.isnan(rewards)
        r = torch.nan_to_num(rewards, nan=0.0)
        count = torch.zeros(P, device=r.device).index_add_(0, inverse, valid.float())
        mean = torch.zeros(P, device=r.device).index_add_(0, inverse, r) / count.clamp(min=1)
        advantages = r - mean[inverse]
        if self.options.use_std:  # official: torch.std (unbiased) over the pool, epsilon 1e-6
            sq = torch.zeros(P, device=r.device).index_add_(0, inverse, (advantages * valid) ** 2)
            std = (sq / (count - 1).clamp(min=1)).sqrt()
            advantages = advantages / (std[inverse] + 1e-6)
        ctx.advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
        ctx.log_metric("pooled_prompts", float((count > ctx.num_generations).sum()))


