"""Fleming-R1 — failure-focused mining of persistently failed prompts (arXiv:2509.15279, RL stage 2).

Fleming-R1 trains in two RLVR stages. Stage 1 consolidates the basics on a balanced mix; once the reward turns sparse,
stage 2 evaluates the model on the whole dataset, takes its **repeated failures** as high-priority samples and trains
on a **Right : Wrong = 1 : 2** mix, refreshing that mix as the model improves (an iterative curriculum on its current
weaknesses). Facts from the paper (UbiquantAI/Fleming-R1@9c2219f holds its README and PDF, no training code):
section 3.3 and Figure 2 (stage 1 ``Hard : Simple = 1 : 1``, stage 2 ``Right : Wrong = 1 : 2``), GRPO with a
correctness-plus-format reward.

Here, in one run, the per-prompt history is the evaluation: each prompt's groups are its evaluations. A group is
**failed** when its accuracy on the verifier column is below ``failed_below``; a prompt whose last ``min_failures``
groups all failed is **persistently failed** (pool ``F``; one solved group takes it out again: the curriculum follows
the current weaknesses). From generation batch ``mining_start_batch`` on (stage 2), each chunk of ``B`` prompts holds
``n_wrong = min(round(wrong_share * B), |F|)`` prompts drawn uniformly from ``F`` and ``B - n_wrong`` drawn uniformly
from the other prompts (the "right" part: prompts not persistently failed, unseen ones included); before it (stage 1)
and while ``F`` is empty, chunks are uniform. With ``wrong_share = 0`` TRL's own sampler is kept (vanilla GRPO).

Mechanism: the sampler, the per-chunk outcome ledger and the chunk delay are
:mod:`trl_plugins.components.prompt_history` (shared with ``adaptive_sampler``): chunk ``c`` is drawn with a
generator seeded by ``(seed, c)`` from the outcomes of chunks up to ``c - feedback_delay``, read from the gathered
rewards, so every process draws alike and a resumed run draws what the unbroken run drew.

Reconstructed (no official code): the single-run stage switch (``mining_start_batch``, the paper switches when the
reward plateaus, between two runs), what counts as a failure (``failed_below``, ``min_failures``) and uniform draws
within each pool. Not covered: stage 1's Hard : Simple 1 : 1 mix (dataset preparation with difficulty labels) and
stage 2's larger rollout count (set ``num_generations`` for the stage-2 run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginError, RewardContext, hookimpl, option
from trl_plugins.api.success import SuccessOptions
from trl_plugins.components.prompt_history import (
    HistoryRepeatSampler,
    OutcomeLedger,
    chunk_generator,
    chunk_success,
    default_feedback_delay,
    refuse_iterable_dataset,
)


@dataclass
class FlemingR1Options(SuccessOptions):
    wrong_share: float = option(
        2.0 / 3.0, min=0.0, max=1.0,
        help="Share of each stage-2 batch drawn from the persistently failed prompts (paper: Right : Wrong = 1 : 2); "
        "0 = TRL's own sampler (vanilla GRPO).",
    )
    mining_start_batch: int = option(
        0, min=0,
        help="Generation batches drawn uniformly (stage 1) before the mining starts (stage 2).", reconstructed=True,
    )
    min_failures: int = option(
        2, min=1, help="Consecutive failed groups that make a prompt persistently failed.", reconstructed=True
    )
    failed_below: float = option(
        0.5, min=0.0, max=1.0, min_exclusive=True,
        help="A group fails when the fraction of its rollouts that succeed is below this.", reconstructed=True,
    )
    feedback_delay: int | None = option(
        None, min=1,
        help="Outcomes of chunk c are used from chunk c + feedback_delay on; None = smallest delay the dataloader's "
        "prefetching allows.",
    )

    @property
    def active(self) -> bool:
        return self.wrong_share > 0


def persistent_failures(fail_streak: torch.Tensor, min_failures: int) -> torch.Tensor:
    """(n,) bool: prompts whose last ``min_failures`` groups all failed, from their (n,) consecutive-failure counts."""
    return fail_streak >= min_failures


def mined_chunk(failed: torch.Tensor, size: int, wrong_share: float, generator: torch.Generator) -> tuple[list[int], int]:
    """Draw ``size`` distinct prompt indices: ``min(round(wrong_share * size), |F|)`` uniformly from ``F`` (``failed``,
    (n,) bool), the rest uniformly from the other prompts (from ``F`` as well when too few others remain).

    Returns:
        (indices, n_wrong): the chunk (failed prompts first) and how many of it come from ``F``.
    """
    pool_f = torch.nonzero(failed).flatten()
    rest = torch.nonzero(~failed).flatten()
    n_wrong = min(int(math.floor(wrong_share * size + 0.5)), pool_f.numel())
    f_order = pool_f[torch.randperm(pool_f.numel(), generator=generator)]
    r_order = rest[torch.randperm(rest.numel(), generator=generator)]
    wrong = f_order[:n_wrong]
    right = torch.cat([r_order, f_order[n_wrong:]])[: size - n_wrong]
    return wrong.tolist() + right.tolist(), n_wrong


class FlemingR1Plugin(Plugin):
    """Stage-2 batches mixing persistently failed prompts with the others, Right : Wrong = 1 : 2 (sampling stage)."""

    name = "fleming_r1"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "Fleming-R1: Toward Expert-Level Medical Reasoning via Reinforcement Learning, arXiv:2509.15279"
    summary = "Mines the prompts the policy keeps failing into each batch (Right : Wrong = 1 : 2 after a first stage)."
    Options = FlemingR1Options
    official = OfficialSource(
        None, verdict="reconstructed",
        note="UbiquantAI/Fleming-R1@9c2219f releases the paper and models, no training code; the mining follows the "
        "paper's section 3.3 and Figure 2 (Right : Wrong = 1 : 2); the single-run stage switch, the failure criterion "
        "and the uniform draws within each pool are reconstructed.",
    )
    claim_metric = ("mined_fraction", "batch share drawn from persistent failures")
    replaces = ("the training sampler (which prompts are drawn)",)
    conflicts_with_hooks = {
        "trl_plugins_train_sampler": "both replace the training sampler, and only the last replacement would draw the "
        "prompts (the other's history would no longer match its batches)",
    }
    reconstructed = (
        "one run: stage 2 starts at generation batch mining_start_batch (the paper switches between runs when the "
        "reward plateaus)",
        "a group fails below failed_below accuracy; min_failures consecutive failed groups make a persistent failure",
        "uniform draws within the failed pool and within the other prompts (unseen prompts count as 'right')",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._seed = 0
        self._delay = self.options.feedback_delay or 2
        self._dataset = None
        self._mined: dict[int, int] = {}  # chunk -> how many of its prompts came from the failed pool
        self.reset_state(0)

    def hook_enabled(self, hook: str) -> bool:
        return self.options.active  # wrong_share = 0: TRL's sampler, no hook at all (vanilla GRPO)

    def reset_state(self, num_prompts: int) -> None:
        """Fresh history for ``num_prompts`` prompts."""
        self.fail_streak = torch.zeros(num_prompts, dtype=torch.long)
        self.draws = torch.zeros(num_prompts, dtype=torch.long)
        self.ledger = OutcomeLedger(self.name)

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {"fail_streak": self.fail_streak.clone(), "draws": self.draws.clone(), "ledger": self.ledger.state_dict()}

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        self.fail_streak = state["fail_streak"].clone()
        self.draws = state["draws"].clone()
        self.ledger.load_state_dict(state["ledger"])

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        refuse_iterable_dataset(trainer, self.name)  # (hooks run only when active)
        self._seed = int(args.seed)
        if self.options.feedback_delay is None:
            self._delay = default_feedback_delay(trainer, args)

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        if not self.options.active:
            return None
        self._dataset = dataset
        if self.ledger.batches_seen == 0 and not self.ledger.restored:
            self.reset_state(len(dataset))
        if len(self.fail_streak) != len(dataset):
            raise PluginError(
                f"fleming_r1: its state covers {len(self.fail_streak)} prompts but the training dataset has "
                f"{len(dataset)} (a checkpoint from another dataset?)."
            )
        return HistoryRepeatSampler(self.draw_chunk, len(dataset), sampler.mini_repeat_count, sampler.batch_size,
                                    sampler.repeat_count)

    # ------------------------------------------------------------------------------------------ drawing
    def failed_pool(self) -> torch.Tensor:
        """(n,) bool: the persistently failed prompts as of the outcomes applied so far."""
        return persistent_failures(self.fail_streak, self.options.min_failures)

    def draw_chunk(self, chunk: int, size: int) -> list[int]:
        """Prompt indices of chunk ``chunk`` (``size`` distinct prompts), after applying the outcomes due by then."""
        for outcome in self.ledger.due(chunk, self._delay):
            self._apply(outcome)
        generator = chunk_generator(self._seed, chunk)
        n = len(self.fail_streak)
        if chunk < self.options.mining_start_batch:  # stage 1: uniform
            drawn, mined = torch.randperm(n, generator=generator)[:size].tolist(), 0
        else:
            drawn, mined = mined_chunk(self.failed_pool(), size, self.options.wrong_share, generator)
        self.ledger.drawn(chunk, drawn, self._delay)
        self._mined = {c: m for c, m in self._mined.items() if c in self.ledger.chunks}
        self._mined[chunk] = mined
        return drawn

    def _apply(self, outcome: dict) -> None:
        for idx, accuracy in zip(outcome["indices"], outcome["accuracy"]):
            failed = accuracy < self.options.failed_below
            self.fail_streak[idx] = self.fail_streak[idx] + 1 if failed else 0
            self.draws[idx] += 1

    # ------------------------------------------------------------------------------------------ outcomes
    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Read (never change) the gathered rewards: record the outcome of the chunk this batch was drawn from."""
        if not self.options.active or ctx.mode != "train":
            return
        k = self.ledger.batches_seen
        self.ledger.require_restored(ctx.step)
        chunk = self.ledger.chunks.get(k)
        if chunk is None:
            return  # not drawn by this plugin's sampler (e.g. a custom loop)
        accuracy = chunk_success(ctx, chunk, self.options.success_rule, self._dataset, self.name).mean(dim=1)
        self.ledger.record(k, {"indices": list(chunk), "accuracy": accuracy.tolist()})
        failed = self.failed_pool()
        n = max(len(failed), 1)
        ctx.log_metric("mined_fraction", self._mined.get(k, 0) / max(len(chunk), 1))
        ctx.log_metric("failed_pool_fraction", float(failed.sum()) / n)
        ctx.log_metric("batch_accuracy", float(accuracy.mean()))
        ctx.log_metric("stage", 2.0 if k >= self.options.mining_start_batch else 1.0)
        ctx.log_metric("seen_fraction", float((self.draws > 0).sum()) / n)
