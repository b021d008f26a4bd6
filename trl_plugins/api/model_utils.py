"""Model helpers plugins and components share: unwrapping a wrapped policy, TRL's prompt/completion batch layout.

The runtime's LM-head statistics (:mod:`trl_plugins.runtime.head_stats`) and policy probe
(:mod:`trl_plugins.runtime.policy_probe`) build on these; a plugin that reads the model's config (OREAL) or a
component that scores completions with a local model (the teacher's log-probs) calls them directly.
"""

from __future__ import annotations

from typing import Any

import torch

from trl_plugins.api.engines import unwrap_causal_lm  # the rule lives with the other engine rules

__all__ = ["prompt_completion_batch", "unwrap_causal_lm"]

def prompt_completion_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's prompt/completion layout of R rows: prompts left-padded to the longest prompt P, completions
    right-padded to the longest completion C (at least 1).

    Returns input_ids (R, P + C), attention_mask (R, P + C) and C (the ``logits_to_keep`` of the forward).
    """
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(1, max(len(c) for c in completion_ids))
    input_ids = torch.full((len(prompt_ids), p_len + c_len), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for j, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[j, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long, device=device)
        input_ids[j, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long, device=device)
        attention_mask[j, p_len - len(p) : p_len + len(c)] = 1
    return input_ids, attention_mask, c_len
