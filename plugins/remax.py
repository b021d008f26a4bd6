"""ReMax — REINFORCE with the greedy completion's reward as baseline (arXiv:2310.10505).

ReMax drops PPO's value model: the baseline of a prompt is the reward of the policy's own **greedy** completion
of that prompt, so the advantage of a sampled completion says whether it beats what the policy would answer
deterministically. Facts from the paper (Algorithm 1) and the official code (liziniu/ReMax; verl ships the same
estimator as ``adv_estimator=remax``):

1. For every prompt ``x``, sample completions ``y_i`` (the paper samples one; TRL samples G) and decode one greedy
   completion ``y_greedy`` with the same policy (no sampling).
2. Score both with the same reward: ``b(x) = r(x, y_greedy)``.
3. ``A_i = r(x, y_i) - b(x)`` for every token of ``y_i`` (an outcome reward: the return-to-go equals ``r``);
   no normalisation by a standard deviation, no value model.

Mapping onto TRL: the sampling stage asks the trainer's generation service for one greedy completion per group
(on the process that holds the group's first row; collective-safe and counted in the rollout budget, so each
step costs ``G + 1`` generations per prompt), scores it with the run's reward functions (their weighted sum, as
TRL combines its columns) and records the score in the row's annotations; the advantage stage replaces TRL's
advantages by ``r_i - b``. The greedy completion is never trained on. The baseline is scored by the reward
functions only: reward-stage transforms of other plugins (which need the whole sampled batch) do not see it.
A row with no reward at all (every column NaN) gets advantage 0. ``baseline="trl"`` keeps TRL's own
group-normalised advantages and generates nothing (the neutral setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from trl_plugins import AdvantageContext, Plugin, PluginError, PluginOptions, RolloutContext, hookimpl, option

#: Annotation key of the greedy baseline's reward, on the first row of each group.
BASELINE_KEY = "remax_greedy_reward"


@dataclass
class RemaxOptions(PluginOptions):
    baseline: Literal["greedy", "trl"] = option(
        "greedy",
        help="'greedy': A = r - r(greedy completion of the prompt) (ReMax); 'trl': keep TRL's advantages and generate "
        "nothing (the neutral setting).",
    )


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``A_i = r_i - b_{g(i)}`` for rows grouped by ``num_generations``; 0 where ``r_i`` is NaN.

    Args:
        rewards: (N,) combined rewards of the sampled rows (group-contiguous).
        baselines: (N // G,) reward of each group's greedy completion.
    Returns:
        (N,) advantages.
    """
    advantages = rewards - baselines.repeat_interleave(num_generations)
    return torch.where(torch.isnan(rewards), torch.zeros_like(advantages), advantages)


class RemaxPlugin(Plugin):
    """Greedy-baseline REINFORCE: the baseline is the reward of one greedy completion per prompt (sampling +
    advantage stages)."""

    name = "remax"
    version = "0.1.0"
    paper = (
        "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large Language Models, "
        "arXiv:2310.10505"
    )
    summary = "Advantage = reward minus the reward of the policy's greedy completion of the same prompt."
    Options = RemaxOptions
    replaces = ("the advantages (reward minus the greedy completion's reward)",)
    conflicts_with = {
        name: f"both replace the advantages outright (ReMax with the greedy completion's reward as baseline, {name} "
        f"{what}); stacked, the later one discards the other's and ReMax's greedy generations are wasted"
        for name, what in (
            ("riskpo", "with Mixed Value-at-Risk credits over bundles"),
            ("canon", "with the other half of the group as baseline"),
            ("disco", "with discriminative sequence weights"),
        )
    }
    reconstructed = (
        "G sampled completions per prompt share one greedy baseline (the paper samples one completion per prompt)",
    )

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        if self.options.baseline != "greedy":
            return
        firsts = [i for i in range(len(ctx)) if ctx.index_in_group[i] == 0]
        completions = ctx.service.generate([ctx.prompts[i] for i in firsts], greedy=True)  # collective
        texts = [ctx.decode(c.completion_ids, i) for i, c in zip(firsts, completions)]
        scores = ctx.score(firsts, texts) if firsts else torch.zeros(0)
        for i, score in zip(firsts, scores.tolist()):
            ctx.annotations[i][BASELINE_KEY] = score
        ctx.log_metric("extra_rollouts", len(firsts))
        finite = [s for s in scores.tolist() if not math.isnan(s)]
        if finite:
            ctx.log_metric("greedy_reward", sum(finite) / len(finite))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if self.options.baseline != "greedy" or ctx.mode != "train":
            return  # no greedy completion in evaluation batches (sampling hooks run on training batches only)
        G = ctx.num_generations
        firsts = ctx.annotations[::G]
        missing = [g for g, a in enumerate(firsts) if BASELINE_KEY not in a]
        if missing:
            raise PluginError(
                f"remax: no greedy baseline for group(s) {missing[:5]} of this batch; the sampling hook records it on "
                "each group's first row (was it disabled, or did a rollout_func bypass the sampling stage?)."
            )
        baselines = torch.tensor([float(a[BASELINE_KEY]) for a in firsts], dtype=ctx.rewards.dtype)
        baselines = torch.nan_to_num(baselines.to(ctx.rewards.device), nan=0.0)
        ctx.advantages = remax_advantages(ctx.rewards, baselines, G)
        ctx.log_metric("baseline_mean", float(baselines.mean()))
        ctx.log_metric("beats_greedy_fraction", float((ctx.advantages > 0).float().mean()))
