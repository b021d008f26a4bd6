"""Length shaping for efficient reasoning — LASER / LASER-D (arXiv:2505.15612) and DLER (arXiv:2510.15110).

Both papers shorten chains of thought through the reward alone:

* **LASER** (Length-bAsed StEp Reward): ``R = C(y) + alpha * 1[y correct] * 1[L(y) <= L_T]``, a step bonus for
  correct responses within a target length ``L_T``. The bonus is written to its own reward column
  ``length_shaping`` (TRL's reward weights and aggregation apply); ``C(y)`` is the correctness column.
* **LASER-D** (dynamic and difficulty-aware): the target depends on the prompt's difficulty bucket (from the
  group's accuracy: easy / medium / hard) and adapts during training. For each bucket the target is the smallest
  candidate budget ``L`` whose *expected correct responses* ``ECR(L) = G * P(correct and length <= L)`` reaches
  ``ecr_min`` (at least one correct response expected within budget), estimated on the rollouts of recent steps:
  easy prompts get short budgets, hard ones keep long ones. **LASER-DE** also rewards *incorrect* responses for
  exploring beyond the budget (``alpha * 1[L > L_A]``).
* **DLER** (Doing Length pEnalty Right): the simplest penalty is truncation — a response longer than the cap (or cut
  off unfinished at ``max_completion_length``) gets **zero reward** on every reward column. The rest of DLER's recipe
  is native TRL (``scale_rewards="batch"``, ``epsilon_high``, dynamic sampling) and is not duplicated here.
  **Difficulty-aware DLER** tightens the cap on easy prompts: ``cap_g = max(min_cap, round(cap (1 - shrink acc_g)))``
  with ``acc_g`` the group's accuracy.

Lengths are completion tokens (EOS included, as TRL's completion mask counts them); correctness is
``value >= correct_threshold`` on the correctness column (NaN counts as incorrect).

Reconstructed (the papers give no numbers; every one is an option marked reconstructed): ``alpha = 0.5``, the
default LASER target (half of ``max_completion_length``), the difficulty edges (accuracy <= 1/3 hard, > 2/3 easy),
the candidate budget grid (8 equal steps up to ``max_completion_length``), ECR estimated online from the last
``window`` generation batches of training rollouts (the paper monitors ECR periodically), the initial targets
(``max_completion_length``), LASER-DE's exploration bonus form, DLER-difficulty's linear shrink (0.5) and floor.
Do not combine DLER with TRL's ``mask_truncated_completions`` blindly: DLER wants truncated outputs to count with
zero reward, the TRL option removes them from the loss.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins import Plugin, PluginConfigError, PluginError, PluginOptions, RewardContext, hookimpl, option

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
        None, help="Reward column that says whether a response is correct (default: the first reward function)."
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
    ecr_min: float = option(
        1.0, min=0.0, min_exclusive=True, help="LASER-D: smallest budget whose expected correct responses reach this.",
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
                explore: bool = False) -> torch.Tensor:
    """LASER step bonus per row: ``alpha * 1[correct] * 1[L <= target]`` (+ ``alpha * 1[wrong] * 1[L > target]``
    with ``explore``, LASER-DE).

    Args: lengths (N,), correct (N,) bool, targets (N,) per-row target lengths. Returns (N,) float.
    """
    within = lengths <= targets
    bonus = (correct & within).float() * alpha
    if explore:
        bonus = bonus + ((~correct) & (~within)).float() * alpha
    return bonus


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
    paper = "LASER / LASER-D, arXiv:2505.15612; DLER, arXiv:2510.15110"
    summary = "Length-efficient reasoning: adaptive step length bonus (LASER-D) or zero reward past a cap (DLER)."
    Options = LengthShapingOptions
    reconstructed = (
        "alpha=0.5, target_length=max_completion_length//2, num_budgets=8, difficulty_edges=[1/3, 2/3], window=4",
        "LASER-D's ECR is estimated online on recent training rollouts (the paper uses a periodic monitoring set)",
        "LASER-DE rewards wrong answers longer than the target with alpha",
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

        return [length_shaping]

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
        names = ctx.reward_func_names
        column = o.correctness_column or next(n for n in names if n != COLUMN)
        values = ctx.rewards_per_func[:, names.index(column)]
        return torch.nan_to_num(values, nan=-math.inf) >= o.correct_threshold

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if ctx.local_completion_ids is None:
            raise PluginError("length_shaping needs the completions' token ids at the reward stage.")
        local = [(len(ids), self._unfinished(ids)) for ids in ctx.local_completion_ids]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        lengths = torch.tensor([n for n, _ in gathered], dtype=torch.long, device=device)
        unfinished = torch.tensor([u for _, u in gathered], dtype=torch.bool, device=device)
        correct = self._correct(ctx).to(device)
        G = ctx.num_generations
        acc = group_accuracy(correct, G)
        ctx.log_metric("mean_length", lengths.float().mean().item())
        if o.mode in LASER_MODES:
            targets = self._laser_targets(lengths, correct, acc, G, ctx).to(device)
            bonus = laser_bonus(lengths, correct, targets, o.alpha, explore=o.mode == "laser_de")
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
            for b in range(3):
                sel = all_buc == b
                if sel.any():
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
