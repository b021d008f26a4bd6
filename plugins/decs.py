"""DECS — Decoupled rewards and Curriculum data Scheduling (arXiv:2509.25827).

Overthinking is penalised where it happens: only the *redundant* tokens of a correct completion -- those after the
first chunk (cut before reflection words such as "Wait", "But", one-line chunks merged into the next, the chunking
stopping at ``</think>``) that contains the correct answer, the end of the *necessary reasoning prefix* (NRP), up to
``</think>`` -- lose reward; advantages are normalised per position over the group (reward and
advantage stages); a curriculum keeps all groups with reward variance and ``int(kappa n / (1 - kappa))`` all-correct
ones and drops the others, refilling the batch through the refill stage as the official trainer filters and
resamples (``curriculum_drop="zero_advantage"``: zero their advantages instead, cheaper), ``kappa`` following the
change of the NRP ratio.
The official chunk judge is a fine-tuned 1.5B model asked whether a chunk contains the correct answer; here the judge
is a rule (the reference answer of ``answer_column`` appears in the chunk as a whole token) [reconstructed].

Facts from the official code (pixas/DECS, ``src_valid/reward_manager.py`` chunk split / classification and
``src_valid/valid_ray_trainer.py`` ``compute_grpo_proc_length_advantage_return`` and the kappa schedule; restated):

* A completion is cut into chunks before every token that starts a reflection word (``Wait``, ``But``,
  ``Alternatively``, ``Hmm``, ``Let``, ``Therefore``, with and without a leading space: the first token id of each).
* The chunking stops at ``</think>``: the last chunk is cut before its first ``</think>`` token (the whole completion
  when there is no split token), so the final answer after the reasoning is never in a chunk and never penalised
  (pixas/DECS@0d12e53 ``src_valid/reward_manager.py:78-85``, the tag's first token id at ``:557``).
* A chunk that is not multi-line (no newline token between its first and its last non-newline token, read from both
  ends as the official loop does) is merged into the next chunk; consecutive one-line chunks accumulate until a
  multi-line chunk or the last one (``split_based_on_tokens`` after the ``</think>`` cut; newline tokens: the first
  token ids of the words of :data:`NEWLINE_WORDS`, a line break with or without a leading space or period).
* In a correct completion the first chunk that contains the correct answer ends the NRP; every token from the next
  chunk to the end of the last chunk (the ``</think>`` cut) is redundant. Incorrect completions have no redundant
  tokens. ``think_end: null`` and ``merge_single_line: false`` give the plugin's behaviour before 2026-11-27 (every
  token to the end of the completion can be redundant, no merging), for models without reasoning tags.
* Token rewards: ``s (1 + beta)`` on every position, except the redundant tokens of a correct completion, which get
  ``s + beta (1 - L / L_max)`` (``s`` the outcome score, ``L`` the completion length, ``L_max`` the maximal completion
  length): redundant tokens lose ``beta L / L_max`` (plus ``beta (s - 1)`` for s != 1), more in longer completions.
* Advantages are normalised **per position** over the group's G rows (mean and unbiased std of the token rewards at
  that position, padding positions included, ``+ 1e-6``), then masked.
* Curriculum data schedule (``valid_ray_trainer.py:1534-1603``, DAPO-style filter over generation batches): groups
  with reward variance are kept, all-wrong groups dropped, and ``int(kappa n / (1 - kappa))`` all-correct groups kept
  at random, ``n`` the count of kept varied groups accumulated (over the generation batches, across steps) until the
  allowance is positive, then reset; nothing all-correct is kept while ``kappa <= 0``. Dropped groups are regenerated
  with new prompts until the batch is full (``max_num_gen_batches``). Here: the ``trl_plugins_reject_groups`` hook
  judges each fresh group of every refill round this way and rejects the dropped ones; the trainer refills their slots
  (``max_refill_rounds`` / ``refill_at_limit`` play ``max_num_gen_batches``). ``kappa`` starts at 0 and moves by
  ``kappa_lr (NRP ratio - previous NRP ratio)`` after each batch, the NRP ratio being the mean of
  ``(index of the NRP's last chunk + 1) / number of chunks`` over the correct completions where an NRP was found.
  **[reconstructed]** the official count resets at each epoch start (``:1416``); here it carries on (the plugin does
  not see epochs); ``kappa`` is clamped to [0, 0.99] (officially unbounded).
  ``curriculum_drop="zero_advantage"`` (the plugin's behaviour before 2026-11-27, cheaper: no regeneration) keeps the
  batch and zeroes the advantages of the dropped groups, with ``n`` the batch's varied groups (no carried count).

Correctness: :mod:`trl_plugins_builtin._length`. DECS has no setting equal to vanilla GRPO (its per-position
normalisation differs from TRL's even with ``beta = 0`` and no curriculum): disable the plugin for that.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginError,
    RefillContext,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS, REFILLS_GROUPS
from trl_plugins.api.success import SuccessRule
from trl_plugins.api.reasons import IMAGES_REFILL

from ._length import CorrectnessOptions, check_reward_columns, local_completion_ids

#: The official split words (their first token id cuts chunks).
SPLIT_WORDS = ("Wait", " Wait", "But", " But", "Alternatively", " Alternatively", "Hmm", " Hmm", "Let", " Let",
               "Therefore", " Therefore")
#: The official newline words (their first token id marks a line break when merging one-line chunks).
NEWLINE_WORDS = ("\n", " \n", "\n\n", " \n\n", ".\n", ".\n\n")


@dataclass
class DecsOptions(CorrectnessOptions):
    answer_column: str = option(
        "answer", help="Dataset column with the reference answer (a chunk containing it ends the necessary reasoning "
        "prefix).",
    )
    beta: float = option(0.1, min=0.0, help="Length-reward weight beta (official default length_reward_beta=0.1).")
    split_words: list[str] = option(
        default_factory=lambda: list(SPLIT_WORDS),
        help="Words whose first token starts a new chunk (official: Wait, But, Alternatively, Hmm, Let, Therefore, "
        "with and without a leading space).",
    )
    think_end: str | None = option(
        "</think>",
        help="Tag whose first token ends the chunking: the last chunk is cut before it, so the final answer is never "
        "redundant (official, pixas/DECS@0d12e53 reward_manager.py:78-85, 557). null: chunks run to the end of the "
        "completion (for models without reasoning tags).",
    )
    merge_single_line: bool = option(
        True,
        help="Merge a chunk with no inner line break into the next chunk (official); false: every split token starts "
        "a chunk.",
    )
    newline_words: list[str] = option(
        default_factory=lambda: list(NEWLINE_WORDS),
        help="Words whose first token is a line break for merge_single_line (official: \\n, ' \\n', \\n\\n, "
        "' \\n\\n', '.\\n', '.\\n\\n').",
    )
    curriculum: bool = option(
        True, help="Curriculum data schedule (keep the varied groups and int(kappa n / (1 - kappa)) all-correct ones; "
        "drop the others and the all-wrong ones, see curriculum_drop).",
    )
    curriculum_drop: Literal["refill", "zero_advantage"] = option(
        "refill",
        help="How the curriculum drops groups. refill (official: filter and resample): reject them through the refill "
        "stage, the trainer regenerates their slots with new prompts (max_refill_rounds, refill_at_limit); "
        "zero_advantage: keep them with zero advantages (cheaper; no regeneration; n = this batch's varied groups).",
    )
    kappa_lr: float = option(
        0.2, min=0.0, help="kappa += kappa_lr * (NRP ratio - previous NRP ratio) after each batch (official 0.2).",
    )


def chunk_starts(ids: list[int], split_ids: set[int]) -> list[int]:
    """Start positions of the chunks of one completion: 0 and every position > 0 holding a split token id."""
    return [0] + [i for i, token in enumerate(ids) if i > 0 and token in split_ids] if ids else []


def _has_inner_break(chunk: list[int], newline_ids: set[int]) -> bool:
    """The official multi-line test of one chunk: read from the front, a newline token after a non-newline token;
    and read from the back, a newline token before a non-newline token."""
    def broken(tokens) -> bool:
        started = False
        for token in tokens:
            if token in newline_ids:
                if started:
                    return True
            else:
                started = True
        return False

    return broken(chunk) and broken(reversed(chunk))


def official_chunks(ids: list[int], split_ids: set[int], newline_ids: set[int] | None = None,
                    end_id: int | None = None) -> list[tuple[int, int]]:
    """(start, end) spans of the chunks of one completion, as the official chunker cuts them: before every split token
    (not at 0); the last chunk cut before its first ``end_id`` token (``</think>``); with ``newline_ids``, a chunk
    without an inner line break merged into the next one (the last chunk always closes the merge). ``end_id=None``
    and ``newline_ids=None``: the plain split to the end of the completion (:func:`chunk_starts`)."""
    starts = chunk_starts(ids, split_ids)
    if not starts:
        return []
    spans = [(a, b) for a, b in zip(starts, starts[1:] + [len(ids)])]
    if end_id is not None:
        a, b = spans[-1]
        if end_id in ids[a:b]:
            spans[-1] = (a, a + ids[a:b].index(end_id))
    if newline_ids is None:
        return spans
    merged, pending = [], None
    for j, (a, b) in enumerate(spans):
        start = a if pending is None else pending
        if j < len(spans) - 1 and not _has_inner_break(ids[a:b], newline_ids):
            pending = start
            continue
        merged.append((start, b))
        pending = None
    return merged


def contains_answer(text: str, answer: str) -> bool:
    """Rule chunk judge: ``answer`` appears in ``text`` as a whole token (not inside a longer number or word)."""
    answer = answer.strip()
    if not answer:
        return False
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w])", text) is not None


def nrp_split(starts: list[int], has_answer: list[bool], length: int) -> tuple[int, float]:
    """(start of the redundant tail or -1, NRP ratio or 0.0) of one correct completion from its chunks' verdicts."""
    first = next((j for j, yes in enumerate(has_answer) if yes), -1)
    if first == -1:
        return -1, 0.0
    ratio = (first + 1) / len(starts)
    tail = starts[first + 1] if first + 1 < len(starts) else -1
    return (tail if 0 <= tail < length else -1), ratio


