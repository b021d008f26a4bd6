"""DECS (arXiv:2509.25827) pure functions for ``length_shaping`` mode ``decs`` (tensors and token-id lists only).

Facts from the official code (pixas/DECS, ``src_valid/reward_manager.py`` chunk split / classification and
``src_valid/valid_ray_trainer.py`` ``compute_grpo_proc_length_advantage_return`` and the kappa schedule; restated):

* A completion is cut into chunks before every token that starts a reflection word (``Wait``, ``But``,
  ``Alternatively``, ``Hmm``, ``Let``, ``Therefore``, with and without a leading space: the first token id of each).
* In a correct completion the first chunk that contains the correct answer ends the *necessary reasoning prefix*
  (NRP); every token after it is redundant. Incorrect completions have no redundant tokens.
* Token rewards: ``s (1 + beta)`` on every position, except the redundant tokens of a correct completion, which get
  ``s + beta (1 - L / L_max)`` (``s`` the outcome score, ``L`` the completion length, ``L_max`` the maximal completion
  length): redundant tokens lose ``beta L / L_max`` (plus ``beta (s - 1)`` for s != 1), more in longer completions.
* Advantages are normalised **per position** over the group's G rows (mean and unbiased std of the token rewards at
  that position, padding positions included, ``+ 1e-6``), then masked.
* Curriculum data schedule: groups with reward variance are kept, all-wrong groups dropped, and
  ``int(kappa n_kept / (1 - kappa))`` all-correct groups kept at random; ``kappa`` starts at 0 and moves by
  ``kappa_lr (NRP ratio - previous NRP ratio)`` after each batch, the NRP ratio being the mean of
  ``(index of the NRP's last chunk + 1) / number of chunks`` over the correct completions where an NRP was found.
"""

from __future__ import annotations

import re

import torch

#: The official split words (their first token id cuts chunks).
SPLIT_WORDS = ("Wait", " Wait", "But", " But", "Alternatively", " Alternatively", "Hmm", " Hmm", "Let", " Let",
               "Therefore", " Therefore")


def chunk_starts(ids: list[int], split_ids: set[int]) -> list[int]:
    """Start positions of the chunks of one completion: 0 and every position > 0 holding a split token id."""
    return [0] + [i for i, token in enumerate(ids) if i > 0 and token in split_ids] if ids else []


def contains_answer(text: str, answer: str) -> bool:
    """Rule chunk judge: ``answer`` appears in ``text`` as a whole token (not inside a longer number or word)."""
    answer = answer.strip()
    if not answer:
        return False
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w])", text) is not None


def nrp_split(starts: list[int], has_answer: list[bool], length: int) -> tuple[int, float]:
    """(start of the redundant tail or -1, NRP ratio or 0.0) of one correct completion from its chunks' verdicts."""
    first = next((j for j, yes in enumerate(has_answer) if yes), -1)
    if first == -1:
        return -1, 0.0
    ratio = (first + 1) / len(starts)
    tail = starts[first + 1] if first + 1 < len(starts) else -1
    return (tail if 0 <= tail < length else -1), ratio


def decs_token_rewards(scores: torch.Tensor, redundant_start: torch.Tensor, lengths: torch.Tensor, width: int,
                       max_length: int, beta: float) -> torch.Tensor:
    """DECS token rewards (N, width).

    Args:
        scores: (N,) outcome scores. redundant_start: (N,) first redundant position, -1 when none (incorrect rows and
            rows without an NRP tail). lengths: (N,) completion lengths. width: T. max_length: L_max. beta: the
            length-reward weight.
    """
    N = scores.numel()
    base = (scores.float() * (1 + beta)).unsqueeze(1).expand(N, width).clone()
    positions = torch.arange(width, device=scores.device).expand(N, width)
    redundant = (redundant_start.unsqueeze(1) >= 0) & (positions >= redundant_start.unsqueeze(1)) \
        & (positions < lengths.unsqueeze(1))
    shaped = (scores.float() + beta * (1 - lengths.float() / max_length)).unsqueeze(1).expand(N, width)
    return torch.where(redundant, shaped, base)


def per_position_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_size: int,
                            eps: float = 1e-6) -> torch.Tensor:
    """Group normalisation per position (N, T): ``(r - mean_g(r_t)) / (std_g(r_t) + eps) * mask``; size-1 groups use
    mean 0 and std 1 (official)."""
    N, T = token_rewards.shape
    grouped = token_rewards.view(-1, group_size, T)
    if group_size == 1:
        mean, std = torch.zeros_like(grouped[:, :1]), torch.ones_like(grouped[:, :1])
    else:
        mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(N, T) * mask


def curriculum_keep(rewards: torch.Tensor, group_size: int, kappa: float, generator: torch.Generator) -> torch.Tensor:
    """(num_groups,) bool: the groups the curriculum keeps (all with reward variance, ``int(kappa n / (1 - kappa))``
    all-correct ones at random, no all-wrong one). ``kappa`` is clamped to [0, 0.99]."""
    grouped = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    varied = grouped.std(dim=1, unbiased=False) > 0 if group_size > 1 else torch.ones(grouped.size(0), dtype=bool)
    easy = (~varied) & (grouped.mean(dim=1) > 0)
    keep = varied.clone()
    kappa = min(max(kappa, 0.0), 0.99)
    allowed = min(int(kappa * int(varied.sum()) / (1 - kappa)), int(easy.sum()))
    if allowed > 0:
        easy_ids = torch.nonzero(easy).squeeze(1)
        chosen = easy_ids[torch.randperm(easy_ids.numel(), generator=generator)[:allowed]]
        keep[chosen] = True
    return keep
