"""Length shaping for efficient reasoning — LASER / LASER-D (arXiv:2505.15612) and DLER (arXiv:2510.15110).

Both papers shorten chains of thought through the reward alone:

* **LASER** (Length-bAsed StEp Reward): ``R = C(y) + alpha * 1[y correct] * 1[L(y) <= L_T]``, a step bonus for
  correct responses within a target length ``L_T``. The bonus is written to its own reward column
  ``length_shaping`` (TRL's reward weights and aggregation apply); ``C(y)`` is the correctness column.
* **LASER-D** (dynamic and difficulty-aware): the target depends on the prompt's difficulty band (from the
  group's accuracy: easy / medium / hard) and adapts during training. As in the official code
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
* **DLER** (Doing Length pEnalty Right): the simplest penalty is truncation — a response longer than the cap (or cut
  off unfinished at ``max_completion_length``) gets **zero reward** on every reward column. The rest of DLER's recipe
  is not in this plugin: batch-level reward normalisation and the higher clip are GRPOConfig settings
  (``scale_rewards="batch"``, ``epsilon_high``); DAPO's dynamic sampling (drop groups with zero reward variance and
  refill the batch) is **not** available in TRL 1.16 -- without it such groups simply get zero advantage.
  **Difficulty-aware DLER** tightens the cap on easy prompts: ``cap_g = max(min_cap, round(cap (1 - shrink acc_g)))``
  with ``acc_g`` the group's accuracy.

Lengths are completion tokens (EOS included, as TRL's completion mask counts them); correctness is
``value >= correct_threshold`` on the correctness column (NaN counts as incorrect): ``correctness_column``, by default
the first reward function that is not a placeholder column (the success rule of :mod:`trl_plugins.success`).

Reconstructed (the papers give no numbers; every one is an option marked reconstructed): ``alpha = 0.5``, the
default LASER target (half of ``max_completion_length``), the difficulty edges (accuracy <= 1/3 hard, > 2/3 easy),
the candidate budget grid (8 equal steps up to ``max_completion_length``), ECR estimated online from the last
``window`` generation batches of training rollouts (the official code reads coverage from a periodic monitoring
run), the initial targets (``max_completion_length``), LASER-DE's "well formatted" without a format column (finished),
DLER-difficulty's linear shrink (0.5) and floor.
Do not combine DLER with TRL's ``mask_truncated_completions`` blindly: DLER wants truncated outputs to count with
zero reward, the TRL option removes them from the loss.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins import Plugin, PluginConfigError, PluginError, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.success import SuccessRule, mark_placeholder

COLUMN = "length_shaping"
LASER_MODES = ("laser", "laser_d", "laser_de")
DLER_MODES = ("dler", "dler_difficulty")


@dataclass
class LengthShapingOptions(PluginOptions):
    mode: Literal["laser", "laser_d", "laser_de", "dler", "dler_difficulty"] = option(
        "laser_d",
        help="laser: fixed-target step bonus; laser_d: adaptive difficulty-aware targets; laser_de: plus exploration "
        "bonus for wrong answers; dler: zero reward beyond a cap; dler_difficulty: tighter caps on easy prompts.",
    )
    correctness_column: str | None = option(
        None, help="Reward column that says whether a response is correct (default: the first reward function that is "
        "not a placeholder column; other columns never count)."
    )
    correct_threshold: float = option(1.0, help="A response is correct when its correctness value is >= this.")
    alpha: float = option(0.5, min=0.0, help="Size of the LASER step bonus.", reconstructed=True)
    target_length: int | None = option(
        None, min=1, help="LASER's fixed target L_T in tokens (default: max_completion_length // 2).",
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
    cap: int | None = option(
        None, min=1, help="DLER truncation cap in tokens (default: max_completion_length).",
    )
    shrink: float = option(
        0.5, min=0.0, max=1.0, help="DLER-difficulty: cap_g = cap * (1 - shrink * group accuracy).", reconstructed=True,
    )
    min_cap: int = option(1, min=1, help="DLER-difficulty: caps never go below this.", reconstructed=True)
    zero_unfinished: bool = option(
        True, help="DLER: responses cut off at max_completion_length without EOS get zero reward too."
    )

    def validate(self) -> None:
        edges = self.difficulty_edges
        if len(edges) != 2 or not (0.0 <= edges[0] <= edges[1] <= 1.0):
            raise PluginConfigError(
                f"Option 'difficulty_edges' of plugin 'length_shaping' got {edges!r}; allowed: two accuracies "
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


def group_accuracy(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool -> (N/G,) fraction correct per group."""
    return correct.float().view(-1, group_size).mean(dim=1)


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


