"""URPO -- one model is both player and referee: the policy scores its own group (arXiv:2507.17515).

URPO (Unified Reward & Policy Optimization) drops the separate reward model. All alignment data is put in one
generative format and trained by one GRPO loop: **verifiable** prompts are rewarded by their checker, **preference**
data is recast as judging prompts (the policy reads a question and several responses and judges them; its reward is
the agreement of its verdict with the human label), and for **open-ended** prompts the policy, acting as referee,
judges the group of answers it has just written, and those judgements are the group's rewards.

Here a dataset column (``kind_column``, default ``urpo_kind``) marks each row's kind: ``open_kind`` ("open"),
``judge_kind`` ("judge") or anything else (verifiable: left to the run's own reward functions). Two reward columns:

* ``urpo_self_judge`` (weight ``self_judge_weight``) -- the reward half, and the referee's turn on open groups.
  With ``verdict_rows = k`` (default 2; reconstructed) the last ``k`` slots of every open group are the referee's:
  they are deferred at the prompt stage (``PromptContext.defer``), TRL samples the group's ``G - k`` answers, and the
  sampling stage (``after_generation``) puts the question and those answers (gathered from every process: a group may
  straddle processes) in the judge format (:data:`JUDGE_INSTRUCTION`) and fills each verdict slot with a judgement the
  **current policy samples under that judge prompt through the trainer's generation service** (``ctx.service.generate``,
  collective: every process calls once, possibly with no request). A verdict row is trained in the step that writes
  it: its training prompt is the judge prompt (``replace_row(..., training_prompt=...)``), its completion the verdict
  tokens, its sampling log-probs kept (sampled and trained under the same prompt, so not prompt-swapped). A verdict's
  last ``<scores>s_1, ..., s_{G-k}</scores>`` (``<think>`` blocks skipped) is **parsable** when it holds exactly
  ``G - k`` scores in ``[score_low, score_high]``. Reward stage::

      r_i = mean over the group's parsable verdicts of (s_i - score_low) / (score_high - score_low)   (answer rows)
      r_i = the mean of its group's r                  (answer rows of a group without a parsable verdict: neutral)
      r_v = 1 if verdict v is parsable else 0          (verdict rows: the format reward; the run's other columns NaN)
      r_i = NaN                                        (other rows: not applicable)

  Advantage stage: in a group holding verdict rows the answers and the verdicts are normalised each in their own
  sub-group (``A = r - mean``, divided by the sub-group's std under TRL's ``scale_rewards="group"``, the spread of
  those rows under ``"batch"``); other groups keep TRL's advantages. ``verdict_rows=0`` is the untrained variant: one
  judgement of all ``G`` answers per open group, asked through the service outside the batch (group ``g`` of the
  list on process ``g % P``), parsed everywhere, never trained.

  Groups without a parsable judgement are counted (``unparsable_fraction``), logged with their text, and refused past
  ``max_unparsable`` of the batch's open groups with :class:`~trl_plugins.components.genrm.GenRMParseError` (the rule
  of :mod:`trl_plugins.components.genrm`: rows without a verdict get the group mean, never a silent zero). Open rows of
  a refill round or of an evaluation batch are not judged (the sampling stage does not run for them): group mean, all
  ``G`` slots answers.
* ``urpo_judge`` (weight ``judge_weight``) -- training the referee. A judge row's prompt is the same judge format
  filled with a preference example (:func:`preference_judge_rows` turns ``(prompt, chosen, rejected...)`` rows into
  such rows, the responses in a seeded random order, the position of the chosen one in ``best_column``); its
  completion is the policy's judgement, and ``r = 1`` when the parsed scores put the labelled best response strictly
  first, else ``0`` (an unparsable judgement is a wrong answer here: the policy is being taught the format). Other rows:
  None (NaN).

**What the paper says and what is reconstructed.** No official code was found (searched GitHub code, issues,
docs and web pages for the title, arXiv id, authors and Moore Threads' repositories on 2026-11-28; the AAAI 2026
page and the paper summaries describe one GRPO loop over the three data kinds, the model first writing candidate
responses and then rewarding them by ground-truth checks or by its own ranking, referee and player improving
together in that one loop). The referee's judgements of open groups are therefore verdict rows of the same step; they
have no label on open-ended prompts, so their reward is the format (a parsable score list) -- reconstructed, like ``k`` verdicts per group (their mean is the
answers' reward: a vote of ``k``), the ``G - k`` answers the group then holds (the group still costs exactly ``G``
rollouts), the sub-group advantages, the judge-format wording, the 1-10 score list, the strict-argmax agreement
reward, the [0, 1] rescaling and sampling the verdicts with the run's generation settings. The referee also learns
from the judge-format rows of preference data (labelled), mixed into the same batches (e.g. with
:func:`preference_judge_rows` and ``datasets.concatenate_datasets``).

Why the generation service and not :class:`~trl_plugins.components.genrm.HFGenRMBackend`: that backend loads its own
frozen copy of a model on every process and generates locally -- it would judge with the initial weights, not the
policy being trained, and it does not see a ZeRO-3 / FSDP-sharded policy. The generation service samples from the
current policy weights, collectively (the same path as ``clpo``'s rewrites), and counts in the rollout budget
(``plugin_generation_budget``). A judge request holds the question and the group's answers, and its reply is cut at
``max_completion_length`` like any completion: leave room for the judgement (a cut reply has no ``<scores>`` list and
is unparsable). A run whose batches hold no judge rows can set ``judge_weight=0`` (otherwise the ``urpo_judge``
column is None everywhere and the reward guard warns that it scored nothing).

Verdict rows need ``tools`` / ``rollout_func`` off (deferred rows) and ``2 <= verdict_rows <= num_generations - 2``
(refused when the trainer is built, naming both values).

Neutral setting: ``self_judge_weight=0`` and ``judge_weight=0`` -- no column, no hook (vanilla GRPO, tested).
Metrics: ``judged_groups``, ``unparsable_fraction``, ``self_score_mean`` (the mean raw score the referee gave),
``verdict_parsable_fraction`` (verdict rows with a parsable score list), ``verdict_fraction`` (verdict rows of the
batch), ``unjudged_fraction`` (open answers without a judgement: refill / eval), ``judge_accuracy`` (judge rows whose
verdict agrees with the label).
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    PromptContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_id_lists, gather_objects_together
from trl_plugins.api.reasons import without_images
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import check_template, completion_text
from trl_plugins.components.genrm import GenRMParseError, neutral_fill
from trl_plugins.components.steps import question_text

logger = logging.getLogger(__name__)

SELF_COLUMN = "urpo_self_judge"
JUDGE_COLUMN = "urpo_judge"
#: per-row annotation written at the sampling stage: the raw score the referee gave the row (None: unparsable)
SCORE_KEY = "urpo_score"
#: per-row annotation of a verdict row (trained self-judgement): its reward, 1.0 parsable / 0.0 not
VERDICT_KEY = "urpo_verdict"

#: The unified judge format (our wording; reconstructed): fields {question}, {responses}, {n}, {low}, {high}.
JUDGE_INSTRUCTION = (
    "You are an impartial referee. Below are a request and {n} candidate responses to it. Judge how well each "
    "response serves the request: correctness, helpfulness, completeness and how closely it follows the "
    "instructions; ignore length and style unless they matter to the request. Reason briefly, then end with one line "
    "that gives every response a score from {low} to {high}, in the order of the responses, separated by commas, "
    "inside <scores></scores> -- e.g. for three responses <scores>7, 2, 9</scores>.\n\n"
    "[Question]\n{question}\n[End of Question]\n\n{responses}"
)
_SCORES_RE = re.compile(r"<scores>(.*?)</scores>", re.DOTALL | re.IGNORECASE)
_NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def render_responses(responses: Sequence[str]) -> str:
    """The responses block of the judge format: ``[Response k]`` ... ``[End of Response k]`` sections, k from 1."""
    return "\n\n".join(f"[Response {k}]\n{r}\n[End of Response {k}]" for k, r in enumerate(responses, start=1))


def judge_prompt(question: str, responses: Sequence[str], *, instruction: str = JUDGE_INSTRUCTION,
                 low: float = 1.0, high: float = 10.0) -> str:
    """The judge request's text for ``question`` and its ``responses`` (the unified format of both halves)."""
    return instruction.format(question=question, responses=render_responses(responses), n=len(responses),
                              low=f"{low:g}", high=f"{high:g}")


