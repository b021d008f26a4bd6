"""EMPO — Entropy Minimized Policy Optimization (arXiv:2504.05812), with a TTRL majority-vote mode (arXiv:2504.16084).

Label-free RL: no reference answer is needed. The G completions of a prompt are clustered by meaning — for math,
by their final answers (extracted, then compared by normalised exact match, :mod:`trl_plugins.answers`) — and

* ``mode="semantic_cluster"`` (EMPO): each completion is rewarded with the empirical probability of its cluster,
  ``r_i = |C(i)| / G``. Maximising it minimises the semantic entropy of the group's answers (the model is pushed
  toward its most consistent answer); a completion without an answer gets 0;
* ``mode="majority_vote"`` (TTRL): ``r_i = 1`` if the completion's answer is the group's majority answer, else 0
  (ties go to the answer that appears first; no answer at all gives 0).

The reward is the column ``empo`` (TRL's reward weights apply). Reward functions see only this process's rows,
so the column is filled by a reward transform with the whole groups in view (answers gathered across processes).

Entropy thresholding (EMPO's filter of prompts whose semantic entropy is too low or too high) is available with
``entropy_low`` / ``entropy_high``: groups outside ``(low, high)`` get zero advantages. It is off by default: the
thresholds are not stated by the papers (reconstructed). Watch for the "model collapse step" of label-free RL:
consistency rewards sharpen the initial distribution and can rise then fall; log accuracy separately.

Stacks with ``seed_grpo`` (same answer clustering, computed once per batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins import AdvantageContext, Plugin, PluginConfigError, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.answers import batch_clusters, cluster_fractions, get_extractor, majority_votes, semantic_entropy
from trl_plugins.success import mark_placeholder

from .rlpr import CORRECTNESS_PICK_ONE

COLUMN = "empo"


@dataclass
class EmpoOptions(PluginOptions):
    mode: Literal["semantic_cluster", "majority_vote"] = option(
        "semantic_cluster", help="EMPO cluster-probability reward, or TTRL majority-vote reward."
    )
    extractor: str = option(
        "task",
        help="Answer extractor: task, boxed, last_number, boxed_or_last_number, or 'package.module:function'.",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the empo column.")
    entropy_low: float | None = option(
        None, min=0.0, help="Zero the advantages of groups whose semantic entropy is <= this.", reconstructed=True
    )
    entropy_high: float | None = option(
        None, min=0.0, help="Zero the advantages of groups whose semantic entropy is >= this.", reconstructed=True
    )
    entropy_estimator: Literal["plugin", "mc"] = option(
        "plugin", help="Entropy used by the thresholds: -sum p log p ('plugin') or SEED-GRPO's -(1/K) sum log p.",
        reconstructed=True,
    )

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'empo': {exc}.") from exc


def empo_rewards(cluster_ids: list[list[int | None]], mode: str) -> list[float]:
    """Flat (N,) rewards from per-group cluster ids (EMPO fractions or TTRL majority votes)."""
    out: list[float] = []
    for ids in cluster_ids:
        out.extend(cluster_fractions(ids) if mode == "semantic_cluster" else majority_votes(ids))
    return out


class EmpoPlugin(Plugin):
    """Label-free semantic-cluster (EMPO) or majority-vote (TTRL) reward (reward stage, optional advantage filter)."""

    name = "empo"
    version = "0.1.0"
    paper = "EMPO, arXiv:2504.05812; TTRL majority vote, arXiv:2504.16084"
    summary = "Label-free reward: probability of the completion's answer cluster in its group, or majority vote."
    Options = EmpoOptions
    replaces = ("the correctness reward (a label-free reward column)",)
    conflicts_with = ("rlpr",)
    conflict_reason = CORRECTNESS_PICK_ONE
    reconstructed = (
        "answer equivalence = normalised exact match of extracted answers (EMPO clusters math answers by "
        "math-verify equivalence, free-form ones with a model)",
        "completions without an answer get reward 0 and form no cluster",
        "entropy_low/entropy_high thresholds off by default",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._entropies: torch.Tensor | None = None

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        def empo(completions, **kwargs):
            # Placeholder column: the reward needs whole groups and is filled in by the reward transform.
            return [0.0] * len(completions)

        empo.reward_weight = self.options.reward_weight
        return [mark_placeholder(empo)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        answers, cluster_ids = batch_clusters(ctx, o.extractor)
        values = torch.tensor(empo_rewards(cluster_ids, o.mode), dtype=ctx.rewards_per_func.dtype,
                              device=ctx.rewards_per_func.device)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values
        ctx.rewards_per_func = rewards
        entropies = [semantic_entropy(ids, o.entropy_estimator, unanswered="ignore") for ids in cluster_ids]
        self._entropies = torch.tensor(entropies, dtype=torch.float32)
        ctx.log_metric("semantic_entropy", float(self._entropies.mean()))
        ctx.log_metric("answered_fraction", sum(a is not None for a in answers) / max(len(answers), 1))
        ctx.log_metric("reward", float(values.mean()))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.entropy_low is None and o.entropy_high is None:
            return
        H = self._entropies
        if H is None or H.numel() * ctx.num_generations != ctx.advantages.size(0):
            return
        keep = torch.ones_like(H, dtype=torch.bool)
        if o.entropy_low is not None:
            keep &= H > o.entropy_low
        if o.entropy_high is not None:
            keep &= H < o.entropy_high
        rows = keep.repeat_interleave(ctx.num_generations).to(ctx.advantages.device)
        shape = (-1,) + (1,) * (ctx.advantages.dim() - 1)
        ctx.advantages = ctx.advantages * rows.view(shape).to(ctx.advantages.dtype)
        ctx.log_metric("kept_group_fraction", float(keep.float().mean()))
