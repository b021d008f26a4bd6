"""The loss rules of the plugin loss path, as pure functions (no trainer, no state).

This module is the one home of the rules that turn per-token log-probs into the micro-batch loss when plugins
take part: TRL 1.16's surrogate per ``loss_type`` (``GRPOTrainer._compute_loss``, same operations in the same
order, so that neutral plugins reproduce TRL bit for bit), the shaped off-policy branch, how plugin contributions
combine, and the aggregation per ``loss_type``. :mod:`trl_plugins.runtime.loss` (the trainer's loss path) and the
testing kit (:func:`trl_plugins.testing.make_loss_context`, :func:`trl_plugins.testing.loss_from_context`) call them.

Order of a micro-batch (B rows, T completion positions; steps marked + are ours, the rest is TRL's):

1. :func:`importance_weights` -- ``log pi_theta - log pi_old`` and the ratio ``coef_1`` at the token or
   sequence level;
2. :func:`reference_kl` -- TRL's k3 estimator to the reference model (only when ``beta != 0``);
3. :func:`base_surrogate` -- the per-token loss of ``loss_type`` (+ a per-token clip range when a
   ``trl_plugins_loss_advantages`` hook called ``LossContext.scale_clip_range``: :func:`clip_bounds`);
4. + :func:`shape_offpolicy_tokens` -- tokens a sampling plugin marked off-policy take ``-A p / (p + gamma)``;
5. :func:`compose_token_loss` -- + one plugin's replacement on a token subset, + token weights (multiply), TRL's
   off-policy sequence mask and entropy mask (multiply), the vLLM importance-sampling ratio (multiply; 1 on
   off-policy tokens, + :func:`offpolicy_neutral_ratio`), ``beta * KL`` (add), + plugins' token terms (add);
6. :func:`aggregate` -- TRL's normalisation by ``loss_type``; + :func:`add_scalar_terms` adds plugins' scalar terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES



def _trl_default(name: str):
    """The default of a ``GRPOConfig`` field (so that the rules never restate TRL's numbers)."""
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}[name]


@dataclass(frozen=True)
class LossSettings:
    """The run's settings the loss rules read; defaults are ``GRPOConfig``'s.

    Attributes:
        loss_type: one of :data:`LOSS_TYPES`.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (cispo: ``epsilon_high`` is
            the upper bound of the detached ratio).
        importance_sampling_level: ``"token"`` (ratio per token) or ``"sequence"`` (GSPO: one ratio per row,
            the exponential of the masked mean log-ratio).
        delta: upper bound of the unclipped ratio (two-sided clipping), or None.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for positive / other advantages.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma-weight parameters.
        offpolicy_gamma: gamma of the shaped off-policy branch ``p / (p + gamma)`` (``offpolicy_shaping_gamma``).
    """

    loss_type: str
    epsilon_low: float = _trl_default("epsilon")
    epsilon_high: float = _trl_default("epsilon")
    importance_sampling_level: str = _trl_default("importance_sampling_level")
    delta: float | None = _trl_default("delta")
    sapo_temperature_pos: float = _trl_default("sapo_temperature_pos")
    sapo_temperature_neg: float = _trl_default("sapo_temperature_neg")
    vespo_k_pos: float = _trl_default("vespo_k_pos")
    vespo_lambda_pos: float = _trl_default("vespo_lambda_pos")
    vespo_k_neg: float = _trl_default("vespo_k_neg")
    vespo_lambda_neg: float = _trl_default("vespo_lambda_neg")
    offpolicy_gamma: float = 0.1

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is unknown; allowed: {', '.join(LOSS_TYPES)}.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r} is unknown; allowed: "
                f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}."
            )

    @classmethod
    def from_trainer(cls, trainer) -> LossSettings:
        """The settings of a ``GRPOTrainer`` (its ``loss_type``/``epsilon_*`` attributes and its ``args``)."""
        args = trainer.args
        return cls(
            loss_type=trainer.loss_type,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            importance_sampling_level=trainer.importance_sampling_level,
            delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            offpolicy_gamma=getattr(args, "offpolicy_shaping_gamma", cls.offpolicy_gamma),
        )


class ImportanceWeights(NamedTuple):
    """Output of :func:`importance_weights`.

    Attributes:
        log_ratio: (B, T) ``log pi_theta - log pi_old`` per token (VESPO's input at any level).
        log_weights: (B, T) at token level, (B, 1) at sequence level (masked mean of ``log_ratio``).
        coef_1: ``exp(log_weights)``, same shape: the importance ratio.
    """

    log_ratio: torch.Tensor
    log_weights: torch.Tensor
    coef_1: torch.Tensor


