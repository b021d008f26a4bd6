"""Reg-GRPO — Regressive GRPO, from "DeepVideo-R1: Video Reinforcement Fine-Tuning via Difficulty-aware Regressive
GRPO" (arXiv:2506.07464).

GRPO's clipped surrogate (with its min and clip "safeguards") is replaced by a regression: the policy's group-
normalised sequence log-ratio is fitted to the group advantage. Facts from the paper (Sec. 3.2, Eqs. 3-8):

1. From the KL-constrained objective ``max E[R] - lambda KL(pi_theta || pi_old)`` the optimal policy satisfies
   ``R(x, y) = lambda log pi*(y|x) / pi_old(y|x) + lambda log Z(x)``; normalising within the group removes lambda and
   Z, so the group advantage ``A_i = (R_i - mu_R) / sigma_R`` equals the group-normalised ``rho*``.
2. Predicted advantage of the current policy: ``rho_i = log pi_theta(y_i|x) - log pi_old(y_i|x)`` (the sequence log-
   ratio: the sum of the token log-ratios over the completion) and ``A^theta_i = (rho_i - mu_rho) / sigma_rho`` over
   the G rows of the group (gradient through the mean and the standard deviation too).
3. Loss: ``mean_i (A_i - A^theta_i)^2``; no ratio clip, no min. The KL to the reference is kept as in GRPO (TRL's
   ``beta``).

The group statistics need the whole group in the loss: the plugin declares ``needs_whole_groups``, so each
micro-batch holds whole groups (``per_device_train_batch_size`` a multiple of ``num_generations``, refused otherwise
at construction; :mod:`trl_plugins.runtime.whole_groups`).

Reconstructed (the official repository mlvlab/DeepVideoR1 was not reachable from here; its appendix neither): the
standard deviations (unbiased, as TRL's advantages) with ``eps`` added to ``sigma_rho`` (default 1e-4, TRL's advantage
epsilon) -- on the first pass over a batch ``pi_theta = pi_old``, every ``rho_i`` is 0 and the prediction is 0, so
the gradient is ``-(2 / (G eps)) sum_i A_i grad rho_i``, GRPO's sequence-level direction scaled by ``1/eps``; the
reduction of the regression term (mean over the micro-batch's rows, divided by the gradient-accumulation steps as
TRL's ``grpo`` loss, whatever ``loss_type``); and the option ``mix`` (ours): the loss is ``(1 - mix)`` times TRL's
surrogate plus ``mix`` times the regression, so ``mix = 1`` is the paper and ``mix = 0`` is vanilla TRL (neutral
setting). The paper's difficulty-aware data augmentation (video noise, reasoning hints) is not part of this plugin.

The target is the group-standardised advantage: ``scale_rewards`` other than ``"group"`` (TRL's default) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import IncompatiblePluginsError, LossContext, OfficialSource, hookimpl, option

from ._group_loss import (GroupLossOptions, GroupLossPlugin, row_advantages, sequence_log_ratios,
                          take_surrogate_place)

#: variance floor before the square root, so the standard deviation has a finite gradient when every rho is equal
_VAR_FLOOR = 1e-20


@dataclass
class RegGrpoOptions(GroupLossOptions):
    eps: float = option(
        1e-4, min=0.0, min_exclusive=True,
        help="Added to the group std of the sequence log-ratios in the predicted advantage.", reconstructed=True,
    )


def predicted_advantages(rho: torch.Tensor, eps: float) -> torch.Tensor:
    """``A^theta = (rho - mean) / (std + eps)`` within each group.

    Args:
        rho: (S, G) sequence log-ratios ``log pi_theta(y|x) - log pi_old(y|x)``, one row per group, with grad.
        eps: added to the unbiased standard deviation.
    Returns:
        (S, G) predicted advantages (gradient through the mean and the std).
    """
    mean = rho.mean(dim=1, keepdim=True)
    std = rho.var(dim=1, keepdim=True).clamp(min=_VAR_FLOOR).sqrt()
    return (rho - mean) / (std + eps)


class RegGrpoPlugin(GroupLossPlugin):
    """Regresses the group-normalised sequence log-ratio onto the group advantage, without clip or min (loss stage)."""

    name = "reg_grpo"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "DeepVideo-R1: Video Reinforcement Fine-Tuning via Difficulty-aware Regressive GRPO (Reg-GRPO), arXiv:2506.07464"
    summary = "Regresses the group-normalised sequence log-ratio onto the group advantage instead of the clipped surrogate."
    Options = RegGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="The official repository (mlvlab/DeepVideoR1) was not reachable; the loss follows the paper's Sec. 3.2; "
        "eps on the log-ratio std, the reduction over rows and the mix option are reconstructed.",
    )
    claim_metric = ("regression_error", "mean squared gap between group advantage and predicted advantage")
    replaces = ("the base surrogate (a regression of the group-normalised sequence log-ratio onto the advantage)",)
    reconstructed = (
        "eps = 1e-4 added to the std of the sequence log-ratios (TRL's advantage epsilon)",
        "regression term: mean over the micro-batch's rows, divided by the gradient-accumulation steps",
        "mix (ours): (1 - mix) TRL surrogate + mix regression; 1 is the paper, 0 is vanilla",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        scale = getattr(args, "scale_rewards", "group")
        if scale not in ("group", True):
            raise IncompatiblePluginsError(
                f"reg_grpo regresses the group-standardised log-ratio onto the advantage, so the advantage must be "
                f"group-standardised too: scale_rewards={scale!r}; allowed: 'group' (TRL's default)."
            )

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        error = (row_advantages(ctx) - predicted_advantages(sequence_log_ratios(ctx), self.options.eps)).pow(2)
        take_surrogate_place(ctx, error.mean(), self.options.mix)
        per_row = error.detach().reshape(-1, 1)
        ctx.log_metric("regression_error", ctx.global_masked_mean(per_row, torch.ones_like(per_row)))
