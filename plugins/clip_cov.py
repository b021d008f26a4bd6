"""Clip-Cov — covariance-based gradient clipping (arXiv:2505.22617, "The Entropy Mechanism of RL for Reasoning LMs").

The paper shows that the change of policy entropy is driven by the covariance between a token's log-probability
and its advantage: tokens that are both likely and well rewarded (or unlikely and penalised) collapse entropy.
Clip-Cov stops the gradient of a small random subset of high-covariance tokens. Facts from the official code
(PRIME-RL/Entropy-Mechanism-of-RL @8850579, ``compute_policy_loss_clip_cov``; restated, not copied):

1. Per token, ``cov = (A - mean_m(A)) * (lp - mean_m(sg(lp)))``; the means are over the valid tokens of the
   micro-batch. The value only selects tokens; no gradient flows through the selection.
2. ``L1 = -A r``, ``L2 = -A clip(r, 1-eps_low, 1+eps_high)``, base = ``max(L1, L2)`` (TRL's clipped surrogate).
   Tokens with ``L2 > L1`` are already handled by the PPO clip and are never candidates.
3. Candidates ``C = {m = 1, not already clipped, lb < cov < ub}``.
4. ``n = max(1, floor(ratio * sum(m)))``; ``min(n, |C|)`` tokens of C are picked uniformly at random without
   replacement.
5. The picked tokens' surrogate is multiplied by 0 (value and gradient), every other token by 1. Aggregation
   is TRL's (the recipes use token-mean, i.e. ``loss_type="dapo"``).

Defaults (official recipes): ratio = 2e-4, lb = 1, ub = 5. The 7B/32B recipes also set ``epsilon =
epsilon_high = 1`` (ordinary ratio clipping effectively off) so that Clip-Cov is the only constraint; we keep
TRL's clip settings unless you set them. An empty window (``lb >= ub``) picks nothing: the loss is TRL's.

Scope: TRL micro-batches are small, so ``ratio * tokens < 1`` gives ``n = 1`` in every micro-batch (as it
would in verl with a small micro-batch). ``scope="generation_batch"`` (our option) computes the covariance
(from the pre-update log-probs, one extra no-grad forward) and the random pick once per generation batch over
all processes at the advantage stage; the loss stage then zeroes the picked tokens that are not already
clipped by the current ratio. The random pick uses the plugin's own generator (seeded from ``seed`` or the
run's ``seed``; saved in checkpoints), never the global RNG. Off-policy (injected) tokens are never picked:
their loss is the shaped off-policy branch, not the clipped surrogate.

Incompatible: Lp-Reg, KL-Cov, SIREN and TRL's entropy bonus (``entropy_coef``) steer entropy on overlapping
token sets ("pick one", see ``docs/compatibility.md``); ``loss_type`` cispo / sapo / vespo have no PPO clip to
complement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES
from trl_plugins.api.reasons import ENTROPY_PICK_ONE

PICK_KEY = "clip_cov_pick"


@dataclass
class ClipCovOptions(PluginOptions):
    ratio: float = option(
        2e-4, min=0.0, max=1.0,
        help="Fraction of valid tokens whose gradient is stopped: n = max(1, floor(ratio * tokens)).",
    )
    lb: float = option(1.0, help="Lower bound of the covariance window (exclusive).")
    ub: float = option(5.0, help="Upper bound of the covariance window (exclusive); lb >= ub picks nothing.")
    scope: Literal["microbatch", "generation_batch"] = option(
        "microbatch",
        help="Where covariance and pick are computed: per loss micro-batch (official code) or once per generation "
        "batch over all processes from the pre-update log-probs (one extra no-grad forward).",
        reconstructed=True,
    )
    seed: int | None = option(
        None, help="Seed of the plugin's random pick; None uses the run's `seed`.", reconstructed=True
    )


# ------------------------------------------------------------------------------------------ pure functions
def token_covariance(advantages: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token covariance proxy ``(A - mean_m A) * (lp - mean_m lp)`` (no grad).

    Args:
        advantages: (B, T) token advantages. logps: (B, T) log-probs (detached inside). mask: (B, T) valid tokens.
    Returns:
        (B, T) float tensor; 0 outside the mask. Means are over the valid tokens of the given tensors.
    """
    m = mask.bool()
    a = advantages.detach().float()
    lp = logps.detach().float()
    n = m.sum().clamp(min=1)
    mean_a = torch.where(m, a, torch.zeros_like(a)).sum() / n
    mean_lp = torch.where(m, lp, torch.zeros_like(lp)).sum() / n
    cov = (a - mean_a) * (lp - mean_lp)
    return torch.where(m, cov, torch.zeros_like(cov))


