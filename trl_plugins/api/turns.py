"""Turn structure of multi-turn tool rollouts (TRL ``tools`` / ``environment_factory``).

With tools, one TRL completion is a conversation: assistant turn, tool results, assistant turn, ... TRL keeps it as
one token sequence (the completion ids) plus a **tool mask** (1 on tokens the model generated, 0 on tool-result
tokens, which the loss skips) and the parsed messages. :class:`TurnStructure` recovers the turns from those:

* assistant turn ``u`` = the ``u``-th maximal run of tool-mask-1 tokens (``assistant_spans[u]``);
* tool-result span = a maximal run of tool-mask-0 tokens (``tool_result_spans``);
* tool-call span = the part of an assistant turn from its first ``<tool_call>`` marker token to the turn's end
  (``tool_call_spans``; the whole turn when the marker cannot be located) -- only for turns that called tools;
* ``tool_calls[u]`` = the calls TRL parsed from turn ``u`` (``[{"name", "arguments"}]``, empty for the last turn);
* ``turn_rewards[u]`` = the environment's reward for turn ``u`` (NaN where it gives none): an environment may keep a
  list attribute ``turn_rewards`` with one float per tool call, in call order; the rewards of a turn's calls are summed.

Token positions index the completion (0 .. len(completion_ids) - 1); spans are half-open ``(start, end)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "TurnStructure", "accumulate_turn_rewards", "build_turn_structure", "environment_call_rewards", "expand_turn_values",
    "single_turn", "turn_ids_tensor", "turn_rewards_tensor",
]

TOOL_CALL_MARKER = "<tool_call>"


@dataclass
class TurnStructure:
    """Turns of one completion (see the module docstring).

    Attributes:
        assistant_spans: (U,) half-open token spans of the assistant turns, in order.
        tool_result_spans: token spans of the tool results (tool-mask 0).
        tool_call_spans: token spans of the tool-call text, one per assistant turn that called tools.
        tool_calls: (U,) per assistant turn, the calls TRL parsed (``{"name", "arguments"}`` dicts).
        tool_mask: (L,) TRL's tool mask of the completion (1 model token, 0 tool-result token).
        turn_rewards: (U,) the environment's per-turn rewards, NaN where it gives none.
    """

    assistant_spans: list[tuple[int, int]]
    tool_result_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_call_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: list[list[dict]] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        """U, the number of assistant turns."""
        return len(self.assistant_spans)

    @property
    def num_tool_calls(self) -> int:
        return sum(len(calls) for calls in self.tool_calls)

    def turn_ids(self) -> list[int]:
        """(L,) index of the assistant turn of each token; -1 on tool-result tokens."""
        ids = [-1] * len(self.tool_mask)
        for u, (start, end) in enumerate(self.assistant_spans):
            ids[start:end] = [u] * (end - start)
        return ids


def _runs(mask: Sequence[int], value: int) -> list[tuple[int, int]]:
    spans, start = [], None
    for t, m in enumerate(list(mask) + [None]):
        if m == value and start is None:
            start = t
        elif m != value and start is not None:
            spans.append((start, t))
            start = None
    return spans


def _marker_offset(decode_one: Any, ids: Sequence[int], marker: str) -> int | None:
    """Index of the token where ``marker`` starts in the text of ``ids`` (decoded token by token), or None."""
    pieces = [decode_one(t) for t in ids]
    pos = "".join(pieces).find(marker)
    if pos < 0:
        return None
    seen = 0
    for k, piece in enumerate(pieces):
        seen += len(piece)
        if seen > pos:
            return k
    return None


def single_turn(length: int) -> TurnStructure:
    """The structure of a completion without tool calls: one assistant turn over all ``length`` tokens."""
    return TurnStructure(assistant_spans=[(0, length)] if length else [], tool_calls=[[]] if length else [],
                         tool_mask=[1] * length, turn_rewards=[math.nan] if length else [])


def build_turn_structure(
    completion_ids: Sequence[int],
    tool_mask: Sequence[int] | None,
    messages: Any = None,
    call_rewards: Sequence[float] | None = None,
    decode_one: Any = None,
    marker: str = TOOL_CALL_MARKER,
) -> TurnStructure:
    """The :class:`TurnStructure` of one completion.

    Args:
        completion_ids: (L,) the completion's token ids (TRL's, tool results included).
        tool_mask: (L,) TRL's tool mask, or None (no tools: one turn).
        messages: TRL's completion (list of assistant / tool messages) for the parsed tool calls; None: no calls known.
        call_rewards: the environment's per-call rewards (``environment.turn_rewards``), or None.
        decode_one: ``token id -> text`` used to locate ``marker`` (None: tool-call spans cover their whole turn).
        marker: the text that opens a tool call.
    """
    length = len(completion_ids)
    if tool_mask is None:
        return single_turn(length)
    mask = [int(m) for m in tool_mask[:length]] + [1] * max(0, length - len(tool_mask))
    assistant_spans = _runs(mask, 1)
    assistant_messages = [m for m in (messages or []) if isinstance(m, dict) and m.get("role") == "assistant"]
    tool_calls = []
    for u in range(len(assistant_spans)):
        calls = (assistant_messages[u].get("tool_calls") or []) if u < len(assistant_messages) else []
        tool_calls.append([
            {"name": c.get("function", c).get("name"), "arguments": c.get("function", c).get("arguments", {})}
            for c in calls
        ])
    call_spans = []
    for (start, end), calls in zip(assistant_spans, tool_calls):
        if not calls:
            continue
        offset = _marker_offset(decode_one, completion_ids[start:end], marker) if decode_one is not None else None
        call_spans.append((start + (offset or 0), end))
    rewards = [math.nan] * len(assistant_spans)
    if call_rewards is not None:
        remaining = [float(r) for r in call_rewards]
        for u, calls in enumerate(tool_calls):
            if calls and remaining:
                rewards[u] = sum(remaining[: len(calls)])
                remaining = remaining[len(calls):]
    return TurnStructure(assistant_spans, _runs(mask, 0), call_spans, tool_calls, mask, rewards)


def environment_call_rewards(env: Any, row: int) -> tuple[list[float] | None, Exception | None]:
    """``(rewards, problem)``: the per-call rewards the environment of global row ``row`` keeps in ``turn_rewards``
    (None when it keeps none), or ``(None, PluginError)`` naming the environment, the entry, the row and what is
    allowed when they cannot enter the turn-level advantages and the loss (not a list, a non-number, a bool, NaN,
    inf). The caller raises the problem on every process together (a collective)."""
    from trl_plugins.api.errors import PluginError

    rewards = getattr(env, "turn_rewards", None)
    if rewards is None:
        return None, None
    name = f"environment {type(env).__name__}"
    if not isinstance(rewards, (list, tuple)):
        return None, PluginError(
            f"{name}: turn_rewards of row {row} is {type(rewards).__name__} {rewards!r:.60}; allowed: a list with one "
            "finite number per tool call of the rollout, in call order (or no turn_rewards attribute)."
        )
    for k, value in enumerate(rewards):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return None, PluginError(
                f"{name}: turn_rewards[{k}] of row {row} is {value!r:.60}; allowed: a finite number (one per tool "
                "call). The turn rewards feed the turn-level advantages and the loss, where a NaN or inf would make "
                "every parameter NaN."
            )
    return [float(value) for value in rewards], None


def turn_ids_tensor(turns: Sequence[TurnStructure], width: int, device: Any = None) -> torch.Tensor:
    """(B, width) long: :meth:`TurnStructure.turn_ids` of each row, right-padded (and on padding) with -1."""
    out = torch.full((len(turns), width), -1, dtype=torch.long)
    for i, turn in enumerate(turns):
        ids = turn.turn_ids()[:width]
        if ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device) if device is not None else out


def turn_rewards_tensor(turns: Sequence[TurnStructure], width: int | None = None) -> torch.Tensor:
    """(B, U_max) float: each row's ``turn_rewards``, NaN-padded (U_max = the most turns of any row, at least 1)."""
    width = width or max([t.num_turns for t in turns] + [1])
    out = torch.full((len(turns), width), math.nan)
    for i, turn in enumerate(turns):
        if turn.turn_rewards:
            out[i, : len(turn.turn_rewards)] = torch.tensor(turn.turn_rewards[:width], dtype=torch.float32)
    return out


