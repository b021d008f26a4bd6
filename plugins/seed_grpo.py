"""SEED-GRPO — Semantic Entropy EnhanceD GRPO (arXiv:2505.12346).

The spread of meanings among a prompt's G answers measures how unsure the model is about the prompt. SEED-GRPO
scales each group's advantages by a decreasing function of that *semantic entropy*: conservative updates on
uncertain prompts, the original signal on confident ones.

1. Cluster the group's completions by meaning: final answers extracted and compared by normalised exact match
   (:mod:`trl_plugins.api.answers`).
2. Semantic entropy with the paper's Monte-Carlo form over the K clusters, ``SE = -(1/K) sum_k log p(C_k)``, and
   its maximum ``SE_max = log G`` (all answers different).
3. ``A_hat_i = A_i * f(alpha * SE / SE_max)`` with ``f`` linear ``1 - x`` (default), exponential ``exp(-x)`` or
   focal ``(1 - x)^gamma``. ``SE = 0`` (every answer agrees) leaves the advantages unchanged.

Reconstructed (marked on the options): the cluster probabilities are frequencies ``|C_k| / G`` (the paper sums
the old policy's sequence probabilities of the cluster's members; frequencies are the usual discrete estimate and
keep ``SE`` in ``[0, log G]``), ``alpha = 1``, ``gamma = 2``, ``f`` clamped at 0 so that an ``alpha > 1`` never flips
a sign, and a completion without an extractable answer counts as a cluster of its own.

The clusters are computed at the reward stage (the only stage that sees the completions; nothing there is
changed) and the scaling is applied at the advantage stage, on the global batch. Stacks with ``empo`` (the
clustering is shared) and with hint scaffolding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import batch_clusters, get_extractor, max_semantic_entropy, semantic_entropy


@dataclass
class SeedGrpoOptions(PluginOptions):
    alpha: float = option(1.0, min=0.0, help="Sensitivity to uncertainty (0 = plain GRPO).", reconstructed=True)
    function: Literal["linear", "exponential", "focal"] = option(
        "linear", help="f(x): linear 1 - x, exponential exp(-x), or focal (1 - x)^gamma."
    )
    gamma: float = option(2.0, min=0.0, help="Exponent of the focal form.", reconstructed=True)
    estimator: Literal["mc", "plugin"] = option(
        "mc", help="Semantic entropy: the paper's -(1/K) sum_k log p_k ('mc') or -sum_k p_k log p_k ('plugin')."
    )
    unanswered: Literal["singleton", "cluster", "ignore"] = option(
        "singleton",
        help="A completion without an answer is its own cluster, they all form one cluster, or they are ignored.",
        reconstructed=True,
    )
    extractor: str = option(
        "task",
        help="Answer extractor: task, boxed, last_number, boxed_or_last_number, or 'package.module:function'.",
    )

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'seed_grpo': {exc}.") from exc


def entropy_scale(se: torch.Tensor, se_max: float, alpha: float, function: str = "linear",
                  gamma: float = 2.0) -> torch.Tensor:
    """Per-group factor ``f(alpha * SE / SE_max)``, clamped at 0.

    Args: se (num_groups,) semantic entropies; se_max = log G (a group of one has SE_max 0 and factor 1).
    Returns: (num_groups,) factors in [0, 1].
    """
    if se_max <= 0:
        return torch.ones_like(se)
    x = alpha * se / se_max
    if function == "linear":
        f = 1.0 - x
    elif function == "exponential":
        f = torch.exp(-x)
    elif function == "focal":
        f = torch.clamp(1.0 - x, min=0.0) ** gamma
    else:
        raise ValueError(f"unknown function {function!r}; allowed: linear, exponential, focal")
    return torch.clamp(f, min=0.0)


def scale_advantages(advantages: torch.Tensor, factors: torch.Tensor, group_size: int) -> torch.Tensor:
    """Multiply each group's rows by its factor. advantages (N,) or (N, T); factors (N/G,). Returns the same shape."""
    rows = factors.repeat_interleave(group_size).to(advantages.device, advantages.dtype)
    return advantages * rows.view((-1,) + (1,) * (advantages.dim() - 1))


class SeedGrpoPlugin(Plugin):
    """Semantic-entropy advantage scaling (advantage stage; clusters read at the reward stage)."""

    name = "seed_grpo"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "SEED-GRPO: Semantic Entropy Enhanced GRPO for Uncertainty-Aware Policy Optimization, arXiv:2505.12346"
    summary = "Scales each group's advantages down by the semantic entropy of its answers (uncertain = conservative)."
    Options = SeedGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No public repository was found; the paper's formula via its arXiv HTML and summaries; alpha, gamma and "
        "the unanswered rows are reconstructed.",
    )
    claim_metric = ("semantic_entropy", "semantic entropy")
    reconstructed = (
        "cluster probabilities are answer frequencies |C_k|/G (paper: summed sequence probabilities)",
        "alpha=1.0, gamma=2.0; f clamped at 0",
        "a completion without an extractable answer is a cluster of its own",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._entropy: torch.Tensor | None = None

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        _, cluster_ids = batch_clusters(ctx, o.extractor)
        self._entropy = torch.tensor(
            [semantic_entropy(ids, o.estimator, o.unanswered) for ids in cluster_ids], dtype=torch.float32
        )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        se = self._entropy
        if se is None or se.numel() * G != ctx.advantages.size(0):
            raise PluginConfigError("seed_grpo: no semantic entropies for this batch (the reward stage did not run).")
        factors = entropy_scale(se, max_semantic_entropy(G), o.alpha, o.function, o.gamma)
        ctx.advantages = scale_advantages(ctx.advantages, factors, G)
        ctx.log_metric("semantic_entropy", float(se.mean()))
        ctx.log_metric("normalized_entropy", float(se.mean() / math.log(G)) if G > 1 else 0.0)
        ctx.log_metric("scale", float(factors.mean()))
        self._entropy = None