class Surrogate(NamedTuple):
    """Output of :func:`base_surrogate`.

    Attributes:
        per_token_loss: (B, T), or (B, 1) at sequence level with per-row advantages (it broadcasts over T).
        coef_1: the importance ratio as TRL holds it after the surrogate (capped at ``delta`` for the clipped
            loss types when ``delta`` is set), which TRL's clip-ratio metrics read.
        vespo_weights: VESPO's detached gamma weights ``phi`` ((B, 1), or (B, T) with token advantages); None for
            every other loss type.
    """

    per_token_loss: torch.Tensor
    coef_1: torch.Tensor
    vespo_weights: torch.Tensor | None = None


def with_behaviour_logps(old_per_token_logps: torch.Tensor, behaviour_logps: torch.Tensor | None) -> torch.Tensor:
    """The old log-probs with the stored behaviour log-probs of replayed tool episodes where those are finite.

    Args:
        old_per_token_logps: (B, T) log pi_old (TRL's, or ``per_token_logps.detach()``).
        behaviour_logps: (B, T) behaviour log-probs of replayed rows, NaN elsewhere (other rows, tool-result tokens,
            padding); None = no replayed row.
    Returns:
        (B, T): ``behaviour_logps`` where finite, ``old_per_token_logps`` elsewhere, so the ratio of a replayed token is
        ``exp(log pi_theta - log pi_behaviour)``.
    """
    if behaviour_logps is None:
        return old_per_token_logps
    behaviour = behaviour_logps.to(device=old_per_token_logps.device, dtype=old_per_token_logps.dtype)
    return torch.where(torch.isfinite(behaviour), behaviour, old_per_token_logps)