def dler_caps(accuracy: torch.Tensor, cap: int, shrink: float, min_cap: int) -> torch.Tensor:
    """Difficulty-aware caps per group: ``max(min_cap, round(cap * (1 - shrink * acc)))`` (Python rounding)."""
    return torch.tensor(
        [max(min_cap, round(cap * (1.0 - shrink * float(a)))) for a in accuracy], dtype=torch.long
    )


def dler_zero_mask(lengths: torch.Tensor, caps: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows whose reward DLER sets to zero (longer than their cap, or unfinished)."""
    return (lengths > caps) | unfinished


class LengthShapingPlugin(Plugin):
    """LASER / LASER-D step bonus and (difficulty-aware) DLER truncation (reward stage)."""

    name = "length_shaping"
    version = "0.1.0"
    paper = (
        "Learn to Reason Efficiently with Adaptive Length-based Reward Shaping (LASER / LASER-D), "
        "arXiv:2505.15612; DLER: Doing Length pEnalty Right - Incentivizing More Intelligence per Token via "
        "Reinforcement Learning, arXiv:2510.15110"
    )
    summary = "Length-efficient reasoning: adaptive step length bonus (LASER-D) or zero reward past a cap (DLER)."
    Options = LengthShapingOptions
    claim_metric = ("bonus", "length bonus")
    reconstructed = (
        "alpha=0.5, target_length=max_completion_length//2, num_budgets=8, difficulty_edges=[1/3, 2/3], window=4",
        "LASER-D's ECR is estimated online on recent training rollouts (the paper uses a periodic monitoring set)",
        "LASER-DE's 'well formatted' without format_column: finished (not truncated)",
        "DLER-difficulty: cap * (1 - shrink * group accuracy), shrink=0.5, floor min_cap",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.targets = [None, None, None]  # LASER-D targets for easy, medium, hard
        self.history: deque = deque(maxlen=self.options.window)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        if self.options.mode not in LASER_MODES:
            return []

        def length_shaping(completions, **kwargs):
            # Placeholder column: the bonus needs the whole groups and is filled in by the reward transform.
            return [0.0] * len(completions)

        return [mark_placeholder(length_shaping)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        o = self.options
        if o.mode in DLER_MODES and getattr(args, "mask_truncated_completions", False):
            warnings.warn(
                "length_shaping (DLER): mask_truncated_completions=True removes truncated completions from the loss, "
                "while DLER trains on them with zero reward; the paper does not mask them.",
                stacklevel=2,
            )
        names = list(trainer.reward_func_names)
        own = [n for n in names if n != COLUMN]
        if o.correctness_column is not None and o.correctness_column not in names:
            raise PluginConfigError(
                f"length_shaping: correctness_column={o.correctness_column!r} is not a reward column "
                f"(columns: {', '.join(names)})."
            )
        if o.format_column is not None and o.format_column not in names:
            raise PluginConfigError(
                f"length_shaping: format_column={o.format_column!r} is not a reward column (columns: {', '.join(names)})."
            )
        if o.correctness_column is None and not own:
            raise PluginConfigError(
                "length_shaping needs a correctness reward function (e.g. accuracy_reward) besides its own column."
            )
        self.eos_ids = set(getattr(trainer, "eos_token_ids", None) or [trainer.processing_class.eos_token_id])
        pad = getattr(trainer.processing_class, "pad_token_id", None)
        if pad is not None:
            self.eos_ids.add(pad)

    def budgets(self) -> list[int]:
        n = self.options.num_budgets
        return sorted({max(1, math.ceil(self.max_len * j / n)) for j in range(1, n + 1)})

    def _correct(self, ctx: RewardContext) -> torch.Tensor:
        o = self.options
        values = ctx.verifier(SuccessRule(o.correctness_column))  # default: first non-placeholder reward function
        return torch.nan_to_num(values, nan=-math.inf) >= o.correct_threshold

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if ctx.local_completion_ids is None:
            raise PluginError("length_shaping needs the completions' token ids at the reward stage.")
        check_repetition = o.mode == "laser_de" and o.explore_gate != "none"
        local = [(len(ids), self._unfinished(ids), check_repetition and is_repetitive(list(ids)))
                 for ids in ctx.local_completion_ids]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        lengths = torch.tensor([n for n, _, _ in gathered], dtype=torch.long, device=device)
        unfinished = torch.tensor([u for _, u, _ in gathered], dtype=torch.bool, device=device)
        repetitive = torch.tensor([r for _, _, r in gathered], dtype=torch.bool, device=device)
        correct = self._correct(ctx).to(device)
        G = ctx.num_generations
        acc = group_accuracy(correct, G)
        ctx.log_metric("mean_length", lengths.float().mean().item())
        if o.mode in LASER_MODES:
            targets = self._laser_targets(lengths, correct, acc, G, ctx).to(device)
            explorable = None
            if o.mode == "laser_de" and o.explore_gate != "none":
                explorable = self._well_formatted(ctx, unfinished) & ~repetitive
                ctx.log_metric("repetitive_fraction", repetitive.float().mean().item())
            bonus = laser_bonus(lengths, correct, targets, o.alpha, explore=o.mode == "laser_de",
                                explorable=explorable)
            col = ctx.reward_func_names.index(COLUMN)
            rewards = ctx.rewards_per_func.clone()
            rewards[:, col] = bonus.to(rewards.dtype)
            ctx.rewards_per_func = rewards
            ctx.log_metric("mean_target", targets.float().mean().item())
            ctx.log_metric("bonus", bonus.mean().item())
        else:
            cap = o.cap or self.max_len
            if o.mode == "dler_difficulty":
                caps = dler_caps(acc, cap, o.shrink, o.min_cap).to(device).repeat_interleave(G)
            else:
                caps = torch.full_like(lengths, cap)
            zero = dler_zero_mask(lengths, caps, unfinished if o.zero_unfinished else torch.zeros_like(unfinished))
            rewards = ctx.rewards_per_func
            # zero every applicable column of the truncated rows (NaN = "not applicable" stays NaN)
            ctx.rewards_per_func = torch.where(zero.unsqueeze(1) & ~torch.isnan(rewards), 0.0, rewards)
            ctx.log_metric("truncated_fraction", zero.float().mean().item())
            ctx.log_metric("mean_cap", caps.float().mean().item())

    def _well_formatted(self, ctx: RewardContext, unfinished: torch.Tensor) -> torch.Tensor:
        """(N,) bool: finished answers, with ``format_column > 0`` when that column is set (NaN = not formatted)."""
        ok = ~unfinished
        column = self.options.format_column
        if column is not None:
            values = ctx.rewards_per_func[:, ctx.reward_func_names.index(column)]
            ok = ok & (torch.nan_to_num(values.float(), nan=0.0) > 0)
        return ok

    def _unfinished(self, ids: list[int]) -> bool:
        return len(ids) >= self.max_len and (not ids or ids[-1] not in self.eos_ids)

    def _laser_targets(self, lengths, correct, acc, G, ctx) -> torch.Tensor:
        o = self.options
        if o.mode == "laser":
            target = o.target_length or max(1, self.max_len // 2)
            return torch.full_like(lengths, target)
        buckets = difficulty_buckets(acc, tuple(o.difficulty_edges)).repeat_interleave(G)
        if ctx.mode == "train":  # statistics from training rollouts only
            self.history.append((lengths.cpu(), correct.cpu(), buckets.cpu()))
            all_len = torch.cat([h[0] for h in self.history])
            all_cor = torch.cat([h[1] for h in self.history])
            all_buc = torch.cat([h[2] for h in self.history])
            budgets = self.budgets()
            sizes = band_sizes(G)
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
            [
                (torch.tensor(a), torch.tensor(b, dtype=torch.bool), torch.tensor(c))
                for a, b, c in state.get("history", [])
            ],
            maxlen=self.options.window,
        )
