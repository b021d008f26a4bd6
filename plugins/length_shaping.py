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

* **PEAR** (Phase Entropy Aware Reward, arXiv:2510.08026; ``mode="pear"``): the mean token entropy of the thinking
  phase (before ``pear_marker``, ``</think>``) is penalised, the answer phase's less or not at all:
  ``bonus = -(pear_alpha H_think + pear_answer_alpha H_answer)`` for correct responses, in the plugin's column, from
  one no-grad forward of the current (pre-update) policy at the reward stage. The paper's exact formula was not
  available to us: this form and its defaults are a reconstruction (:mod:`trl_plugins_builtin._pear`);
  ``pear_alpha = pear_answer_alpha = 0`` is the neutral setting (an all-zero column).
* **SIRI** (Scaling Iterative RL with Interleaved compression, arXiv:2509.25176; ``mode="siri"``): the maximal rollout
  length oscillates during training -- compression phases with a short cap, expansion phases with a long one -- set
  on the generation itself (:meth:`~trl_plugins.PluginGRPOTrainer.set_generation_length_cap`, HF generation and vLLM)
  after every optimizer step, with the length-capping reward (``R = 0`` when the response is longer than the cap or
  cut off at it). Schedulers: ``cosine`` (the official models') and ``stair``; the caps and the period are options
  (the paper's 8K/16K-token settings are far beyond small models; defaults: max_completion_length // 2 and
  max_completion_length, 100 steps per cycle, reconstructed). Starting phase: cosine starts at the long cap, stair
  with compression [reconstructed].
* **DECS** (Decoupled rewards and Curriculum data Scheduling, arXiv:2509.25827; ``mode="decs"``, advantage stage):
  only the *redundant* tokens of a correct completion -- those after the first chunk (cut before reflection words
  such as "Wait", "But") that contains the correct answer, the end of the *necessary reasoning prefix* -- are
  penalised: their token reward is ``s + beta (1 - L / L_max)`` instead of ``s (1 + beta)``; advantages are
  normalised per position over the group; the curriculum keeps all groups with reward variance and
  ``int(kappa n / (1 - kappa))`` all-correct ones (the others get zero advantages, TRL having no dynamic sampling),
  ``kappa`` following the change of the NRP ratio. The official chunk judge is a fine-tuned 1.5B model asked whether a
  chunk contains the correct answer; here the judge is a rule (the reference answer of ``answer_column`` appears in the
  chunk as a whole token) [reconstructed]. Facts and formulas: :mod:`trl_plugins_builtin._decs`.
* **HBPO** (Hierarchical Budget Policy Optimization, arXiv:2507.15844; ``mode="hbpo"``, sampling, reward and advantage
  stages): each group of ``G`` rollouts is split into ``k = len(hbpo_budgets)`` equal sub-groups (rows
  ``j * G/k .. (j+1) * G/k - 1`` get budget ``b_j``); each row is sampled **and trained** under its prompt with the
  budget sentence (``hbpo_prompt``, official "I will answer the question with {budget} tokens"). The correctness
  column of a correct response of ``n`` tokens becomes the budget-aware reward (official ``min(f1, f2)``, or the
  paper's piecewise ``f1`` / ``f2``; ``f1 = beta cos(pi n / 2L) - alpha |n - b|``, ``f2 = beta cos(pi b / 2L)``), 0 for a
  wrong one; the advantages are the hierarchical ones, ``(R - mean) / (std + 1e-6)`` over the group plus
  ``w (mean of the sub-group's R - f2(b))`` (official ``w = 2``, the paper's equation ``w = 1``), in place of TRL's
  (``scale_rewards`` does not apply). Refused with the refill plugins (refilled groups would lack the budget
  sentences) and with another plugin that recomputes the advantages from scratch. Evaluation batches
  keep their prompts, rewards and advantages (the paper evaluates without budget sentences). Facts and formulas:
  :mod:`trl_plugins_builtin._hbpo`. ``hbpo_intra_weight=0`` leaves GRPO's group-normalised advantage (std + 1e-6)
  of the budget rewards; the budget sentences and the budget reward are what HBPO is, so it has no setting equal to
  vanilla GRPO (disable the plugin for that).

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

from trl_plugins import (
    AdvantageContext,
    IncompatiblePluginsError,
    Plugin,
    PluginConfigError,
    PluginError,
    PluginOptions,
    PromptContext,
    RewardContext,
    available_plugins,
    hookimpl,
    option,
)
from trl_plugins.success import SuccessRule, placeholder_column, verifier_column

from ._decs import (
    SPLIT_WORDS,
    chunk_starts,
    contains_answer,
    curriculum_keep,
    decs_token_rewards,
    nrp_split,
    per_position_advantages,
)
from ._hbpo import (
    OFFICIAL_BUDGET_PROMPT,
    PAPER_BUDGETS,
    budget_rewards,
    budget_slots,
    hierarchical_advantages,
    with_budget_sentence,
)
from ._pear import pear_bonus, phase_boundary, phase_entropies

COLUMN = "length_shaping"
LASER_MODES = ("laser", "laser_d", "laser_de")
#: Modes whose bonus is written to the plugin's own (placeholder) reward column.
COLUMN_MODES = LASER_MODES + ("pear",)
DLER_MODES = ("dler", "dler_difficulty")
HBPO_REFILL_REASON = (
    "a refill plugin regenerates rejected groups from the original prompts, without HBPO's budget sentences, while "
    "their rewards and advantages would still follow the budgets"
)


@dataclass
class LengthShapingOptions(PluginOptions):
    mode: Literal["laser", "laser_d", "laser_de", "dler", "dler_difficulty", "decs", "pear", "siri", "hbpo"] = option(
        "laser_d",
        help="laser: fixed-target step bonus; laser_d: adaptive difficulty-aware targets; laser_de: plus exploration "
        "bonus for wrong answers; dler: zero reward beyond a cap; dler_difficulty: tighter caps on easy prompts; "
        "decs: penalise only the tokens after the first correct answer, per-position advantages, curriculum; pear: "
        "penalise the thinking phase's token entropy (reconstructed formula); siri: oscillate the rollout length cap "
        "(compression / expansion) with zero reward beyond it; hbpo: budget sub-groups sampled with per-row budget "
        "sentences, budget-aware reward, hierarchical (intra + inter sub-group) advantage.",
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

    answer_column: str = option(
        "answer", help="DECS: dataset column with the reference answer (a chunk containing it ends the necessary "
        "reasoning prefix).",
    )
    decs_beta: float = option(
        0.1, min=0.0, help="DECS: length-reward weight beta (official default length_reward_beta=0.1).",
    )
    decs_split_words: list[str] = option(
        default_factory=lambda: list(SPLIT_WORDS),
        help="DECS: words whose first token starts a new chunk (official: Wait, But, Alternatively, Hmm, Let, "
        "Therefore, with and without a leading space).",
    )
    decs_curriculum: bool = option(
        True, help="DECS: curriculum data schedule (keep int(kappa n / (1 - kappa)) all-correct groups; drop the "
        "others and the all-wrong ones by zeroing their advantages).",
    )
    decs_kappa_lr: float = option(
        0.2, min=0.0, help="DECS: kappa += kappa_lr * (NRP ratio - previous NRP ratio) after each batch (official 0.2).",
    )

    siri_schedule: Literal["cosine", "stair"] = option(
        "cosine", help="SIRI: length scheduler. cosine: cap = min + (max - min)(1 + cos(2 pi step / period)) / 2 "
        "(the official models' scheduler); stair: min for the first half of each period, max for the second.",
    )
    siri_min_cap: int | None = option(
        None, min=1, help="SIRI: compression cap in tokens (default: max_completion_length // 2).", reconstructed=True,
    )
    siri_max_cap: int | None = option(
        None, min=1, help="SIRI: expansion cap in tokens (default: max_completion_length).",
    )
    siri_period: int = option(
        100, min=1, help="SIRI: optimizer steps per compression-expansion cycle.", reconstructed=True,
    )
    pear_alpha: float = option(
        0.1, min=0.0, help="PEAR: weight of the thinking phase's mean token entropy in the (negative) bonus.",
        reconstructed=True,
    )
    pear_answer_alpha: float = option(
        0.0, min=0.0, help="PEAR: weight of the answer phase's mean token entropy (smaller: moderate answer-phase "
        "entropy is tolerated; 0: not penalised).", reconstructed=True,
    )
    pear_marker: str = option(
        "</think>", help="PEAR: text that ends the thinking phase (no marker: the whole completion is thinking).",
    )
    pear_only_correct: bool = option(
        True, help="PEAR: pay the entropy bonus to correct responses only.", reconstructed=True,
    )
    hbpo_budgets: list[int] = option(
        default_factory=lambda: list(PAPER_BUDGETS),
        help="HBPO: token budgets of the sub-groups (paper: 512, 1024, 2048, 2560); num_generations must be a "
        "multiple of their number (equal sub-groups).",
    )
    hbpo_prompt: str = option(
        OFFICIAL_BUDGET_PROMPT,
        help="HBPO: budget sentence ({budget} is replaced), appended to a text prompt after a space or to the last "
        "user message of a conversational prompt after a blank line [reconstructed for conversational prompts: the "
        "official rollout prefills it after '<think>' in the assistant turn]. Official wording 'with {budget} "
        "tokens'; the paper writes 'within {budget} tokens'.",
    )
    hbpo_reward: Literal["official_min", "paper_piecewise"] = option(
        "official_min",
        help="HBPO: reward of a correct answer. official_min: min(f1, f2) (official code); paper_piecewise: f1 beyond "
        "the budget, f2 within it (the paper's equation).",
    )
    hbpo_beta: float = option(4.0, min=0.0, help="HBPO: reward scale beta of the cosine terms (official: 4).")
    hbpo_alpha: float | None = option(
        None, min=0.0, help="HBPO: deviation penalty alpha per token beyond/away from the budget (default / official: "
        "1 / hbpo_max_length).",
    )
    hbpo_max_length: int | None = option(
        None, min=1, help="HBPO: L_max of the cosine terms (default: max_completion_length; official: the 4096-token "
        "response length).",
    )
    hbpo_intra_weight: float = option(
        2.0, min=0.0,
        help="HBPO: weight of the intra-sub-group advantage mean_i(R) - f2(b_i). Official code: 2 (the term is added "
        "twice); the paper's equation: 1; 0 leaves the inter-sub-group (group-normalised) advantage only.",
    )

    def validate(self) -> None:
        if not self.hbpo_budgets or any(int(b) < 1 for b in self.hbpo_budgets):
            raise PluginConfigError(
                f"Option 'hbpo_budgets' of plugin 'length_shaping' got {self.hbpo_budgets!r}; allowed: a non-empty "
                "list of positive token counts."
            )
        if "{budget}" not in self.hbpo_prompt:
            raise PluginConfigError(
                f"Option 'hbpo_prompt' of plugin 'length_shaping' got {self.hbpo_prompt!r}; it must contain the "
                "placeholder '{budget}'."
            )
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


def siri_cap(step: int, low: int, high: int, period: int, schedule: str) -> int:
    """SIRI's length cap at ``step``: ``cosine`` starts at ``high``, reaches ``low`` at half a period and returns
    (``round(low + (high - low)(1 + cos(2 pi step / period)) / 2)``); ``stair`` holds ``low`` for the first half of each
    period (compression) and ``high`` for the second (expansion)."""
    phase = (step % period) / period
    if schedule == "stair":
        return low if phase < 0.5 else high
    return int(round(low + (high - low) * (1 + math.cos(2 * math.pi * phase)) / 2))


def dler_zero_mask(lengths: torch.Tensor, caps: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows whose reward DLER sets to zero (longer than their cap, or unfinished)."""
    return (lengths > caps) | unfinished


class LengthShapingPlugin(Plugin):
    """LASER / LASER-D step bonus and (difficulty-aware) DLER truncation (reward stage)."""

    name = "length_shaping"
    multi_turn = (
        "its length reward counts completion_ids, which in tool rollouts include the tool-result tokens the "
        "model did not write."
    )
    version = "0.1.0"
    paper = (
        "Learn to Reason Efficiently with Adaptive Length-based Reward Shaping (LASER / LASER-D), "
        "arXiv:2505.15612; DLER: Doing Length pEnalty Right - Incentivizing More Intelligence per Token via "
        "Reinforcement Learning, arXiv:2510.15110; Overthinking Reduction with Decoupled Rewards and Curriculum Data "
        "Scheduling (DECS), arXiv:2509.25827; PEAR: Phase Entropy Aware Reward for Efficient Reasoning, "
        "arXiv:2510.08026; SIRI: Scaling Iterative Reinforcement Learning with Interleaved Compression, "
        "arXiv:2509.25176; Hierarchical Budget Policy Optimization for Adaptive Reasoning (HBPO), arXiv:2507.15844"
    )
    summary = ("Length-efficient reasoning: adaptive step length bonus (LASER-D), zero reward past a cap (DLER), "
               "penalties on the tokens after the first correct answer only (DECS), thinking-entropy penalty (PEAR), "
               "oscillating rollout length cap (SIRI), budget sub-groups with budget-aware rewards (HBPO).")
    Options = LengthShapingOptions
    claim_metric = ("bonus", "length bonus")
    replaces = (
        "mode hbpo: the correctness column's value (by the budget-aware reward) and the advantages (hierarchical; "
        "refused together with another plugin that recomputes the advantages from scratch); mode hbpo is refused with "
        f"the refill plugins (dynamic_sampling, dars): {HBPO_REFILL_REASON}",
    )
    reconstructed = (
        "alpha=0.5, target_length=max_completion_length//2, num_budgets=8, difficulty_edges=[1/3, 2/3], window=4",
        "LASER-D's ECR is estimated online on recent training rollouts (the paper uses a periodic monitoring set)",
        "LASER-DE's 'well formatted' without format_column: finished (not truncated)",
        "DLER-difficulty: cap * (1 - shrink * group accuracy), shrink=0.5, floor min_cap",
        "SIRI: default caps max_completion_length // 2 and max_completion_length, period 100 steps, starting phase",
        "PEAR: the bonus -(alpha H_think + alpha_answer H_answer) on correct responses and its defaults (the paper's "
        "exact formula was not available)",
        "DECS: the chunk judge is a rule (the reference answer appears in the chunk); official: a fine-tuned 1.5B judge",
        "DECS: the curriculum drops groups by zeroing their advantages (TRL has no dynamic sampling); kappa in [0, 0.99]",
        "HBPO: the budget sentence of a conversational prompt ends the last user message (official: assistant prefill "
        "after '<think>', which TRL's chat templating cannot express)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1
        self.targets = [None, None, None]  # LASER-D targets for easy, medium, hard
        self.history: deque = deque(maxlen=self.options.window)
        self.kappa, self.last_nrp_ratio = 0.0, 0.5  # DECS curriculum (official initial values)
        self._decs_batch: list | None = None
        self._split_ids: set[int] | None = None
        self._generator = torch.Generator().manual_seed(0)

    def required_columns(self) -> list[str]:
        return [self.options.answer_column] if self.options.mode == "decs" else []

    def hook_enabled(self, hook: str) -> bool:
        # only HBPO samples under per-row prompts; the other modes keep TRL's sampling path
        return hook != "trl_plugins_generation_prompts" or self.options.mode == "hbpo"

    def overwritten(self) -> tuple[str, ...]:
        return ("advantages",) if self.options.mode == "hbpo" else ()

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        if self.options.mode not in COLUMN_MODES:
            return []

        # the bonus needs whole groups: the reward transform fills the column in
        return [placeholder_column("length_shaping")]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.max_len = int(trainer.max_completion_length)
        o = self.options
        self._generator.manual_seed(int(getattr(args, "seed", 0)))
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
        if o.mode == "hbpo":
            refill = [name for name in getattr(args, "plugins", None) or []
                      if name != self.name and "trl_plugins_reject_groups" in available_plugins()[name].hook_names()]
            if refill:
                raise IncompatiblePluginsError(
                    f"length_shaping (mode hbpo) and {refill[0]!r} cannot be stacked: {HBPO_REFILL_REASON}. Use "
                    f"another length_shaping mode or disable {refill[0]}."
                )
        if o.mode == "hbpo" and max(o.hbpo_budgets) > (o.hbpo_max_length or self.max_len):
            warnings.warn(
                f"length_shaping (hbpo): budgets {o.hbpo_budgets} exceed L_max={o.hbpo_max_length or self.max_len} "
                "(hbpo_max_length, default max_completion_length); the paper's budgets (up to 2560) assume a 4096-token "
                "response length. Set hbpo_budgets for this run's length.",
                stacklevel=2,
            )
        if o.mode == "hbpo" and args.num_generations % len(o.hbpo_budgets):
            raise PluginConfigError(
                f"length_shaping (hbpo): num_generations={args.num_generations} is not a multiple of the "
                f"{len(o.hbpo_budgets)} budgets {o.hbpo_budgets}; HBPO splits each group into equal budget sub-groups."
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
        if o.mode == "decs":
            self._decs_batch = ctx.gather_object([self._decs_row(ctx, i) for i in range(len(ctx.local_rows))])
            return
        if o.mode == "pear":
            self._pear(ctx)
            return
        if o.mode == "siri":
            self._siri_rewards(ctx)
            return
        if o.mode == "hbpo":
            if ctx.mode == "train":
                self._hbpo_rewards(ctx)
            return
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

    # ------------------------------------------------------------------------------------------ SIRI
    def siri_cap(self, step: int) -> int:
        """The rollout length cap at optimizer step ``step`` (compression and expansion phases alternate)."""
        o = self.options
        high = min(o.siri_max_cap or self.max_len, self.max_len)
        low = min(o.siri_min_cap or max(1, self.max_len // 2), high)
        return siri_cap(step, low, high, o.siri_period, o.siri_schedule)

    def _apply_siri_cap(self, trainer) -> None:
        if self.options.mode == "siri":
            trainer.set_generation_length_cap(self.siri_cap(int(trainer.state.global_step)))

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        self._apply_siri_cap(trainer)  # at the start of training and on resume: the cap of the current step
        return None

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        self._apply_siri_cap(trainer)

    def _siri_rewards(self, ctx: RewardContext) -> None:
        """SIRI's length-capping reward: every column of a row longer than the current cap, or cut off at it without
        EOS, is 0 (NaN stays NaN)."""
        cap = self.siri_cap(ctx.step) if ctx.mode == "train" else self.max_len
        local = [(len(ids), len(ids) >= cap and (not ids or ids[-1] not in self.eos_ids))
                 for ids in ctx.local_completion_ids]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        lengths = torch.tensor([n for n, _ in gathered], dtype=torch.long, device=device)
        unfinished = torch.tensor([u for _, u in gathered], dtype=torch.bool, device=device)
        zero = dler_zero_mask(lengths, torch.full_like(lengths, cap), unfinished)
        rewards = ctx.rewards_per_func
        ctx.rewards_per_func = torch.where(zero.unsqueeze(1) & ~torch.isnan(rewards), 0.0, rewards)
        ctx.log_metric("cap", float(cap))
        ctx.log_metric("truncated_fraction", zero.float().mean().item())

    # ------------------------------------------------------------------------------------------ HBPO
    def _hbpo_row_budgets(self, index_in_group, G: int) -> torch.Tensor:
        """(N,) long budget of each row (its sub-group's) from its index in the group."""
        budgets = torch.tensor([int(b) for b in self.options.hbpo_budgets], dtype=torch.long)
        index = torch.as_tensor(index_in_group, dtype=torch.long).cpu()
        return budgets[budget_slots(index, G, len(budgets))]

    def _hbpo_constants(self) -> tuple[int, float]:
        """(L_max, alpha) of the budget reward."""
        L = self.options.hbpo_max_length or self.max_len
        alpha = self.options.hbpo_alpha if self.options.hbpo_alpha is not None else 1.0 / L
        return L, alpha

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        o = self.options
        budgets = self._hbpo_row_budgets(ctx.index_in_group, ctx.num_generations).tolist()
        for i, b in enumerate(budgets):
            prompt = with_budget_sentence(ctx.prompts[i], o.hbpo_prompt.format(budget=b))
            ctx.generation_prompts[i] = ctx.training_prompts[i] = prompt
            ctx.annotations[i]["hbpo_budget"] = b

    def _hbpo_rewards(self, ctx: RewardContext) -> None:
        """Write HBPO's budget-aware reward into the correctness column (NaN stays NaN)."""
        o = self.options
        device = ctx.rewards_per_func.device
        lengths = torch.tensor(ctx.gather_object([len(ids) for ids in ctx.local_completion_ids]), device=device)
        budgets = self._hbpo_row_budgets(ctx.index_in_group, ctx.num_generations).to(device)
        L, alpha = self._hbpo_constants()
        reward = budget_rewards(lengths, budgets, self._correct(ctx).to(device), L, o.hbpo_beta, alpha, o.hbpo_reward)
        K = ctx.rewards_per_func.shape[1]
        flags = ctx.run.placeholder_columns if len(ctx.run.placeholder_columns) == K else ()
        col = verifier_column(ctx.reward_func_names, flags, o.correctness_column)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, col] = torch.where(torch.isnan(rewards[:, col]), rewards[:, col], reward.to(rewards.dtype))
        ctx.rewards_per_func = rewards
        ctx.log_metric("mean_length", lengths.float().mean().item())
        ctx.log_metric("within_budget_fraction", (lengths <= budgets).float().mean().item())
        ctx.log_metric("budget_reward", reward.mean().item())

    def _hbpo_advantages(self, ctx: AdvantageContext) -> None:
        o = self.options
        G = ctx.num_generations
        budgets = self._hbpo_row_budgets(ctx.index_in_group, G)
        slots = budget_slots(torch.as_tensor(ctx.index_in_group).cpu(), G, len(o.hbpo_budgets))
        L, _ = self._hbpo_constants()
        adv = hierarchical_advantages(ctx.rewards.cpu(), slots, budgets, G, L, o.hbpo_beta, o.hbpo_intra_weight)
        ctx.advantages = adv.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
        ctx.log_metric("hbpo_advantage_mean", adv.mean().item())

    # ------------------------------------------------------------------------------------------ PEAR
    def _pear(self, ctx: RewardContext) -> None:
        """Fill the plugin's column with PEAR's phase-entropy bonus (one no-grad forward over the local rows)."""
        o = self.options
        if o.pear_alpha == 0 and o.pear_answer_alpha == 0:  # neutral: an all-zero column, no forward
            return
        tokenizer = ctx.tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False)

        entropies = ctx.policy_entropies()
        local = [phase_entropies(h.float().cpu(), phase_boundary(ids, decode, o.pear_marker))
                 for h, ids in zip(entropies, ctx.local_completion_ids)]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        think = torch.tensor([t for t, _ in gathered], device=device)
        answer = torch.tensor([a for _, a in gathered], device=device)
        bonus = pear_bonus(think, answer, self._correct(ctx).to(device), o.pear_alpha, o.pear_answer_alpha,
                           o.pear_only_correct)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = bonus.to(rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("think_entropy", think.mean().item())
        ctx.log_metric("answer_entropy", answer.mean().item())
        ctx.log_metric("bonus", bonus.mean().item())

    # ------------------------------------------------------------------------------------------ DECS
    def _decs_row(self, ctx: RewardContext, i: int) -> tuple[int, float]:
        """(first redundant position or -1, NRP ratio) of local row ``i`` (rule chunk judge on the answer column)."""
        tokenizer = ctx.tokenizer
        if self._split_ids is None:
            ids = [tokenizer.encode(w, add_special_tokens=False) for w in self.options.decs_split_words]
            self._split_ids = {x[0] for x in ids if x}
        ids = list(ctx.local_completion_ids[i])
        starts = chunk_starts(ids, self._split_ids)
        ends = starts[1:] + [len(ids)]
        answer = str(ctx.local_rows[i].get(self.options.answer_column, ""))
        verdicts = [contains_answer(tokenizer.decode(ids[a:b], skip_special_tokens=True), answer)
                    for a, b in zip(starts, ends)]
        return nrp_split(starts, verdicts, len(ids)) if starts else (-1, 0.0)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.mode == "hbpo":
            if ctx.mode == "train":
                self._hbpo_advantages(ctx)
            return
        if o.mode != "decs":
            return
        if self._decs_batch is None or len(self._decs_batch) != ctx.rewards.numel():
            raise PluginError("length_shaping (decs): the reward stage did not record this batch's chunks.")
        G = ctx.num_generations
        mask = ctx.completion_mask().float()
        device = mask.device
        correct = torch.nan_to_num(ctx.verifier(SuccessRule(o.correctness_column)).float(), nan=-math.inf) \
            >= o.correct_threshold
        starts = torch.tensor([s for s, _ in self._decs_batch], device=device)
        ratios = torch.tensor([r for _, r in self._decs_batch], device=device)
        starts = torch.where(correct.to(device), starts, torch.full_like(starts, -1))
        scores = torch.nan_to_num(ctx.rewards.float(), nan=0.0).to(device)
        token_rewards = decs_token_rewards(scores, starts, mask.sum(-1).long(), mask.size(1), self.max_len,
                                           o.decs_beta)
        advantages = per_position_advantages(token_rewards, mask, G)
        if o.decs_curriculum:
            keep = curriculum_keep(scores, G, self.kappa, self._generator).to(device)
            advantages = advantages * keep.repeat_interleave(G).unsqueeze(1).float()
            ctx.log_metric("kept_group_fraction", keep.float().mean().item())
        ctx.advantages = advantages.to(ctx.advantages.dtype)
        found = ratios[correct.to(device) & (ratios > 0)]
        ratio = float(found.mean()) if found.numel() else 0.0
        if ctx.mode == "train" and o.decs_curriculum:
            if self.last_nrp_ratio != 0:
                self.kappa += (ratio - self.last_nrp_ratio) * o.decs_kappa_lr
            self.last_nrp_ratio = ratio
        ctx.log_metric("nrp_ratio", ratio)
        ctx.log_metric("redundant_fraction", float(((starts >= 0).float()).mean()))
        ctx.log_metric("kappa", self.kappa)
        self._decs_batch = None

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
            "kappa": self.kappa,
            "last_nrp_ratio": self.last_nrp_ratio,
            "generator": self._generator.get_state().tolist(),
            "targets": list(self.targets),
            "history": [(h[0].tolist(), h[1].tolist(), h[2].tolist()) for h in self.history],
        }

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.targets = list(state.get("targets", [None, None, None]))
        self.kappa = float(state.get("kappa", 0.0))
        self.last_nrp_ratio = float(state.get("last_nrp_ratio", 0.5))
        if "generator" in state:
            self._generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        self.history = deque(
            [
                (torch.tensor(a), torch.tensor(b, dtype=torch.bool), torch.tensor(c))
                for a, b, c in state.get("history", [])
            ],
            maxlen=self.options.window,
        )
