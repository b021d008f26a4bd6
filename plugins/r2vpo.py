"""R2VPO — Ratio-Variance Regularized Policy Optimization (arXiv:2601.03320; extended version arXiv:2605.26784).

PPO/GRPO keep updates in a trust region by clipping the importance ratio ``r = pi_theta / pi_old``, which zeroes
the gradient of every token past the clip range, including high-return "eureka" tokens, and makes slightly stale
samples useless. R2VPO constrains the **variance (second central moment) of the ratio** instead: a smooth,
distribution-level relaxation of the trust region, enforced by a primal-dual scheme, that keeps the gradient of
every token and down-weights stale data rather than discarding it.

What was checked against what: the abstract and introduction of arXiv:2601.03320 ("... for Efficient LLM
Fine-tuning") and the abstract of its extended version arXiv:2605.26784 (ICML), the only parts of the paper
reachable to us; no official code was found (no public repository of the authors). They state: the ratio clip is
removed (the unclipped importance-weighted objective), the constraint is on the ratio's variance (its second central
moment), it is enforced with a primal-dual (Lagrangian) formulation, and stale samples are down-weighted and reused
from a replay buffer. The method section's formulas and hyper-parameters were not reachable, so every concrete
formula and default below is **our reconstruction**, consistent with those statements (each option is marked so):

1. Per token, replacing TRL's clipped surrogate: ``l = -r A + lambda (r - 1)^2``, with ``r`` TRL's importance ratio
   at its ``importance_sampling_level``. ``(r - 1)^2`` is the ratio's squared deviation from its mean under the old
   policy (``E_old[r] = 1``), so its token-mean is the sample second central moment; it is aggregated with the
   surrogate by ``loss_type``.
2. Dual ascent once per optimizer step: ``lambda <- clip(lambda + dual_lr * (V - variance_target), 0, max_lambda)``,
   with ``V`` the global token-mean of ``(r - 1)^2`` over the step's micro-batches (all processes).
3. The paper's replay buffer (rollouts of earlier steps re-used) is not part of this plugin; the staleness TRL
   offers (``num_iterations > 1``, ``steps_per_generation > gradient_accumulation_steps``) is handled by 1-2.

Identity: in a single on-policy pass (``r = 1`` in value) the penalty and its gradient vanish and the unclipped
surrogate has the clipped one's value and gradient, so R2VPO trains exactly as GRPO/DAPO there; it differs once
samples are reused. Off-policy tokens spliced by sampling plugins keep their shaped branch.

No official code was reachable and the method
section was unreachable: the dual update (initial lambda, target, learning rate, cap) is reconstructed (``trl-plugins
show r2vpo``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option


@dataclass
class R2vpoOptions(PluginOptions):
    initial_lambda: float = option(
        1.0, min=0.0, help="Starting value of the dual variable lambda (the penalty's weight).", reconstructed=True
    )
    variance_target: float = option(
        0.04, min=0.0,
        help="delta: the ratio variance the constraint allows (0.04 = 0.2^2, the square of PPO's usual clip range).",
        reconstructed=True,
    )
    dual_lr: float = option(
        1.0, min=0.0,
        help="Step size of the dual ascent on lambda, once per optimizer step; 0 keeps lambda fixed.",
        reconstructed=True,
    )
    max_lambda: float = option(
        100.0, min=0.0, help="Upper bound of lambda (keeps the dual ascent bounded).", reconstructed=True
    )


def r2vpo_token_loss(coef_1: torch.Tensor, advantages: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``l = -r A + lambda (r - 1)^2`` per token (no clipping).

    Args:
        coef_1: (B, T) or (B, 1) importance ratio ``r`` with grad. advantages: (B, T) or (B, 1).
    Returns:
        ``(loss, squared_deviation)``, both broadcast to the larger of the two shapes.
    """
    sq = (coef_1 - 1.0) ** 2
    return -coef_1 * advantages + lam * sq, sq


def dual_update(lam: float, variance: float, target: float, lr: float, max_lambda: float) -> float:
    """One projected dual-ascent step: ``clip(lam + lr * (variance - target), 0, max_lambda)``."""
    return min(max(lam + lr * (variance - target), 0.0), max_lambda)


class R2vpoPlugin(Plugin):
    """Unclipped importance-weighted surrogate with a ratio-variance penalty whose weight follows a dual ascent."""
    claim_metric = ('ratio_variance', 'variance of the importance ratio')
    image_inputs = True
    multi_turn = True

    name = "r2vpo"
    version = "0.1.0"
    paper = (
        "Ratio-Variance Regularized Policy Optimization for Efficient LLM Fine-tuning (R2VPO), arXiv:2601.03320 "
        "(extended: arXiv:2605.26784)"
    )
    summary = "Replaces ratio clipping by a penalty on the ratio's variance, weighted by a dual-ascent multiplier."
    Options = R2vpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the method section was unreachable: the dual update (initial lambda, "
        "target, learning rate, cap) is reconstructed.",
    )
    replaces_surrogate = True
    replaces = ("the clipped surrogate on every on-policy token (unclipped r A minus the ratio-variance penalty)",)
    loss_types = ("grpo", "bnpo", "dr_grpo", "dapo")
    loss_types_reason = (
        "R2VPO replaces PPO's clipped surrogate; cispo, sapo, vespo and luspo are other replacements of the same "
        "clipping"
    )
    reconstructed = (
        "the per-token form -r A + lambda (r - 1)^2, the projected dual ascent on lambda and every default (no "
        "official code; checked against the abstracts and introduction of arXiv:2601.03320 / 2605.26784, which state "
        "the unclipped objective, the ratio-variance constraint and the primal-dual scheme, not the formulas)",
        "the paper's replay buffer of earlier rollouts is not implemented",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.lam = float(self.options.initial_lambda)
        self._measurements: list[float] = []

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        values, sq = r2vpo_token_loss(ctx.coef_1, ctx.advantages, self.lam)
        values = values.expand_as(ctx.per_token_logps) if values.shape != ctx.per_token_logps.shape else values
        ctx.replace_tokens(ctx.mask.bool() & ~ctx.offpolicy_mask, values)
        variance = ctx.global_masked_mean(sq.detach().expand_as(ctx.mask))
        if ctx.mode == "train":
            self._measurements.append(variance)
        ctx.log_metric("ratio_variance", variance)
        ctx.log_metric("lambda", self.lam)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        if not self._measurements:
            return
        o = self.options
        variance = sum(self._measurements) / len(self._measurements)
        self._measurements = []
        self.lam = dual_update(self.lam, variance, o.variance_target, o.dual_lr, o.max_lambda)

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"lambda": self.lam}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.lam = float(state.get("lambda", self.options.initial_lambda))
