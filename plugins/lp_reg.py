"""Lp-Reg — Low-probability Regularization (arXiv:2510.03222).

Protects "reasoning sparks": low-probability tokens that are about to be pushed to zero by negative
advantages. A proxy distribution is built from the policy's next-token distribution by dropping noise
tokens below a min-p threshold and renormalising; on the lowest-probability sampled tokens with negative
advantage, the clipped surrogate is replaced by an unclipped policy-gradient term plus a KL pull toward the
proxy. Facts from the official code (CarlanLark/Lp-Reg-dev @33b27e2, ``compute_policy_loss_lp_reg``):

1. Proxy (no grad; by default from the pre-update policy, i.e. at the advantage stage, as the recipes'
   ``minp_old_log_prob=True``): keep set ``K = {v : p(v) >= kappa * max_u p(u)}`` ("minp") or
   ``{v : p(v) >= kappa}`` ("fixed"); ``lp_proxy = log p(o) - log sum_{v in K} p(v)`` for ``o in K``, and a
   -1e4 sentinel (never selected) otherwise.
2. Candidates: ``N = {(b,t) : mask = 1, A < 0}``; ``k = max(1, floor(|N| * rho))``; **only if k > 1**, the k
   tokens of N with the smallest ``sg(log pi_theta)`` form S.
3. Filter: ``S' = {(b,t) in S : sg(lp) < lp_proxy}``.
4. On S': ``loss = -A * r + beta * clamp(exp(D) - D - 1, -10, 10)`` with ``D = lp_proxy - lp`` (grad through lp)
   and ``r`` the **unclipped** ratio; elsewhere TRL's surrogate is unchanged.

Defaults (official recipes): kappa = 0.02 (minp), rho = 0.01, beta = 1. The recipes also set
``epsilon=1.0, epsilon_high=9.0`` (clipping effectively off), ``loss_type='dapo'``, ``beta=0`` (no ref-KL),
``entropy_coef=0`` and temperature 1; we keep TRL's own clip settings unless you set them (documented
deviation). With temperature != 1 the keep set is computed on temperature-scaled logits (the official code
filters raw logits, then divides; identical at temperature 1). The selection runs per micro-batch as in the
official code (``selection_scope="microbatch"``); ``"generation_batch"`` takes the rho-quantile threshold of
the old log-probs once per generation batch instead (our option, for small TRL micro-batches).

Incompatible: TRL's entropy bonus (``entropy_coef``), Clip-Cov, KL-Cov and SIREN steer entropy on overlapping
token sets ("pick one", see ``docs/compatibility.md``).
"""

from __future__ import annotations

import math
import warnings
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
from trl_plugins.api.reasons import ENTROPY_PICK_ONE

PROXY_KEY = "lp_reg_proxy_logps"
THRESHOLD_KEY = "lp_reg_threshold"


@dataclass
class LpRegOptions(PluginOptions):
    kappa: float = option(0.02, min=0.0, max=1.0, min_exclusive=True, help="Min-p threshold of the proxy keep set.")
    threshold_mode: Literal["minp", "fixed"] = option(
        "minp", help="'minp': keep p(v) >= kappa * max p (paper); 'fixed': keep p(v) >= kappa."
    )
    rho: float = option(
        0.01, min=0.0, max=1.0, help="Fraction of negative-advantage tokens regularised (lowest log-prob first)."
    )
    beta: float = option(1.0, min=0.0, help="Coefficient of the KL pull toward the proxy (k3 estimator).")
    kl_clamp: float = option(10.0, min=0.0, min_exclusive=True, help="Clamp of the k3 value, as in the official code.")
    proxy_source: Literal["old", "current"] = option(
        "old",
        help="'old': proxy from the pre-update policy at the advantage stage (faithful, one extra no-grad forward); "
        "'current': from the loss forward's hidden states (equal when num_iterations=1 and "
        "steps_per_generation <= gradient_accumulation_steps).",
    )
    selection_scope: Literal["microbatch", "generation_batch"] = option(
        "microbatch",
        help="Where the bottom-rho selection is taken: per loss micro-batch (official code) or once per generation "
        "batch from the old log-probs.",
        reconstructed=True,
    )


def select_tokens(
    logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, rho: float
) -> torch.Tensor:
    """S: the ``k = max(1, floor(|N| rho))`` lowest-``logps`` tokens among negatives N, only if ``k > 1``.

    Args:
        logps: (B, T) detached log-probs used for ranking. advantages: (B, T). mask: (B, T).
    Returns:
        (B, T) bool mask of S (all False when k <= 1).
    """
    negative = (advantages < 0) & mask.bool()
    n = int(negative.sum().item())
    k = max(1, math.floor(n * rho))
    selected = torch.zeros_like(negative)
    if k <= 1:
        return selected
    scores = torch.where(negative, logps, torch.full_like(logps, math.inf))
    idx = torch.topk(scores.flatten(), k, largest=False).indices
    selected.view(-1)[idx] = True
    return selected & negative


