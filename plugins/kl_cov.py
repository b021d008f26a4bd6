"""KL-Cov — covariance-targeted KL penalty (arXiv:2505.22617, "The Entropy Mechanism of RL for Reasoning LMs").

Companion of Clip-Cov (same paper, same covariance proxy, see :mod:`trl_plugins_builtin.clip_cov`): instead of
stopping gradients at random, KL-Cov puts a KL-like penalty on the tokens with the *largest* covariance between
log-probability and advantage, the ones that drive entropy collapse. Facts from the official code
(PRIME-RL/Entropy-Mechanism-of-RL @8850579, ``compute_policy_loss_kl_cov``; restated, not copied):

1. ``cov = (A - mean_m(A)) * (lp - mean_m(sg(lp)))`` over the valid tokens of the micro-batch (selection only).
2. ``k = max(1, floor(N_valid * ratio))``; the k tokens with the largest ``cov`` are selected.
3. The whole per-token loss is replaced: ``-A r + beta_kl * |lp - lp_old|`` on the selected tokens and the
   **unclipped** ``-A r`` everywhere else (no PPO clip anywhere). Aggregation is TRL's (``loss_type="dapo"`` is
   the recipes' token-mean).

Defaults: ratio = 2e-3 (the paper's 7B recipe; 2e-4 for 32B; the original ``k_percent`` key is in percent and
upstream verl's ``kl_cov_ratio`` defaults to 2e-4), beta_kl = 1 (official recipes; upstream verl's default is 0.1).

**On-policy subtlety.** ``d|x|/dx`` at exactly ``x = 0`` is 0 in torch. When TRL skips ``old_per_token_logps``
(``num_iterations = 1`` and one optimizer step per generation batch) ``lp_old = sg(lp)``: the penalty is 0 in
value and gradient, and since ``r = 1`` the unclipped ``-A r`` equals TRL's clipped surrogate, so KL-Cov is then
exactly vanilla GRPO (a test checks it; configure warns). In verl ``lp_old`` comes from a separate forward, so ``lp - lp_old`` is
tiny but non-zero and the gradient is ``+-beta_kl``. The penalty bites when the policy moves between rollout and
update (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``).

Scope: ``scope="generation_batch"`` (our option) selects the top-k once per generation batch over all processes
at the advantage stage, from the pre-update log-probs (one extra no-grad forward), for TRL's small micro-batches.
Off-policy (injected) tokens keep their shaped branch and are never selected.

Incompatible: Lp-Reg, Clip-Cov, SIREN and TRL's entropy bonus ("pick one", see ``docs/compatibility.md``). KL-Cov replaces
the surrogate, so no other surrogate-replacing plugin can be stacked with it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.loss_types import policy_moves_before_loss
from trl_plugins.api.reasons import ENTROPY_PICK_ONE

from .clip_cov import (
    CLIPPED_LOSS_TYPES,
    CLIPPED_ONLY,
    check_no_entropy_bonus,
    global_token_advantages,
    token_covariance,
)

SELECT_KEY = "kl_cov_selected"


@dataclass
class KlCovOptions(PluginOptions):
    ratio: float = option(
        2e-3, min=0.0, max=1.0,
        help="Fraction of valid tokens penalised: k = max(1, floor(ratio * tokens)) (7B recipe 2e-3; 32B 2e-4).",
    )
    beta_kl: float = option(
        1.0, min=0.0, help="Coefficient of |lp - lp_old| on the selected tokens (official recipes)."
    )
    scope: Literal["microbatch", "generation_batch"] = option(
        "microbatch",
        help="Where covariance and top-k are computed: per loss micro-batch (official code) or once per generation "
        "batch over all processes from the pre-update log-probs (one extra no-grad forward).",
        reconstructed=True,
    )


def num_to_select(num_valid: int, ratio: float) -> int:
    """``k = max(1, floor(num_valid * ratio))``."""
    return max(1, math.floor(num_valid * ratio))


def top_covariance(cov: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) bool: the ``min(k, |mask|)`` valid tokens with the largest ``cov`` (ties: lowest flat index first).

    Args:
        cov: (B, T) covariance values. mask: (B, T) tokens that may be selected. k: how many.
    """
    m = mask.bool()
    n = int(m.sum())
    selected = torch.zeros_like(m)
    k = min(k, n)
    if k <= 0:
        return selected
    scores = torch.where(m, cov.float(), torch.full_like(cov, -math.inf, dtype=torch.float32))
    # stable descending sort: deterministic tie-breaking by position
    idx = torch.sort(scores.reshape(-1), descending=True, stable=True).indices[:k]
    selected.view(-1)[idx] = True
    return selected


