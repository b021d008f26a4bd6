"""The branching seam's request checks and per-request cuts (pure helpers of
:meth:`~trl_plugins.runtime.generation.GenerationService.continue_prefixes`).

A continuation request is ``(prompt ids, prefix ids, max_new_tokens, stop strings, probe positions)``. The backend
generates every request of a call with one ``max_new_tokens`` (the largest over all processes); each request is then
cut to its own limit and just after the first occurrence of one of its stop strings (the stop string is kept, as
``transformers``' ``stop_strings`` keeps it). Sampling is autoregressive, so a continuation cut where its stop string
completes has the distribution of one stopped there.

A fork request (:meth:`~trl_plugins.runtime.generation.GenerationService.fork_prefixes`) adds a rank: its first new
token is forced to the rank-th most likely next token after the prefix (:func:`forced_token`), so requests sharing a
prefix with ranks ``0 .. k-1`` continue it with ``k`` distinct next tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trl_plugins.api.errors import PluginError

WHERE = "GenerationService.continue_prefixes"


@dataclass
class ContinuationRequest:
    """One checked request: ``prefix`` continues ``prompt``; at most ``max_new`` new tokens (already capped so that
    ``len(prefix) + max_new <= max_completion_length``); ``stop`` strings; ``positions`` to probe."""

    prompt: list[int]
    prefix: list[int]
    max_new: int
    stop: list[str]
    positions: list[int]


def _per_request(value, n: int, name: str) -> list:
    """``value`` given once for every request, or one per request."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise PluginError(f"{WHERE}: {len(value)} values of {name} for {n} requests; allowed: one value, or one "
                              "per request.")
        return list(value)
    return [value] * n


def check_requests(
    prompt_ids: Sequence[Sequence[int]],
    prefix_ids: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    stop: Sequence[str] | Sequence[Sequence[str]] | None,
    probe_positions: Sequence[Sequence[int]] | None,
    top_k: int,
    max_completion_length: int,
) -> list[ContinuationRequest]:
    """Check a call's requests; a bad one raises a ``PluginError`` naming the value and what is allowed.

    ``stop`` is one list of strings for every request, or one list per request; ``probe_positions`` one list of
    completion indices per request, each in ``[0, len(prefix)]`` (known before generation: the prefix's own tokens
    and the first new one).
    """
    n = len(prompt_ids)
    if len(prefix_ids) != n:
        raise PluginError(f"{WHERE}: {len(prefix_ids)} prefixes for {n} prompts; allowed: one prefix per prompt.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise PluginError(f"{WHERE}: top_k={top_k!r}; allowed: an integer >= 0 (0: no top-k list).")
    limits = _per_request(max_new_tokens, n, "max_new_tokens")
    if stop is None or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        stops = [list(stop or [])] * n
    else:
        stops = [list(s) for s in _per_request(list(stop), n, "stop")]
    positions = [[] for _ in range(n)] if probe_positions is None else _per_request(list(probe_positions), n,
                                                                                  "probe_positions")
    requests = []
    for j in range(n):
        m = limits[j]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PluginError(f"{WHERE}: max_new_tokens={m!r} for request {j}; allowed: an integer >= 1.")
        for s in stops[j]:
            if not isinstance(s, str) or not s:
                raise PluginError(f"{WHERE}: stop string {s!r} for request {j}; allowed: non-empty strings (an empty "
                                  "one would match before the first token).")
        prefix = [int(t) for t in prefix_ids[j]]
        room = max_completion_length - len(prefix)
        if room < 1:
            raise PluginError(f"{WHERE}: request {j}'s prefix has {len(prefix)} tokens; allowed: fewer than "
                              f"max_completion_length={max_completion_length}, so that one new token fits.")
        pos = [int(t) for t in positions[j]]
        bad = [t for t in pos if not 0 <= t <= len(prefix)]
        if bad:
            raise PluginError(f"{WHERE}: probe position {bad[0]} for request {j}; allowed: 0 .. {len(prefix)} (the "
                              "prefix's tokens and the first new one).")
        requests.append(ContinuationRequest([int(t) for t in prompt_ids[j]], prefix, min(m, room), stops[j], pos))
    return requests


def cut_continuation(new_ids: list[int], max_new: int, stop: Sequence[str], eos_ids: Sequence[int],
                     decode: Callable[[list[int]], str]) -> tuple[list[int], bool, str | None]:
    """``(ids, finished, stop_string)``: ``new_ids`` cut to ``max_new`` tokens and just after the first token whose
    text completes one of ``stop`` (the earliest one wins); ``finished`` when it ends in EOS or a stop string."""
    ids = list(new_ids[:max_new])
    if stop and any(s in decode(ids) for s in stop):
        for n in range(1, len(ids) + 1):
            text = decode(ids[:n])
            hits = [s for s in stop if s in text]
            if hits:
                return ids[:n], True, min(hits, key=text.index)
    finished = bool(ids) and ids[-1] in set(eos_ids)
    return ids, finished, None


def check_fork_ranks(ranks: Sequence[int], exclude: Sequence[int | None] | None, n: int) -> list[int | None]:
    """Check :meth:`~trl_plugins.runtime.generation.GenerationService.fork_prefixes`' ``ranks`` (one integer >= 0 per
    request) and ``exclude`` (None, or one token id or None per request); returns the per-request excluded ids."""
    where = "GenerationService.fork_prefixes"
    if len(ranks) != n:
        raise PluginError(f"{where}: {len(ranks)} ranks for {n} requests; allowed: one rank per request.")
    for j, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise PluginError(f"{where}: rank {r!r} for request {j}; allowed: an integer >= 0 (0: the most likely "
                              "next token).")
    if exclude is None:
        return [None] * n
    if len(exclude) != n:
        raise PluginError(f"{where}: {len(exclude)} excluded tokens for {n} requests; allowed: None, or one token id "
                          "(or None) per request.")
    return [None if e is None else int(e) for e in exclude]


def forced_token(top_ids: Sequence[int], rank: int, exclude: int | None) -> int:
    """The ``rank``-th most likely next token of ``top_ids`` (most likely first) once ``exclude`` is left out; the
    least likely listed one when the list is shorter (a vocabulary smaller than the rank)."""
    ids = [int(t) for t in top_ids if exclude is None or int(t) != exclude] or [int(t) for t in top_ids]
    return ids[min(rank, len(ids) - 1)]