def redundant_span(spans: list[tuple[int, int]], has_answer: list[bool]) -> tuple[int, int, float]:
    """(first redundant position or -1, end of the redundant span, NRP ratio or 0.0) of one correct completion from
    its chunk spans and their verdicts: the chunks after the first one with the answer, to the end of the last chunk
    (official: the first to the last negative chunk delta)."""
    first = next((j for j, yes in enumerate(has_answer) if yes), -1)
    if first == -1:
        return -1, 0, 0.0
    ratio = (first + 1) / len(spans)
    if first + 1 >= len(spans) or spans[first + 1][0] >= spans[-1][1]:
        return -1, 0, ratio
    return spans[first + 1][0], spans[-1][1], ratio


def decs_token_rewards(scores: torch.Tensor, redundant_start: torch.Tensor, lengths: torch.Tensor, width: int,
                       max_length: int, beta: float, redundant_end: torch.Tensor | None = None) -> torch.Tensor:
    """DECS token rewards (N, width).

    Args:
        scores: (N,) outcome scores. redundant_start: (N,) first redundant position, -1 when none (incorrect rows and
            rows without an NRP tail). lengths: (N,) completion lengths. width: T. max_length: L_max. beta: the
            length-reward weight. redundant_end: (N,) end (exclusive) of the redundant span (default: ``lengths``).
    """
    N = scores.numel()
    base = (scores.float() * (1 + beta)).unsqueeze(1).expand(N, width).clone()
    positions = torch.arange(width, device=scores.device).expand(N, width)
    end = lengths if redundant_end is None else torch.minimum(redundant_end, lengths)
    redundant = (redundant_start.unsqueeze(1) >= 0) & (positions >= redundant_start.unsqueeze(1)) \
        & (positions < end.unsqueeze(1))
    shaped = (scores.float() + beta * (1 - lengths.float() / max_length)).unsqueeze(1).expand(N, width)
    return torch.where(redundant, shaped, base)


