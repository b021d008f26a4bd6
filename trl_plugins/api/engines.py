"""The engine rules: how the framework touches a model trained under DDP, FSDP1, FSDP2, DeepSpeed ZeRO-2 or ZeRO-3.

Plugins never see these rules; the framework's services (head statistics, policy probes, local models) follow them:

* **Unwrapping.** :func:`unwrap_causal_lm` peels every wrapper down to the transformers ``*ForCausalLM``: DDP, FSDP1,
  DeepSpeed engines (which carry a ``.config`` of their own: DeepSpeed's dict, not the model's), ``torch.compile``,
  PEFT. The logit transform (``final_logit_softcapping``, ``logit_scale`` and its aliases) is read from *that* model's
  config, under every wrapper.
* **The LM head for no-grad statistics.** After a forward the head is not whole under every engine: FSDP2 holds a
  sharded ``DTensor``, FSDP1 (``use_orig_params=True``) a flat 1-D shard view, ZeRO-3 a partitioned parameter of
  ``numel 0``. :func:`gathered_lm_head` gathers it (``full_tensor()``, ``summon_full_params``,
  ``deepspeed.zero.GatheredParameters``, as TRL's ``maybe_gather_lm_head_ctx`` does) and, when it had to gather,
  hands out a detached copy that outlives the gather. Gathering under FSDP1 and ZeRO-3 is a collective: the framework
  calls it the same number of times on every process.
* **Gradient through the head.** Under DDP, ZeRO-2 and FSDP2 (whose root unit keeps the head unsharded at loss time
  under accelerate 1.15) the head is the live parameter and its gradient is reduced with the others. Under ZeRO-3 the
  gathered head is a copy outside the engine's gradient reduction; :func:`head_gradient_path` routes a statistic's
  head gradient back through a call of the head *module* on the rows of an identity matrix (``W^T``, one head-sized
  activation), which ZeRO-3 gathers in its forward hooks and whose gradient it reduces with the others (a collective:
  every process asks for it the same number of times). Under FSDP1 the head lives in the root unit's flat parameter,
  which no call outside the root forward can reach: a statistic whose gradient must reach the head (SIREN's top-p
  entropy) is refused there at construction (``Plugin.unsupported_engines``), naming plugin, engine and reason.
* **Local component models** (an HF teacher, judge or PRM run in-process): frozen, no-grad, never trained, so they
  are loaded whole on every process (:func:`whole_model_loading`: outside transformers' ZeRO-3 ``zero.Init``, which
  would partition them with nothing to gather them) and generate with ``synced_gpus=False``
  (:data:`LOCAL_GENERATE_KWARGS`): transformers turns it on under ZeRO-3, which makes ``generate`` a collective, while
  only the processes with requests call it.
* **Collective forwards.** A forward of a sharded model is itself a collective, so every service that runs the policy
  for given rows (:mod:`trl_plugins.runtime.policy_probe`) pads each process's rows to the largest count across processes.
  The hidden-state service (:mod:`trl_plugins.runtime.hidden_states`) runs over the local generation batch, which has
  the same number of rows on every process, so every process makes the same forward calls; with ``head=True`` it
  gathers the LM head once per call, before the chunks, on every process.

Engine names: ``"single"`` (one process), ``"ddp"``, ``"fsdp1"``, ``"fsdp2"``, ``"zero2"``, ``"zero3"`` (ZeRO-1 is
reported as ``"zero1"`` and treated like ZeRO-2).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

__all__ = ["ENGINES", "LOCAL_GENERATE_KWARGS", "whole_model_loading", "GATHERING_ENGINES", "check_engine_support", "engine_of", "gathered_lm_head", "head_gradient_path", "head_owner_fsdp1", "unwrap_causal_lm"]

ENGINES = ("single", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")
#: engines under which the LM head must be gathered (a collective) for statistics read after a forward
GATHERING_ENGINES = ("fsdp1", "zero3")


def engine_of(accelerator: Any) -> str:
    """The engine an ``accelerate.Accelerator`` runs (one of :data:`ENGINES`)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return f"fsdp{getattr(state.fsdp_plugin, 'fsdp_version', 1) or 1}"
    if state.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{int(state.deepspeed_plugin.zero_stage)}"
    return "single" if accelerator.num_processes == 1 else "ddp"


#: keyword arguments of ``generate`` for a local component model (see the module docstring)
LOCAL_GENERATE_KWARGS = {"synced_gpus": False}


def trainer_device(trainer: Any) -> torch.device | None:
    """The device of this process's accelerator (where a component model such as a local judge or teacher is placed),
    or None for a trainer without one (stub trainers in tests)."""
    return getattr(getattr(trainer, "accelerator", None), "device", None)


