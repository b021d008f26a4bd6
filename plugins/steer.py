"""STEER — entropy-change-aware token reweighting (arXiv:2510.10150, "Rethinking Entropy Interventions in RLVR:
An Entropy Change Perspective").

Rather than steering entropy through proxies (advantage, probability), STEER estimates each token's first-order
effect on the policy entropy and down-weights the tokens that would change it most. Facts from the official
code (zz-haooo/STEER @b31df71, ``compute_token_weights`` and ``compute_policy_loss_with_entropy`` registered as
"entropy_control", ``run/run_exp.sh``; restated, not copied):

1. ``x = clamp(exp(sg(lp)), 1e-8, 1 - 1e-8)`` (current policy), ``p_old = clamp(exp(lp_old), 1e-8, 1)``,
   ``H`` = the old policy's token entropy (detached).
2. Estimated entropy change ``Omega = (A / p_old) * x (1 - x) (ln x + H)``; non-finite values are set to 0;
   ``a = |Omega|``.
3. Weights (no gradient), with max / min over the valid tokens of the micro-batch:

   * ``mapping="exp"`` (the paper's runs): ``k = -ln(lambda_min) / max(max a, 0.02)``,
     ``w = clamp(exp(-k a), lambda_min, 1)``; so the token with the largest ``a`` gets exactly ``lambda_min``
     once ``max a >= 0.02``;
   * ``mapping="linear"``: ``w = lambda_max - (a - a_min)(lambda_max - lambda_min) / (a_max - a_min)`` clamped to
     ``[lambda_min, lambda_max]``; the midpoint when ``a_max == a_min``.
4. Loss ``w * L_ppo`` where ``L_ppo`` is the clipped surrogate with dual-clip ``c = 10`` for ``A < 0``:
   ``min(-A c, max(L1, L2))``. TRL has no dual-clip, so the plugin applies it on the clipped loss types:
   dual-clipped tokens get weight 0 (no gradient, as the constant branch has none) plus the constant
   ``w * (-A c)`` as an additive token term (so the loss value is the paper's too). ``dual_clip=None`` turns it
   off. Aggregation is TRL's (the paper uses token-mean, ``loss_type="dapo"``).

Defaults (``run_exp.sh``): exp mapping, lambda_min = 0.8, lambda_max = 1.0, dual-clip 10; the paper also uses
clip 0.2 / 0.28 and no entropy bonus. The code's fallbacks (0.95 / 1.05 and function defaults 0.8 / 1.2) are not
the paper's run settings. ``lambda_min = 1`` (exp mapping) gives weight 1 everywhere: TRL's loss exactly.

Entropy ``H``: ``entropy_source="auto"`` (default) uses ``sg(entropies)`` of the loss forward when the policy
cannot have moved since the rollout (TRL skips ``old_per_token_logps``: one optimizer step per generation batch
and ``num_iterations = 1``; then the current entropy *is* the old one), otherwise the old policy's entropy from
an advantage-stage no-grad forward; ``"current"`` / ``"old"`` force one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    hookimpl,
    option,
)
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES

OLD_ENTROPY_KEY = "steer_old_entropy"
MIN_SCALE = 0.02  # floor of max|Omega| in the exp mapping (official code)


@dataclass
class SteerOptions(PluginOptions):
    mapping: Literal["exp", "linear"] = option("exp", help="Weight mapping of |Omega|: 'exp' (paper runs) or 'linear'.")
    lambda_min: float = option(
        0.8, min=0.0, max=1.0, min_exclusive=True, help="Smallest token weight (given to the largest |Omega|)."
    )
    lambda_max: float = option(
        1.0, min=0.0, help="Largest token weight of the linear mapping (the exp mapping uses 1)."
    )
    dual_clip: float | None = option(
        10.0, min=1.0, min_exclusive=True,
        help="Dual-clip constant c for A < 0: loss capped at -A c (paper: 10); None disables.",
    )
    entropy_source: Literal["auto", "current", "old"] = option(
        "auto",
        help="Entropy H in Omega: 'current' = sg(loss-forward entropies), 'old' = old policy via one advantage-stage "
        "no-grad forward, 'auto' = 'current' when the policy cannot have moved since the rollout, else 'old'.",
        reconstructed=True,
    )

    def validate(self) -> None:
        if self.mapping == "linear" and self.lambda_max < self.lambda_min:
            raise PluginConfigError(
                f"steer: lambda_max ({self.lambda_max}) must be >= lambda_min ({self.lambda_min}) "
                "for the linear mapping."
            )


# ------------------------------------------------------------------------------------------ pure functions
def entropy_change(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor
) -> torch.Tensor:
    """First-order entropy change ``Omega = (A / p_old) x (1 - x) (ln x + H)`` (no grad; non-finite -> 0).

    Args:
        logps: (B, T) current log-probs. old_logps: (B, T) lp_old. advantages: (B, T). entropy: (B, T) old entropy.
    Returns:
        (B, T) float tensor.
    """
    x = logps.detach().float().exp().clamp(1e-8, 1 - 1e-8)
    p_old = old_logps.detach().float().exp().clamp(1e-8, 1.0)
    omega = (advantages.detach().float() / p_old) * x * (1 - x) * (torch.log(x) + entropy.detach().float())
    return torch.where(torch.isfinite(omega), omega, torch.zeros_like(omega))


def steer_weights(
    magnitude: torch.Tensor, mask: torch.Tensor, lambda_min: float, lambda_max: float = 1.0, mapping: str = "exp"
) -> torch.Tensor:
    """Token weights from ``a = |Omega|`` (no grad); max / min over valid tokens.

    Args:
        magnitude: (B, T) ``|Omega|``. mask: (B, T) valid tokens. lambda_min, lambda_max: weight range.
        mapping: "exp" (``clamp(exp(-k a), lambda_min, 1)``, ``k = -ln(lambda_min) / max(max a, 0.02)``) or "linear".
    Returns:
        (B, T) weights; 1 at invalid positions (exp) / the same formula (linear), harmless since they are masked.
    """
    a = magnitude.detach().float()
    m = mask.bool()
    valid = a[m]
    if mapping == "exp":
        a_max = float(valid.max()) if valid.numel() else 0.0
        k = -math.log(lambda_min) / max(a_max, MIN_SCALE)
        return torch.exp(-k * a).clamp(min=lambda_min, max=1.0)
    if valid.numel() == 0:
        return torch.full_like(a, lambda_max)
    a_min, a_max = float(valid.min()), float(valid.max())
    if a_max == a_min:
        return torch.full_like(a, (lambda_min + lambda_max) / 2)
    w = lambda_max - (a - a_min) * (lambda_max - lambda_min) / (a_max - a_min)
    return w.clamp(min=lambda_min, max=lambda_max)


def dual_clip_mask(per_token_loss: torch.Tensor, advantages: torch.Tensor, c: float) -> torch.Tensor:
    """(B, T) bool: tokens where the dual clip is active, ``A < 0`` and ``L > -A c`` (loss values, no grad)."""
    return (advantages < 0) & (per_token_loss.detach() > -advantages * c)


def policy_moves(trainer, args) -> bool:
    """Whether the policy may differ from the rollout policy at the loss (TRL then computes old log-probs)."""
    generate_every = args.steps_per_generation * trainer.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0


class SteerPlugin(Plugin):
    """Down-weights tokens by their estimated entropy change (loss stage)."""

    name = "steer"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "Rethinking Entropy Interventions in RLVR: An Entropy Change Perspective (STEER), arXiv:2510.10150"
    summary = "Token weights in [lambda_min, 1] that shrink with each token's first-order entropy change."
    Options = SteerOptions
    official = OfficialSource(
        "zz-haooo/STEER", "b31df71", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py", "verl/workers/actor/dp_actor.py"),
    )
    claim_metric = ("reweighted_token_fraction", "tokens reweighted")
    reconstructed = (
        "entropy_source='auto' uses the loss forward's entropy when the policy cannot have moved since the rollout "
        "(equal to the old entropy), else an advantage-stage forward",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._use_old_entropy = self.options.entropy_source == "old"
        self._dual_clip = self.options.dual_clip

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        moves = policy_moves(trainer, args)
        self._use_old_entropy = o.entropy_source == "old" or (o.entropy_source == "auto" and moves)
        if args.loss_type not in CLIPPED_LOSS_TYPES:
            self._dual_clip = None  # cispo / sapo / vespo have no clipped max(L1, L2) to dual-clip

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if self._use_old_entropy:
            ctx.set_local_extra(OLD_ENTROPY_KEY, ctx.policy_stats().entropies)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps
        adv = ctx.advantages.expand_as(lp)
        entropy = ctx.extras[OLD_ENTROPY_KEY] if self._use_old_entropy else ctx.entropies
        omega = entropy_change(lp, ctx.old_per_token_logps, adv, entropy)
        w = steer_weights(omega.abs(), ctx.mask, o.lambda_min, o.lambda_max, o.mapping).to(lp.dtype)
        weights = w
        if self._dual_clip is not None:
            dual = dual_clip_mask(ctx.per_token_loss, adv, self._dual_clip) & ~ctx.offpolicy_mask
            if dual.any():
                weights = torch.where(dual, torch.zeros_like(w), w)
                ctx.add_token_loss(torch.where(dual, w * (-adv.detach() * self._dual_clip), torch.zeros_like(w)))
            ctx.log_metric("dual_clip_fraction", ctx.global_masked_mean(dual.float()))
        ctx.scale_tokens(weights)
        ctx.log_metric("mean_weight", ctx.global_masked_mean(w.detach().float()))
        ctx.log_metric("reweighted_token_fraction", ctx.global_masked_mean((w < 1).float()))
        ctx.log_metric("max_abs_entropy_change", float(omega.abs()[ctx.mask.bool()].max()) if ctx.mask.any() else 0.0)
