"""Where the thinking phase of a completion ends (shared by ``pear`` and ``funrl``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


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
