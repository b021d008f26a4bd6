"""The hidden-state service: per-token hidden states of one layer, reduced chunk by chunk by a plugin's callback.

``AdvantageContext.hidden_states(reduce, layer, head)`` (plugins declaring ``needs_hidden_states``) runs one no-grad
forward of the current policy over this process's generation batch, in chunks of ``per_device_train_batch_size``
rows, through TRL's fused log-prob forward (no (B, T, V) logits). A forward hook on the one module whose output is
the requested layer captures it (no ``output_hidden_states=True``, which would keep every layer); each chunk's
completion-aligned states ``(n, C, d)`` go to the plugin's ``reduce`` callback and are dropped before the next
chunk, so no (B, T, d) tensor of the whole batch is ever held. ``reduce`` returns per-row (or per-token) statistics
(a tensor of n rows, a dict of them, or None); the service concatenates them along rows.

Layer numbering is transformers' ``output_hidden_states`` tuple: 0 the embeddings, ``i`` the output of decoder block
``i``, ``-1`` (or the number of blocks) the backbone's final output after its last norm (what the LM head sees).
Position ``t`` of a chunk is the state that *predicts* completion token ``t`` (sequence position ``P - 1 + t``).

Collective-safe: the local generation batch has the same number of rows on every process, so every process runs
the same number of forward chunks (a sharded forward under FSDP/ZeRO-3 is a collective); with ``head=True`` the LM
head is gathered once, before the chunks, on every process (:func:`~trl_plugins.api.engines.gathered_lm_head`).
The callback must not call collectives itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trl_plugins.api.contexts import HiddenChunk
from trl_plugins.api.errors import PluginError
from trl_plugins.runtime.generation import check_text_only
from trl_plugins.runtime.head_stats import (
    CapturedHidden,
    backbone_of,
    capture_hidden_states,
    lm_head_of,
    transform_logits_,
)


def _decoder_blocks(backbone: nn.Module) -> nn.ModuleList | None:
    blocks = getattr(backbone, "layers", None)
    if blocks is None:
        blocks = getattr(backbone, "h", None)  # GPT-2 style
    return blocks if isinstance(blocks, nn.ModuleList) else None


def layer_module(model: nn.Module, layer: int) -> nn.Module | None:
    """The module whose output is ``hidden_states[layer]`` of a (possibly wrapped) causal LM; None for the last
    layer (the backbone's own output, captured by :func:`~trl_plugins.runtime.head_stats.capture_hidden_states`).

    Raises ``PluginError`` for a layer outside ``[-(L + 1), L]`` (L decoder blocks) or a model whose blocks it cannot
    find (then only the last layer is available).
    """
    backbone = backbone_of(model)
    blocks = _decoder_blocks(backbone)
    if layer == -1:
        return None
    if blocks is None:
        raise PluginError(f"hidden-state layer {layer} needs the decoder blocks of {type(backbone).__name__} "
                          "(a `.layers` or `.h` ModuleList), which it does not have; only layer -1 (last) is available.")
    n = len(blocks)
    if not -(n + 1) <= layer <= n:
        raise PluginError(f"hidden-state layer {layer} is out of range for a model with {n} decoder blocks: allowed "
                          f"{-(n + 1)}..{n} (0 the embeddings, -1 or {n} the final output).")
    index = layer % (n + 1)
    if index == n:
        return None
    if index == 0:
        embed = getattr(backbone, "embed_tokens", None) or getattr(backbone, "wte", None)
        if embed is None:
            raise PluginError(f"hidden-state layer 0 needs the embedding module of {type(backbone).__name__}.")
        return embed
    return blocks[index - 1]


@contextmanager
def capture_layer(model: nn.Module, layer: int) -> Iterator[CapturedHidden]:
    """Record ``hidden_states[layer]`` (B, L, d) of the first forward inside the ``with`` block (see
    :func:`layer_module`); the hook is removed on exit."""
    module = layer_module(model, layer)
    if module is None:
        with capture_hidden_states(model) as cap:
            yield cap
        return
    cap = CapturedHidden()
    handle = module.register_forward_hook(cap._hook)
    try:
        yield cap
    finally:
        handle.remove()


def head_logprobs(
    hidden: torch.Tensor, vocab_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    logit_scale: float, softcap: float | None, temperature: float, chunk_size: int,
) -> torch.Tensor:
    """Log-probs ``(..., K)`` of the tokens ``vocab_ids`` (K,) under the LM head at ``hidden`` (..., d).

    The normaliser is the full-vocabulary log-sum-exp (TRL's transform: logit scale, softcap, temperature), taken
    over blocks of ``chunk_size`` positions, so at most (chunk_size, V) logits exist at once. No grad.
    """
    shape = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.size(-1))
    ids = vocab_ids.to(device=flat.device, dtype=torch.long)
    out = torch.empty(flat.size(0), ids.numel(), device=flat.device, dtype=torch.float32)
    w = weight.to(flat.device)
    b = None if bias is None else bias.to(flat.device)
    with torch.no_grad():
        for start in range(0, flat.size(0), chunk_size):
            h = flat[start:start + chunk_size].to(w.dtype)
            z = h @ w.T
            if b is not None:
                z = z + b
            z = transform_logits_(z.float(), logit_scale, softcap, temperature)
            out[start:start + chunk_size] = z[:, ids] - torch.logsumexp(z, dim=-1, keepdim=True)
            del z
    return out.view(*shape, ids.numel())


def _concat(parts: list) -> Any:
    if not parts or parts[0] is None:
        return None
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if isinstance(parts[0], dict):
        return {k: _concat([p[k] for p in parts]) for k in parts[0]}
    return [x for p in parts for x in p]


class HiddenStateService:
    """The hidden-state service of one trainer (a :class:`~trl_plugins.PluginGRPOTrainer`)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def run(self, output: dict, reduce: Callable[[HiddenChunk], Any], layer: int = -1, head: bool = False) -> Any:
        """Run ``reduce`` on every chunk of the local generation batch ``output`` (TRL's dict); see the module doc."""
        tr = self.trainer
        check_text_only(tr, "The hidden-state service (ctx.hidden_states)")
        layer_module(tr.model, layer)  # refuse a bad layer before any forward (same answer on every process)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        C = output["completion_ids"].size(1)
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        head_fn = None
        if head:
            weight, bias, logit_scale, softcap = lm_head_of(tr.model)  # a collective under FSDP1/ZeRO-3: once, here
            chunk = tr.args.head_stats_chunk_size

            def head_fn(hidden: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
                return head_logprobs(hidden, vocab_ids, weight, bias, logit_scale, softcap, tr.temperature, chunk)

        batch_size = tr.args.per_device_train_batch_size
        parts = []
        with torch.no_grad():
            for start in range(0, ids.size(0), batch_size):
                sl = slice(start, min(start + batch_size, ids.size(0)))
                with capture_layer(tr.model, layer) as cap:
                    tr.per_token_logps_and_entropies(tr.model, ids[sl], attention_mask[sl], C, compute_entropy=False)
                hidden = cap.hidden[:, -(C + 1):-1].detach()
                cap.hidden = None
                parts.append(reduce(HiddenChunk(
                    rows=sl, hidden=hidden, mask=mask[sl], completion_ids=output["completion_ids"][sl], _head=head_fn,
                )))
                del hidden
        return _concat(parts)
