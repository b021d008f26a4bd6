"""Per-prompt outcome history behind a replacement training sampler, for plugins that choose *which* prompts TRL draws.

A history sampler draws each chunk of ``generation_batch_size / G`` prompt indices from the outcomes of earlier
chunks. Three pieces make such draws identical on every process and across a resume:

* :class:`HistoryRepeatSampler` keeps the layout of TRL's ``RepeatSampler`` (each index G times in a row, each chunk
  ``repeat_count`` times, the same length per epoch) and asks its ``draw_chunk(chunk, size)`` callback for the indices
  of chunk ``c`` only when the dataloader first needs it; :func:`chunk_generator` seeds the draw of chunk ``c`` from
  ``(seed, c)`` alone.
* :class:`OutcomeLedger` remembers which prompts each chunk drew and holds each chunk's outcome (read at the reward
  stage from the **gathered** rewards, so identical on every process) until chunk ``c + delay`` is drawn: the
  dataloader draws ahead of training (TRL pulls a whole optimizer step of batches, accelerate prefetches one more),
  and :func:`default_feedback_delay` is the smallest delay that prefetching allows.
* :func:`chunk_success` reads a generation batch's success matrix (``(prompts, G)`` on the verifier column) and checks,
  on every process together, that the batch holds the prompts its chunk drew.

Used by ``adaptive_sampler`` (the sampler layout) and ``fleming_r1`` (all of it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.api.success import SuccessRule


def chunk_generator(seed: int, chunk: int) -> torch.Generator:
    """The generator that draws chunk ``chunk`` of a run seeded with ``seed`` (a function of both alone)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + chunk * 7_919 + 12_345) % (2**63 - 1))
    return g


def default_feedback_delay(trainer: Any, args: Any) -> int:
    """Smallest chunk delay the dataloader's prefetching allows: batches drawn ahead of the one being trained
    (``gradient_accumulation_steps``, plus the workers' prefetch) over the times each chunk is yielded, plus one."""
    repeat = max(1, trainer.num_iterations * args.steps_per_generation)
    ahead = args.gradient_accumulation_steps
    if args.dataloader_num_workers > 0:
        ahead += args.dataloader_num_workers * (args.dataloader_prefetch_factor or 2)
    return ahead // repeat + 1


def refuse_iterable_dataset(trainer: Any, owner: str) -> None:
    """Refuse an iterable training dataset (TRL attaches no sampler to it, so none can be replaced)."""
    from torch.utils.data import IterableDataset

    if isinstance(trainer.train_dataset, IterableDataset):
        raise PluginConfigError(
            f"{owner} needs a map-style training dataset (TRL attaches no sampler to an IterableDataset)."
        )


def warn_lagging_feedback(owner: str, chunk: int, due: int) -> None:
    """Warn that chunk ``chunk`` is drawn before the outcome of chunk ``due`` is known."""
    warnings.warn(
        f"{owner}: chunk {chunk} is drawn before the outcome of chunk {due} is known; increase feedback_delay (draws "
        "stay identical across processes, but a resumed run may differ).",
        stacklevel=4,
    )


def refuse_unrestored_resume(owner: str, step: int) -> None:
    """Refuse a run resumed at ``step`` whose checkpoint did not bring the history plugin's state."""
    raise PluginError(
        f"{owner}: training resumed at step {step} without this plugin's saved state (the checkpoint was saved by a "
        f"run without {owner}, or its trl_plugins_state.pt is missing), so the sampler's draws no longer line up "
        f"with the batches. Resume from a checkpoint saved with {owner} enabled, or start a new run "
        "(resume_from_checkpoint unset) from those weights."
    )


class HistoryRepeatSampler(Sampler):
    """TRL's ``RepeatSampler`` layout with each chunk's prompts drawn by ``draw_chunk(chunk, batch_size)``.

    Each chunk of ``batch_size`` prompt indices is drawn lazily, when the dataloader first needs it; each index is
    yielded ``mini_repeat_count`` times in a row, each chunk ``repeat_count`` times; an epoch has as many chunks as
    TRL's sampler would (``num_samples // batch_size``), and epoch ``e`` starts at chunk ``e * chunks_per_epoch``.
    """

    def __init__(self, draw_chunk: Callable[[int, int], list[int]], num_samples: int, mini_repeat_count: int,
                 batch_size: int, repeat_count: int):
        self.draw_chunk = draw_chunk
        self.num_samples = num_samples
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.epoch: int | None = None
        self._iterations = 0

    @property
    def chunks_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch if self.epoch is not None else self._iterations
        self._iterations += 1
        for j in range(self.chunks_per_epoch):
            chunk = self.draw_chunk(epoch * self.chunks_per_epoch + j, self.batch_size)
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return self.chunks_per_epoch * self.batch_size * self.mini_repeat_count * self.repeat_count