@contextmanager
def whole_model_loading() -> Iterator[None]:
    """Within the block, ``from_pretrained`` loads a model whole even under ZeRO-3 (transformers' global ZeRO-3 flag,
    which wraps loading in ``deepspeed.zero.Init``, is lifted and restored on exit). For frozen in-process component
    models only; the policy itself is prepared by the trainer."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover
        yield
        return
    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)


def check_engine_support(plugins: list, engine: str) -> None:
    """Refuse, at construction, a plugin declaring ``engine`` in its ``unsupported_engines`` (one error naming every
    such plugin, the engine and each reason)."""
    from trl_plugins.api.errors import IncompatiblePluginsError

    refused = [f"{p.name}: {p.unsupported_engines[engine]}" for p in plugins
               if engine in (getattr(p, "unsupported_engines", None) or {})]
    if refused:
        raise IncompatiblePluginsError(
            f"Not supported under the {engine} engine: " + "; ".join(refused)
            + ". Drop the plugin or train under another engine (docs/reliability.md lists what runs where)."
        )


def _is_transformers_model(model: nn.Module) -> bool:
    from transformers import PretrainedConfig

    return isinstance(getattr(model, "config", None), PretrainedConfig)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """Return the transformers ``*ForCausalLM`` module whose ``forward`` TRL patched.

    Peels, repeatedly and in any order: ``torch.compile``'s ``_orig_mod``, PEFT's ``PeftModel`` (``get_base_model()``),
    and every module that is not a transformers model and wraps one under ``.module`` (DDP, FSDP1, DeepSpeed engines
    -- a ``DeepSpeedEngine`` has a ``.config``, DeepSpeed's own, so the test is on the config's type).
    """
    for _ in range(16):  # bounded: wrappers never nest this deep
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
            model = model.get_base_model()
        elif not _is_transformers_model(model) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model
    return model


def head_owner_fsdp1(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The innermost FSDP1 unit (``FullyShardedDataParallel``) of ``model`` holding ``head``; None if none does."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    owner = None
    for module in model.modules():  # pre-order: a later match is nested in an earlier one
        if isinstance(module, FSDP) and any(m is head for m in module.module.modules()):
            owner = module
    return owner


def _is_zero3_partitioned(param: torch.Tensor | None) -> bool:
    return param is not None and hasattr(param, "ds_id") and hasattr(param, "ds_status")


def head_gradient_path(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], tuple] | None:
    """How a head gradient reaches the engine when :func:`gathered_lm_head` handed out copies; None where it handed out
    the live parameters (autograd delivers the gradient: nothing to do).

    Under ZeRO-3 returns ``attach(weight (V, d), bias (V,) or None) -> (weight, bias)``: the same values, exactly
    (the gathered copies), with autograd through :func:`through_head_module`. Calling ``attach`` is a collective (the
    module's forward gathers the partitioned head). Under FSDP1 (no path: see the module docstring) also None; plugins
    that need one declare FSDP1 unsupported."""
    head = unwrap_causal_lm(model).get_output_embeddings()
    if not _is_zero3_partitioned(head.weight):
        return None
    return lambda weight, bias: through_head_module(head, weight, bias)


def through_head_module(head: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """``(weight (V, d), bias (V,) or None)`` equal in value to the given copies of ``head``'s parameters, with their
    gradient flowing into ``head``'s own parameters through one call of the module.

    The call is ``out = head(R)`` with ``R`` the ``(d, d)`` identity (``(d + 1, d)`` with a row of zeros when there is
    a bias): ``out[:d] = W^T (+ b)``, ``out[d] = b``. The returned tensors are ``copy + (x - x.detach())`` of the
    matching parts of ``out``, so their values are the copies bit for bit and ``d/dx`` is the identity: a gradient
    ``G_W`` on the weight reaches ``head.weight`` as ``R^T G_W^T = G_W``, and the bias row cancels the ``b`` that every
    identity row carries."""
    d = weight.shape[1]
    rows = torch.eye(d + (bias is not None), d, dtype=weight.dtype, device=weight.device)
    out = head(rows)  # (d [+ 1], V)
    w_t = out[:d] if bias is None else out[:d] - out[d:]
    weight = weight.detach() + (w_t - w_t.detach()).T
    if bias is not None:
        bias = bias.detach() + (out[d] - out[d].detach())
    return weight, bias


@contextmanager
def gathered_lm_head(model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield the whole LM head ``(weight (V, d), bias (V,) or None)`` of a (possibly wrapped) causal LM.

    Without a gather (single process, DDP, ZeRO-1/2, an unsharded FSDP2 head) these are the live parameters. A
    ``DTensor`` (FSDP2) is gathered with ``full_tensor()`` (differentiable). Under FSDP1 the owning unit's parameters
    are summoned (``summon_full_params(writeback=False, recurse=False)``), under ZeRO-3 the partitioned parameters are
    gathered (``deepspeed.zero.GatheredParameters``); then the yielded tensors are **detached copies** that stay valid
    after the block. Those two gathers are collectives: every process must enter this context the same number of
    times. Must not be entered inside the model's forward or backward.
    """
    causal_lm = unwrap_causal_lm(model)
    head = causal_lm.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if _is_zero3_partitioned(weight):
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for p in (weight, bias) if p is not None]
        # already whole (e.g. tied to an embedding inside its forward): gathering again would re-partition it on exit
        available = all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
        with contextlib.nullcontext() if available else deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            copies = (weight.detach().clone(), None if bias is None else bias.detach().clone())
        yield copies
        return
    owner = head_owner_fsdp1(model, head) if weight.dim() != 2 or weight.numel() == 0 else None
    if owner is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(owner, writeback=False, recurse=False):
            weight, bias = head.weight, getattr(head, "bias", None)
            copies = (weight.detach().clone(), None if bias is None else bias.detach().clone())
        yield copies
        return
    if hasattr(weight, "full_tensor"):  # torch.distributed.tensor.DTensor (FSDP2)
        weight = weight.full_tensor()
        if bias is not None:
            bias = bias.full_tensor()
    if weight.dim() != 2:
        raise RuntimeError(
            f"The LM head of {type(causal_lm).__name__} is not whole here (weight of shape {tuple(weight.shape)}) and "
            f"no engine rule knows how to gather it (wrapper: {type(model).__name__}); supported engines: "
            f"{', '.join(ENGINES)}."
        )
    yield weight, bias