def kl_cov_token_loss(
    logps: torch.Tensor, old_logps: torch.Tensor, coef_1: torch.Tensor, advantages: torch.Tensor,
    selected: torch.Tensor, beta_kl: float,
) -> torch.Tensor:
    """KL-Cov per-token loss: ``-A r`` (unclipped) plus ``beta_kl * |lp - lp_old|`` where ``selected``.

    Args: (B, T) tensors (``coef_1`` may be (B, 1)); ``logps`` and ``coef_1`` with grad. Returns (B, T).
    """
    pg = -advantages * coef_1
    kl = beta_kl * (logps - old_logps).abs()
    return pg + torch.where(selected, kl, torch.zeros_like(kl))


class KlCovPlugin(Plugin):
    """Penalises ``|lp - lp_old|`` on the top-covariance tokens, unclipped PG elsewhere (loss stage)."""

    name = "kl_cov"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (KL-Cov), arXiv:2505.22617"
    summary = "Unclipped PG plus a |logp - logp_old| penalty on the top-covariance tokens (replaces the surrogate)."
    Options = KlCovOptions
    official = OfficialSource(
        "PRIME-RL/Entropy-Mechanism-of-RL", "8850579", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py",),
        note="Selection per TRL micro-batch (scope); on-policy (num_iterations=1) the KL penalty is exactly 0 (warned).",
    )
    claim_metric = ("selected_token_fraction", "tokens penalised")
    replaces = ("the base surrogate on on-policy tokens (unclipped -A r plus the KL penalty)",)
    replaces_surrogate = True
    conflicts_with = ("lp_reg", "clip_cov", "siren")
    conflict_reason = ENTROPY_PICK_ONE
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = CLIPPED_ONLY
    reconstructed = (
        "scope='generation_batch' is our option (top-k once per generation batch); the official code works per "
        "micro-batch",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        check_no_entropy_bonus(self.name, args)
        if self.options.beta_kl > 0 and not policy_moves_before_loss(args, getattr(trainer, "num_iterations", None)):
            warnings.warn(
                "kl_cov: with num_iterations=1 and one optimizer step per generation batch the policy never moves "
                "between rollout and update (lp_old = lp), so the |lp - lp_old| penalty is zero and KL-Cov trains "
                "exactly like vanilla GRPO; use num_iterations > 1 or steps_per_generation > "
                "gradient_accumulation_steps (the paper: 256-prompt rollout batches in mini-batches of 32, 8 updates).",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.scope != "generation_batch":
            return
        stats = ctx.policy_stats()
        local_width = stats.per_token_logps.size(1)
        logps = ctx.gather_padded(stats.per_token_logps)
        mask = ctx.completion_mask().bool()
        cov = token_covariance(global_token_advantages(ctx, mask.size(1)), logps, mask)
        selected = top_covariance(cov, mask, num_to_select(int(mask.sum()), o.ratio))
        ctx.set_local_extra(SELECT_KEY, selected[ctx.process_slice, :local_width].clone())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps
        adv = ctx.advantages.expand_as(lp)
        onpolicy = ~ctx.offpolicy_mask
        if o.scope == "microbatch":
            cov = token_covariance(adv, lp, ctx.mask)
            selected = top_covariance(cov, ctx.mask.bool() & onpolicy, num_to_select(int(ctx.mask.sum()), o.ratio))
        else:
            selected = ctx.extras[SELECT_KEY].bool() & ctx.mask.bool() & onpolicy
        values = kl_cov_token_loss(lp, ctx.old_per_token_logps, ctx.coef_1, adv, selected, o.beta_kl)
        ctx.replace_tokens(onpolicy, values)
        ctx.log_metric("selected_token_fraction", ctx.global_masked_mean(selected.float()))
        abs_diff = (lp.detach() - ctx.old_per_token_logps).abs()
        ctx.log_metric("selected_abs_logp_change", ctx.global_masked_mean(abs_diff, ctx.mask * selected))
