"""LASER — Length-bAsed StEp Reward, with LASER-D and LASER-DE (arXiv:2505.15612).

Shortens chains of thought through the reward alone (``variant``):

* **LASER**: ``R = C(y) + alpha * 1[y correct] * 1[L(y) <= L_T]``, a step bonus for correct responses within a target
  length ``L_T``. The bonus is written to the plugin's own reward column (named after the plugin; TRL's reward weights
  and aggregation apply); ``C(y)`` is the correctness column.
* **LASER-D** (dynamic and difficulty-aware, the default): the target depends on the prompt's difficulty band (from
  the group's accuracy: easy / medium / hard) and adapts during training. As in the official code
  (``target_estimator="coverage"``), a band's target is the smallest candidate budget ``L`` with
  ``floor(coverage(L) * n_band) >= ecr_min``, where ``coverage(L)`` is the fraction of the band's rollouts (correct
  or not) no longer than ``L`` and ``n_band`` is ``floor(2G/3)`` for easy, ``floor(G/3)`` for medium and 1 for hard
  prompts: easy prompts get short budgets, hard prompts keep a budget covering all their rollouts (in practice the
  full budget). ``target_estimator="ecr"`` is this project's earlier estimator (smallest ``L`` with
  ``G * P(correct and length <= L) >= ecr_min``; not official: it can cut hard prompts short).
* **LASER-DE** also rewards *incorrect* responses for exploring beyond the target (``alpha * 1[L > L_A]``), as the
  official code does, only when they are well formatted (``format_column > 0``; without it: finished, i.e. not cut
  off at ``max_completion_length``) and **not repetitive** (the official token n-gram repetition test,
  :func:`is_repetitive`); ``explore_gate="none"`` pays every long wrong answer (not official).

Lengths and correctness: :mod:`trl_plugins_builtin._length`. ``alpha = 0`` is the neutral setting (an all-zero
column).

Reconstructed (the paper gives no numbers; every one is an option marked reconstructed): ``alpha = 0.5``, the
default LASER target (half of ``max_completion_length``), the difficulty edges (accuracy <= 1/3 hard, > 2/3 easy),
the candidate budget grid (8 equal steps up to ``max_completion_length``), ECR estimated online from the last
``window`` generation batches of training rollouts (the official code reads coverage from a periodic monitoring
run), the initial targets (``max_completion_length``), LASER-DE's "well formatted" without a format column (finished).

Official code checked against: ``hkust-nlp/Laser@c9e7c4e`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show laser``, docs/faithfulness.md).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS
from trl_plugins.api.success import placeholder_column

from ._length import (
    CorrectnessOptions,
    check_reward_columns,
    correct_rows,
    eos_ids,
    group_accuracy,
    is_unfinished,
    local_completion_ids,
)


@dataclass
class LaserOptions(CorrectnessOptions):
    variant: Literal["laser", "laser_d", "laser_de"] = option(
        "laser_d",
        help="laser: fixed-target step bonus; laser_d: adaptive difficulty-aware targets; laser_de: plus an "
        "exploration bonus for long wrong answers.",
    )
    alpha: float = option(0.5, min=0.0, help="Size of the LASER step bonus.", reconstructed=True)
    target_length: int | None = option(
        None, min=1, help="variant laser: the fixed target L_T in tokens (default: max_completion_length // 2).",
        reconstructed=True,
    )
    num_budgets: int = option(
        8, min=1, help="LASER-D candidate budgets: max_completion_length * j / num_budgets, j = 1..num_budgets.",
        reconstructed=True,
    )
    target_estimator: Literal["coverage", "ecr"] = option(
        "coverage",
        help="LASER-D target per difficulty band. 'coverage' (official _choose_target_length): the smallest budget L "
        "with floor(coverage(L) * n_band) >= ecr_min, coverage(L) = fraction of the band's rollouts with length <= L, "
        "n_band = floor(2G/3) easy, floor(G/3) medium, 1 hard (so hard prompts keep a budget covering all their "
        "rollouts). 'ecr': smallest L with G * P(correct and length <= L) >= ecr_min (not official).",
    )
    ecr_min: float = option(
        1.0, min=0.0, min_exclusive=True,
        help="LASER-D: expected number of responses within the budget that the target must keep (official: 1).",
    )
    explore_gate: Literal["formatted_non_repetitive", "none"] = option(
        "formatted_non_repetitive",
        help="LASER-DE: which wrong answers longer than the target earn the exploration bonus. Official: only "
        "well-formatted (see format_column), finished, non-repetitive ones (token n-gram repetition check); 'none': "
        "every long wrong answer, truncated and repetitive ones included (not official).",
    )
    format_column: str | None = option(
        None,
        help="LASER-DE: reward column whose value > 0 marks a well-formatted answer (official: the answer could be "
        "extracted). None: every finished (not truncated) answer counts as well formatted [reconstructed].",
    )
    difficulty_edges: list[float] = option(
        default_factory=lambda: [1 / 3, 2 / 3],
        help="Group-accuracy edges [hard_max, medium_max]: acc <= hard_max is hard, > medium_max is easy.",
        reconstructed=True,
    )
    window: int = option(
        4, min=1, help="LASER-D: ECR is estimated on the rollouts of the last `window` generation batches.",
        reconstructed=True,
    )

    def validate(self) -> None:
        edges = self.difficulty_edges
        if len(edges) != 2 or not (0.0 <= edges[0] <= edges[1] <= 1.0):
            raise PluginConfigError(
                f"Option 'difficulty_edges' of plugin 'laser' got {edges!r}; allowed: two accuracies "
                "[hard_max, medium_max] with 0 <= hard_max <= medium_max <= 1."
            )


# --------------------------------------------------------------------------------------------- pure functions
def laser_bonus(lengths: torch.Tensor, correct: torch.Tensor, targets: torch.Tensor, alpha: float,
                explore: bool = False, explorable: torch.Tensor | None = None) -> torch.Tensor:
    """LASER step bonus per row: ``alpha * 1[correct] * 1[L <= target]`` (+ ``alpha * 1[wrong] * 1[L > target]
    * 1[explorable]`` with ``explore``, LASER-DE).

    Args: lengths (N,), correct (N,) bool, targets (N,) per-row target lengths, explorable (N,) bool: wrong answers
    allowed the exploration bonus (LASER-DE's official gate: well formatted and not repetitive; None = all).
    Returns (N,) float.
    """
    within = lengths <= targets
    bonus = (correct & within).float() * alpha
    if explore:
        eligible = (~correct) & (~within)
        if explorable is not None:
            eligible = eligible & explorable
        bonus = bonus + eligible.float() * alpha
    return bonus


def is_repetitive(ids: list[int]) -> bool:
    """LASER-DE's repetition test on a completion's token ids (the facts of the official detector).

    Sequences of at most 8 tokens never repeat. The n-gram size grows with the length ``L`` (2 below 30 tokens, 3
    below 100, else 4) and so does the count that flags it (2 below 200 tokens, else 3). A completion is repetitive
    when an n-gram -- not made of one token repeated, for n > 2 -- occurs at least that many times with two
    consecutive occurrences closer than ``L // 3`` tokens, or when a 2n-token pattern occurs twice (``L >= 4n``).
    """
    L = len(ids)
    if L <= 8:
        return False
    n = 2 if L < 30 else 3 if L < 100 else 4
    needed = 2 if L < 200 else 3
    positions: dict[tuple, list[int]] = {}
    for i in range(L - n + 1):
        gram = tuple(ids[i:i + n])
        if n > 2 and len(set(gram)) == 1:
            continue
        positions.setdefault(gram, []).append(i)
    for found in positions.values():
        if len(found) >= needed and any(b - a < L // 3 for a, b in itertools.pairwise(found)):
            return True
    if L >= 4 * n:
        seen = set()
        for i in range(L - 2 * n + 1):
            pattern = tuple(ids[i:i + 2 * n])
            if pattern in seen:
                return True
            seen.add(pattern)
    return False


def difficulty_buckets(accuracy: torch.Tensor, edges: tuple[float, float]) -> torch.Tensor:
    """Bucket per group from its accuracy: 0 = easy (acc > edges[1]), 1 = medium, 2 = hard (acc <= edges[0])."""
    hard = accuracy <= edges[0]
    easy = accuracy > edges[1]
    return torch.where(easy, 0, torch.where(hard, 2, 1)).long()


def ecr_target(lengths: torch.Tensor, correct: torch.Tensor, budgets: list[int], group_size: int,
               ecr_min: float) -> int:
    """Smallest budget ``L`` with ``G * P(correct and length <= L) >= ecr_min`` (P over the given rollouts);
    the largest budget when none qualifies or there are no rollouts."""
    n = lengths.numel()
    if n == 0:
        return budgets[-1]
    for budget in budgets:
        p = float(((lengths <= budget) & correct).sum()) / n
        if group_size * p >= ecr_min - 1e-12:
            return budget
    return budgets[-1]


def coverage_target(lengths: torch.Tensor, budgets: list[int], band_size: int, expected: float) -> int:
    """LASER-D's official target of one difficulty band: the smallest budget ``L`` with
    ``floor(coverage(L) * band_size) >= expected``, ``coverage(L)`` = fraction of the band's rollouts (correct or not)
    of length <= L; the largest budget when none qualifies or the band has no rollout.

    ``band_size``: floor(2G/3) for easy prompts, floor(G/3) for medium ones, 1 for hard ones (which therefore need
    every rollout covered: hard prompts keep the budget of their longest rollout).
    """
    n = lengths.numel()
    if n == 0:
        return budgets[-1]
    for budget in budgets:
        coverage = float((lengths <= budget).sum()) / n
        if int(coverage * band_size + 1e-9) >= expected - 1e-12:
            return budget
    return budgets[-1]


def band_sizes(group_size: int) -> tuple[int, int, int]:
    """``n_band`` of the easy, medium and hard bands for :func:`coverage_target` (the official floor rounding)."""
    return int(group_size * 2 / 3), int(group_size * 1 / 3), 1


class LaserPlugin(Plugin):
    """LASER / LASER-D / LASER-DE length step bonus in the plugin's own reward column (reward stage)."""

    name = "laser"
    image_inputs = True
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.1.0"
    paper = "Learn to Reason Efficiently with Adaptive Length-based Reward Shaping (LASER / LASER-D), arXiv:2505.15612"
    summary = ("Step bonus for correct answers within a target length; LASER-D adapts the targets per difficulty, "
               "LASER-DE also pays long wrong answers for exploring.")
    Options = LaserOptions
    official = OfficialSource(
        "hkust-nlp/Laser", "c9e7c4e", verdict="faithful",
        files=("verl/utils/reward_score/length_penalty.py", "verl/utils/reward_score/count_length_distribution.py"),
        variants=("target_estimator", "explore_gate"),
    )
    claim_metric = ("bonus", "length bonus")
    reconstructed = (
        "alpha=0.5, target_length=max_completion_length//2, num_budgets=8, difficulty_edges=[1/3, 2/3], window=4",
        "LASER-D's ECR is estimated online on recent training rollouts (the paper uses a periodic monitoring set)",
        "LASER-DE's 'well formatted' without format_column: finished (not truncated)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.eos_ids: set[int] = set()
        self.targets = [None, None, None]  # LASER-D targets for easy, medium, hard
        self.history: deque = deque(maxlen=self.options.window)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(self.name)]  # the bonus needs whole groups: the reward transform fills it in

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        check_reward_columns(self.name, trainer, self.options, own=self.name, format_column=self.options.format_column)
        self.eos_ids = eos_ids(trainer)

    def budgets(self) -> list[int]:
        """LASER-D's candidate target lengths (ascending)."""
        n = self.options.num_budgets
        return sorted({max(1, math.ceil(self.max_len * j / n)) for j in range(1, n + 1)})

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        explore = o.variant == "laser_de"
        check_repetition = explore and o.explore_gate != "none"
        local = [(len(ids), is_unfinished(ids, self.max_len, self.eos_ids), check_repetition and is_repetitive(list(ids)))
                 for ids in local_completion_ids(ctx, self.name)]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        lengths = torch.tensor([n for n, _, _ in gathered], dtype=torch.long, device=device)
        unfinished = torch.tensor([u for _, u, _ in gathered], dtype=torch.bool, device=device)
        repetitive = torch.tensor([r for _, _, r in gathered], dtype=torch.bool, device=device)
        correct = correct_rows(ctx, o).to(device)
        ctx.log_metric("mean_length", lengths.float().mean().item())
        targets = self._targets(lengths, correct, ctx).to(device)
        explorable = None
        if check_repetition:
            explorable = self._well_formatted(ctx, unfinished) & ~repetitive
            ctx.log_metric("repetitive_fraction", repetitive.float().mean().item())
        bonus = laser_bonus(lengths, correct, targets, o.alpha, explore=explore, explorable=explorable)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(self.name)] = bonus.to(rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("mean_target", targets.float().mean().item())
        ctx.log_metric("bonus", bonus.mean().item())

    def _targets(self, lengths: torch.Tensor, correct: torch.Tensor, ctx: RewardContext) -> torch.Tensor:
        """(N,) long target length of each row: the fixed target (LASER) or its difficulty band's (LASER-D/DE),
        updated from the training rollouts of the last ``window`` batches."""
        o, G = self.options, ctx.num_generations
        if o.variant == "laser":
            return torch.full_like(lengths, o.target_length or max(1, self.max_len // 2))
        buckets = difficulty_buckets(group_accuracy(correct, G), tuple(o.difficulty_edges)).repeat_interleave(G)
        if ctx.mode == "train":  # statistics from training rollouts only
            self.history.append((lengths.cpu(), correct.cpu(), buckets.cpu()))
            all_len, all_cor, all_buc = (torch.cat([h[k] for h in self.history]) for k in range(3))
            budgets, sizes = self.budgets(), band_sizes(G)
            for b in range(3):
                sel = all_buc == b
                if sel.any():
                    if o.target_estimator == "coverage":
                        self.targets[b] = coverage_target(all_len[sel], budgets, sizes[b], o.ecr_min)
                    else:
                        self.targets[b] = ecr_target(all_len[sel], all_cor[sel], budgets, G, o.ecr_min)
        per_bucket = torch.tensor([t if t is not None else self.max_len for t in self.targets], dtype=torch.long)
        for b, name in enumerate(("easy", "medium", "hard")):
            ctx.log_metric(f"target_{name}", float(per_bucket[b]))
        return per_bucket[buckets.cpu()].to(lengths.device)

    def _well_formatted(self, ctx: RewardContext, unfinished: torch.Tensor) -> torch.Tensor:
        """(N,) bool: finished answers, with ``format_column > 0`` when that column is set (NaN = not formatted)."""
        ok = ~unfinished
        column = self.options.format_column
        if column is not None:
            values = ctx.rewards_per_func[:, ctx.reward_func_names.index(column)]
            ok = ok & (torch.nan_to_num(values.float(), nan=0.0) > 0)
        return ok

    @hookimpl
    def trl_plugins_state_dict(self):
        return {
            "targets": list(self.targets),
            "history": [(h[0].tolist(), h[1].tolist(), h[2].tolist()) for h in self.history],
        }

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.targets = list(state.get("targets", [None, None, None]))
        self.history = deque(
            [(torch.tensor(a), torch.tensor(b, dtype=torch.bool), torch.tensor(c))
             for a, b, c in state.get("history", [])],
            maxlen=self.options.window,
        )
