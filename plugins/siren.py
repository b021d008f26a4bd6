"""SIREN — selective entropy regularisation (arXiv:2509.25133, "Rethinking Entropy Regularization in LRMs").

A plain entropy bonus on reasoning models either does nothing or makes entropy explode: it pushes up the entropy
of every position over the whole vocabulary. SIREN restricts it three ways. Facts from the official code
(Linn3a/siren @fa59a8d, ``efficient_top_p_sampling``, ``mask_by_quantile``, ``update_policy``, the step-1 anchor
in ``ray_trainer.py``; restated, not copied):

1. *Top-p (nucleus) entropy* over actions: among the most likely candidates (sorted by probability), the nucleus
   is the tokens whose **inclusive** cumulative probability is ``< top_p`` (the crossing token is excluded; the
   nucleus may be empty). ``q`` = the probabilities renormalised over the nucleus and ``H_p = -sum q log q``
   (0 for an empty nucleus), **with gradient** through the logits. Computed by
   ``ctx.head_stats().top_p_entropy_with_grad(top_p, k_max, mode="siren")``: the LM head is applied in chunks of
   tokens, forward and again in the backward (which forms the gradient chunk by chunk), so no ``(B, T, V)``
   tensor is ever built, whatever ``k_max`` and the nucleus width.
2. *Peak-entropy mask* over positions, per sequence: ``tau_b`` = the ``quantile`` (0.8) quantile of ``H_p[b, :]``
   over valid tokens (linear interpolation); ``M = H_p > tau_b`` (strict), the top ~20 % of each response.
3. *Aggregate* (seq-mean-token-mean): ``H_agg = mean_b( sum_t M H_p / sum_t M )``, a row with an empty mask
   counting 0.
4. *Self-anchor*: ``H_0`` is the same statistic computed **once**, on the first training generation batch, from
   the rollout policy (no grad, one extra forward with LM-head statistics at that step only), over the whole
   global batch; it then stays fixed and is saved in checkpoints. ``anchor`` sets it by hand.
5. *Loss*: ``L = L_pg + coef * (H_agg - H_0)^2``; the term is added per micro-batch, divided by the gradient
   accumulation steps (as TRL does for its entropy bonus). The quadratic acts on a micro-batch mean, so the
   result is not invariant to gradient accumulation (as in the original).

Defaults (``exp_scripts/siren.sh``): top_p = 0.8, quantile = 0.8, coef = ``entropy_coeff`` = 0.005. The official
code considers the top 10000 candidates; ``k_max`` = 2048 caps them here (each chunk's top-k workspace is
``chunk_size * k_max``, within the chunked bound of ``chunk_size * V`` for any value), which only matters when a
0.8-nucleus has more than 2048 tokens. Recommended PG settings of the paper: ``loss_type="dr_grpo"``, ``scale_rewards="none"``, symmetric clip
0.28. TRL's ``entropy_coef`` (a global bonus) and ``top_entropy_quantile`` (a global mask on the PG loss, a
different thing) must stay off. ``coef = 0`` is exactly TRL's loss.

Incompatible: Lp-Reg, Clip-Cov, KL-Cov and TRL's entropy bonus steer entropy on overlapping token sets ("pick
one", see ``docs/compatibility.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginOptions,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import ENTROPY_PICK_ONE


@dataclass
class SirenOptions(PluginOptions):
    coef: float = option(0.005, min=0.0, help="Coefficient c of the anchored term c * (H_agg - H_0)^2 (entropy_coeff).")
    top_p: float = option(
        0.8, min=0.0, max=1.0, min_exclusive=True,
        help="Nucleus mass: tokens whose inclusive cumulative probability is below top_p (crossing token excluded).",
    )
    quantile: float = option(
        0.8, min=0.0, max=1.0, help="Per-sequence quantile of H_p; positions strictly above it are regularised."
    )
    k_max: int = option(
        2048, min=1,
        help="Most likely candidates the nucleus is chosen from (official: 10000); top-k workspace chunk_size * k_max.",
        reconstructed=True,
    )
    anchor: float | None = option(
        None, help="H_0 by hand; None computes it once from the rollout policy on the first training batch."
    )


# ------------------------------------------------------------------------------------------ pure functions
def peak_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T) bool: valid positions whose entropy is strictly above their row's ``quantile`` (linear interpolation).

    Args:
        entropy: (B, T) per-token (nucleus) entropy; detached inside. mask: (B, T) valid tokens.
    Rows without a valid token give an all-False row.
    """
    m = mask.bool()
    x = entropy.detach().float().masked_fill(~m, float("nan"))
    tau = torch.nanquantile(x, quantile, dim=-1, keepdim=True)  # (B, 1); NaN for empty rows
    return m & (entropy.detach().float() > tau)