class OutcomeLedger:
    """Which prompts each chunk drew, and each chunk's outcome until it is due (``delay`` chunks later).

    ``batches_seen`` counts the generation batches whose outcome was recorded (batch ``k`` was drawn as chunk ``k``);
    ``restored`` is set by :meth:`load_state_dict`, so a plugin can refuse a resume that lost this state.
    """

    def __init__(self, owner: str):
        self.owner = owner
        self.chunks: dict[int, list[int]] = {}
        self.pending: dict[int, dict] = {}
        self.batches_seen = 0
        self.restored = False
        self._lag_warned = False

    def drawn(self, chunk: int, indices: list[int], delay: int) -> None:
        """Remember the indices of ``chunk`` (older chunks than any outcome can still need are forgotten)."""
        self.chunks[chunk] = list(indices)
        for old in [c for c in self.chunks if c < chunk - delay - 8]:
            del self.chunks[old]

    def due(self, chunk: int, delay: int) -> list[dict]:
        """Pop the outcomes to apply before drawing ``chunk`` (those of chunks ``<= chunk - delay``, oldest first);
        warns once when the outcome of ``chunk - delay`` is not known yet (the draws then lag, alike on every
        process, but a resumed run may differ)."""
        limit = chunk - delay
        if limit >= 0 and self.batches_seen <= limit and not self._lag_warned:
            warn_lagging_feedback(self.owner, chunk, limit)
            self._lag_warned = True
        return [self.pending.pop(c) for c in sorted(k for k in self.pending if k <= limit)]

    def record(self, k: int, outcome: dict) -> None:
        self.pending[k] = outcome
        self.batches_seen = k + 1

    def require_restored(self, step: int) -> None:
        """Refuse a run resumed at ``step`` > 0 whose checkpoint did not bring this ledger."""
        if self.batches_seen == 0 and step > 0 and not self.restored:
            refuse_unrestored_resume(self.owner, step)

    def state_dict(self) -> dict:
        return {"chunks": {int(k): list(v) for k, v in self.chunks.items()},
                "pending": {int(k): dict(v) for k, v in self.pending.items()}, "batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict) -> None:
        self.chunks = {int(k): list(v) for k, v in state["chunks"].items()}
        self.pending = {int(k): dict(v) for k, v in state["pending"].items()}
        self.batches_seen = int(state["batches_seen"])
        self.restored = True


def chunk_success(ctx: Any, chunk: list[int], rule: SuccessRule, dataset: Any, owner: str) -> torch.Tensor:
    """``(len(chunk), G)`` float success of the generation batch drawn as ``chunk`` (verifier column, gathered rows).

    Refuses, on every process together, a batch whose size is not ``len(chunk) * G`` or whose local rows are not the
    chunk's prompts (compared on the ``prompt`` column of ``dataset``; no check without a dataset). Collective: every
    process must call it.
    """
    G = ctx.num_generations
    success = ctx.success(rule).cpu()  # (N,) on the verifier column only
    if success.numel() != len(chunk) * G:
        raise PluginError(
            f"{owner}: a generation batch has {success.numel()} rows but its chunk holds {len(chunk)} prompts x {G} "
            "generations."
        )
    if dataset is not None:
        start = ctx.process_slice.start
        flags = [row.get("prompt") == dataset[chunk[(start + j) // G]].get("prompt")
                 for j, row in enumerate(ctx.local_rows)]
        if not all(ctx.gather_object(flags)):
            raise PluginError(
                f"{owner}: the generation batch does not hold the prompts its sampler drew (another plugin or a "
                "custom dataloader changed the order, or train() was called again on the same trainer: build a new "
                "trainer for a new run)."
            )
    return success.double().view(-1, G)
