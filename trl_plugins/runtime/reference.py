"""The reference policy for plugins that need its log-probs (``Plugin.needs_reference_model``), trainer side.

This module belongs to the trainer; it reaches TRL through the public names of :mod:`trl_plugins.runtime.trl_seam`
(``per_token_logps_and_entropies``), and plugins reach it only through
:meth:`trl_plugins.AdvantageContext.reference_logprobs`.

Where the reference log-probs come from, in TRL's own order:

1. ``beta != 0``: TRL already computed ``ref_per_token_logps`` for the batch; they are reused (no extra forward);
2. TRL holds a reference model (``trainer.ref_model``): one no-grad forward on it;
3. a PEFT model: one no-grad forward with the adapter switched off (TRL's rule: the ``"ref"`` adapter when the model
   has one, else no adapter), exactly as TRL computes its reference under PEFT;
4. full fine-tuning with ``beta == 0`` (TRL builds no reference model): a frozen copy of the initial policy, made at
   trainer construction (:func:`frozen_reference_copy`; one more copy of the weights in memory, as TRL's own
   reference model with ``beta != 0``). Not available under DeepSpeed or FSDP, whose parameters are sharded: there
   set ``beta > 0`` (TRL then builds and shards its reference model) or train a PEFT adapter.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.runtime.trl_seam import multimodal_forward_kwargs


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency of the PEFT path only
        return False
    return isinstance(model, PeftModel)


def needs_reference_copy(trainer: Any, plugins: list) -> bool:
    """True when a plugin needs the reference policy and only a frozen copy can give it (rule 4 above)."""
    if not any(getattr(p, "needs_reference_model", False) for p in plugins):
        return False
    return trainer.ref_model is None and not _is_peft(trainer.accelerator.unwrap_model(trainer.model))


def frozen_reference_copy(trainer: Any, plugins: list) -> torch.nn.Module:
    """A frozen (eval, no grad) copy of the policy as it is now, with TRL's fused log-prob head.

    Raises a ``PluginConfigError`` naming the plugins under DeepSpeed or FSDP (sharded parameters cannot be copied).
    """
    from trl.trainer.utils import add_fused_lm_head

    names = [p.name for p in plugins if getattr(p, "needs_reference_model", False)]
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise PluginConfigError(
            f"Plugins {names} need the reference policy; with full fine-tuning under DeepSpeed/FSDP and beta=0 TRL "
            "builds no reference model and a sharded policy cannot be copied. Set beta > 0 (TRL then builds its "
            "reference model) or train a PEFT adapter (the reference is the model with the adapter off)."
        )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ref = copy.deepcopy(policy)
    # TRL's fused head replaces ``forward`` on the instance with a closure over the *policy's* original forward; drop it
    # so that the copy runs its own weights, and add the head again on the copy.
    ref.__dict__.pop("forward", None)
    add_fused_lm_head(ref, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32)
    ref.eval()
    ref.requires_grad_(False)
    return ref


@contextlib.contextmanager
def reference_model(trainer: Any):
    """The model that computes the reference policy, by the rules above (a PEFT model with its adapter switched off
    for the duration); a ``PluginError`` when there is none."""
    if trainer.ref_model is not None:
        yield trainer.ref_model
    elif _is_peft(trainer.accelerator.unwrap_model(trainer.model)):
        from trl.trainer.utils import use_adapter

        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            yield trainer.model
    elif getattr(trainer, "reference_copy", None) is not None:
        yield trainer.reference_copy
    else:
        raise PluginError(
            "no reference policy is available (declare needs_reference_model = True on the plugin so that the "
            "trainer keeps one)."
        )


def reference_logprobs(trainer: Any, output: dict, cache: dict) -> torch.Tensor:
    """(B, T) no-grad reference log-probs of the local generation batch ``output`` (TRL's dict), cached in ``cache``."""
    if "reference" in cache:
        return cache["reference"]
    if output.get("ref_per_token_logps") is not None:
        cache["reference"] = output["ref_per_token_logps"]
        return cache["reference"]
    prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    logits_to_keep = output["completion_ids"].size(1)
    batch_size = trainer.args.per_device_train_batch_size

    def forward(model):
        logps, _, _ = trainer.per_token_logps_and_entropies(
            model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            **multimodal_forward_kwargs(output),  # the prompts' images, as TRL's own forwards pass them
        )
        return logps

    with torch.no_grad(), reference_model(trainer) as model:
        logps = forward(model)
    cache["reference"] = logps
    return logps