def already_clipped(advantages: torch.Tensor, ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """(B, T) bool: tokens where the PPO clip is active, ``-A clip(r) > -A r``. ``ratio`` may be (B, 1)."""
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return (l2 > l1).expand_as(advantages)


def covariance_candidates(cov: torch.Tensor, mask: torch.Tensor, lb: float, ub: float) -> torch.Tensor:
    """(B, T) bool: valid tokens with ``lb < cov < ub`` (empty when ``lb >= ub``)."""
    return mask.bool() & (cov > lb) & (cov < ub)


def num_to_pick(num_valid: int, ratio: float) -> int:
    """``n = max(1, floor(num_valid * ratio))``."""
    return max(1, math.floor(num_valid * ratio))


def random_pick(candidates: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``min(n, |C|)`` candidates picked uniformly at random without replacement.

    Args:
        candidates: (B, T) bool. n: how many to pick. generator: a CPU ``torch.Generator`` (the only randomness).
    Returns:
        (B, T) bool mask of the picked tokens.
    """
    flat = candidates.reshape(-1)
    idx = flat.nonzero().squeeze(1)
    picked = torch.zeros_like(flat)
    if idx.numel() == 0 or n <= 0:
        return picked.view_as(candidates)
    order = torch.randperm(idx.numel(), generator=generator)[: min(n, idx.numel())].to(idx.device)
    picked[idx[order]] = True
    return picked.view_as(candidates)


def global_token_advantages(ctx: AdvantageContext, width: int) -> torch.Tensor:
    """The advantage-stage advantages as (N, width) token advantages (broadcast from (N,), cut or zero-padded)."""
    adv = ctx.advantages
    if adv.dim() == 1:
        return adv.unsqueeze(1).expand(-1, width)
    if adv.size(1) >= width:
        return adv[:, :width]
    return torch.nn.functional.pad(adv, (0, width - adv.size(1)))


#: Why Clip-Cov and KL-Cov refuse the loss types outside CLIPPED_LOSS_TYPES (``Plugin.loss_types_reason``).
CLIPPED_ONLY = "it is defined on the PPO clipped surrogate, which loss_type 'cispo', 'sapo' and 'vespo' do not have"


def check_no_entropy_bonus(name: str, args) -> None:
    """Refuse TRL's entropy bonus (shared by Clip-Cov and KL-Cov)."""
    if args.entropy_coef != 0 or getattr(args, "use_adaptive_entropy", False):
        raise IncompatiblePluginsError(
            f"{name} cannot be combined with TRL's entropy bonus (entropy_coef={args.entropy_coef!r}, "
            f"use_adaptive_entropy={getattr(args, 'use_adaptive_entropy', False)!r}): {ENTROPY_PICK_ONE}. "
            f"Set entropy_coef=0 or disable {name}."
        )


class ClipCovPlugin(Plugin):
    """Stops the gradient of a few random high-covariance tokens (loss stage)."""

    name = "clip_cov"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (Clip-Cov), arXiv:2505.22617"
    summary = "Zeroes the surrogate of a small random subset of tokens whose logp-advantage covariance is in a window."
    Options = ClipCovOptions
    official = OfficialSource(
        "PRIME-RL/Entropy-Mechanism-of-RL", "8850579", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py",),
        note="Selection per TRL micro-batch (scope); TRL's clip range unless set (the recipe's epsilon is 1).",
    )
    claim_metric = ("clipped_token_fraction", "tokens clipped")
    conflicts_with = ("lp_reg", "kl_cov", "siren")
    conflict_reason = ENTROPY_PICK_ONE
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = CLIPPED_ONLY
    reconstructed = (
        "scope='generation_batch' is our option (covariance and pick once per generation batch); the official code "
        "works per micro-batch",
        "the pick uses the plugin's own seeded generator instead of the global RNG",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._generator: torch.Generator | None = None

    def _rng(self) -> torch.Generator:
        if self._generator is None:  # hooks driven without configure (unit tests)
            self._generator = torch.Generator().manual_seed(self.options.seed or 0)
        return self._generator

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        check_no_entropy_bonus(self.name, args)
        seed = args.seed if self.options.seed is None else self.options.seed
        if self.options.scope == "microbatch":  # local picks: independent streams per process
            seed += getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        self._generator = torch.Generator().manual_seed(int(seed))

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"rng": self._rng().get_state()}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        if "rng" in state:
            self._rng().set_state(state["rng"])

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.scope != "generation_batch":
            return
        stats = ctx.policy_stats()
        local_width = stats.per_token_logps.size(1)
        logps = ctx.gather_padded(stats.per_token_logps)  # (N, T_max) pre-update log-probs
        mask = ctx.completion_mask().bool()
        adv = global_token_advantages(ctx, mask.size(1))
        cov = token_covariance(adv, logps, mask)
        candidates = covariance_candidates(cov, mask, o.lb, o.ub)
        picked = random_pick(candidates, num_to_pick(int(mask.sum()), o.ratio), self._rng())
        ctx.set_local_extra(PICK_KEY, picked[ctx.process_slice, :local_width].clone())
        ctx.log_metric("candidate_token_fraction", float(candidates.sum()) / max(1, int(mask.sum())))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps.detach()
        adv = ctx.advantages.expand_as(lp)
        mask = ctx.mask.bool() & ~ctx.offpolicy_mask
        clipped = already_clipped(adv, ctx.coef_1.detach(), ctx.epsilon_low, ctx.epsilon_high)
        if o.scope == "microbatch":
            cov = token_covariance(adv, lp, ctx.mask)
            candidates = covariance_candidates(cov, mask, o.lb, o.ub) & ~clipped
            picked = random_pick(candidates, num_to_pick(int(ctx.mask.sum()), o.ratio), self._rng())
            ctx.log_metric("candidate_token_fraction", ctx.global_masked_mean(candidates.float()))
        else:
            picked = ctx.extras[PICK_KEY].bool() & mask & ~clipped
        ctx.scale_tokens((~picked).to(ctx.per_token_logps.dtype))
        ctx.log_metric("clipped_token_fraction", ctx.global_masked_mean(picked.float()))