def row_entropy(entropy: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence token-mean ``sum_t M H / sum_t M`` (0 for a row with an empty mask), gradient kept.

    Args:
        entropy: (B, T). peak: (B, T) bool mask M.
    """
    m = peak.to(entropy.dtype)
    counts = m.sum(-1)
    row = (entropy * m).sum(-1) / counts.clamp(min=1.0)
    return torch.where(counts > 0, row, torch.zeros_like(row))


def aggregate_entropy(entropy: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """Scalar seq-mean-token-mean ``mean_b(row_entropy)`` (a row with an empty mask counts 0).

    Args:
        entropy: (B, T), gradient kept. peak: (B, T) bool mask M.
    """
    if entropy.size(0) == 0:
        return entropy.sum()
    return row_entropy(entropy, peak).mean()


def anchored_term(h_agg: torch.Tensor, anchor: float, coef: float) -> torch.Tensor:
    """SIREN's self-anchored term ``coef * (H_agg - H_0)^2`` (scalar, gradient through ``h_agg``)."""
    return coef * (h_agg - anchor) ** 2


class SirenPlugin(Plugin):
    """Anchored top-p entropy regularisation on peak-entropy positions (loss stage; anchor at the advantage stage)."""

    name = "siren"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "Rethinking Entropy Regularization in Large Reasoning Models (SIREN), arXiv:2509.25133"
    summary = "Keeps the top-p entropy of each response's peak-entropy positions near its initial value (anchored)."
    Options = SirenOptions
    official = OfficialSource(
        "Linn3a/siren", "fa59a8d", verdict="faithful",
        files=("verl/verl/workers/actor/dp_actor.py", "verl/verl/trainer/ppo/core_algos.py"),
        non_official_defaults={
            "k_max": "10000 candidates; 2048 here bounds the top-k workspace",
        },
    )
    claim_metric = ("peak_token_fraction", "tokens regularised")
    needs_head_stats = True
    unsupported_engines = {
        "fsdp1": "its top-p entropy term needs its gradient through the LM head, which FSDP1 keeps in the root unit's "
        "flat parameter, out of reach after the forward; use DDP, FSDP2, ZeRO-2 or ZeRO-3",
    }
    conflicts_with = ("lp_reg", "clip_cov", "kl_cov")
    conflict_reason = ENTROPY_PICK_ONE
    reconstructed = ("k_max=2048 caps the nucleus candidates for memory; the official code uses the top 10000",)

    def __init__(self, options=None):
        super().__init__(options)
        self.anchor: float | None = self.options.anchor

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.entropy_coef != 0 or getattr(args, "use_adaptive_entropy", False):
            raise IncompatiblePluginsError(
                f"siren cannot be combined with TRL's entropy bonus (entropy_coef={args.entropy_coef!r}, "
                f"use_adaptive_entropy={getattr(args, 'use_adaptive_entropy', False)!r}): {ENTROPY_PICK_ONE}; "
                "SIREN is the selective, anchored replacement of that bonus. Set entropy_coef=0 or disable siren."
            )
        if args.top_entropy_quantile < 1.0:
            raise IncompatiblePluginsError(
                f"siren needs top_entropy_quantile=1.0 (got {args.top_entropy_quantile}): TRL's quantile is a global "
                "mask on the PG loss, not SIREN's per-sequence peak mask (use siren's `quantile` option)."
            )

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"anchor": self.anchor}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.anchor = state.get("anchor", self.anchor)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Self-anchor H_0 from the rollout policy, once (first batch), over the whole global batch."""
        if self.anchor is not None:
            return
        if ctx.mode != "train":
            return  # the anchor comes from the first *training* batch
        o = self.options
        stats = ctx.policy_stats(head_stats=True)
        h = stats.head_stats.top_p_entropy(o.top_p, o.k_max, mode="siren")  # (B, T), no grad
        row = row_entropy(h, peak_mask(h, stats.mask, o.quantile))  # (B,)
        self.anchor = float(ctx.gather(row).mean())  # seq-mean over the whole global batch

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        h = ctx.head_stats().top_p_entropy_with_grad(o.top_p, o.k_max, mode="siren")  # (B, T), with grad
        peak = peak_mask(h, ctx.mask, o.quantile)
        h_agg = aggregate_entropy(h, peak)
        anchor = self.anchor
        if anchor is None:  # no training advantage stage ran yet (hooks driven by hand, or eval first)
            anchor = float(h_agg.detach())
            if ctx.mode == "train":
                self.anchor = anchor
        term = anchored_term(h_agg, anchor, o.coef)
        ctx.add_loss(term / ctx.gradient_accumulation_steps)
        ctx.log_metric("topp_entropy", float(h_agg.detach()))
        ctx.log_metric("anchor", anchor)
        ctx.log_metric("entropy_gap", float(h_agg.detach()) - anchor)
        ctx.log_metric("peak_token_fraction", ctx.global_masked_mean(peak.float()))