def importance_weights(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> ImportanceWeights:
    """The importance ratio at TRL's ``importance_sampling_level``.

    Args:
        per_token_logps: (B, T) log pi_theta, with grad.
        old_per_token_logps: (B, T) log pi_old.
        mask: (B, T) loss mask.
        level: ``"token"`` or ``"sequence"``.
    """
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_weights = log_ratio
    elif level == "sequence":
        log_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_weights = log_weights.unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling_level={level!r} is unknown; allowed: token, sequence.")
    return ImportanceWeights(log_ratio, log_weights, torch.exp(log_weights))


def reference_kl(
    per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, coef_1: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's per-token KL to the reference model, ``exp(ref - lp) - (ref - lp) - 1``.

    Args:
        per_token_logps, ref_per_token_logps: (B, T).
        coef_1: the importance ratio ((B, T) or (B, 1)) when ``use_bias_correction_kl``; None otherwise.
    Returns:
        (B, T).
    """
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    if coef_1 is not None:
        per_token_kl = per_token_kl * coef_1
    return per_token_kl


def base_surrogate(
    settings: LossSettings,
    per_token_logps: torch.Tensor,
    weights: ImportanceWeights,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None = None,
    clip_scale: torch.Tensor | None = None,
) -> Surrogate:
    """TRL's per-token surrogate of ``settings.loss_type``.

    * clipped (grpo, bnpo, dr_grpo, dapo, luspo): ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, with ``r``
      capped at ``delta`` first when set; with ``clip_scale`` ``c`` the range is per token,
      ``clip(r, 1 - c eps_low, 1 + c eps_high)`` (:func:`clip_bounds`);
    * cispo: ``-sg(min(r, eps_high)) A log pi``;
    * sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau`` = ``sapo_temperature_pos`` where ``A > 0``, else
      ``sapo_temperature_neg``;
    * vespo: ``-phi A log pi`` with TRL's detached gamma weights ``phi`` of the sequence ratio
      (``GRPOTrainer.get_gamma_weights``, called as is), which also take in the vLLM importance-sampling ratio.

    Args:
        per_token_logps: (B, T) log pi_theta, with grad.
        weights: :func:`importance_weights` of this micro-batch.
        advantages: (B, 1) per row, or (B, T) per token.
        mask: (B, T) loss mask.
        importance_sampling_ratio: (B, T) vLLM importance-sampling ratio; used by vespo only (the other loss types
            get it in :func:`compose_token_loss`).
        clip_scale: (B, T) positive factors of the clip range per token (``LossContext.scale_clip_range``), or None
            (TRL's scalar range). Only for the clipped loss types.
    """
    coef_1 = weights.coef_1
    loss_type = settings.loss_type
    if clip_scale is not None and loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(
            f"A per-token clip scale needs a clipped loss type ({', '.join(CLIPPED_LOSS_TYPES)}); "
            f"loss_type={loss_type!r} has no PPO clip range."
        )
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=settings.epsilon_high).detach()
        return Surrogate(-clamped_ratios * advantages * per_token_logps, coef_1)
    if loss_type in CLIPPED_LOSS_TYPES:
        low, high = clip_bounds(settings, clip_scale)
        coef_2 = torch.clamp(coef_1, low, high)
        if settings.delta is not None:
            coef_1 = torch.clamp(coef_1, max=settings.delta)
        return Surrogate(-torch.min(coef_1 * advantages, coef_2 * advantages), coef_1)
    if loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        return Surrogate(-soft_coef_1 * advantages, coef_1)
    if loss_type == "vespo":
        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=weights.log_ratio,
            mask=mask,
            importance_sampling_ratio=importance_sampling_ratio,
            k_pos=settings.vespo_k_pos,
            lambda_pos=settings.vespo_lambda_pos,
            k_neg=settings.vespo_k_neg,
            lambda_neg=settings.vespo_lambda_neg,
        )
        return Surrogate(-phi_seq * advantages * per_token_logps, coef_1, phi_seq)
    raise ValueError(f"loss_type={loss_type!r} is unknown; allowed: {', '.join(LOSS_TYPES)}.")


def clip_bounds(
    settings: LossSettings, clip_scale: torch.Tensor | None = None
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """The clip range ``(1 - eps_low, 1 + eps_high)`` of the clipped loss types: TRL's two scalars, or with
    ``clip_scale`` ``c`` ((B, T), one factor per token) the per-token bounds ``(1 - c eps_low, 1 + c eps_high)``."""
    if clip_scale is None:
        return 1 - settings.epsilon_low, 1 + settings.epsilon_high
    return 1 - clip_scale * settings.epsilon_low, 1 + clip_scale * settings.epsilon_high


def ratio_enters_surrogate(loss_type: str) -> bool:
    """Whether the vLLM importance-sampling ratio goes into the surrogate (vespo's gamma weights) instead of
    multiplying the per-token loss (every other loss type)."""
    return loss_type == "vespo"


def shaped_offpolicy_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY policy shaping for off-policy tokens: ``-A * f(p)`` with ``f(p) = p / (p + gamma)``, p = exp(logp).

    No importance ratio and no clipping. Gradient w.r.t. log p: ``-A * gamma * p / (p + gamma)^2``.

    Args:
        per_token_logps: (B, T) log pi_theta, with grad.
        advantages: (B, T) or (B, 1).
    Returns:
        (B, T) per-token loss.
    """
    p = per_token_logps.exp()
    return -advantages * (p / (p + gamma))


def shape_offpolicy_tokens(
    per_token_loss: torch.Tensor,
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    offpolicy: torch.Tensor | None,
    gamma: float,
) -> torch.Tensor:
    """The surrogate with off-policy tokens replaced by :func:`shaped_offpolicy_loss`.

    Args:
        per_token_loss: (B, T) or (B, 1) base surrogate.
        per_token_logps: (B, T) log pi_theta, with grad.
        advantages: (B, T) or (B, 1).
        offpolicy: (B, T) bool, or None when the micro-batch has no off-policy token (then unchanged).
    Returns:
        (B, T) when some token is off-policy, else ``per_token_loss`` itself.
    """
    if offpolicy is None:
        return per_token_loss
    shaped = shaped_offpolicy_loss(per_token_logps, advantages, gamma)
    return torch.where(offpolicy, shaped, per_token_loss.expand_as(shaped))


def offpolicy_neutral_ratio(importance_sampling_ratio: torch.Tensor, offpolicy: torch.Tensor | None) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio with 1 on off-policy tokens (they were not sampled by the policy).

    Args:
        importance_sampling_ratio: (B, T) or (B, 1).
        offpolicy: (B, T) bool, or None when no token is off-policy (then unchanged).
    Returns:
        (B, T) when some token is off-policy, else the ratio itself.
    """
    if offpolicy is None:
        return importance_sampling_ratio
    ratio = importance_sampling_ratio.expand_as(offpolicy)
    return torch.where(offpolicy, torch.ones_like(ratio), ratio)


def compose_token_loss(
    per_token_loss: torch.Tensor,
    *,
    replacement: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_weights: Sequence[torch.Tensor] = (),
    token_terms: Sequence[torch.Tensor] = (),
    off_policy_mask: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    beta: float = 0.0,
    per_token_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token loss the micro-batch aggregates, from the (shaped) surrogate and every contribution.

    The one plugin allowed to replace the surrogate does so first (``values`` where its token mask is set); then
    every plugin's token weights multiply; then TRL's factors (off-policy sequence mask, entropy mask, vLLM
    importance-sampling ratio) multiply; then ``beta * KL`` and the plugins' token terms add. Additive terms are
    therefore never scaled by token weights or masks; the aggregation masks them like the surrogate.

    Args:
        per_token_loss: (B, T) or (B, 1).
        replacement: ``(token_mask (B, T) bool, values (B, T))`` or None.
        token_weights: tensors broadcastable to (B, T).
        token_terms: (B, T) tensors.
        off_policy_mask: TRL's off-policy sequence mask ((B, 1) or (B, T)), or None.
        entropy_mask: (B, T) TRL's high-entropy mask, or None.
        importance_sampling_ratio: (B, T) or (B, 1) vLLM ratio (see :func:`offpolicy_neutral_ratio`), or None.
        beta, per_token_kl: the KL coefficient and (B, T) :func:`reference_kl`; the term is added when
            ``beta != 0``.
    Returns:
        (B, T), or (B, 1) when every input is per row.
    """
    if replacement is not None:
        replace_mask, values = replacement
        per_token_loss = torch.where(replace_mask, values, per_token_loss.expand_as(values))
    for weights in token_weights:
        per_token_loss = per_token_loss * weights
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    for term in token_terms:
        per_token_loss = per_token_loss + term
    return per_token_loss


def aggregate(
    loss_type: str,
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor,
    max_completion_length: int,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    mode: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's micro-batch loss from the per-token loss, by ``loss_type``.

    * grpo, sapo: mean over rows of each row's masked token-mean;
    * bnpo: masked token-mean of the micro-batch;
    * dr_grpo: masked sum / (B * ``max_completion_length``);
    * dapo, cispo, vespo: masked sum / the generation batch's loss tokens per accumulation window
      (``num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation`` in training,
      ``num_items_in_batch / num_processes`` in eval); no further division;
    * luspo: mean over rows of each row's masked sum.

    Every type but dapo/cispo/vespo is then divided by ``gradient_accumulation_steps`` in training.

    Args:
        per_token_loss: (B, T) or (B, 1) (broadcast against ``mask``).
        mask: (B, T) loss mask.
        num_items_in_batch: scalar tensor, loss tokens of the whole generation batch on all processes.
    Returns:
        ``(loss to backpropagate, policy loss for logging (detached, before the accumulation division))``.
    """
    accumulation = gradient_accumulation_steps if mode == "train" else 1.0
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type in ("cispo", "dapo", "vespo"):
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if mode == "train":
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        return loss, loss.detach()
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:
        raise ValueError(f"loss_type={loss_type!r} is unknown; allowed: {', '.join(LOSS_TYPES)}.")
    return loss / accumulation, loss.detach()


def add_scalar_terms(loss: torch.Tensor, scalar_terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The micro-batch loss plus the plugins' scalar terms (0-dim tensors, added as given)."""
    for term in scalar_terms:
        loss = loss + term
    return loss


def rows_if_constant(advantages: torch.Tensor) -> torch.Tensor:
    """(B, T) token advantages that are constant along each row as (B, 1), else unchanged.

    The loss path expands per-row advantages to (B, T) for ``trl_plugins_loss_advantages`` hooks; when the hooks
    keep them per row, the surrogate is built from (B, 1) as TRL builds it (same rounding, and at sequence-level
    importance sampling the same per-sequence metrics).
    """
    if advantages.size(1) > 1 and torch.equal(advantages, advantages[:, :1].expand_as(advantages)):
        return advantages[:, :1]
    return advantages


def per_sequence(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values as (B, 1) per-sequence masked means (rows without loss tokens: 0); (B, 1) unchanged.

    Used for metrics TRL logs per sequence at sequence-level importance sampling (clip ratios, VESPO's
    ``phi``), once plugin token advantages made them per token.
    """
    if x.size(1) == 1:
        return x
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
