"""The loss stage: TRL 1.16's ``GRPOTrainer._compute_loss`` with plugin hook points and off-policy shaping.

Used instead of TRL's method only when a stack has loss hooks or sampling hooks (which may inject off-policy
tokens); with no plugins the trainer calls TRL's own method. With no loss contribution and no off-policy
tokens this function reproduces TRL's loss and gradients bit for bit, for every loss type (checked by
``tests/runtime/test_reduction.py`` and ``tests/runtime/test_loss_stage.py``). The formulas live in
:mod:`trl_plugins.runtime.loss_rules`; this module runs the forward, calls the hooks and TRL's helpers, and logs TRL's
metrics, reaching TRL's private state only through the public accessors of :mod:`trl_plugins.runtime.trl_seam`
(``per_token_logps_and_entropies``, ``micro_step``, ``entropy_bonus``, ``record_metric``). Order of operations (TRL's,
with our additions marked +):

1. per-token log-probs and entropies through TRL's fused LM head (+ hidden states captured for head stats);
2. TRL's entropy mask (``top_entropy_quantile``);
3. token advantages (B, T) (+ ``trl_plugins_loss_advantages`` chain; advantages the hooks keep per row go back
   to (B, 1), so the surrogate and the metrics are TRL's; + per-token clip range from ``ctx.scale_clip_range``);
4. old log-probs (+ the stored behaviour log-probs of replayed tool episodes), TRL's off-policy sequence mask
   (+ never applied to off-policy tokens), importance ratio;
5. reference KL;
6. base surrogate by ``loss_type`` (+ off-policy tokens: ``-A * p / (p + gamma)``, LUFFY shaping, no ratio);
7. (+ ``trl_plugins_loss``: token-subset replacement, multiplicative weights, additive token terms);
8. masks multiply, vLLM IS ratio (+ 1 on off-policy tokens), ``beta * KL`` added, aggregation by ``loss_type``;
9. entropy bonus, MoE aux loss (+ scalar plugin terms); TRL's metrics (+ at sequence-level importance sampling,
   clip ratios stay per sequence when plugin token advantages vary along a row).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from trl_plugins.runtime import loss_rules as rules
from trl_plugins.api.contexts import BEHAVIOUR_LOGPS_KEY, EXTRA_PREFIX, OFFPOLICY_KEY, LossContext
from trl_plugins.api.errors import IncompatiblePluginsError
from trl_plugins.api.loss_types import SUPPORTED_LOSS_TYPES
from trl_plugins.runtime.trl_seam import multimodal_forward_kwargs


def check_loss_type(loss_type: str) -> None:
    """Refuse loss types the plugin loss path does not implement (at construction)."""
    if loss_type not in SUPPORTED_LOSS_TYPES:
        raise IncompatiblePluginsError(
            f"loss_type={loss_type!r} is not supported together with loss- or sampling-stage plugins; "
            f"supported: {', '.join(SUPPORTED_LOSS_TYPES)}."
        )


def compute_loss_with_plugins(trainer: Any, model: Any, inputs: dict) -> torch.Tensor:
    """Micro-batch loss with the plugin stack applied (see the module docstring for the order)."""
    t = trainer
    args = t.args
    stack = t.plugin_stack
    mode = "train" if t.model.training else "eval"
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

    capture_ctx = contextlib.nullcontext()
    if stack.needs_head_stats:
        from trl_plugins.runtime.head_stats import capture_hidden_states

        capture_ctx = capture_hidden_states(model)
    with capture_ctx as capture:
        per_token_logps, entropies, aux_loss = t.per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=t.aux_loss_enabled,
            **multimodal_forward_kwargs(inputs),
        )

    entropy_mask = None
    if t.top_entropy_quantile < 1.0:
        entropy_mask = t.get_high_entropy_mask(entropies, mask, 1 - t.top_entropy_quantile)

    settings = rules.LossSettings.from_trainer(t)
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    per_row_advantages = advantages.size(1) == 1
    offpolicy = inputs.get(OFFPOLICY_KEY)
    offpolicy = torch.zeros_like(mask, dtype=torch.bool) if offpolicy is None else offpolicy.bool()
    has_offpolicy = bool(offpolicy.any())
    offpolicy_tokens = offpolicy if has_offpolicy else None
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    old_per_token_logps = rules.with_behaviour_logps(old_per_token_logps, inputs.get(BEHAVIOUR_LOGPS_KEY))
    extras = {k[len(EXTRA_PREFIX):]: v for k, v in inputs.items() if k.startswith(EXTRA_PREFIX)}

    ctx = LossContext(
        inputs=inputs,
        per_token_logps=per_token_logps,
        old_per_token_logps=old_per_token_logps,
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
        entropies=entropies,
        advantages=advantages,
        mask=mask,
        offpolicy_mask=offpolicy,
        extras=extras,
        loss_type=t.loss_type,
        epsilon_low=t.epsilon_low,
        epsilon_high=t.epsilon_high,
        beta=t.beta,
        num_items_in_batch=inputs["num_items_in_batch"],
        iteration=(t.micro_step // args.steps_per_generation) % t.num_iterations,
        mode=mode,
        gradient_accumulation_steps=t.current_gradient_accumulation_steps if mode == "train" else 1,
        num_generations=_whole_group_size(t, mode) if stack.needs_whole_groups else None,
        services=t.plugin_services if capture is None else dataclasses.replace(
            t.plugin_services, head_stats=_head_stats_factory(t, model, capture, logits_to_keep, mask)
        ),
    )

    if stack.has("trl_plugins_loss_advantages"):
        if per_row_advantages:
            ctx.advantages = ctx.advantages.expand(-1, logits_to_keep).clone()
        stack.call("trl_plugins_loss_advantages", ctx)
    advantages = rules.rows_if_constant(ctx.advantages) if per_row_advantages else ctx.advantages

    if t.off_policy_mask_threshold is not None:
        sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
        off_policy_mask = t.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=sampling_per_token_logps,
            mask=mask,
            off_policy_threshold=t.off_policy_mask_threshold,
        )
        # Injected (off-policy) tokens are never masked by TRL's off-policy sequence mask
        off_policy_mask = torch.where(offpolicy, torch.ones_like(off_policy_mask), off_policy_mask)

    weights = rules.importance_weights(per_token_logps, old_per_token_logps, mask, settings.importance_sampling_level)
    ctx.log_ratio, ctx.coef_1 = weights.log_weights, weights.coef_1

    per_token_kl = None
    if t.beta != 0.0:
        per_token_kl = rules.reference_kl(
            per_token_logps, inputs["ref_per_token_logps"], weights.coef_1 if args.use_bias_correction_kl else None
        )

    is_ratio = None
    if t.use_vllm and t.vllm_importance_sampling_correction:
        is_ratio = rules.offpolicy_neutral_ratio(inputs["importance_sampling_ratio"], offpolicy_tokens)
    in_surrogate = rules.ratio_enters_surrogate(settings.loss_type)
    surrogate = rules.base_surrogate(
        settings, per_token_logps, weights, advantages, mask, is_ratio if in_surrogate else None, ctx.clip_scale
    )
    per_token_loss = rules.shape_offpolicy_tokens(
        surrogate.per_token_loss, per_token_logps, advantages, offpolicy_tokens, settings.offpolicy_gamma
    )

    ctx.per_token_loss = per_token_loss
    ctx.surrogate_built = True
    if stack.has("trl_plugins_loss"):
        stack.call("trl_plugins_loss", ctx)
    per_token_loss = rules.compose_token_loss(
        per_token_loss,
        replacement=ctx.replacement,
        token_weights=ctx.token_weights,
        token_terms=ctx.token_terms,
        off_policy_mask=off_policy_mask if t.off_policy_mask_threshold is not None else None,
        entropy_mask=entropy_mask,
        importance_sampling_ratio=None if in_surrogate else is_ratio,
        beta=t.beta,
        per_token_kl=per_token_kl,
    )

    loss, policy_loss = rules.aggregate(
        settings.loss_type,
        per_token_loss,
        mask,
        num_items_in_batch=inputs["num_items_in_batch"],
        max_completion_length=t.max_completion_length,
        num_processes=t.accelerator.num_processes,
        # transformers sets it inside the training loop only; evaluation (eval_on_start, evaluate() before train())
        # neither splits nor accumulates, as in TRL
        gradient_accumulation_steps=t.current_gradient_accumulation_steps if mode == "train" else 1,
        steps_per_generation=args.steps_per_generation,
        mode=mode,
    )
    loss = rules.add_scalar_terms(loss, ctx.scalar_terms)

    if t.entropy_bonus_enabled:
        loss = t.entropy_bonus(loss, policy_loss, entropies, mask, entropy_mask, mode)
    if t.aux_loss_enabled:
        normalizer = t.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + t.router_aux_loss_coef * aux_loss / normalizer
        t.record_metric(mode, "aux_loss", t.accelerator.gather_for_metrics(aux_loss).mean().item())

    _log_trl_metrics(t, mode, mask, entropies, surrogate, advantages, per_token_kl, per_row_advantages, ctx.clip_scale)
    if has_offpolicy or stack.has("trl_plugins_after_generation"):
        t.record_metric(mode, "plugins/framework/offpolicy_token_fraction", _global_masked_mean(t, offpolicy.float(), mask))
    return loss


def _whole_group_size(t: Any, mode: str) -> int:
    """G of this micro-batch's groups (whole, consecutive: :mod:`trl_plugins.runtime.whole_groups`)."""
    return t.num_generations if mode == "train" else t.num_generations_eval


