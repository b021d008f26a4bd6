"""HAPO — Heterogeneous Adaptive Policy Optimization (arXiv:2509.16591, "From Uniform to Heterogeneous: Tailoring
Policy Optimization to Every Token's Nature").

HAPO treats tokens differently by their entropy at every stage where GRPO/DAPO treat them alike. Facts from the
official code (starriver030515/HAPO @7671dde, verl/trainer/ppo/core_algos.py: ``compute_hapo_outcome_advantage``,
``compute_entropy_h``, ``ada_clip``, ``ada_advantage`` and the hapo branch of ``compute_policy_loss``; restated, not
copied):

1. **Token-level group average advantage** (advantage stage). In a group with rewards ``R_i`` and lengths ``L_i``
   every *token* counts once: ``mu = sum_i L_i R_i / sum_i L_i``,
   ``sigma = sqrt(sum_i L_i (R_i - mu)^2 / sum_i L_i)`` (population std over tokens) and
   ``A_i = (R_i - mu) / (sigma + 1e-6)``. When some ``|A| >= 5`` in a group, that whole group keeps the ordinary
   GRPO advantage instead (TRL's own, ``std + 1e-4``; the official code's GRPO uses ``+ 1e-6``). The official test
   runs over the padded (rows, max length) tensor of scores, so the padding positions of a row shorter than the
   padded length count with score 0, i.e. ``|(0 - mu) / (sigma + 1e-6)| >= 5`` alone makes the group fall back
   (core_algos.py:330, 361 @7671dde): with rewards in {0.9, 1.0} every group that has a short row falls back.
   ``fallback_test="padded"`` (default) reproduces that with the padded length ``max_completion_length``;
   ``"real"`` tests the real rows only.
2. **Entropy normalisation** (loss stage, no gradient, over the valid tokens of the micro-batch, current-policy
   entropies ``H``): ``l = ln(max(H, 1e-8))`` (core_algos.py:88, 104); ``med`` = the nearest-rank ``entropy_pivot``
   quantile of ``l``; ``h = (l - med) / s`` with ``s = sqrt(mean (l - med)^2)``; ``h_hat = h / max(h)`` for ``h > 0``
   and ``h / |min(h)|`` for ``h <= 0``, so ``h_hat`` lies in ``[-1, 1]`` (+1 at the highest-entropy token, -1 at the
   lowest). The official code multiplies the non-positive side by ``1 / min(h)`` (a negative number), which makes
   every ``h_hat >= 0`` and sends low-entropy tokens through the high-entropy branches, against the paper's text;
   ``code_sign_compat=True`` reproduces that.
3. **Asymmetric adaptive clipping**: for ``h_hat <= 0``, ``eps_low' = eps_low (1 - alpha h_hat)`` (more room to push
   noisy low-entropy tokens down), ``eps_high`` unchanged; for ``h_hat > 0``, ``eps_high' = eps_high (1 + alpha
   h_hat)`` (more room to raise high-entropy tokens), ``eps_low`` unchanged.
4. **Differential advantage redistribution**: ``A_ent = A (1 + beta h_hat)``; the neutral band of the ratio is
   ``(1 - eps_low'/2, 1 + eps_high'/2)``. High-entropy tokens use ``A`` inside the band and ``A_ent`` outside; the
   other tokens use ``A_ent`` inside and ``A`` outside.
5. PPO with the per-token epsilons and the redistributed advantage, plus the dual clip ``-A c`` (``c = 10``) on
   negative advantages; aggregation is TRL's (``loss_type="dapo"`` is the paper's token-mean).
6. **Adaptive sampling temperature** (``temperature_tau > 0``; official recipe 0.05): every generated token is
   sampled at ``T_t = T (1 + tau h_hat_t)``, ``T`` the run's temperature, ``h_hat_t`` the normalised log-entropy of
   that step's next-token distribution (from the raw logits, before any temperature) with the statistics of the
   previous optimizer step: the ``entropy_pivot`` quantile ``med``, the RMS deviation ``s`` and the scales
   ``1 / max(h)`` and ``1 / |min(h)|`` of ``h = (ln H - med) / s`` over the loss tokens that step saw (current-policy
   entropies at ``T``), so ``h_hat_t = clip(h_t * scale, -1, 1)``; before the first step the temperature stays ``T``.
   The official code computes the statistics over the whole batch of old-policy entropies of the previous step on the
   driver; here each process uses the tokens of its own micro-batches [reconstructed]; ``code_sign_compat`` applies
   to the scale of the negative side as in item 2 (the official sampler's scale is negative there too, so it only
   ever raises the temperature). Transformers generation only
   (:meth:`~trl_plugins.PluginGRPOTrainer.set_token_temperature`, :mod:`trl_plugins.runtime.token_temperature`): vLLM
   samples every token of a request at one temperature, so ``temperature_tau > 0`` is refused with ``use_vllm=True``.
   Log-probs: as in the official code (old log-probs recomputed at the rollout's base temperature), the loss, the
   old log-probs and the importance ratio use the single temperature ``T``; the tokens are treated as samples of
   ``pi_T`` and the small mismatch (``|T_t / T - 1| <= tau``) is not importance-corrected.

Defaults are the authors' recipe: ``entropy_pivot=0.8``, ``clip_alpha=1``, ``adv_beta=1``, ``dual_clip_c=10``, clip
0.2/0.2 (TRL's ``epsilon``/``epsilon_high``). Neutral setting: ``token_level_advantage=false, clip_alpha=0,
adv_beta=0, dual_clip_c=null`` leaves TRL's advantages and surrogate untouched (the run equals vanilla TRL).
Off-policy (injected) tokens keep the shaped off-policy branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

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
from trl_plugins.api.reasons import ADVANTAGE_PICK_ONE, ENTROPY_PICK_ONE

#: Plugins that compute the advantages from scratch: HAPO's token-level advantage is refused together with them.
ADVANTAGE_ESTIMATORS = ("canon", "prl", "riskpo")


@dataclass
class HapoOptions(PluginOptions):
    token_level_advantage: bool = option(
        True, help="Token-level group average advantage (every token weighs once in the group's mean and std)."
    )
    scale: Literal["group", "none"] = option(
        "group",
        help="'group': divide by the token-weighted group std + 1e-6 (official default); 'none': R - mean only.",
    )
    fallback_threshold: float = option(
        5.0, min=0.0, min_exclusive=True,
        help="A group whose token-level advantage has some |A| >= this keeps TRL's GRPO advantage (official: 5).",
    )
    fallback_test: Literal["padded", "real"] = option(
        "padded",
        help="Rows the fallback test looks at. 'padded' (official): also the padding positions (score 0) of every row "
        "shorter than max_completion_length, as the official test runs over the padded score tensor; 'real': the "
        "real rows only.",
    )
    entropy_pivot: float = option(
        0.8, min=0.0, max=1.0, help="Quantile of the log-entropies used as the centre of h (official recipe: 0.8)."
    )
    clip_alpha: float = option(
        1.0, min=0.0, help="Strength of the adaptive clip: eps_low (1 - alpha h_hat) / eps_high (1 + alpha h_hat)."
    )
    adv_beta: float = option(
        1.0, min=0.0, help="Strength of the advantage redistribution A (1 + beta h_hat)."
    )
    dual_clip_c: float | None = option(
        10.0, min=1.0, min_exclusive=True,
        help="Dual-clip bound c on negative advantages (loss <= -A c); null: no dual clip (official recipe: 10).",
    )
    code_sign_compat: bool = option(
        False,
        help="Reproduce the official code's sign of h_hat on low-entropy tokens (h_hat >= 0 everywhere); false: the "
        "paper's h_hat in [-1, 1].",
    )
    temperature_tau: float = option(
        0.0, min=0.0, max=1.0,
        help="Per-token adaptive sampling temperature T (1 + tau h_hat) (official recipe: 0.05; 0: TRL's single "
        "temperature). Transformers generation only: refused with use_vllm=True (vLLM samples a request at one "
        "temperature).",
    )

    def is_neutral_loss(self) -> bool:
        return self.clip_alpha == 0 and self.adv_beta == 0 and self.dual_clip_c is None


# --------------------------------------------------------------------------------------------- advantage stage
def token_level_group_stats(
    rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group (num_groups, 1): the token-weighted mean, the divisor (token-weighted population std + ``eps``, or 1
    without ``scale``) and the token count. NaN rewards count as 0 (TRL's nansum)."""
    R = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    L = lengths.float().view(-1, group_size)
    total = L.sum(dim=1, keepdim=True)
    safe = total.clamp(min=1.0)
    mu = (L * R).sum(dim=1, keepdim=True) / safe
    denom = torch.ones_like(mu)
    if scale:
        denom = ((L * (R - mu) ** 2).sum(dim=1, keepdim=True) / safe).sqrt() + eps
    return mu, denom, total


