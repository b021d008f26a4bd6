"""HBPO -- Hierarchical Budget Policy Optimization (arXiv:2507.15844): the pure functions of ``length_shaping``'s
``mode="hbpo"``.

Facts from the paper (Sec. 3, Algorithm 1) and the official code (ZJU-REAL/HBPO @5c8991d: the hierarchical vLLM
rollout, ``rllm/rewards/math_reward.py`` and ``compute_grpo_outcome_advantage`` in ``verl/trainer/ppo/core_algos.py``;
restated, not copied):

* **Budget sub-groups.** The ``G`` rollouts of a prompt are split into ``k`` equal sub-groups; sub-group ``i`` is
  sampled with a budget sentence for ``b_i`` (paper: 16 rollouts, ``B = {512, 1024, 2048, 2560}``). The official
  rollout appends ``"<think> I will answer the question with {b} tokens"`` to the prompt token ids, after the chat
  template's assistant header; the paper writes the sentence as "I will answer the question within n tokens" after
  the reasoning tag. The sentence is part of the prompt (not trained on).
* **Budget-aware reward** of a correct response of ``n <= L_max`` tokens under budget ``b``, with
  ``f1(n, b) = beta cos(pi n / (2 L_max)) - alpha |n - b|`` and ``f2(b) = beta cos(pi b / (2 L_max))``: the paper's
  piecewise rule is ``f1`` for ``n > b`` and ``f2`` for ``n <= b``; the official code pays ``min(f1, f2)`` for every
  ``n`` (the two differ for short answers, where ``alpha |n - b|`` exceeds the cosine gap). Wrong answers get 0.
  Official constants: ``beta = 4``, ``L_max = 4096`` (the response length), ``alpha = 1 / L_max``.
* **Hierarchical advantage** of response ``j`` of sub-group ``i``: ``A_inter = (R_ij - mean(R)) / (std(R) + 1e-6)``
  over the whole group (unbiased std) plus ``A_intra_i = mean_j(R_ij) - f2(b_i)``. The paper adds ``A_intra`` once;
  the official code adds it twice (a repeated line), i.e. weight 2.
"""

from __future__ import annotations

import math

import torch

#: The paper's budgets (tokens).
PAPER_BUDGETS = (512, 1024, 2048, 2560)
#: The official rollout's budget sentence (appended after the reasoning tag); ``{budget}`` is replaced.
OFFICIAL_BUDGET_PROMPT = "I will answer the question with {budget} tokens"


def budget_slots(index_in_group: torch.Tensor, group_size: int, num_budgets: int) -> torch.Tensor:
    """(N,) long: the budget sub-group of each row, ``index_in_group // (G / k)`` (equal, contiguous sub-groups)."""
    return torch.div(index_in_group.long(), group_size // num_budgets, rounding_mode="floor")


def with_budget_sentence(prompt, sentence: str):
    """``prompt`` with the budget ``sentence`` appended: to the text after one space for a text prompt (the official
    rollout's place when the prompt ends with the assistant header or the reasoning tag); for a conversational prompt,
    after a blank line at the end of the last user message (a chat template renders the generation prompt itself, so
    an assistant prefill cannot be expressed there)."""
    if isinstance(prompt, str):
        return f"{prompt} {sentence}"
    messages = [dict(m) for m in prompt]
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            m["content"] = f"{m['content']}\n\n{sentence}"
            return messages
    raise ValueError("HBPO: a conversational prompt without a text user message cannot carry the budget sentence.")


def budget_baseline(budgets: torch.Tensor, max_length: int, beta: float) -> torch.Tensor:
    """``f2(b) = beta cos(pi b / (2 L_max))`` per row (N,)."""
    return beta * torch.cos(math.pi * budgets.float() / (2 * max_length))


def budget_rewards(lengths: torch.Tensor, budgets: torch.Tensor, correct: torch.Tensor, max_length: int, beta: float,
                   alpha: float, form: str = "official_min") -> torch.Tensor:
    """HBPO's reward per row (N,).

    Args:
        lengths: (N,) completion tokens ``n``. budgets: (N,) the row's budget ``b``. correct: (N,) bool.
        form: ``"official_min"`` -- ``min(f1, f2)``; ``"paper_piecewise"`` -- ``f1`` if ``n > b`` else ``f2``.
    Returns:
        (N,) float: the budget reward for correct rows with ``n <= max_length``, else 0.
    """
    n = lengths.float()
    f1 = beta * torch.cos(math.pi * n / (2 * max_length)) - alpha * (n - budgets.float()).abs()
    f2 = budget_baseline(budgets, max_length, beta)
    shaped = torch.minimum(f1, f2) if form == "official_min" else torch.where(n > budgets.float(), f1, f2)
    return torch.where(correct & (lengths <= max_length), shaped, torch.zeros_like(shaped))


def hierarchical_advantages(rewards: torch.Tensor, slots: torch.Tensor, budgets: torch.Tensor, group_size: int,
                            max_length: int, beta: float, intra_weight: float, eps: float = 1e-6) -> torch.Tensor:
    """HBPO's advantage per row (N,): ``(R - mean_g) / (std_g + eps) + intra_weight (mean_{g,i}(R) - f2(b_i))``.

    Args:
        rewards: (N,) combined rewards, groups of ``group_size`` contiguous (NaN counts as 0).
        slots: (N,) budget sub-group of each row. budgets: (N,) the row's budget ``b``.
    """
    R = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    inter = (R - R.mean(dim=1, keepdim=True)) / (R.std(dim=1, keepdim=True) + eps)
    s = slots.view(-1, group_size)
    same = (s.unsqueeze(2) == s.unsqueeze(1)).float()  # (groups, G, G): rows of one budget sub-group
    sub_mean = (same * R.unsqueeze(1)).sum(dim=2) / same.sum(dim=2)
    intra = sub_mean - budget_baseline(budgets, max_length, beta).view(-1, group_size)
    return (inter + intra_weight * intra).view(-1)
