"""OREAL's token-level reward model: a scalar head trained online from outcome labels, whose per-token scores weight
the tokens of the policy loss (arXiv:2502.06781; facts from the official ``train_oreal.py``).

Official recipe, per rollout of the RL batch (the rows the pair filter kept):

* scores ``s_t`` (T,) -- the reward model's scalar logit at the position that predicts completion token ``t`` (the
  same alignment as the policy's log-probs);
* training: binary cross-entropy of the **sequence mean** ``mean_t s_t`` against the outcome label (1 correct,
  0 wrong), summed over the batch's rows and divided by their number; its own AdamW (lr 2e-6, weight decay 0.01,
  gradient norm clipped at 1);
* token weights: ``p_t = sigmoid(cumulative mean of s up to t)`` (no grad); positive rows weight their tokens by
  ``rescale(p_t)``, negative rows by ``rescale(1 - p_t)``, with ``threshold`` rescaling
  ``clamp((p - c) / (1 - c), 0, 1)`` (``c = 0.5``) or ``topk`` (the top ``ratio`` share of a row's tokens, min-max
  normalised, the rest 0).

Here the reward model is a linear head ``(d -> 1, no bias)`` over the policy's **detached** last hidden states
(official: a full copy of the policy with that head) [reconstructed]; it is trained by its own optimiser inside the
plugin, never through the policy's loss or optimiser, and its gradients are summed over the processes before each
step, so every process holds the same head. Nothing here builds (B, T, V) logits: only ``(B, T, d) @ (d, 1)``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


# ============================================================================================= pure functions
def cumulative_mean(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) running mean of ``scores`` over each row's loss tokens up to and including ``t`` (0 before the first).

    Args:
        scores, mask: (B, T); ``mask`` 1 on loss tokens.
    """
    mask = mask.to(scores.dtype)
    return (scores * mask).cumsum(-1) / mask.cumsum(-1).clamp(min=1.0)


def threshold_rescale(prob: torch.Tensor, threshold: float) -> torch.Tensor:
    """``clamp((prob - threshold) / (1 - threshold), 0, 1)``, elementwise (official ``threshold_rescale``)."""
    return ((prob - threshold) / (1.0 - threshold)).clamp(0.0, 1.0)


def topk_rescale(prob: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """(B, T): per row, its top ``int(n * ratio)`` loss tokens by ``prob`` min-max normalised (all 1 when they tie),
    every other token 0 (official ``topk_rescale``; ``n`` = the row's loss tokens)."""
    out = torch.zeros_like(prob)
    for b in range(prob.size(0)):
        valid = torch.nonzero(mask[b] > 0).flatten()
        k = int(valid.numel() * ratio)
        if k == 0:
            continue
        values, idx = torch.topk(prob[b, valid], k)
        span = values.max() - values.min()
        out[b, valid[idx]] = (values - values.min()) / span if span > 0 else torch.ones_like(values)
    return out


def oreal_token_weights(
    scores: torch.Tensor,
    mask: torch.Tensor,
    positive: torch.Tensor,
    rescale: str = "threshold",
    correct_threshold: float = 0.5,
    incorrect_threshold: float = 0.5,
    correct_topk_ratio: float = 0.5,
    incorrect_topk_ratio: float = 0.5,
) -> torch.Tensor:
    """(B, T) no-grad token weights of the policy loss from the reward model's scores.

    Args:
        scores: (B, T) scalar logits of the reward model. mask: (B, T) loss mask. positive: (B,) bool.
        rescale: ``"threshold"`` or ``"topk"`` (see the module docstring).
    """
    prob = torch.sigmoid(cumulative_mean(scores.detach().float(), mask))
    if rescale == "threshold":
        pos, neg = threshold_rescale(prob, correct_threshold), threshold_rescale(1 - prob, incorrect_threshold)
    elif rescale == "topk":
        pos, neg = topk_rescale(prob, mask, correct_topk_ratio), topk_rescale(1 - prob, mask, incorrect_topk_ratio)
    else:
        raise ValueError(f"rescale={rescale!r} is unknown; allowed: threshold, topk.")
    return torch.where(positive.bool().unsqueeze(-1), pos, neg) * mask.to(prob.dtype)


def sequence_bce(scores: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) binary cross-entropy of each row's mean score (over its loss tokens) against ``labels`` (B,) in {0, 1}."""
    mask = mask.to(scores.dtype)
    mean = (scores * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return F.binary_cross_entropy_with_logits(mean, labels.to(mean.dtype), reduction="none")


# ============================================================================================= trained head
class TokenRewardHead:
    """A ``Linear(d, 1, bias=False)`` over detached hidden states with its own AdamW.

    Gradients of :meth:`accumulate` build up over micro-batches; :meth:`step` sums them (and the row count) over
    processes with ``reduce``, divides by the rows, clips the norm and steps. The initial weight is drawn from
    ``seed`` (uniform in ``+-1/sqrt(d)``, nn.Linear's default), so every process starts from the same head.
    """

    def __init__(self, lr: float, weight_decay: float, max_grad_norm: float, seed: int = 0):
        self.lr, self.weight_decay, self.max_grad_norm, self.seed = lr, weight_decay, max_grad_norm, seed
        self.weight: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self.rows = 0.0
        self.steps = 0
        self._pending: dict | None = None

    @property
    def built(self) -> bool:
        return self.weight is not None

    def build(self, hidden_size: int, device: torch.device | str) -> None:
        """Create the head (once) for ``hidden_size`` on ``device``; a state loaded earlier is applied now."""
        if self.built:
            return
        g = torch.Generator().manual_seed(self.seed)
        bound = 1.0 / math.sqrt(hidden_size)
        w = (torch.rand(1, hidden_size, generator=g, dtype=torch.float32) * 2 - 1) * bound
        self.weight = torch.nn.Parameter(w.to(device))
        self.optimizer = torch.optim.AdamW([self.weight], lr=self.lr, weight_decay=self.weight_decay)
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T) scores of hidden states (B, T, d); the graph reaches the head only (the input is detached)."""
        return (hidden.detach().float() @ self.weight.t()).squeeze(-1)

    def accumulate(self, loss_sum: torch.Tensor, rows: int) -> None:
        """Back-propagate ``loss_sum`` (a sum over ``rows`` rows) into the head's gradient only."""
        if rows > 0:
            torch.autograd.backward(loss_sum, inputs=[self.weight])
            self.rows += rows

    def step(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        """One optimiser step on the gradient summed over processes, divided by the global row count; False (and
        nothing changed) when no process saw a row. Collective when ``reduce`` is given: call on every process."""
        if not self.built:
            return False
        grad = self.weight.grad if self.weight.grad is not None else torch.zeros_like(self.weight)
        flat = torch.cat([grad.flatten(), torch.tensor([self.rows], device=grad.device, dtype=grad.dtype)])
        if reduce is not None:
            flat = reduce(flat)
        total = float(flat[-1])
        self.rows = 0.0
        if total <= 0:
            self.weight.grad = None
            return False
        self.weight.grad = (flat[:-1] / total).view_as(self.weight)
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([self.weight], self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return True

    def state_dict(self) -> dict:
        if not self.built:
            return dict(self._pending or {})
        return {"weight": self.weight.detach().cpu().clone(), "optimizer": self.optimizer.state_dict(),
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if self.built:
            self._apply(state)
        else:
            self._pending = dict(state)

    def _apply(self, state: dict) -> None:
        with torch.no_grad():
            self.weight.copy_(state["weight"].to(self.weight.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))
