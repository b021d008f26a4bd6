"""AEPO — Agentic Entropy-Balanced Policy Optimization (arXiv:2510.14545): the loss half.

AEPO has a rollout half (entropy pre-monitoring that splits the sampling budget between global and branched
rollouts, with a penalty on consecutive high-entropy branchings) and a policy-update half; this plugin is the update
half, which needs no branching. Facts from AEPO's ``compute_policy_loss_entropy_balanced_clipping`` (verl
``core_algos.py``; flags ``enable_entropy_balanced_clipping`` and ``enable_entropy_balanced_advantage``, both on in
the released scripts):

1. Entropy clipping-balanced mechanism: the upper clip bound ``1 + eps_high`` becomes ``(1 + eps_high) r / sg(r)``.
   Its value is unchanged, but a token clipped from above (``A > 0``, ``r > 1 + eps_high``: mostly high-entropy
   tokens, which the paper shows the upper clip hits) keeps the gradient ``(1 + eps_high) A grad log pi`` instead of
   none. The lower bound stays a hard clip.
2. Entropy-aware advantage: ``A_t <- A_t (1 + 0.2 z_t)`` with ``z_t = (H_t - mean H) / std H`` the token entropy
   standardised over the loss tokens of the micro-batch (std 1 when it is 0; no gradient through ``z``).
3. Dual-clip PPO for ``A < 0`` (verl's ``clip_ratio_c = 3``): ``min(-A c, L)``, so a negative-advantage token whose
   ratio passed ``c`` contributes the constant ``-A c``.

Here (1) and (3) replace TRL's surrogate on the tokens they concern (``ctx.replace_tokens``; clipped loss types
only), and (2) is a ``trl_plugins_loss_advantages`` hook, so TRL's surrogate is built from the shaped advantages.
The entropy is TRL's full-vocabulary entropy of the loss forward, as verl's actor computes it. TRL's clip range
(``epsilon``, ``epsilon_high``) is used; a per-token clip scale from another plugin scales the upper bound too.

Faithfulness: the official repository (RUC-NLPIR/ARPO, its AEPO folder) is not in the snapshot reachable from here
(it predates AEPO), so the plugin is marked reconstructed: the rules above follow a public copy of the official
function in a third-party fork and the paper's text.

Neutral setting: ``balanced_clipping=False, entropy_advantage_coef=0, dual_clip=None`` switches both hooks off
(vanilla TRL). On the first pass over a batch (``r = 1``) neither clip is active, so only (2) acts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES

ENTROPY_ADVANTAGE_HOOK = "trl_plugins_loss_advantages"
CLIP_HOOK = "trl_plugins_loss"


@dataclass
class AepoOptions(PluginOptions):
    balanced_clipping: bool = option(
        True, help="Keep the gradient of tokens clipped from above: upper bound (1 + eps_high) r / sg(r)."
    )
    entropy_advantage_coef: float = option(
        0.2, min=0.0, help="A <- A (1 + coef z), z the token entropy standardised over the micro-batch; 0: off."
    )
    dual_clip: float | None = option(
        3.0, min=1.0, min_exclusive=True,
        help="Dual-clip constant c for A < 0: loss min(-A c, L); None: off (TRL has no dual clip).",
    )


def entropy_scaled_advantages(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
                              coef: float) -> torch.Tensor:
    """``A (1 + coef z)``, ``z`` the entropy standardised over the loss tokens (unbiased std; 1 when it is 0).

    Args:
        advantages: (B, T). entropies: (B, T) (detached here). mask: (B, T) loss mask.
    Returns:
        (B, T) shaped advantages (unchanged when no token is in the mask).
    """
    valid = entropies.detach()[mask.bool()]
    if valid.numel() == 0:
        return advantages
    std = valid.std() if valid.numel() > 1 else valid.new_tensor(0.0)
    std = torch.where(std == 0, torch.ones_like(std), std)
    z = (entropies.detach() - valid.mean()) / std
    return advantages * (1 + coef * z)


def balanced_upper_clip(advantages: torch.Tensor, coef_1: torch.Tensor, upper: torch.Tensor | float) -> torch.Tensor:
    """Loss of a token clipped from above with the gradient kept: ``-A upper r / sg(r)`` (value ``-A upper``)."""
    return -advantages * upper * coef_1 / coef_1.detach()


class AepoPlugin(Plugin):
    """Gradient-preserving upper clip, entropy-aware advantages and dual clip: AEPO's policy update (loss stage)."""

    name = "aepo"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "Agentic Entropy-Balanced Policy Optimization (AEPO), arXiv:2510.14545"
    summary = "Keeps the gradient of upper-clipped tokens, scales advantages by token entropy, dual-clips negatives."
    Options = AepoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="The official code (RUC-NLPIR/ARPO, AEPO folder) is not in the reachable snapshot (it predates AEPO); "
        "the rules follow a public copy of AEPO's compute_policy_loss_entropy_balanced_clipping (verl core_algos.py) "
        "in a third-party fork, and the paper. TRL's clip range is used.",
    )
    claim_metric = ("preserved_clip_fraction", "upper-clipped tokens whose gradient is kept")
    replaces = ("the base surrogate on upper-clipped positive-advantage tokens (gradient kept) and, with dual_clip, "
                "on negative-advantage tokens past the dual-clip constant",)
    replaces_surrogate = True
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = "AEPO changes PPO's clipped surrogate; cispo, sapo and vespo replace that clipping otherwise."
    reconstructed = ("the rollout half (entropy pre-monitoring, branch penalty) is not part of this plugin",)

    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook == ENTROPY_ADVANTAGE_HOOK:
            return o.entropy_advantage_coef > 0
        if hook == CLIP_HOOK:
            return o.balanced_clipping or o.dual_clip is not None
        return True

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx: LossContext):
        ctx.advantages = entropy_scaled_advantages(ctx.advantages, ctx.entropies, ctx.mask,
                                                   self.options.entropy_advantage_coef)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        mask = ctx.mask.bool() & ~ctx.offpolicy_mask  # injected tokens keep their shaped branch
        advantages = ctx.advantages.expand_as(ctx.mask)
        coef_1 = ctx.coef_1.expand_as(ctx.mask)
        upper = 1 + ctx.epsilon_high * (1.0 if ctx.clip_scale is None else ctx.clip_scale)
        upper = torch.as_tensor(upper, dtype=coef_1.dtype, device=coef_1.device).expand_as(coef_1)
        values = ctx.per_token_loss.expand_as(coef_1)
        preserved = mask & (advantages > 0) & (coef_1.detach() > upper) if o.balanced_clipping else torch.zeros_like(mask)
        dual = torch.zeros_like(mask)
        if o.dual_clip is not None:
            dual = mask & (advantages < 0) & (ctx.per_token_loss.detach() > -advantages * o.dual_clip)
        if preserved.any() or dual.any():
            values = torch.where(preserved, balanced_upper_clip(advantages, ctx.coef_1, upper), values)
            if o.dual_clip is not None:
                values = torch.where(dual, -advantages * o.dual_clip, values)
            ctx.replace_tokens(preserved | dual, values)
        ctx.log_metric("preserved_clip_fraction", ctx.global_masked_mean(preserved.float()))
        ctx.log_metric("dual_clip_fraction", ctx.global_masked_mean(dual.float()))