def _global_masked_mean(t: Any, x: torch.Tensor, mask: torch.Tensor) -> float:
    if x.shape[1] == 1:
        local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
    else:
        local_sum, local_count = (x * mask).sum(), mask.sum().float()
    totals = t.accelerator.reduce(torch.stack([local_sum.float(), local_count.float()]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _log_trl_metrics(
    t, mode, mask, entropies, surrogate, advantages, per_token_kl, per_row_advantages, clip_scale=None
) -> None:
    """TRL's own loss metrics (kl, entropy, clip ratios, VESPO's phi), so dashboards look the same with plugins on.

    TRL logs the clip ratios and ``phi`` per sequence at sequence-level importance sampling (one value per row).
    When ``trl_plugins_loss_advantages`` hooks turned per-row advantages into advantages that vary along a row,
    the per-token indicators are first averaged within each row (:func:`~trl_plugins.runtime.loss_rules.per_sequence`),
    so every sequence still counts once, as in TRL.
    """
    from trl.trainer.utils import nanmax, nanmin

    coef_1 = surrogate.coef_1
    per_row = per_row_advantages and coef_1.size(1) == 1

    def at_trl_level(x):
        return rules.per_sequence(x, mask) if per_row else x

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    if per_token_kl is not None:
        t.record_metric(mode, "kl", _global_masked_mean(t, per_token_kl, mask))
    t.record_metric(mode, "entropy", _global_masked_mean(t, entropies, mask))
    if t.loss_type in rules.CLIPPED_LOSS_TYPES:
        low_bound, high_bound = rules.clip_bounds(rules.LossSettings.from_trainer(t), clip_scale)
        is_low_clipped = (coef_1 < low_bound) & (advantages < 0)
        is_high_clipped = (coef_1 > high_bound) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        low, high = at_trl_level(is_low_clipped.float()), at_trl_level(is_high_clipped.float())
        t.record_metric(mode, "clip_ratio/low_mean", _global_masked_mean(t, low, mask))
        t.record_metric(mode, "clip_ratio/high_mean", _global_masked_mean(t, high, mask))
        region = at_trl_level(is_region_clipped.float())
        t.record_metric(mode, "clip_ratio/region_mean", _global_masked_mean(t, region, mask))
        gathered_low_clip = t.accelerator.gather(masked_seq_mean(low))
        t.record_metric(mode, "clip_ratio/low_min", nanmin(gathered_low_clip).item())
        gathered_high_clip = t.accelerator.gather(masked_seq_mean(high))
        t.record_metric(mode, "clip_ratio/high_max", nanmax(gathered_high_clip).item())
    elif t.loss_type == "cispo":
        is_cispo_clipped = at_trl_level(((coef_1 > t.epsilon_high) & (advantages > 0)).float())
        t.record_metric(mode, "cispo_clip_ratio", _global_masked_mean(t, is_cispo_clipped, mask))
    elif t.loss_type == "vespo":  # phi is per sequence in TRL whenever the advantages are per row
        phi = rules.per_sequence(surrogate.vespo_weights, mask) if per_row_advantages else surrogate.vespo_weights
        t.record_metric(mode, "vespo/phi_seq_mean", _global_masked_mean(t, phi, mask))


def _head_stats_factory(t: Any, model: Any, capture: Any, logits_to_keep: int, mask: torch.Tensor):
    """Lazy builder of the :class:`HeadStats` of this forward (built once, on first use).

    Under an engine whose head must be gathered (FSDP1, ZeRO-3: a collective, :mod:`trl_plugins.api.engines`) it is
    built at once, on every process, so a plugin asking for it on some processes only cannot leave the others
    waiting."""
    from trl_plugins.api.engines import GATHERING_ENGINES

    cache: dict[str, Any] = {}

    def build():
        if "stats" not in cache:
            from trl_plugins.api.engines import head_gradient_path
            from trl_plugins.runtime.head_stats import HeadStats, lm_head_of

            weight, bias, logit_scale, softcap = lm_head_of(model)
            cache["stats"] = HeadStats(
                capture.hidden,
                logits_to_keep,
                mask,
                weight,
                bias,
                logit_scale=logit_scale,
                softcap=softcap,
                temperature=t.temperature,
                chunk_size=t.args.head_stats_chunk_size,
                head_gradient=head_gradient_path(model),
            )
        return cache["stats"]

    if getattr(t, "engine", None) in GATHERING_ENGINES:
        build()
    return build