def parse_scores(text: Any, n: int, low: float = 1.0, high: float = 10.0) -> list[float] | None:
    """The ``n`` scores of a judgement: the numbers of its last ``<scores>...</scores>`` (``<think>`` blocks
    skipped); None when there is no such block, it does not hold exactly ``n`` numbers, or one is outside
    ``[low, high]``."""
    if not isinstance(text, str):
        return None
    blocks = _SCORES_RE.findall(_THINK_RE.sub("", text))
    if not blocks:
        return None
    values = [float(x) for x in _NUMBER_RE.findall(blocks[-1])]
    if len(values) != n or not all(low <= v <= high for v in values):
        return None
    return values


def agreement(scores: Sequence[float] | None, best: int) -> float:
    """Judge-row reward: 1.0 when response ``best`` (1-based) has the strictly highest of ``scores``, else 0.0
    (also for an unparsable judgement, None)."""
    if scores is None or not 1 <= best <= len(scores):
        return 0.0
    top = scores[best - 1]
    return float(all(s < top for k, s in enumerate(scores) if k != best - 1))


def self_judge_rewards(scores: Sequence[float | None], is_open: Sequence[bool], group_size: int,
                       low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``urpo_self_judge`` column from (N,) raw referee scores (None: no judgement) and (N,) open-row flags.

    Returns:
        (N,) rewards: ``(s - low) / (high - low)`` on judged open rows, the group's mean on open rows without a score
        (0.0 when none of the group has one), NaN on other rows; and the (N,) bool mask of open rows without a score.
    """
    raw = torch.tensor([math.nan if s is None or not o else (float(s) - low) / (high - low)
                        for s, o in zip(scores, is_open, strict=True)], dtype=torch.float32)
    filled, missing = neutral_fill(raw, group_size)
    open_mask = torch.tensor(list(is_open), dtype=torch.bool)
    return torch.where(open_mask, filled, torch.full_like(filled, math.nan)), missing & open_mask


def subgroup_advantages(rewards: torch.Tensor, keys: torch.Tensor, scale: str, rows: torch.Tensor) -> torch.Tensor:
    """Group-relative advantages within sub-groups: ``A = r - mean`` over the ``rows`` sharing a key, divided by that
    sub-group's std (``scale="group"``, Bessel-corrected, + 1e-4 as TRL), the std of the ``rows``' rewards
    (``"batch"``) or nothing (``"none"``).

    Args:
        rewards: (N,) combined rewards (NaN: left out of the statistics, advantage 0).
        keys: (N,) long sub-group ids (e.g. ``group_id * 2 + is_verdict``).
        scale: TRL's ``scale_rewards``.
        rows: (N,) bool, the rows to compute (others get 0).
    Returns:
        (N,) advantages.
    """
    r = rewards.float()
    use = rows & ~torch.isnan(r)
    adv = torch.zeros_like(r)
    spread = r[use].std() if int(use.sum()) > 1 else torch.tensor(0.0)
    for key in torch.unique(keys[use]).tolist():
        members = use & (keys == key)
        values = r[members]
        centred = values - values.mean()
        if scale == "group" or scale is True:
            centred = centred / ((values.std() if values.numel() > 1 else torch.tensor(0.0)) + 1e-4)
        elif scale == "batch":
            centred = centred / (spread + 1e-4)
        adv[members] = centred
    return adv


def preference_judge_rows(rows: Iterable[dict], *, prompt: str = "prompt", chosen: str = "chosen",
                          rejected: str = "rejected", kind_column: str = "urpo_kind", judge_kind: str = "judge",
                          best_column: str = "urpo_best", instruction: str = JUDGE_INSTRUCTION, low: float = 1.0,
                          high: float = 10.0, conversational: bool = True, seed: int = 0) -> list[dict]:
    """Preference data in the judge format (URPO's recast of preference pairs), to mix into the training set.

    Each row's ``rejected`` may be one response or a list (an N-way example: one chosen among several). The chosen and
    rejected responses are shuffled (a seeded order per row, so the chosen one is not always first), and the new row
    is ``{"prompt": judge request, kind_column: judge_kind, best_column: position of the chosen one (1-based)}``.
    Prompts and responses may be strings or message lists (their last user / assistant text is used). The other
    columns of the row are dropped (the judge row has no verifier answer). Raises ``ValueError`` naming the row when a
    column is missing or empty.
    """
    out, rng = [], random.Random(seed)
    for i, row in enumerate(rows):
        missing = [c for c in (prompt, chosen, rejected) if row.get(c) in (None, "", [])]
        if missing:
            raise ValueError(f"preference_judge_rows: row {i} has no {', '.join(missing)}.")
        others = row[rejected]
        others = others if isinstance(others, list) and not _is_messages(others) else [others]
        responses = [completion_text(row[chosen])] + [completion_text(r) for r in others]
        order = list(range(len(responses)))
        rng.shuffle(order)
        text = judge_prompt(question_text(row[prompt]), [responses[k] for k in order], instruction=instruction,
                            low=low, high=high)
        out.append({"prompt": [{"role": "user", "content": text}] if conversational else text,
                    kind_column: judge_kind, best_column: order.index(0) + 1})
    return out


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


@dataclass
class UrpoOptions(PluginOptions):
    self_judge_weight: float = option(
        1.0, min=0.0, help="TRL reward weight of the urpo_self_judge column (the policy's scores of its own open "
        "groups); 0 = no self-judging.",
    )
    judge_weight: float = option(
        1.0, min=0.0, help="TRL reward weight of the urpo_judge column (judge rows: the verdict agrees with the "
        "label); 0 = the judge rows are not rewarded by urpo.",
    )
    kind_column: str = option("urpo_kind", help="Dataset column holding each row's kind (open, judge or other).")
    open_kind: str = option("open", help="Kind of the open-ended rows, rewarded by the policy judging its group.")
    judge_kind: str = option("judge", help="Kind of the judge-format rows (preference data, preference_judge_rows).")
    default_kind: str = option(
        "verifiable", help="Kind of rows without a kind_column value (e.g. 'open' for a purely open-ended dataset).",
    )
    best_column: str = option("urpo_best", help="Judge rows: position (1-based) of the labelled best response.")
    score_low: float = option(1.0, reconstructed=True, help="Lowest score the referee may give.")
    score_high: float = option(10.0, reconstructed=True, help="Highest score the referee may give.")
    instruction: str = option(
        JUDGE_INSTRUCTION, reconstructed=True,
        help="The judge format; fields {question}, {responses} (required), {n}, {low}, {high}.",
    )
    greedy: bool = option(
        False, reconstructed=True, help="Judge the groups greedily instead of sampling with the run's settings.",
    )
    verdict_rows: int = option(
        2, min=0, reconstructed=True,
        help="Self-judgements trained in their step: this many of each open group's G slots are the referee's "
        "verdicts on the group's other G - verdict_rows answers (sampled under the judge prompt, trained under it, "
        "advantages in their own sub-group, reward 1 for a parsable verdict); the answers' reward is the mean of the "
        "parsable verdicts. 0 = one untrained judgement per group through the generation service.",
    )
    max_unparsable: float = option(
        0.5, min=0.0, max=1.0, reconstructed=True,
        help="Largest share of the batch's self-judgements that may be unparsable; above it the step fails naming "
        "the group and the text (components.genrm's rule). Their rows get their group's mean (a neutral advantage).",
    )

    def validate(self) -> None:
        if not (math.isfinite(self.score_low) and math.isfinite(self.score_high) and self.score_low < self.score_high):
            raise PluginConfigError(
                f"Plugin 'urpo': score range [{self.score_low}, {self.score_high}] is empty; allowed: finite "
                "score_low < score_high.")
        check_template("urpo", "instruction", self.instruction, ("question", "responses", "n", "low", "high"),
                       required=("question", "responses"))
        kinds = {"open_kind": self.open_kind, "judge_kind": self.judge_kind}
        if self.open_kind == self.judge_kind or not all(kinds.values()):
            raise PluginConfigError(
                f"Plugin 'urpo': open_kind={self.open_kind!r} and judge_kind={self.judge_kind!r}; allowed: two "
                "different non-empty names.")
        if self.verdict_rows == 1:
            raise PluginConfigError(
                "Plugin 'urpo': verdict_rows=1; allowed: 0 (untrained self-judgements) or 2 and more (the verdicts' "
                "advantages are relative to each other: one verdict alone would get 0).")
        for name in ("kind_column", "best_column"):
            if not getattr(self, name):
                raise PluginConfigError(f"Plugin 'urpo': {name}={getattr(self, name)!r}; allowed: a column name.")

    @property
    def active(self) -> bool:
        return self.self_judge_weight > 0 or self.judge_weight > 0

    @property
    def trains_verdicts(self) -> bool:
        """Whether the self-judgements are rows of the batch (``verdict_rows > 0`` with self-judging on)."""
        return self.self_judge_weight > 0 and self.verdict_rows > 0

    def check_group_size(self, num_generations: int) -> None:
        """Refuse a group too small to hold two answers to judge and ``verdict_rows`` verdicts (at least two: their
        advantages are relative to each other)."""
        k = self.verdict_rows
        if self.trains_verdicts and (k < 2 or num_generations - k < 2):
            raise PluginConfigError(
                f"Plugin 'urpo': verdict_rows={k} with num_generations={num_generations}; allowed: 0 (untrained "
                "self-judgements) or 2 <= verdict_rows <= num_generations - 2 (two verdicts or more, relative to each "
                "other, on two answers or more).")


class UrpoPlugin(Plugin):
    """The policy judges its own open-ended groups (rewards) and is trained as a judge on preference data."""

    name = "urpo"
    version = "0.2.0"
    paper = "URPO: A Unified Reward & Policy Optimization Framework for Large Language Models, arXiv:2507.17515"
    summary = ("One model is player and referee: open-ended groups rewarded by the policy's own judgements of them, "
               "trained as verdict rows in the same step; judge-format preference rows rewarded by agreement.")
    Options = UrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the three data kinds in one generative format, the policy judging its own "
        "open-ended group inside the GRPO loop and preference data recast as judge prompts rewarded by agreement "
        "follow the paper; the judge wording, the score list, the rescaling, the agreement rule and one judgement "
        "per group are reconstructed. The self-judgements on open groups are verdict rows trained in the step that "
        "writes them, rewarded by their format (reconstructed: no label exists for them).",
    )
    claim_metric = ("judge_accuracy", "judge rows whose verdict agrees with the preference label")
    multi_turn = ("its referee reads one question and each completion's text; tool calls and tool results are part of "
                  "that text only as far as completion_text renders them.")
    image_inputs = without_images(
        "its referee is asked through the generation service with the prompt's text, and its verdict rows are "
        "deferred rows (PromptContext.defer), sampled from token ids alone")
    reconstructed = (
        "the judge format wording and the `<scores>s_1, ..., s_G</scores>` verdict with scores 1 to 10",
        "self-judge reward = (s - low) / (high - low); rows of an unparsable judgement get their group's mean",
        "judge-row reward = 1 when the labelled best response gets the strictly highest score (else 0)",
        "verdict_rows = 2 of each open group's G slots are verdicts (trained under the judge prompt, reward 1 when "
        "parsable, advantages in their own sub-group); the answers' reward is the mean over the parsable verdicts",
        "the verdicts are sampled with the run's generation settings",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._scale = "group"

    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_generation_prompts", "trl_plugins_transform_advantages"):
            return self.options.trains_verdicts
        return self.options.active

    def overwritten(self) -> tuple[str, ...]:
        # the groups holding verdict rows get sub-group advantages recomputed from their rewards
        return ("advantages",) if self.options.trains_verdicts else ()

    def _kind(self, row: Any) -> str:
        value = row.get(self.options.kind_column) if isinstance(row, dict) else None
        return self.options.default_kind if value in (None, "") else str(value)

    # ------------------------------------------------------------------------------------------ columns
    @hookimpl
    def trl_plugins_reward_functions(self, args):
        o, funcs = self.options, []
        if o.self_judge_weight > 0:
            funcs.append(placeholder_column(SELF_COLUMN, o.self_judge_weight))
        if o.judge_weight > 0:
            plugin = self

            def urpo_judge(prompts, completions, **kwargs):
                n = len(completions)
                kinds = kwargs.get(o.kind_column) or [None] * n
                bests = kwargs.get(o.best_column) or [None] * n
                out = []
                for i, (kind, best, completion) in enumerate(zip(kinds, bests, completions)):
                    if plugin._kind({o.kind_column: kind}) != o.judge_kind:
                        out.append(None)
                        continue
                    if not isinstance(best, int) or isinstance(best, bool) or best < 1:
                        raise PluginConfigError(
                            f"urpo: judge row {i} of the reward call has {o.best_column}={best!r}; allowed: the "
                            "1-based position of the labelled best response (preference_judge_rows writes it).")
                    n_resp = len(re.findall(r"\[End of Response \d+\]", question_text(prompts[i])))
                    out.append(agreement(parse_scores(completion_text(completion), n_resp, o.score_low, o.score_high),
                                         best))
                return out

            urpo_judge.reward_weight = o.judge_weight
            funcs.append(urpo_judge)
        return funcs

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.options.check_group_size(int(args.num_generations))
        self._scale = getattr(trainer, "scale_rewards", getattr(args, "scale_rewards", "group"))

    # ------------------------------------------------------------------------------------------ referee
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Trained verdicts: the last ``verdict_rows`` slots of every open group are left out of the first round (the
        referee fills them once the group's answers exist)."""
        o, G = self.options, ctx.num_generations
        o.check_group_size(G)
        for i, row in enumerate(ctx.rows):
            if self._kind(row) == o.open_kind and ctx.index_in_group[i] >= G - o.verdict_rows:
                ctx.defer(i)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """The current policy judges every open group of the batch (collective), scores into the rows' annotations."""
        o = self.options
        if ctx.mode != "train" or o.self_judge_weight == 0:
            return
        G, tok = ctx.num_generations, ctx.tokenizer
        o.check_group_size(G)
        flags = torch.tensor([self._kind(r) == o.open_kind for r in ctx.rows], dtype=torch.long,
                             device=ctx.device)
        is_open = ctx.gather(flags).cpu().bool().tolist()  # (N,)
        if not any(is_open):
            return  # the same decision on every process: nobody calls the service
        encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        questions = gather_id_lists(ctx, [encode(question_text(p)) if ix == 0 else []
                                          for p, ix in zip(ctx.prompts, ctx.index_in_group)])
        answers = gather_id_lists(ctx, [encode(completion_text(c)) for c in ctx.completions])
        groups = [g for g in range(len(is_open) // G) if all(is_open[g * G:(g + 1) * G])]
        conversational = not isinstance(ctx.prompts[0], str) if len(ctx) else True
        players = G - o.verdict_rows if o.trains_verdicts else G

        def request(g: int):
            text = judge_prompt(tok.decode(questions[g * G], skip_special_tokens=True),
                                [tok.decode(answers[g * G + j], skip_special_tokens=True) for j in range(players)],
                                instruction=o.instruction, low=o.score_low, high=o.score_high)
            return [{"role": "user", "content": text}] if conversational else text

        if o.trains_verdicts:
            verdicts = self._verdict_rows(ctx, groups, players, request)
        else:
            verdicts = self._one_judgement(ctx, groups, request)
        scores: dict[int, list[float] | None] = {}  # group -> per-answer mean of its parsable verdicts
        for g, texts in verdicts.items():
            parsed = [v for v in (parse_scores(t, players, o.score_low, o.score_high) for t in texts) if v is not None]
            scores[g] = [sum(v[j] for v in parsed) / len(parsed) for j in range(players)] if parsed else None
        for i, gi in enumerate(ctx.global_index):
            g, j = divmod(gi, G)
            if g not in scores:
                continue
            if j < players:
                ctx.annotations[i][SCORE_KEY] = None if scores[g] is None else scores[g][j]
            else:
                text = verdicts[g][j - players]
                ctx.annotations[i][VERDICT_KEY] = float(parse_scores(text, players, o.score_low, o.score_high)
                                                        is not None)
        self._report(ctx, verdicts, scores, players)

    def _one_judgement(self, ctx: RolloutContext, groups: list[int], request) -> dict[int, list[str]]:
        """``verdict_rows=0``: one judgement per open group through the generation service, outside the batch (group
        ``k``-th of the list asked on process ``k % P``); every process gets every reply."""
        B, P, tok = len(ctx), max(int(ctx.run.num_processes), 1), ctx.tokenizer
        p = ctx.global_index[0] // B if B else 0
        mine = [g for k, g in enumerate(groups) if k % P == p]
        replies = ctx.service.generate(prompts=[request(g) for g in mine], greedy=self.options.greedy)  # collective
        local = [[] for _ in range(B)]
        for j, reply in enumerate(replies):
            local[j] = list(reply.completion_ids)
        gathered = gather_id_lists(ctx, local)  # process q's k-th request sits at q * B + k
        return {g: [tok.decode(gathered[(k % P) * B + k // P], skip_special_tokens=True)]
                for k, g in enumerate(groups)}

    def _verdict_rows(self, ctx: RolloutContext, groups: list[int], players: int, request) -> dict[int, list[str]]:
        """Trained verdicts: every deferred slot of an open group is filled with a judgement of the group's
        ``players`` answers, sampled by the current policy under the judge prompt and trained under it (its sampling
        log-probs kept); returns every group's verdict texts (gathered)."""
        G, tok, open_groups = ctx.num_generations, ctx.tokenizer, set(groups)
        rows = [i for i, gi in enumerate(ctx.global_index) if gi // G in open_groups and gi % G >= players]
        prompts = [request(ctx.global_index[i] // G) for i in rows]
        replies = ctx.service.generate(prompts=prompts, greedy=self.options.greedy)  # collective: maybe no request
        for i, prompt, reply in zip(rows, prompts, replies):
            ids, lps = (reply.completion_ids, reply.logprobs) if reply.completion_ids else ([tok.eos_token_id], None)
            ctx.replace_row(i, list(ids), logprobs=lps, training_prompt=prompt, prompt_swapped=False)
        mine = set(rows)
        texts = gather_id_lists(ctx, [ctx.completion_ids[i] if i in mine else [] for i in range(len(ctx))])
        return {g: [tok.decode(texts[g * G + j], skip_special_tokens=True) for j in range(players, G)]
                for g in groups}

    def _report(self, ctx: RolloutContext, verdicts: dict[int, list[str]], scores: dict, players: int) -> None:
        """Metrics, and the refusal of a batch where too many groups got no parsable judgement."""
        o = self.options
        bad = [(g, verdicts[g][0]) for g in verdicts if scores[g] is None]
        ctx.log_metric("judged_groups", float(len(verdicts)))
        ctx.log_metric("unparsable_fraction", len(bad) / len(verdicts) if verdicts else 0.0)
        parsed = [s for v in scores.values() if v is not None for s in v]
        if parsed:
            ctx.log_metric("self_score_mean", sum(parsed) / len(parsed))
        if o.trains_verdicts and verdicts:
            n_ok = sum(parse_scores(t, players, o.score_low, o.score_high) is not None
                       for texts in verdicts.values() for t in texts)
            ctx.log_metric("verdict_parsable_fraction", n_ok / (len(verdicts) * o.verdict_rows))
        if bad:
            g, text = bad[0]
            message = (f"The policy as referee (plugin 'urpo') gave no parsable <scores> list of {players} scores in "
                       f"[{o.score_low:g}, {o.score_high:g}] for {len(bad)} of {len(verdicts)} open groups; first: "
                       f"group {g}, text {text[:300]!r}")
            if len(bad) / len(verdicts) > o.max_unparsable:
                raise GenRMParseError(f"{message}. That is more than max_unparsable={o.max_unparsable:g}.")
            logger.warning("%s.", message)

    # ------------------------------------------------------------------------------------------ rewards
    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o, names = self.options, ctx.reward_func_names
        local = list(ctx.local_annotations) or [{} for _ in ctx.local_rows]
        triples = gather_objects_together(
            ctx, self.name, lambda: [(self._kind(r) == o.open_kind, a.get(SCORE_KEY), self._kind(r) == o.judge_kind,
                                      a.get(VERDICT_KEY)) for r, a in zip(ctx.local_rows, local)])
        verdict = [t[3] for t in triples]
        is_verdict = torch.tensor([v is not None for v in verdict], dtype=torch.bool)
        is_open = [t[0] and v is None for t, v in zip(triples, verdict)]  # the answers of open groups
        if SELF_COLUMN in names:
            values, missing = self_judge_rewards([t[1] for t in triples], is_open, ctx.num_generations,
                                                 o.score_low, o.score_high)
            matrix = ctx.rewards_per_func.clone()
            matrix[:, names.index(SELF_COLUMN)] = values.to(matrix)
            if is_verdict.any():  # a verdict is rewarded as a verdict only (the run's columns score answers)
                matrix[is_verdict] = math.nan
                matrix[is_verdict, names.index(SELF_COLUMN)] = torch.tensor(
                    [v for v in verdict if v is not None], dtype=matrix.dtype, device=matrix.device)
            ctx.rewards_per_func = matrix
            if any(is_open):
                ctx.log_metric("unjudged_fraction", missing.float().sum().item() / sum(is_open))
        if JUDGE_COLUMN in names:
            judged = torch.tensor([t[2] for t in triples], dtype=torch.bool)
            if judged.any():
                column = ctx.rewards_per_func[:, names.index(JUDGE_COLUMN)]
                ctx.log_metric("judge_accuracy", column[judged].nan_to_num(0.0).mean().item())

    # ------------------------------------------------------------------------------------------ advantages
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Groups holding verdict rows: answers and verdicts normalised each in their own sub-group (TRL's
        ``scale_rewards``); every other group keeps the incoming advantages."""
        is_verdict = torch.tensor([VERDICT_KEY in a for a in ctx.annotations], dtype=torch.bool)
        if ctx.mode != "train" or not is_verdict.any():
            return
        groups = ctx.group_ids.cpu()
        mixed = torch.isin(groups, groups[is_verdict])
        sub = subgroup_advantages(ctx.rewards.cpu(), groups * 2 + is_verdict.long(), self._scale, mixed)
        advantages = ctx.advantages.clone()
        rows = mixed.to(advantages.device)
        values = sub.to(advantages)
        advantages[rows] = values[rows] if advantages.dim() == 1 else values[rows].unsqueeze(1).expand_as(
            advantages[rows])
        ctx.advantages = advantages
        ctx.log_metric("verdict_fraction", is_verdict.float().mean().item())
