"""Shared rollout buffer of ``replay`` (SPEAR / RAPO) and ``r2vpo``: stored rollouts under integer keys, newest last.

A plugin keeps one :class:`RolloutBuffer` and updates it only from gathered data (the same calls on every process),
so the buffer is **identical on every process**: a stored rollout can be replayed into any row whatever process
sampled it, and the checkpoint written by the main process (``trl_plugins_state_dict``) holds the whole buffer.

Entries are plain dicts (checkpointable with ``torch.load(weights_only=True)``): ``"step"`` (the optimizer step at
which the rollout was stored) plus the plugin's own fields: lists of ints and floats or CPU tensors (token ids,
log-probs; replay's batch placement keeps tensors, about 8 times less memory than lists) or prompts (strings /
message lists). Stored tensors are never changed in place, so a copy of an entry may share them.
"""

from __future__ import annotations


def _copy_entry(entry: dict) -> dict:
    """A copy of ``entry`` whose list values are copied too (a stored entry never aliases a caller's list)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in entry.items()}


class RolloutBuffer(dict):
    """``{key: [entry, ...]}`` newest last; a dict, so ``buffer == {}`` and ``buffer.values()`` read as before."""

    def add(self, key: int, entry: dict, limit: int | None = None) -> dict:
        """Append ``entry`` under ``key``, keeping the newest ``limit`` entries of the key (None: all); returns it."""
        entries = self.setdefault(int(key), [])
        entries.append(entry)
        if limit is not None:
            del entries[: max(len(entries) - limit, 0)]
        return entry

    def evict(self, step: int, max_age: int | None) -> None:
        """Drop entries stored more than ``max_age`` optimizer steps before ``step`` (and keys left empty); None: none."""
        if max_age is None:
            return
        for key in list(self):
            kept = [e for e in self[key] if step - e["step"] <= max_age]
            if kept:
                self[key] = kept
            else:
                del self[key]

    def total(self) -> int:
        """Entries held under every key."""
        return sum(len(v) for v in self.values())

    def state(self) -> dict:
        """A checkpointable copy: ``{int key: [entry dict, ...]}``."""
        return {int(k): [_copy_entry(e) for e in v] for k, v in self.items()}

    @classmethod
    def from_state(cls, state: dict) -> RolloutBuffer:
        """The buffer saved by :meth:`state` (keys back to ints: a JSON round trip makes them strings)."""
        return cls({int(k): [_copy_entry(e) for e in v] for k, v in state.items()})