def expand_turn_values(values: torch.Tensor, turn_ids: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-turn values (R, U) to per-token values (R, T): token t of row r gets ``values[r, turn_ids[r, t]]``;
    tokens outside every assistant turn (turn id -1: tool results, padding) get ``fill``."""
    index = turn_ids.clamp(min=0).to(values.device)
    if values.size(1) == 0:
        return torch.full(turn_ids.shape, fill, dtype=values.dtype, device=values.device)
    index = index.clamp(max=values.size(1) - 1)
    expanded = torch.gather(values, 1, index)
    return torch.where(turn_ids.to(values.device) >= 0, expanded, torch.full_like(expanded, fill))


def accumulate_turn_rewards(rewards: torch.Tensor, gamma: float, sqrt_terms: bool = False) -> torch.Tensor:
    """(N, U) discounted returns of per-turn rewards (N, U): ``A_t = sum_{k >= t} gamma^(k-t) r_k`` over the non-NaN
    rewards of each row (divided by sqrt(#terms) when ``sqrt_terms``); NaN where the row has no turn."""
    N, U = rewards.shape
    out = torch.full_like(rewards, math.nan)
    running = torch.zeros(N)
    terms = torch.zeros(N)
    for u in range(U - 1, -1, -1):
        valid = ~torch.isnan(rewards[:, u])
        running = torch.where(valid, rewards[:, u].nan_to_num(0.0) + gamma * running, running)
        terms = terms + valid.float()
        value = running / terms.clamp(min=1).sqrt() if sqrt_terms else running
        out[:, u] = torch.where(valid, value, out[:, u])
    return out