def per_position_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_size: int,
                            eps: float = 1e-6) -> torch.Tensor:
    """Group normalisation per position (N, T): ``(r - mean_g(r_t)) / (std_g(r_t) + eps) * mask``; size-1 groups use
    mean 0 and std 1 (official)."""
    N, T = token_rewards.shape
    grouped = token_rewards.view(-1, group_size, T)
    if group_size == 1:
        mean, std = torch.zeros_like(grouped[:, :1]), torch.ones_like(grouped[:, :1])
    else:
        mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(N, T) * mask


def curriculum_select(rewards: torch.Tensor, group_size: int, kappa: float, carried: int,
                      generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """The official curriculum filter of one generation batch: ``((groups,) bool kept, carried count)``.

    Kept: every group with reward variance and, when ``kappa > 0``, ``int(kappa c / (1 - kappa))`` all-correct groups
    (reward mean > 0, no variance) at random, ``c = carried + varied groups``; ``c`` is carried to the next batch while
    the allowance is 0 and reset once it is positive (pixas/DECS@0d12e53 valid_ray_trainer.py:1545-1570). ``kappa`` is
    clamped to at most 0.99."""
    grouped = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    varied = grouped.std(dim=1, unbiased=False) > 0 if group_size > 1 else torch.ones(grouped.size(0), dtype=bool)
    easy = (~varied) & (grouped.mean(dim=1) > 0)
    keep = varied.clone()
    if kappa > 0:
        kappa = min(kappa, 0.99)
        carried += int(varied.sum())
        allowed = int(kappa * carried / (1 - kappa))
        if allowed > 0:
            carried = 0
        allowed = min(allowed, int(easy.sum()))
        if allowed > 0:
            easy_ids = torch.nonzero(easy).squeeze(1)
            keep[easy_ids[torch.randperm(easy_ids.numel(), generator=generator)[:allowed]]] = True
    return keep, carried


def curriculum_keep(rewards: torch.Tensor, group_size: int, kappa: float, generator: torch.Generator) -> torch.Tensor:
    """(num_groups,) bool: the groups the curriculum keeps (all with reward variance, ``int(kappa n / (1 - kappa))``
    all-correct ones at random, no all-wrong one). ``kappa`` is clamped to [0, 0.99]."""
    grouped = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    varied = grouped.std(dim=1, unbiased=False) > 0 if group_size > 1 else torch.ones(grouped.size(0), dtype=bool)
    easy = (~varied) & (grouped.mean(dim=1) > 0)
    keep = varied.clone()
    kappa = min(max(kappa, 0.0), 0.99)
    allowed = min(int(kappa * int(varied.sum()) / (1 - kappa)), int(easy.sum()))
    if allowed > 0:
        easy_ids = torch.nonzero(easy).squeeze(1)
        chosen = easy_ids[torch.randperm(easy_ids.numel(), generator=generator)[:allowed]]
        keep[chosen] = True
    return keep


class DecsPlugin(Plugin):
    """DECS: penalties on the redundant tokens after the first correct answer only, per-position advantages and the
    curriculum (reward and advantage stages)."""

    name = "decs"
    image_inputs = IMAGES_REFILL
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.2.0"
    paper = "Overthinking Reduction with Decoupled Rewards and Curriculum Data Scheduling (DECS), arXiv:2509.25827"
    summary = ("Penalises only the tokens after the first correct answer (per-position advantages), with a curriculum "
               "over all-correct groups.")
    Options = DecsOptions
    official = OfficialSource(
        "pixas/DECS", "0d12e53", verdict="faithful",
        files=("src_valid/reward_manager.py", "src_valid/valid_ray_trainer.py"),
        note="The chunk judge is a rule (the reference answer in the chunk); officially a fine-tuned 1.5B judge.",
        variants=("think_end", "merge_single_line", "curriculum_drop"),
    )
    claim_metric = ("redundant_fraction", "correct responses with a redundant tail")
    reconstructed = (
        "the chunk judge is a rule (the reference answer appears in the chunk); official: a fine-tuned 1.5B judge",
        "the curriculum's carried count of varied groups does not reset at epoch starts; kappa clamped to [0, 0.99]",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.kappa, self.last_nrp_ratio = 0.0, 0.5  # curriculum (official initial values)
        self._batch: list | None = None  # (first redundant position, span end, NRP ratio) per row of the batch
        self._split_ids: set[int] | None = None
        self._newline_ids: set[int] | None = None
        self._end_id: int | None = None
        self._generator = torch.Generator().manual_seed(0)
        self.carried_kept = 0  # the official cur_batch_kept_num (curriculum_drop="refill")

    def required_columns(self) -> list[str]:
        return [self.options.answer_column]

    def _refills(self) -> bool:
        return self.options.curriculum and self.options.curriculum_drop == "refill"

    def hook_enabled(self, hook: str) -> bool:
        return hook != "trl_plugins_reject_groups" or self._refills()

    def multi_turn_refusal(self) -> str | None:
        return REFILLS_GROUPS if self._refills() else super().multi_turn_refusal()

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext) -> None:
        """The curriculum filter on each fresh group (the combined outcome reward, as the advantage stage's scores)."""
        fresh = ctx.fresh.cpu()
        if not bool(fresh.any()):
            return
        G = ctx.num_generations
        rewards = ctx.group_rewards().cpu()[fresh]
        keep, self.carried_kept = curriculum_select(rewards, G, self.kappa, self.carried_kept, self._generator)
        slots = fresh.nonzero().flatten()
        ctx.reject(slots[~keep].tolist())
        if ctx.round == 0:
            ctx.log_metric("kept_group_fraction", float(keep.float().mean()))

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        self._generator.manual_seed(int(getattr(args, "seed", 0)))
        check_reward_columns(self.name, trainer, self.options)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        local_completion_ids(ctx, self.name)
        self._batch = ctx.gather_object([self._row(ctx, i) for i in range(len(ctx.local_rows))])

    def _first_ids(self, tokenizer, words) -> set[int]:
        """The first token id of each word (the official way to find split / newline tokens)."""
        ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
        return {x[0] for x in ids if x}

    def _row(self, ctx: RewardContext, i: int) -> tuple[int, int, float]:
        """(first redundant position or -1, end of the redundant span, NRP ratio) of local row ``i`` (rule chunk judge
        on the answer column)."""
        o, tokenizer = self.options, ctx.tokenizer
        if self._split_ids is None:
            self._split_ids = self._first_ids(tokenizer, o.split_words)
            self._newline_ids = self._first_ids(tokenizer, o.newline_words) if o.merge_single_line else None
            end = tokenizer.encode(o.think_end, add_special_tokens=False) if o.think_end else []
            self._end_id = end[0] if end else None
        ids = list(ctx.local_completion_ids[i])
        spans = official_chunks(ids, self._split_ids, self._newline_ids, self._end_id)
        answer = str(ctx.local_rows[i].get(o.answer_column, ""))
        verdicts = [contains_answer(tokenizer.decode(ids[a:b], skip_special_tokens=True), answer) for a, b in spans]
        return redundant_span(spans, verdicts) if spans else (-1, 0, 0.0)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if self._batch is None or len(self._batch) != ctx.rewards.numel():
            raise PluginError(f"{self.name}: the reward stage did not record this batch's chunks.")
        G = ctx.num_generations
        mask = ctx.completion_mask().float()
        device = mask.device
        correct = torch.nan_to_num(ctx.verifier(SuccessRule(o.correctness_column)).float(), nan=-math.inf) \
            >= o.correct_threshold
        starts = torch.tensor([s for s, _, _ in self._batch], device=device)
        ends = torch.tensor([e for _, e, _ in self._batch], device=device)
        ratios = torch.tensor([r for _, _, r in self._batch], device=device)
        starts = torch.where(correct.to(device), starts, torch.full_like(starts, -1))
        scores = torch.nan_to_num(ctx.rewards.float(), nan=0.0).to(device)
        token_rewards = decs_token_rewards(scores, starts, mask.sum(-1).long(), mask.size(1), self.max_len, o.beta,
                                           redundant_end=ends)
        advantages = per_position_advantages(token_rewards, mask, G)
        if o.curriculum and not self._refills():
            keep = curriculum_keep(scores, G, self.kappa, self._generator).to(device)
            advantages = advantages * keep.repeat_interleave(G).unsqueeze(1).float()
            ctx.log_metric("kept_group_fraction", keep.float().mean().item())
        ctx.advantages = advantages.to(ctx.advantages.dtype)
        found = ratios[correct.to(device) & (ratios > 0)]
        ratio = float(found.mean()) if found.numel() else 0.0
        if ctx.mode == "train" and o.curriculum:
            if self.last_nrp_ratio != 0:
                self.kappa += (ratio - self.last_nrp_ratio) * o.kappa_lr
            self.last_nrp_ratio = ratio
        ctx.log_metric("nrp_ratio", ratio)
        ctx.log_metric("redundant_fraction", float(((starts >= 0).float()).mean()))
        ctx.log_metric("kappa", self.kappa)
        self._batch = None

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"kappa": self.kappa, "last_nrp_ratio": self.last_nrp_ratio, "carried_kept": self.carried_kept,
                "generator": self._generator.get_state().tolist()}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.kappa = float(state.get("kappa", 0.0))
        self.carried_kept = int(state.get("carried_kept", 0))
        self.last_nrp_ratio = float(state.get("last_nrp_ratio", 0.5))
        if "generator" in state:
            self._generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
