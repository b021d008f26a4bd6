"""An exclusive file lock, so that processes started together build or convert a cached artefact once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["exclusive_file_lock"]


@contextlib.contextmanager
def exclusive_file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created with its folder if missing) for the ``with`` block (POSIX
    ``flock``; on Windows no lock is taken, and callers' atomic renames still keep their caches whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