def lp_reg_token_loss(
    logps: torch.Tensor, coef_1: torch.Tensor, advantages: torch.Tensor, proxy_logps: torch.Tensor,
    beta: float, kl_clamp: float,
) -> torch.Tensor:
    """Lp-Reg replacement loss per token: ``-A r + beta * clamp(exp(D) - D - 1, -c, c)``, ``D = lp_proxy - lp``.

    Args: (B, T) tensors (``coef_1`` may be (B, 1)); ``logps`` with grad. Returns (B, T).
    """
    d = proxy_logps - logps
    k3 = torch.clamp(torch.exp(d) - d - 1, min=-kl_clamp, max=kl_clamp)
    return -advantages * coef_1 + beta * k3


class LpRegPlugin(Plugin):
    """Low-probability regularisation toward a min-p proxy on the rarest negative-advantage tokens (loss stage)."""

    name = "lp_reg"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Low-probability Tokens Sustain Exploration in Reinforcement Learning with Verifiable Reward "
        "(Lp-Reg), arXiv:2510.03222"
    )
    summary = "Shields rare negative-advantage tokens with a KL pull toward a min-p filtered proxy distribution."
    Options = LpRegOptions
    official = OfficialSource(
        "CarlanLark/Lp-Reg-dev", "33b27e2", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py", "verl/workers/actor/dp_actor.py"),
        note="TRL's clip range unless set (the recipe's 1.0 / 9.0); selection per TRL micro-batch (selection_scope).",
    )
    claim_metric = ("regularised_token_fraction", "tokens regularised")
    replaces = ("the base surrogate on low-probability negative-advantage tokens (KL toward the min-p proxy)",)
    needs_head_stats = True
    replaces_surrogate = True
    conflicts_with = ("clip_cov", "kl_cov", "siren")
    conflict_reason = ENTROPY_PICK_ONE
    reconstructed = ("selection_scope='generation_batch' is our option; the official code selects per micro-batch",)

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.entropy_coef != 0 or getattr(args, "use_adaptive_entropy", False):
            raise IncompatiblePluginsError(
                f"lp_reg cannot be combined with TRL's entropy bonus (entropy_coef={args.entropy_coef!r}): "
                f"{ENTROPY_PICK_ONE}. Set entropy_coef=0 or disable lp_reg."
            )
        if args.top_entropy_quantile < 1.0:
            warnings.warn(
                f"lp_reg: top_entropy_quantile={args.top_entropy_quantile} masks low-entropy tokens after Lp-Reg's "
                "replacement, which silently drops regularised tokens; the paper uses 1.0.",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.proxy_source == "old":
            stats = ctx.policy_stats(head_stats=True)
            proxy = stats.head_stats.min_p_logprob(stats.completion_ids, o.kappa, o.threshold_mode)
            ctx.set_local_extra(PROXY_KEY, proxy)
        if o.selection_scope == "generation_batch":
            stats = ctx.policy_stats(head_stats=o.proxy_source == "old")
            adv = ctx.advantages[ctx.process_slice]
            adv = adv if adv.dim() == 2 else adv.unsqueeze(1).expand_as(stats.per_token_logps)
            negative = (adv < 0) & stats.mask.bool()
            local = stats.per_token_logps[negative]
            gathered = ctx.gather(torch.tensor([local.numel()], device=local.device))
            total = int(gathered.sum().item())
            k = max(1, math.floor(total * o.rho))
            values = _gather_values(ctx, local)
            threshold = torch.kthvalue(values, k).values if k > 1 and values.numel() >= k else torch.tensor(-math.inf)
            ctx.set_local_extra(THRESHOLD_KEY, threshold.expand(stats.mask.size(0)).clone())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        if o.proxy_source == "old":
            proxy = ctx.extras[PROXY_KEY]
        else:
            proxy = ctx.head_stats().min_p_logprob(ctx.completion_ids, o.kappa, o.threshold_mode)
        lp = ctx.per_token_logps.detach()
        advantages = ctx.advantages.expand_as(lp)
        if o.selection_scope == "microbatch":
            selected = select_tokens(lp, advantages, ctx.mask, o.rho)
        else:
            threshold = ctx.extras[THRESHOLD_KEY].unsqueeze(1)
            selected = (advantages < 0) & ctx.mask.bool() & (ctx.old_per_token_logps <= threshold)
        regularised = selected & (lp < proxy) & ~ctx.offpolicy_mask  # injected tokens keep their shaped branch
        if regularised.any():
            values = lp_reg_token_loss(ctx.per_token_logps, ctx.coef_1, advantages, proxy, o.beta, o.kl_clamp)
            ctx.replace_tokens(regularised, values)
        ctx.log_metric("regularised_token_fraction", ctx.global_masked_mean(regularised.float()))
        ctx.log_metric("selected_token_fraction", ctx.global_masked_mean(selected.float()))


def _gather_values(ctx: AdvantageContext, local: torch.Tensor) -> torch.Tensor:
    """All-gather a variable-length 1-D tensor (pad with +inf, drop the padding)."""
    values = ctx.gather_padded(local, dim=0, pad_value=math.inf)
    return values[torch.isfinite(values)]
