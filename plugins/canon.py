"""CANON — Conditional Advantage Estimation (arXiv:2509.23962).

Instead of comparing each response with the mean of its whole group, CANON splits every group by a metric
(the response's mean old-policy token entropy, or its length) into a low half ``C-`` (the ``floor(G/2)``
smallest values) and a high half ``C+`` (the rest) and compares each response with the *other* half's mean
reward (inter-group term, weight ``lam``) and with its own half's mean (intra-group term, weight ``1-lam``).
The sign of the learned preference (e.g. "higher entropy is better when it pays off") is thus read from the
data, not hand-picked.

Entropy version, with ``mu-``/``mu+`` the mean rewards of ``C-``/``C+``::

    i in C+:  A_i = lam * (R_i - alpha * mu- + b) + (1 - lam) * (R_i - mu+)
    i in C-:  A_i = lam * (alpha * R_i - mu+ - b) + (1 - lam) * (R_i - mu-)

Length version: ``alpha`` multiplies ``R_i`` in ``C+`` and ``mu+`` in ``C-`` instead. No std normalisation.
Identity: ``lam = 0.5``, ``alpha = 1``, ``b = 0`` and even ``G`` give ``A_i = R_i - mean(R)`` (Dr.GRPO).

Defaults are the paper's (alpha = 1, b = 0, lam = 1). ``lam`` can also change during training
(``lam_schedule``): ``"annealed"`` is the official code's annealed estimator (biuboomc/CANON,
``dr_entropy_token_budget_annel``): the inter-group weight is the **batch accuracy**, the mean reward of the
generation batch (first intra-group, later inter-group as accuracy rises); ``"annealed_reverse"`` uses one minus
it (the official code's commented-out alternative, first inter, later intra). The batch mean is clamped to [0, 1]
(the official code assumes 0/1 rewards and does not clamp). ``"linear"`` moves ``lam`` linearly to ``lam_final``
over ``max_steps``: a schedule of this plugin, not of the paper. The official code's cosine-with-restart schedules
are not offered. The paper divides by the maximal length ``Lmax``; TRL's
``loss_type="dr_grpo"`` (recommended) already divides by ``max_completion_length``, so the plugin does not
(``divide_by_max_length`` restores it for other loss types). Ties in the metric are broken by the row's global
position (stable sort), so the split is deterministic.

Official code checked against: ``biuboomc/CANON@7d6f814`` (faithful with documented options; the files and the deviating
options: ``trl-plugins show canon``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginConfigError, PluginOptions, hookimpl, option


@dataclass
class CanonOptions(PluginOptions):
    metric: Literal["entropy", "length"] = option(
        "entropy", help="Metric that splits each group: mean old-policy token entropy, or completion length."
    )
    lam: float = option(
        1.0, min=0.0, max=1.0,
        help="Weight of the inter-group comparison (paper's mu); 1 - lam weights the intra-group one.",
    )
    alpha: float = option(1.0, help="Scale on R_i (C+) / mu- (C-) in the entropy version (Eq. 8); 1 = paper default.")
    b: float = option(0.0, help="Bias added to the high half's inter-group term (subtracted for the low half).")
    lam_schedule: Literal["constant", "annealed", "annealed_reverse", "linear"] = option(
        "constant",
        help="constant: lam. annealed (official annealed estimator): lam = the generation batch's mean reward "
        "(accuracy), clamped to [0, 1]. annealed_reverse: 1 - that mean (official commented-out variant). "
        "linear: lam to lam_final over max_steps (not from the paper).",
    )
    lam_final: float | None = option(
        None, min=0.0, max=1.0, help="End value of lam_schedule='linear' (required there, refused otherwise).",
    )
    divide_by_max_length: bool = option(
        False, help="Divide advantages by max_completion_length (the paper's 1/Lmax); off because dr_grpo already does.",
    )

    def validate(self) -> None:
        if (self.lam_schedule == "linear") != (self.lam_final is not None):
            raise PluginConfigError(
                f"Options of plugin 'canon': lam_final={self.lam_final!r} with lam_schedule={self.lam_schedule!r}; "
                "lam_final is required with lam_schedule='linear' and allowed only there."
            )


def batch_accuracy_lam(rewards: torch.Tensor, reverse: bool = False) -> float:
    """The official annealed inter-group weight: the mean of ``rewards`` (N,) (NaN ignored) clamped to [0, 1];
    ``reverse`` gives one minus it. An all-NaN batch gives 0.5."""
    valid = rewards[~torch.isnan(rewards)]
    accuracy = min(max(float(valid.float().mean()), 0.0), 1.0) if valid.numel() else 0.5
    return 1.0 - accuracy if reverse else accuracy


def canon_advantages(
    rewards: torch.Tensor, metric: torch.Tensor, group_size: int, lam: float, alpha: float, b: float, version: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """CANON advantages of whole groups.

    Args:
        rewards: (N,) rewards, N = num_groups * group_size, groups contiguous. A NaN reward (no reward function
            applied to the row) gets advantage 0 and counts as 0 in its half's mean, as in TRL's nansum.
        metric: (N,) entropy or length per response.
        group_size: G.
        lam, alpha, b: the formula's parameters; version: "entropy" or "length".
    Returns:
        advantages (N,) and the per-group reward gap ``mu+ - mu-`` (num_groups,).
    """
    G = group_size
    R = rewards.view(-1, G).float()
    M = metric.view(-1, G).float()
    n_groups = R.size(0)
    adv = torch.zeros_like(R)
    gaps = torch.zeros(n_groups, dtype=R.dtype, device=R.device)
    if G < 2:
        return adv.view(-1), gaps
    n_low = G // 2
    for g in range(n_groups):
        # stable sort: ties broken by position in the group (= global position)
        order = torch.argsort(M[g].double(), stable=True)
        low, high = order[:n_low], order[n_low:]
        r = torch.nan_to_num(R[g], nan=0.0)
        mu_low, mu_high = r[low].mean(), r[high].mean()
        gaps[g] = mu_high - mu_low
        if version == "entropy":
            adv[g, high] = lam * (r[high] - alpha * mu_low + b) + (1 - lam) * (r[high] - mu_high)
            adv[g, low] = lam * (alpha * r[low] - mu_high - b) + (1 - lam) * (r[low] - mu_low)
        else:
            adv[g, high] = lam * (alpha * r[high] - mu_low + b) + (1 - lam) * (r[high] - mu_high)
            adv[g, low] = lam * (r[low] - alpha * mu_high - b) + (1 - lam) * (r[low] - mu_low)
        adv[g, torch.isnan(R[g])] = 0.0
    return adv.view(-1), gaps


class CanonPlugin(Plugin):
    """Conditional advantage estimation on entropy or length (advantage stage)."""

    name = "canon"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Conditional Advantage Estimation for Reinforcement Learning in Large Reasoning Models (CANON), "
        "arXiv:2509.23962"
    )
    summary = "Advantages from comparing each response with the other half of its group, split by entropy or length."
    Options = CanonOptions
    official = OfficialSource(
        "biuboomc/CANON", "7d6f814", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py",),
        note="lam_schedule='linear' is a schedule of this plugin, not of the paper; the batch mean of 'annealed' is "
        "clamped to [0, 1].",
    )
    claim_metric = ("high_minus_low_reward", "reward gap between the two halves of a group")
    replaces = ("the advantages",)
    overwrites = ("advantages",)  # recomputed from the rewards: runs first in the advantage chain

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.loss_type != "dr_grpo" and not self.options.divide_by_max_length:
            warnings.warn(
                f"canon: the paper's objective divides by the maximal length; with loss_type={args.loss_type!r} "
                "use loss_type='dr_grpo' (recommended) or set divide_by_max_length=true.",
                stacklevel=2,
            )
        self._max_steps = max(int(getattr(args, "max_steps", 0) or 0), 1)
        self._max_len = trainer.max_completion_length

    def current_lam(self, step: int, rewards: torch.Tensor) -> float:
        """lam for a generation batch at ``step`` with combined rewards (N,), by ``lam_schedule``."""
        o = self.options
        if o.lam_schedule in ("annealed", "annealed_reverse"):
            return batch_accuracy_lam(rewards, reverse=o.lam_schedule == "annealed_reverse")
        if o.lam_schedule == "constant":
            return o.lam
        frac = min(max(step / self._max_steps, 0.0), 1.0)
        return o.lam + (o.lam_final - o.lam) * frac

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.metric == "entropy":
            metric = ctx.policy_stats().mean_entropy
        else:
            metric = ctx.completion_lengths
        lam = self.current_lam(ctx.step, ctx.rewards)
        adv, gaps = canon_advantages(ctx.rewards, metric, ctx.num_generations, lam, o.alpha, o.b, o.metric)
        if o.divide_by_max_length:
            adv = adv / self._max_len
        ctx.advantages = adv.to(ctx.advantages.dtype)
        ctx.log_metric("lam", lam)
        ctx.log_metric("high_minus_low_reward", gaps.mean().item())
        ctx.log_metric("abs_advantage", adv.abs().mean().item())
