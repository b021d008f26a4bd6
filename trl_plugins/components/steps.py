"""Reasoning steps: split a completion into steps with character spans, find the first wrong step, and map a step
boundary back to a token index of the completion (token-exact, for splicing).

Conventions shared by the PRMs (:mod:`trl_plugins.components.prm`), the teachers
(:mod:`trl_plugins.components.teacher`) and the step-level plugins (SCOPE, Posterior-GRPO):

* a *step* is a non-empty piece of the completion text between separators, stripped of surrounding whitespace
  (Qwen2.5-Math-PRM convention: separator ``"\\n\\n"``; the bundled arithmetic tasks: one step per line, ``"\\n"``,
  exactly :func:`trl_plugins.tasks.arithmetic.split_steps`);
* step indices are **0-based** (a "first error k* = 3" of ``[0.9, 0.8, 0.3, 0.9]`` is index 2 here).
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StepSpan", "aggregate_step_scores", "first_error", "join_steps", "question_text", "split_steps", "token_boundary"]


@dataclass(frozen=True)
class StepSpan:
    """One step of a completion: its stripped text and where it lies in the completion text.

    Attributes:
        text: the step, stripped of surrounding whitespace.
        start: character offset of the step's first character in the completion text.
        end: offset just after its last character (``text == completion[start:end]``).
    """

    text: str
    start: int
    end: int


def split_steps(text: str, separator: str = "\n\n") -> list[StepSpan]:
    """The non-empty, stripped pieces of ``text`` between ``separator`` s, with their character spans.

    With ``separator="\\n"`` the text is split into lines exactly as :meth:`str.splitlines` does (so the steps equal
    :func:`trl_plugins.tasks.arithmetic.split_steps`).

    >>> [(s.text, s.start) for s in split_steps("a=1\\n\\n  b=2\\n\\n\\n\\nc", "\\n\\n")]
    [('a=1', 0), ('b=2', 7), ('c', 14)]
    """
    if not separator:
        raise ValueError("split_steps: the step separator must be a non-empty string.")
    pieces = text.splitlines(keepends=True) if separator == "\n" else _split_keep(text, separator)
    spans, pos = [], 0
    for piece in pieces:
        stripped = piece.strip()
        if stripped:
            start = pos + (len(piece) - len(piece.lstrip()))
            spans.append(StepSpan(stripped, start, start + len(stripped)))
        pos += len(piece)
    return spans


def _split_keep(text: str, separator: str) -> list[str]:
    parts = text.split(separator)
    return [p + separator for p in parts[:-1]] + [parts[-1]]


def join_steps(steps: Sequence[str], separator: str = "\n\n") -> str:
    """Inverse of :func:`split_steps` for clean steps: ``separator.join(steps)``."""
    return separator.join(steps)


def aggregate_step_scores(scores: Sequence[float], how: str) -> float:
    """One process reward from step scores: ``"mean"``, ``"min"``, ``"last"`` or ``"prod"`` (0.0 without steps).

    >>> aggregate_step_scores([1.0, 0.5], "mean"), aggregate_step_scores([0.5, 0.5], "prod")
    (0.75, 0.25)
    """
    if not scores:
        return 0.0
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    if how == "prod":
        return math.prod(scores)
    raise ValueError(f"aggregate_step_scores: how={how!r}; allowed: mean, min, last, prod.")


def first_error(scores: Sequence[float], threshold: float = 0.5) -> int | None:
    """0-based index of the first step whose score is below ``threshold``; None if every step reaches it.

    >>> first_error([0.9, 0.8, 0.3, 0.9], 0.5)
    2
    """
    for k, score in enumerate(scores):
        if score < threshold:
            return k
    return None


def token_boundary(ids: Sequence[int], char_offset: int, decode: Callable[[list[int]], str]) -> int:
    """The largest ``j`` such that ``decode(ids[:j])`` is a prefix of ``decode(ids)`` of at most ``char_offset``
    characters: where to cut the completion's **token ids** so that the kept tokens end at or before a character
    offset (a step start), without re-tokenizing anything.

    A token that straddles the offset (e.g. ``"\\n\\n7"`` in a BPE vocabulary) is left out, so the kept text may end a
    few characters before the offset; the caller continues from ``decode(ids[:j])``.

    Args:
        ids: the completion's token ids.
        char_offset: offset into ``decode(ids)``.
        decode: ids -> text, the same decoding that produced the text the offset refers to.
    """
    full = decode(list(ids))
    lo, hi = 0, len(ids)
    while lo < hi:  # largest j with len(decode(ids[:j])) <= char_offset (the length is non-decreasing in j)
        mid = (lo + hi + 1) // 2
        if len(decode(list(ids[:mid]))) <= char_offset:
            lo = mid
        else:
            hi = mid - 1
    j = lo
    while j > 0 and not full.startswith(decode(list(ids[:j]))):  # guard against non-monotone decodings
        j -= 1
    return j


def question_text(prompt: Any) -> str:
    """The question of a prompt: the string itself, or the content of the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(list(prompt)):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, list):  # typed content blocks
                return "".join(block.get("text", "") for block in content if isinstance(block, dict))
            return str(content)
    raise ValueError("question_text: the prompt has no user message.")
