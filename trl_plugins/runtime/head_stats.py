"""Chunked next-token statistics from the last hidden state ("HeadStats").

TRL 1.16's ``GRPOTrainer`` never materialises ``(B, T, V)`` logits: ``trl.trainer.utils.add_fused_lm_head`` patches
the model so that ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone and then a chunked LM-head
kernel that only emits the label log-prob and the entropy (plus a few no-grad extras). Methods such as Lp-Reg
(min-p proxy log-probs) and SIREN (top-p entropy *with* gradient) need other statistics of the same next-token
distribution. This module provides them:

* :func:`capture_hidden_states` hooks the backbone the fused forward calls and records its ``last_hidden_state``.
* :func:`lm_head_of` returns the LM head ``(weight, bias, logit_scale, softcap)`` read the way TRL reads it.
* :class:`HeadStats` projects the valid completion positions through the head ``chunk_size`` tokens at a time,
  in float32 and under ``torch.no_grad()``, and reduces each ``(chunk, V)`` block to per-token statistics.
  It never builds a ``(B, T, V)`` tensor; neither does the one statistic with gradient (the top-p entropy),
  which recomputes each chunk in its backward instead of keeping its logits.

Logit transform (identical to TRL's fused kernel)::

    z = h @ W.T (+ bias)
    z = z * logit_scale
    z = softcap * tanh(z / softcap)        # only when the config sets ``final_logit_softcapping``
    z = z / temperature

All statistics below are of this temperature-scaled ``z``, so they line up with TRL's ``per_token_logps`` and
``entropies``. The one numerical difference: the projection here always runs in float32, whereas TRL runs the
matmul in the autocast / hidden dtype (e.g. bf16) and only the reduction in float32.

Shapes: ``B`` sequences, ``L`` = prompt + completion length, ``C`` = ``logits_to_keep`` completion positions,
``d`` hidden size, ``V`` vocabulary, ``N`` = number of valid (``completion_mask == 1``) completion positions.
Completion token ``j`` is predicted from hidden index ``L - C + j - 1``, i.e. the ``(B, C, d)`` slice
``hidden[:, -(C + 1):-1]``; this matches TRL's ``log_probs[:, -logits_to_keep:]``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn

from trl_plugins.api.model_utils import unwrap_causal_lm

__all__ = [
    "OUT_OF_KEEP_SET",
    "CapturedHidden",
    "HeadStats",
    "capture_hidden_states",
    "lm_head_of",
    "transform_logits",
    "backbone_of",
]

#: Value :meth:`HeadStats.min_p_logprob` returns where the label is outside the keep set ``K``
#: (i.e. ``log pi_proxy(label) = -inf``). It is a finite sentinel so downstream arithmetic stays NaN-free; any
#: real log-prob in float32 is far above it. Lp-Reg's "``sg(lp) < lp_proxy``" filter drops such tokens.
OUT_OF_KEEP_SET = -1.0e4

_NUCLEUS_MODES = ("cover", "siren")


# ---------------------------------------------------------------------------------------------------------------------
# Backbone and head lookup (unwrapping: trl_plugins.api.model_utils.unwrap_causal_lm)
# ---------------------------------------------------------------------------------------------------------------------


def backbone_of(model: nn.Module) -> nn.Module:
    """Return the backbone module that TRL's fused forward calls, for a (possibly wrapped) causal LM.

    TRL calls ``getattr(causal_lm, "base_model")``, except for vision-language models under transformers < 5, where
    it calls ``causal_lm.model``. ``base_model`` of a transformers model is the inner transformer (e.g.
    ``LlamaForCausalLM.model``).
    """
    causal_lm = unwrap_causal_lm(model)
    attr = "base_model"
    config = getattr(causal_lm, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        import transformers
        from packaging.version import Version

        if config.get_text_config() is not config and Version(transformers.__version__) < Version("5.0.0"):
            attr = "model"
    backbone = getattr(causal_lm, attr)
    if backbone is causal_lm:
        raise ValueError(f"{type(causal_lm).__name__} has no separate backbone under `.{attr}`")
    return backbone


def _read_logit_scale_and_softcap(config) -> tuple[float, float | None]:
    """``(logit_scale, softcap)`` from a transformers config, resolved with the same precedence as TRL 1.16.

    ``logit_scale`` is the first set among ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, then
    ``1 / logits_scaling`` (``logits_scaling`` itself for ``model_type == "hyperclovax"``); 1.0 when none is set.
    ``softcap`` is ``final_logit_softcapping`` (``None`` when unset).
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(text_config, name, None)
        if scale is not None:
            break
    if scale is None:
        scaling = getattr(text_config, "logits_scaling", None)
        if scaling is not None:
            scale = scaling if getattr(text_config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


def lm_head_of(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float, float | None]:
    """LM head of a (possibly wrapped) causal LM, as TRL's fused head uses it.

    Returns:
        ``(weight (V, d), bias (V,) or None, logit_scale, softcap)``. ``weight``/``bias`` are the live parameters
        (an FSDP2 ``DTensor`` is gathered with ``full_tensor()``), or, under FSDP1 and ZeRO-3, detached copies of the
        gathered head: there this call is a collective (see :mod:`trl_plugins.api.engines`). ``softcap`` is ``None`` when
        the config has no ``final_logit_softcapping``; it and ``logit_scale`` come from the unwrapped model's config.
    """
    from trl_plugins.api.engines import gathered_lm_head

    causal_lm = unwrap_causal_lm(model)
    with gathered_lm_head(model) as (weight, bias):  # live parameters, or copies that outlive a gather
        pass
    logit_scale, softcap = _read_logit_scale_and_softcap(causal_lm.config)
    return weight, bias, logit_scale, softcap


# ---------------------------------------------------------------------------------------------------------------------
# Hidden-state capture
# ---------------------------------------------------------------------------------------------------------------------


class CapturedHidden:
    """Holder yielded by :func:`capture_hidden_states`.

    Attributes:
        hidden: ``(B, L, d)`` ``last_hidden_state`` of the first backbone call inside the context (``None`` until
            then). It keeps its autograd graph; detach it if you only need statistics.
        num_calls: how many backbone calls the hook has seen (including ignored ones).
    """

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.num_calls = 0

    def reset(self) -> None:
        """Forget the captured tensor so that the next backbone call is captured (e.g. one per sub-batch)."""
        self.hidden = None

    def _hook(self, module, args, output) -> None:
        self.num_calls += 1
        if self.hidden is not None:  # e.g. gradient-checkpointing recomputation
            return
        if hasattr(output, "last_hidden_state"):
            self.hidden = output.last_hidden_state
        elif isinstance(output, (tuple, list)):
            self.hidden = output[0]
        else:
            self.hidden = output


@contextmanager
def capture_hidden_states(model: nn.Module) -> Iterator[CapturedHidden]:
    """Record the backbone's ``last_hidden_state`` during the first forward inside the ``with`` block.

    ``model`` may be wrapped (DDP / accelerate ``.module``, ``torch.compile``, PEFT). The hook sits on the module
    returned by :func:`backbone_of`, i.e. the one TRL's fused forward calls, and is removed on exit. Only the first
    call is recorded; later calls (gradient-checkpointing recomputation, a second forward) are ignored unless
    :meth:`CapturedHidden.reset` is called in between. Note that a non-fused forward (e.g. generation) calls the
    same backbone, so keep the context tight around the forward you want.

    Example::

        with capture_hidden_states(model) as cap:
            out = model(input_ids, attention_mask=am, labels=labels, fused_lm_head=True)
        stats = HeadStats.from_model(model, cap.hidden, logits_to_keep, completion_mask, temperature=0.7)
    """
    captured = CapturedHidden()
    handle = backbone_of(model).register_forward_hook(captured._hook)
    try:
        yield captured
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------------------------------
# Logit transform and the gradient path of the nucleus entropy
# ---------------------------------------------------------------------------------------------------------------------


def transform_logits(
    z: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """TRL's head transform on raw logits ``z`` (any shape): scale, optional ``softcap*tanh(z/softcap)``, /T."""
    z = z * logit_scale
    if softcap is not None:
        cap = softcap or 1.0  # TRL's kernel uses 1.0 when the configured cap is 0
        z = cap * torch.tanh(z / cap)
    return z / temperature


def transform_logits_(z: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """:func:`transform_logits` in place on ``z`` (no grad; no second block of logits), returning ``z``."""
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:
        cap = softcap or 1.0
        z.div_(cap).tanh_().mul_(cap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _NucleusEntropy(torch.autograd.Function):
    """Nucleus entropy ``H (N,)`` of hidden rows ``h (N, d)`` with gradient, recomputed chunk by chunk.

    Forward: for each chunk of ``stats.chunk_size`` rows, project through the head (no grad), pick the nucleus and
    reduce it to ``H``. Only ``h``, the head and ``H`` are saved. Backward: project each chunk again, pick the same
    nucleus, and form the gradient directly: with ``q`` the nucleus distribution,
    ``dH/dz_k = -q_k (log q_k + H)`` on nucleus ids (0 elsewhere), times the derivative of the logit transform,
    scattered into the chunk's ``(rows, V)`` block, then ``grad_h = g W`` and ``grad_W += g^T h`` (``grad_b +=
    sum_rows g``), the head cast to float32 ``vocab_tile`` rows at a time. So no tensor has more than
    ``chunk_size * V`` elements (plus the ``(V, d)`` float32 gradient buffer of the head when it requires grad),
    whatever the nucleus width.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, stats, top_p, k_max, mode):
        H = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
        with torch.no_grad():
            for s in range(0, h.shape[0], stats.chunk_size):
                z = stats._project(h[s : s + stats.chunk_size])
                H[s : s + z.shape[0]] = stats._nucleus(z, top_p, k_max, mode)[3]
                del z
        ctx.save_for_backward(h, weight, bias, H)
        ctx.stats, ctx.top_p, ctx.k_max, ctx.mode = stats, top_p, k_max, mode
        return H

    @staticmethod
    def backward(ctx, grad_H):
        h, weight, bias, H = ctx.saved_tensors
        stats = ctx.stats
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(h.shape, device=h.device, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_b else None
        grad_H = grad_H.float()
        tile = weight.shape[0] if weight.dtype == torch.float32 else stats.vocab_tile  # one product when float32
        with torch.no_grad():
            for s in range(0, h.shape[0], stats.chunk_size):
                h_rows = h[s : s + stats.chunk_size].float()
                z = stats._project(h_rows)  # (n, V), transformed
                ids, keep, logq, _ = stats._nucleus(z, ctx.top_p, ctx.k_max, ctx.mode)
                H_rows = H[s : s + z.shape[0], None]
                g = torch.where(keep, -logq.exp() * (logq + H_rows), torch.zeros_like(logq))
                g = g * grad_H[s : s + z.shape[0], None] * stats.transform_slope(z.gather(1, ids))
                g_full = z.zero_().scatter_add_(1, ids, g)  # (n, V), reusing the block
                for v in range(0, weight.shape[0], tile):
                    w_tile = weight[v : v + tile].float()
                    if need_h:
                        grad_h[s : s + z.shape[0]] += g_full[:, v : v + tile] @ w_tile
                    if need_w:
                        grad_w[v : v + tile] += g_full[:, v : v + tile].T @ h_rows
                if need_b:
                    grad_b += g_full.sum(0)
                del z, g_full
        return (
            None if grad_h is None else grad_h.to(h.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


# ---------------------------------------------------------------------------------------------------------------------
# HeadStats
# ---------------------------------------------------------------------------------------------------------------------


class HeadStats:
    """Per-token statistics of the temperature-scaled next-token distribution at valid completion positions.

    Args:
        hidden: ``(B, L, d)`` backbone ``last_hidden_state`` (e.g. ``CapturedHidden.hidden``), ``L >= C + 1``.
            Kept as given (with its graph) for :meth:`top_p_entropy_with_grad`; every other method detaches it.
        logits_to_keep: ``C``, number of completion positions (TRL's ``logits_to_keep``).
        completion_mask: ``(B, C)``; positions with a nonzero entry are "valid" and the only ones projected.
        weight: ``(V, d)`` LM-head weight. bias: ``(V,)`` or ``None``.
        logit_scale, softcap, temperature: TRL's logit transform (see module docstring).
        chunk_size: valid tokens projected at once. Peak extra memory of the no-grad path is a small constant
            number (1.25 for the min-p proxy, about 2 for the top-p entropy; docs/benchmarks.md section 7) of
            ``(chunk_size, V)`` float32 blocks, including the top-k workspace of the top-p methods; it never grows
            with the number of tokens.
        vocab_tile: when ``weight`` is not float32, it is cast to float32 ``vocab_tile`` rows at a time, so no full
            float32 copy of the head is made (gradient path included; a head that itself requires grad gets its
            gradient accumulated in one ``(V, d)`` float32 buffer).
        head_gradient: when ``weight`` / ``bias`` are gathered copies (ZeRO-3), the engine rule that routes their
            gradient back to the model's head (:func:`trl_plugins.api.engines.head_gradient_path`); used by
            :meth:`top_p_entropy_with_grad` only.

    Valid positions are ordered row-major (``completion_mask.nonzero()`` order); ``N`` denotes their number.
    Methods returning ``(B, C)`` put 0 at invalid positions.

    Debug counters: ``max_rows_projected`` is the largest number of rows ever sent through one ``(rows, V)``
    projection, ``num_projections`` the number of such projections.
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        logits_to_keep: int,
        completion_mask: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        vocab_tile: int = 8192,
        head_gradient: Callable | None = None,
    ) -> None:
        C = int(logits_to_keep)
        if hidden.dim() != 3 or hidden.shape[1] < C + 1:
            raise ValueError(f"hidden must be (B, L, d) with L >= logits_to_keep + 1, got {tuple(hidden.shape)}")
        if completion_mask.shape != (hidden.shape[0], C):
            raise ValueError(f"completion_mask must be (B, C)=({hidden.shape[0]}, {C}), got {completion_mask.shape}")
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.weight = weight
        self.bias = bias
        #: ``trl_plugins.api.engines.head_gradient_path`` of the model: how the head's gradient reaches the engine
        #: when ``weight`` / ``bias`` are gathered copies (ZeRO-3); None when they are the live parameters
        self.head_gradient = head_gradient
        self.logit_scale = float(logit_scale)
        self.softcap = None if softcap is None else float(softcap)
        self.temperature = float(temperature)
        self.chunk_size = int(chunk_size)
        self.vocab_tile = int(vocab_tile)
        self.logits_to_keep = C
        device = weight.device
        #: ``(B, C, d)`` hidden states that predict the completion tokens, graph kept.
        self.hidden_c = hidden[:, -(C + 1) : -1].to(device)
        #: ``(B, C)`` bool mask of valid positions.
        self.mask = completion_mask.to(device).bool()
        self.num_valid = int(self.mask.sum())
        self.max_rows_projected = 0
        self.num_projections = 0

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        hidden: torch.Tensor,
        logits_to_keep: int,
        completion_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 1024,
    ) -> "HeadStats":
        """Build from a (possibly wrapped) model; the head and its transform come from :func:`lm_head_of`, the
        head's gradient path from :func:`~trl_plugins.api.engines.head_gradient_path`."""
        from trl_plugins.api.engines import head_gradient_path

        weight, bias, logit_scale, softcap = lm_head_of(model)
        return cls(hidden, logits_to_keep, completion_mask, weight, bias, logit_scale, softcap, temperature, chunk_size,
                   head_gradient=head_gradient_path(model))

    # ------------------------------------------------------------------------------------------------- plumbing

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def _valid(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, ...)`` -> ``(N, ...)``: entries at valid positions, row-major."""
        return x.to(self.mask.device)[self.mask]

    def to_bc(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter per-valid-token ``values (N,)`` back to ``(B, C)`` (``fill`` at invalid positions).

        Differentiable with respect to ``values``.
        """
        out = values.new_full(self.mask.shape, fill)
        return out.masked_scatter(self.mask, values)

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        """Transformed float32 logits ``(n, V)`` for hidden rows ``h (n, d)``. Call under ``no_grad``."""
        n = h.shape[0]
        self.max_rows_projected = max(self.max_rows_projected, n)
        self.num_projections += 1
        h = h.float()
        W = self.weight
        if W.dtype == torch.float32:
            z = h @ W.t()
        else:  # cast the head tile by tile: no full float32 copy of W
            z = torch.empty((n, W.shape[0]), device=h.device, dtype=torch.float32)
            for s in range(0, W.shape[0], self.vocab_tile):
                torch.mm(h, W[s : s + self.vocab_tile].float().t(), out=z[:, s : s + self.vocab_tile])
        if self.bias is not None:
            z += self.bias.float()
        return transform_logits_(z, self.logit_scale, self.softcap, self.temperature)  # z is ours: in place

    def map_chunks(
        self, fn: Callable[[torch.Tensor, slice], torch.Tensor | tuple[torch.Tensor, ...]]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Apply ``fn`` to the logits of each chunk of valid tokens and concatenate the results.

        ``fn(z, rows)`` receives ``z (n, V)``, the transformed float32 logits of valid tokens ``rows`` (a ``slice``
        into ``0..N-1``, ``n <= chunk_size``; ``fn`` may modify it in place), and returns a tensor ``(n, ...)`` or a
        tuple of them. The result is the
        concatenation over chunks, ``(N, ...)`` (or a tuple). Runs under ``torch.no_grad()``; each ``z`` is dropped
        before the next chunk, so peak memory is one chunk's logits plus ``fn``'s workspace.
        """
        outs: list = []
        with torch.no_grad():
            h = self._valid(self.hidden_c.detach())  # (N, d)
            for s in range(0, self.num_valid, self.chunk_size):
                rows = slice(s, min(s + self.chunk_size, self.num_valid))
                z = self._project(h[rows])
                outs.append(fn(z, rows))
                del z
            if not outs:  # no valid token: call fn on an empty block to learn the output layout
                z = torch.empty((0, self.vocab_size), device=h.device, dtype=torch.float32)
                outs.append(fn(z, slice(0, 0)))
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))
        return torch.cat(outs, dim=0)

    # --------------------------------------------------------------------------------------- full-vocab stats

    def logsumexp(self) -> torch.Tensor:
        """``(B, C)`` float32: ``logsumexp_v z_v`` (log partition of the temperature-scaled logits)."""
        return self.to_bc(self.map_chunks(lambda z, rows: torch.logsumexp(z, dim=-1)))

    def max_logit(self) -> torch.Tensor:
        """``(B, C)`` float32: ``max_v z_v``."""
        return self.to_bc(self.map_chunks(lambda z, rows: z.amax(dim=-1)))

    def label_logit(self, labels: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` float32: ``z[label]``. ``labels``: ``(B, C)`` completion token ids."""
        lab = self._valid(labels).long()
        return self.to_bc(self.map_chunks(lambda z, rows: z.gather(-1, lab[rows, None]).squeeze(-1)))

    def label_logprob(self, labels: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` float32: ``log softmax(z)[label]`` (equals TRL's ``per_token_logps``, without grad).

        ``labels``: ``(B, C)`` completion token ids.
        """
        lab = self._valid(labels).long()

        def fn(z, rows):
            return z.gather(-1, lab[rows, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)

        return self.to_bc(self.map_chunks(fn))

    def entropy(self) -> torch.Tensor:
        """``(B, C)`` float32: full-vocabulary entropy ``-sum_v p_v log p_v`` (equals TRL's ``entropies``, no grad)."""

        def fn(z, rows):
            logp = torch.log_softmax(z, dim=-1)
            return -(logp.exp() * logp).sum(-1)

        return self.to_bc(self.map_chunks(fn))

    def mean_log_softmax(self) -> torch.Tensor:
        """``(B, C)`` float32: ``mean_v log p_v = mean_v z_v - logsumexp_v z_v``."""
        return self.to_bc(self.map_chunks(lambda z, rows: z.mean(-1) - torch.logsumexp(z, dim=-1)))

    # ------------------------------------------------------------------------------------------------- min-p

    def min_p_logprob(self, labels: torch.Tensor, kappa: float, mode: str = "minp") -> torch.Tensor:
        """``(B, C)`` float32: Lp-Reg proxy log-prob ``log pi_proxy(label)``.

        Keep set ``K`` (on the temperature-scaled distribution ``p = softmax(z)``):

        * ``mode="minp"``: ``K = {v : p_v >= kappa * max_u p_u}``, i.e. ``z_v >= z_max + ln(kappa)``;
        * ``mode="fixed"``: ``K = {v : p_v >= kappa}``, i.e. ``z_v - logsumexp(z) >= ln(kappa)``.

        ``pi_proxy = p * 1[v in K] / p(K)``, so for a label in ``K`` the value is ``z_label - logsumexp_{v in K} z_v``
        (``>= log p_label``); for a label outside ``K`` it is :data:`OUT_OF_KEEP_SET` (``-1e4``, standing for
        ``-inf``). ``kappa <= 0`` keeps the whole vocabulary (plain log-softmax). ``labels``: ``(B, C)`` token ids.
        """
        if mode not in ("minp", "fixed"):
            raise ValueError(f"mode must be 'minp' or 'fixed', got {mode!r}")
        log_kappa = math.log(kappa) if kappa > 0 else -math.inf
        lab = self._valid(labels).long()

        def fn(z, rows):
            ref = z.amax(-1, keepdim=True) if mode == "minp" else torch.logsumexp(z, -1, keepdim=True)
            z_lab = z.gather(-1, lab[rows, None]).squeeze(-1)
            in_keep = z_lab >= ref.squeeze(-1) + log_kappa
            # in place (z is this chunk's own block): the logits plus one transient bool mask, no other block
            z.masked_fill_(z < ref + log_kappa, -math.inf)
            top = z.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # "fixed" may keep nothing: -inf
            lse_keep = z.sub_(top).exp_().sum(-1).log_() + top.squeeze(-1)
            return torch.where(in_keep, z_lab - lse_keep, torch.full_like(z_lab, OUT_OF_KEEP_SET))

        return self.to_bc(self.map_chunks(fn))

    # ------------------------------------------------------------------------------------------------- top-p

    @staticmethod
    def _nucleus_keep(sorted_p: torch.Tensor, top_p: float, mode: str) -> torch.Tensor:
        """Bool ``(n, k)`` over probabilities sorted descending: which ranks are in the nucleus.

        ``"cover"``: smallest prefix whose mass is ``>= top_p`` (rank ``i`` kept iff the mass *before* it is
        ``< top_p``; the top-1 is always kept). ``"siren"``: ranks whose *inclusive* cumulative mass is
        ``< top_p`` (the crossing token is excluded; the nucleus may be empty), as in SIREN's code.
        ``"cover"`` with ``top_p >= 1`` keeps every candidate.
        """
        if mode not in _NUCLEUS_MODES:
            raise ValueError(f"mode must be one of {_NUCLEUS_MODES}, got {mode!r}")
        if mode == "cover" and top_p >= 1.0:  # everything (rounding must not drop the tail)
            return torch.ones_like(sorted_p, dtype=torch.bool)
        p = sorted_p.double()  # float64 cumulative sums: fewer rounding flips at the boundary
        cum = p.cumsum(-1)
        return (cum - p) < top_p if mode == "cover" else cum < top_p

    def _top(self, z: torch.Tensor, k_max: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values (n,k), ids (n,k), sorted probs (n,k))`` of the ``k = min(k_max, V)`` largest logits."""
        k = self.vocab_size if k_max is None else min(int(k_max), self.vocab_size)
        vals, ids = torch.topk(z, k, dim=-1, sorted=True)
        probs = torch.exp(vals - torch.logsumexp(z, dim=-1, keepdim=True))  # true (full-vocab) probabilities
        return vals, ids, probs

    def _nucleus(self, z: torch.Tensor, top_p: float, k_max: int | None, mode: str):
        """The nucleus of logits ``z (n, V)``: ids ``(n, k)`` (most likely first), keep mask ``(n, k)``, ``log q``
        ``(n, k)`` (0 outside the nucleus) and the nucleus entropy ``H (n,)`` (0 for an empty nucleus)."""
        vals, ids, probs = self._top(z, k_max)
        keep = self._nucleus_keep(probs, top_p, mode)
        zk = vals.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(zk, dim=-1, keepdim=True)
        logq = torch.where(keep, zk - lse, torch.zeros_like(zk))
        H = -(logq.exp() * logq).masked_fill(~keep, 0.0).sum(-1)
        return ids, keep, logq, torch.where(keep.any(-1), H, torch.zeros_like(H))

    def transform_slope(self, z: torch.Tensor) -> torch.Tensor:
        """``dz / draw`` of the logit transform, from transformed logits ``z`` (any shape)."""
        slope = self.logit_scale / self.temperature
        if self.softcap is None:
            return torch.full_like(z, slope)
        cap = self.softcap or 1.0
        t = z * (self.temperature / cap)  # tanh(scaled raw / cap)
        return slope * (1.0 - t * t)

    def top_p_entropy(self, top_p: float, k_max: int | None = None, mode: str = "cover") -> torch.Tensor:
        """``(B, C)`` float32, no grad: entropy of the nucleus distribution ``q = p|_nucleus / p(nucleus)``.

        The nucleus is chosen among the ``k_max`` most likely tokens (all ``V`` when ``None``) by ``mode`` (see
        :meth:`_nucleus_keep`; default ``"cover"`` = smallest set with mass ``>= top_p``). An empty nucleus (only
        possible with ``"siren"``) gives 0. Workspace per chunk: top-k values, int64 ids and probs, ``n * k`` each.
        """
        return self.to_bc(self.map_chunks(lambda z, rows: self._nucleus(z, top_p, k_max, mode)[3]))

    def nucleus_ids(self, top_p: float, k_max: int, mode: str = "cover") -> torch.Tensor:
        """``(N, min(k_max, V))`` int64, no grad: nucleus token ids per valid position, most likely first, padded
        with -1. The result itself is ``N * min(k_max, V)`` ids (the full vocabulary width when ``k_max >= V``).

        Row ``n`` is the ``n``-th valid position in row-major order (see :meth:`to_bc`). The nucleus is chosen as in
        :meth:`top_p_entropy` among the ``k_max`` most likely tokens, so a nucleus larger than ``k_max`` is truncated.
        """

        def fn(z, rows):
            _, ids, probs = self._top(z, k_max)
            return ids.masked_fill(~self._nucleus_keep(probs, top_p, mode), -1)

        return self.map_chunks(fn)

    def top_p_entropy_with_grad(self, top_p: float, k_max: int | None, mode: str = "cover") -> torch.Tensor:
        """``(B, C)`` float32: nucleus entropy WITH autograd through the hidden states (and the head).

        Same value as :meth:`top_p_entropy`. The gradient is exact for the chosen nucleus (the choice itself is
        piecewise constant): each chunk of ``chunk_size`` valid tokens is projected once in the forward and once
        again in the backward, and its gradient formed directly (see :class:`_NucleusEntropy`), so the memory is
        that of the no-grad statistics (a few ``(chunk_size, V)`` float32 blocks) for any ``k_max`` and nucleus
        width, plus ``N * d`` for the saved hidden rows and, when the head requires grad, its ``(V, d)`` float32
        gradient buffer. Invalid positions and empty nuclei give 0 with zero gradient. Gradients reach ``hidden``
        (thus the model), ``weight`` and ``bias`` when those require grad; with a ``head_gradient`` path (ZeRO-3: a
        collective, so every process calls this method the same number of times) they reach the model's head.
        """
        if mode not in _NUCLEUS_MODES:
            raise ValueError(f"mode must be one of {_NUCLEUS_MODES}, got {mode!r}")
        h = self._valid(self.hidden_c)  # (N, d), graph kept
        weight, bias = self.weight, self.bias
        if self.head_gradient is not None:
            weight, bias = self.head_gradient(weight, bias)
        H = _NucleusEntropy.apply(h, weight, bias, self, top_p, k_max, mode)
        return self.to_bc(H)