def token_level_group_advantages(
    rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """HAPO's token-level group average advantage of whole groups.

    Args:
        rewards: (N,) rewards (groups contiguous, N = num_groups * G); NaN counts as 0 (TRL's nansum).
        lengths: (N,) number of loss tokens per row (the token weights).
        group_size: G. scale: divide by the token-weighted population std + ``eps``.
    Returns:
        (N,) advantages; a group with no tokens gets 0.
    """
    mu, denom, total = token_level_group_stats(rewards, lengths, group_size, scale, eps)
    R = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    adv = (R - mu) / denom
    return torch.where(total > 0, adv, torch.zeros_like(adv)).view(-1)


def padding_advantages(
    rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, padded_length: int, scale: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(num_groups,) the value the official test sees at a group's padding positions, ``(0 - mu) / (sigma + eps)``;
    0 for a group whose rows all reach ``padded_length`` (no padding) or that has no tokens."""
    mu, denom, total = token_level_group_stats(rewards, lengths, group_size, scale, eps)
    has_padding = (lengths.view(-1, group_size) < padded_length).any(dim=1)
    pad = (-mu / denom).view(-1)
    return torch.where(has_padding & (total.view(-1) > 0), pad, torch.zeros_like(pad))


def with_grpo_fallback(
    token_adv: torch.Tensor, grpo_adv: torch.Tensor, group_size: int, threshold: float,
    pad_adv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups with some ``|token_adv| >= threshold`` (or ``|pad_adv| >= threshold``, the (num_groups,) value at their
    padding positions, when given) take ``grpo_adv``. Returns (N,) advantages and the (num_groups,) bool mask of the
    groups that fell back."""
    t = token_adv.view(-1, group_size)
    fallback = (t.abs() >= threshold).any(dim=1)
    if pad_adv is not None:
        fallback = fallback | (pad_adv.abs() >= threshold)
    out = torch.where(fallback.unsqueeze(1), grpo_adv.view(-1, group_size).to(t.dtype), t)
    return out.view(-1), fallback


# --------------------------------------------------------------------------------------------- loss stage
def normalized_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, pivot: float, code_sign: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """``h_hat`` (B, T): log-entropy centred at its nearest-rank ``pivot`` quantile over the valid tokens, divided by
    the RMS deviation, then scaled into [-1, 1] per side (``code_sign``: the official code's non-positive side, >= 0).

    Args:
        entropies: (B, T) next-token entropies (detached). mask: (B, T) valid tokens.
    Returns:
        (B, T) ``h_hat`` (0 on invalid tokens; all 0 when no token is valid).
    """
    valid = mask.bool()
    if not valid.any():
        return torch.zeros_like(entropies, dtype=torch.float32)
    logh = torch.log(entropies.float().clamp(min=eps))
    med = torch.quantile(logh[valid], pivot, interpolation="nearest")
    h = logh - med
    s = (h[valid].pow(2).mean()).clamp(min=1e-8).sqrt()
    h = torch.where(valid, h / s, torch.zeros_like(h))
    pos_max = torch.where(valid & (h > 0), h, torch.zeros_like(h)).max().clamp(min=1e-8)
    neg_min = torch.where(valid & (h < 0), h, torch.zeros_like(h)).min().clamp(max=-1e-8)
    neg_scale = (1.0 / neg_min) if code_sign else (1.0 / neg_min.abs())
    return torch.where(h > 0, h / pos_max, h * neg_scale)


def adaptive_clip_ranges(
    h_hat: torch.Tensor, eps_low: float, eps_high: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (eps_low', eps_high') (B, T): low-entropy tokens (h_hat <= 0) get ``eps_low (1 - alpha h_hat)``,
    high-entropy ones ``eps_high (1 + alpha h_hat)``; the other side keeps its scalar."""
    low = torch.full_like(h_hat, eps_low)
    high = torch.full_like(h_hat, eps_high)
    low = torch.where(h_hat <= 0, eps_low * (1 - alpha * h_hat), low)
    high = torch.where(h_hat > 0, eps_high * (1 + alpha * h_hat), high)
    return low, high


def redistributed_advantages(
    advantages: torch.Tensor, h_hat: torch.Tensor, ratio: torch.Tensor, eps_low: torch.Tensor,
    eps_high: torch.Tensor, beta: float,
) -> torch.Tensor:
    """HAPO's advantage redistribution (B, T): ``A_ent = A (1 + beta h_hat)``; inside the neutral band
    ``(1 - eps_low'/2, 1 + eps_high'/2)`` high-entropy tokens keep A and the others take A_ent, outside the reverse.

    Args: advantages (B, T) or (B, 1); h_hat, eps_low, eps_high (B, T); ratio (B, T) detached importance ratio.
    """
    adv = advantages.expand_as(h_hat)
    adv_ent = adv * (1 + beta * h_hat)
    inside = (ratio > 1 - eps_low / 2) & (ratio < 1 + eps_high / 2)
    high = torch.where(inside, adv, adv_ent)
    low = torch.where(inside, adv_ent, adv)
    return torch.where(h_hat > 0, high, low)


def hapo_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: torch.Tensor, eps_high: torch.Tensor,
    dual_clip_c: float | None,
) -> torch.Tensor:
    """PPO's clipped loss with per-token ranges, plus the dual clip on negative advantages (B, T).

    ``max(-A r, -A clip(r, 1 - eps_low', 1 + eps_high'))``, then ``min(., -A c)`` where ``A < 0`` (when ``dual_clip_c``).
    ``ratio`` carries the gradient; the others are detached.
    """
    clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    if dual_clip_c is None:
        return clipped
    return torch.where(advantages < 0, torch.minimum(clipped, -advantages * dual_clip_c), clipped)


# --------------------------------------------------------------------------------------------- sampling temperature
class EntropyStats(NamedTuple):
    """Normalisation of the log-entropies for the sampling temperature: ``h_hat = clip(h * scale, -1, 1)`` with
    ``h = (ln H - median) / std`` and ``scale = scale_pos`` for ``h > 0``, ``scale_neg`` otherwise."""

    median: float
    std: float
    scale_pos: float
    scale_neg: float


def entropy_statistics(entropies: torch.Tensor, pivot: float, code_sign: bool = False,
                       eps: float = 1e-8) -> EntropyStats:
    """The official ``compute_entropy_h`` statistics of (M,) token entropies: nearest-rank ``pivot`` quantile of
    ``ln max(H, eps)``, RMS deviation from it (``sqrt(max(mean (l - med)^2, eps))``), ``1 / max(h)`` and
    ``1 / |min(h)|`` (``code_sign``: the official ``1 / min(h)``, negative) over ``h = (l - med) / std``."""
    logh = torch.log(entropies.float().clamp(min=eps))
    med = torch.quantile(logh, pivot, interpolation="nearest")
    std = (logh - med).pow(2).mean().clamp(min=eps).sqrt()
    h = (logh - med) / std
    pos_max = h.clamp(min=0).max().clamp(min=eps)
    neg_min = h.clamp(max=0).min().clamp(max=-eps)
    scale_neg = 1.0 / neg_min if code_sign else 1.0 / neg_min.abs()
    return EntropyStats(float(med), float(std), float(1.0 / pos_max), float(scale_neg))


def adaptive_temperatures(logits: torch.Tensor, stats: EntropyStats, temperature: float, tau: float,
                          eps: float = 1e-6, floor: float = 1e-8) -> torch.Tensor:
    """HAPO's per-token sampling temperature (B,) from one decoding step's raw (B, V) logits:
    ``T (1 + tau clip(h * scale, -1, 1))``, ``h = (ln max(H, floor) - median) / (std + eps)``, ``H`` the entropy of
    ``softmax(logits)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(dim=-1)
    h = (torch.log(entropy.clamp(min=floor)) - stats.median) / (stats.std + eps)
    h_hat = torch.where(h > 0, h * stats.scale_pos, h * stats.scale_neg).clamp(-1.0, 1.0)
    return temperature * (1.0 + tau * h_hat)


class HapoPlugin(Plugin):
    """Token-heterogeneous advantages and entropy-adaptive asymmetric clipping (advantage and loss stages)."""
    claim_metric = ('high_entropy_fraction', 'tokens treated as high-entropy')
    image_inputs = True
    multi_turn = True

    name = "hapo"
    version = "0.1.0"
    paper = (
        "From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature (HAPO), "
        "arXiv:2509.16591"
    )
    summary = "Token-level group advantages, entropy-adaptive asymmetric clipping and advantage redistribution."
    Options = HapoOptions
    official = OfficialSource(
        "starriver030515/HAPO", "7671dde", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py",),
        variants=("fallback_test",),
    )
    replaces = (
        "the advantages (token-level group average; with token_level_advantage=true, refused then together with "
        f"{', '.join(ADVANTAGE_ESTIMATORS)})",
        "the base surrogate on on-policy tokens (per-token clip ranges, redistributed advantage, dual clip)",
    )
    replaces_surrogate = True
    conflicts_with = {
        "clip_cov": ENTROPY_PICK_ONE,
        "kl_cov": ENTROPY_PICK_ONE,
        "lp_reg": ENTROPY_PICK_ONE,
        "siren": ENTROPY_PICK_ONE,
    }
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = "HAPO adapts PPO's clip range per token; this loss type has no PPO clip"
    reconstructed = (
        "h_hat's sign on low-entropy tokens follows the paper (the official code's sign: code_sign_compat=true)",
        "the GRPO fallback uses TRL's advantage (std + 1e-4) where the official code adds 1e-6",
        "the adaptive temperature's entropy statistics come from each process's loss tokens of the previous optimizer "
        "step (official: the whole previous batch's old-policy entropies, on the driver)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.temperature = 1.0
        self.padded_length: int | None = None  # max_completion_length, the official padded response length
        self.entropy_stats: EntropyStats | None = None  # of the previous optimizer step
        self._step_entropies: list[torch.Tensor] = []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        self.padded_length = getattr(args, "max_completion_length", None)
        if o.temperature_tau > 0:
            if args.use_vllm:
                raise IncompatiblePluginsError(
                    f"hapo: temperature_tau={o.temperature_tau!r} asks for a per-token sampling temperature, which "
                    "cannot go through vLLM (it samples every token of a request at one temperature). Set "
                    "temperature_tau=0 or use_vllm=False."
                )
            self.temperature = float(args.temperature)
            trainer.set_token_temperature(self.sampling_temperatures)
        others = [p for p in getattr(args, "plugins", None) or [] if p in ADVANTAGE_ESTIMATORS]
        if o.token_level_advantage and others:
            raise IncompatiblePluginsError(
                f"Plugins 'hapo' (token_level_advantage=true) and {others[0]!r} cannot be stacked: "
                f"{ADVANTAGE_PICK_ONE}. Set token_level_advantage=false (HAPO then acts on the loss only) or disable "
                f"{others[0]}."
            )
        if args.importance_sampling_level != "token":
            raise IncompatiblePluginsError(
                f"hapo adapts the clip range per token; importance_sampling_level={args.importance_sampling_level!r} "
                "gives one ratio per sequence. Use importance_sampling_level='token'."
            )
        if getattr(args, "delta", None) is not None and not o.is_neutral_loss():
            raise IncompatiblePluginsError(
                f"hapo replaces TRL's clipped surrogate and has its own dual clip (dual_clip_c); delta={args.delta!r} "
                "would be ignored. Set delta=None."
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.token_level_advantage:
            return
        G = ctx.num_generations
        token_adv = token_level_group_advantages(ctx.rewards, ctx.completion_lengths, G, scale=o.scale == "group")
        grpo = ctx.advantages if ctx.advantages.dim() == 1 else ctx.advantages[:, 0]
        pad_adv = None
        if o.fallback_test == "padded":
            padded = self.padded_length or int(ctx.completion_lengths.max())
            pad_adv = padding_advantages(ctx.rewards, ctx.completion_lengths, G, padded, scale=o.scale == "group")
        adv, fallback = with_grpo_fallback(token_adv, grpo, G, o.fallback_threshold, pad_adv)
        ctx.advantages = adv.to(ctx.advantages.dtype)
        ctx.log_metric("fallback_group_fraction", fallback.float().mean().item())

    def sampling_temperatures(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) raw logits of one decoding step -> (B,) temperatures ``T (1 + tau h_hat)``."""
        if self.entropy_stats is None:
            return torch.full(logits.shape[:1], self.temperature, device=logits.device)
        return adaptive_temperatures(logits, self.entropy_stats, self.temperature, self.options.temperature_tau)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        if self._step_entropies:
            o = self.options
            self.entropy_stats = entropy_statistics(torch.cat(self._step_entropies), o.entropy_pivot, o.code_sign_compat)
            self._step_entropies = []

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"entropy_stats": None if self.entropy_stats is None else list(self.entropy_stats)}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        stats = (state or {}).get("entropy_stats")
        self.entropy_stats = None if stats is None else EntropyStats(*[float(x) for x in stats])

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        if o.temperature_tau > 0 and ctx.mode == "train":
            self._step_entropies.append(ctx.entropies.detach()[ctx.mask.bool()].float().cpu())
        if o.is_neutral_loss():
            return
        with torch.no_grad():
            h_hat = normalized_entropy(ctx.entropies.detach(), ctx.mask, o.entropy_pivot, o.code_sign_compat)
            h_hat = h_hat.to(ctx.per_token_logps.dtype)
            eps_low, eps_high = adaptive_clip_ranges(h_hat, ctx.epsilon_low, ctx.epsilon_high, o.clip_alpha)
            ratio = ctx.coef_1.detach().expand_as(h_hat)
            advantages = redistributed_advantages(ctx.advantages, h_hat, ratio, eps_low, eps_high, o.adv_beta)
        values = hapo_token_loss(ctx.coef_1.expand_as(h_hat), advantages, eps_low, eps_high, o.dual_clip_c)
        tokens = ctx.mask.bool() & ~ctx.offpolicy_mask
        ctx.replace_tokens(tokens, values)
        ctx.log_metric("high_entropy_fraction", ctx.global_masked_mean((h_hat > 0).float()))
        ctx.log_metric("mean_eps_low", ctx.global_masked_mean(eps_low))
        ctx.log_metric("mean_eps_high", ctx.global_masked_mean(eps_high))
