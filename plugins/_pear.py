"""PEAR (arXiv:2510.08026) pure functions for ``length_shaping`` mode ``pear``.

What the paper states: the thinking phase of a response (before the ``</think>`` marker) has higher token entropy than
the final-answer phase, and entropy correlates with length; PEAR's reward penalises entropy in the thinking phase while
allowing moderate entropy in the answer phase, computed from the (old-policy) per-token entropies of each response.
The exact combination was not available to us (no copy of the official code here), so the bonus below is a documented
reconstruction: ``-(alpha H_think + alpha_answer H_answer)`` with the phases' mean token entropies, for correct
responses (``alpha_answer`` < ``alpha``: the answer phase is penalised less, by default not at all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def phase_boundary(ids: Sequence[int], decode: Callable[[list[int]], str], marker: str) -> int:
    """Index of the first answer-phase token: the shortest token prefix whose text contains ``marker`` (the marker's
    own tokens belong to the thinking phase); ``len(ids)`` when the completion has no marker (all thinking)."""
    ids = list(ids)
    if not marker or marker not in decode(ids):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def phase_entropies(entropies: torch.Tensor, boundary: int) -> tuple[float, float]:
    """(mean entropy of the thinking phase, of the answer phase) of one completion's (L,) token entropies; an empty
    phase has mean 0."""
    think, answer = entropies[:boundary], entropies[boundary:]
    return (float(think.mean()) if think.numel() else 0.0, float(answer.mean()) if answer.numel() else 0.0)


def pear_bonus(think: torch.Tensor, answer: torch.Tensor, correct: torch.Tensor, alpha: float, alpha_answer: float,
               only_correct: bool = True) -> torch.Tensor:
    """(N,) reward bonus ``-(alpha H_think + alpha_answer H_answer)``, 0 on incorrect rows when ``only_correct``."""
    bonus = -(alpha * think + alpha_answer * answer)
    return torch.where(correct, bonus, torch.zeros_like(bonus)) if only_correct else bonus
