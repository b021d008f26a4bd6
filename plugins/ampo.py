"""AMPO — Adaptive Multi-Guidance Policy Optimization (arXiv:2510.02227, "More Than One Teacher: Adaptive
Multi-Guidance Policy Optimization for Diverse Exploration").

Guidance on demand, from several teachers: only a group whose own rollouts mostly fail gets external solutions, and
among the teachers' solutions the ones the **student finds most comprehensible** replace failed rollouts; the mixed
group is trained with LUFFY's shaped off-policy branch. Facts from the official code (``EnigmaYYYY/AMPO``:
``ampo/verl/verl/adaptive_mix_src/mix_dapo_trainer.py`` ``mix_off_policy_rollout``,
``ampo/verl/verl/workers/reward_manager/prob.py``, ``exp_scripts/train_ampo.sh``):

Checked against ``EnigmaYYYY/AMPO@647e2e4de7f0bdcd2787fa9941d4dbc317facb7e``: ``exp_scripts/train_ampo.sh`` sets 8
rollouts (``:63``), 4 teacher solutions at most (``:26``), ``pass_num`` 4 with adaptive k (``:27-28``), ``p_div_p_0.1``
(``:33``), ``best_k`` (``:38``), whole solutions (``:165-166``), ``threshold_0`` / ``mean_exp_log_softmax``
(``:184-185``), format coefficient 0.1 (``:190``); with adaptive k the trainer uses a fixed 0.5 success threshold and
``k = min(#solutions, int(G * 0.5) - #successes)`` (``ampo/verl/verl/adaptive_mix_src/mix_dapo_trainer.py:1397-1401``).

1. Teachers: each prompt carries solutions from several teachers (up to 4, ``max_available_targets``) -- here a
   dataset column holding a list of solutions (strings, or dicts with ``content``), or teacher models queried per
   needing group through the teacher components (``teachers="endpoint"`` / ``"hf"``, one solution per model).
2. Trigger: with G = 8 and ``pass_num = 4`` a group is guided when fewer than ``pass_fraction * G`` = 4 of its
   rollouts succeed (``trigger="below_pass"``), and the number of injected solutions is adaptive
   (``use_adaptive_k``): ``k = min(#teacher solutions, floor(pass_fraction * G) - #successes)``, restoring a
   roughly 1:1 ratio of correct and wrong rollouts. ``trigger="all_fail"`` guides only groups with no success, as
   the paper's first version describes (then ``k = min(#solutions, floor(pass_fraction * G))``).
3. Comprehension-based selection (``off_policy_reward_manager="prob"``, ``compute_score_name=
   "mean_exp_log_softmax"``): each solution is scored by the **mean probability the policy gives to the ground-truth
   answer's tokens** when they follow the solution's reasoning (``selection="answer_likelihood"``); the ``k``
   best-scoring solutions are used (``target_selection_strategy="best_k"``). Which text is scored
   (``answer_span``): ``"answer_tag"`` (official ``replace_answer_with_gt``) rewrites the solution with the ground
   truth (``answer_column``) as its answer: a solution with exactly one ``<answer>`` tag followed by non-blank text
   keeps everything up to the tag and the whitespace after it (one space when none), then ``ground truth + " " +
   "</answer>"``; any other solution gets ``"<answer> " + ground truth + " </answer>"`` appended (official: after
   dropping its last ``len(suffix) + 5`` padded ids, which are padding unless the solution fills the response
   length [reconstructed: the whole solution is kept]); the scored tokens are the ground truth's, tokenized apart
   from the text around them [reconstructed]. ``"last_occurrence"`` scores the last occurrence of the answer text
   in the solution as written (0 when it does not occur). The injected completion is the teacher's solution as
   written either way. The official score is then ``(1 - c) * shaped(likelihood - scoreA) + c * format``, with
   ``c = format_coefficient = 0.1`` and ``format`` = 1 when the solution holds each of ``format_tags`` (``<answer>``,
   ``</answer>``: the official ``R1_nothink`` format) exactly once and in that order, else 0; the official shaping
   ``threshold_0`` (0 below 0) of ``likelihood - scoreA`` with ``scoreA = 0`` (the official script's on-policy
   reward manager is ``naive``, which sets no scoreA) is the likelihood itself. ``"sequence_likelihood"`` scores the
   mean token probability of the whole solution, ``"first"`` keeps the column's order.
4. Replacement: ``k`` failed rollouts of the group, chosen at random (seeded, the same on every process), are
   replaced by the selected solutions (whole solutions, ``min/max_prefix_ratio = 1.0``), best first, trained after
   the original prompt, fully off-policy: shaped branch ``-A p/(p+gamma)``, ``gamma = 0.1``
   (``off_policy_reshape="p_div_p_0.1"``), NaN sampling log-probs.

Advantages: the official run centres them without std scaling (``norm_adv_by_std_in_grpo=False``,
``exp_scripts/train_ampo.sh:117``): set ``scale_rewards="none"`` (warned otherwise, as TRL's default ``"group"``
divides by the group std).

Rewards of the injected rows are computed by the run's reward functions like every row. Scoring costs one no-grad
forward over the candidate solutions of the guided groups, on the processes holding them. With teacher models, each
process queries the teachers for the guided groups whose rows it holds (a group split across two processes is asked
twice; use ``teacher_temperature=0`` for identical answers); a failing teacher stops every process together.
Metrics: ``guided_group_fraction``, ``injected_rows`` (teacher rollouts, counted apart from the policy's),
``injected_success_rate``, ``selected_score_mean``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RolloutContext, hookimpl, option
from trl_plugins.api.collectives import run_together
from trl_plugins.api.data_checks import cell_problem, check_column_filled, check_column_values
from trl_plugins.api.option_groups import OffPolicyOptions
from trl_plugins.api.reasons import edits_completions
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE
from trl_plugins.components.teacher import shared_teacher

from .rl_plus import demonstration_ids


@dataclass
class AmpoOptions(OffPolicyOptions, SuccessOptions):
    teachers: Literal["column", "endpoint", "hf"] = option(
        "column", help="Where the teachers' solutions come from: a dataset column with several solutions per prompt, "
        "or teacher models (OpenAI-compatible endpoints, local HF models) asked per guided group."
    )
    solutions_column: str = option(
        "teacher_solutions", help="teachers='column': column holding a list of solutions (strings or dicts with "
        "'content')."
    )
    teacher_models: list[str] = option(
        default_factory=list, help="teachers='endpoint' / 'hf': one served model name (endpoint) or name/path (hf) per "
        "teacher."
    )
    teacher_base_urls: list[str] = option(
        default_factory=list, help="teachers='endpoint': one base URL per teacher (or one URL serving every model)."
    )
    teacher_api_key_env: str | None = option(None, help="Environment variable holding the endpoints' key.")
    teacher_timeout: float = option(
        120.0, min=0.0, min_exclusive=True, help="Seconds per teacher endpoint request before it counts as failed."
    )
    teacher_max_retries: int = option(4, min=0, help="Retries (with backoff) of a failed teacher endpoint request.")
    teacher_temperature: float = option(0.0, min=0.0, help="Teacher sampling temperature.")
    max_teachers: int = option(4, min=1, help="Most solutions considered per prompt (official max_available_targets).")
    trigger: Literal["below_pass", "all_fail"] = option(
        "below_pass", help="Guide groups with fewer than pass_fraction * G successes (official code) or only all-fail "
        "groups (the paper's first version)."
    )
    pass_fraction: float = option(
        0.5, min=0.0, max=1.0, min_exclusive=True,
        help="pass_num / G (official 4 / 8; with use_adaptive_k the official code fixes it at 0.5 whatever pass_num); "
        "the adaptive k fills the group up to this many successes.",
    )
    selection: Literal["answer_likelihood", "sequence_likelihood", "first"] = option(
        "answer_likelihood", help="Comprehension score: mean policy probability of the answer's tokens after the "
        "solution's reasoning (official), of every solution token, or the column's order."
    )
    answer_column: str = option("answer", help="selection='answer_likelihood': column with the ground-truth answer.")
    answer_span: Literal["answer_tag", "last_occurrence"] = option(
        "answer_tag", help="selection='answer_likelihood': score the ground truth written as the solution's answer "
        "after its <answer> tag (official replace_answer_with_gt), or the last occurrence of the answer text in the "
        "solution as written."
    )
    format_coefficient: float = option(
        0.1, min=0.0, max=1.0, help="Weight c of the format reward in the score (1 - c) * likelihood + c * format "
        "(official 0.1; 0 = likelihood only)."
    )
    format_tags: list[str] = option(
        default_factory=lambda: ["<answer>", "</answer>"],
        help="Tags the format reward wants exactly once each, in this order; also the answer tags of "
        "answer_span='answer_tag' (official R1_nothink: <answer>, </answer>).",
    )
    seed: int = option(0, help="Seed of the random choice of replaced rollouts (with the step and group).")

    def validate(self) -> None:
        if self.teachers in ("endpoint", "hf") and not self.teacher_models:
            raise PluginConfigError(f"Plugin 'ampo' with teachers={self.teachers!r} needs teacher_models (one per "
                                    "teacher).")
        if len(self.format_tags) != 2 or not all(isinstance(t, str) and t for t in self.format_tags):
            raise PluginConfigError(
                f"Option 'format_tags' of plugin 'ampo' got {self.format_tags!r}; allowed: two non-empty strings, the "
                "opening and the closing answer tag."
            )
        if self.teachers == "endpoint" and len(self.teacher_base_urls) not in (1, len(self.teacher_models)):
            raise PluginConfigError(
                f"Plugin 'ampo': teacher_base_urls has {len(self.teacher_base_urls)} URLs for "
                f"{len(self.teacher_models)} teacher_models; give one URL per teacher, or one for all."
            )


# ============================================================================================= pure functions
def solution_texts(value: Any, limit: int) -> list[str]:
    """The teacher solutions of one dataset value: a list of strings or of dicts with ``content`` (one string: one
    solution), blanks dropped, at most ``limit``."""
    items = [value] if isinstance(value, (str, dict)) else list(value or [])
    texts = [item.get("content") if isinstance(item, dict) else item for item in items]
    return [t for t in texts if isinstance(t, str) and t.strip()][:limit]


SOLUTIONS_ALLOWED = "a list of solutions (strings, or dicts with a 'content' string), one string, or None"


def solutions_ok(value: Any) -> bool:
    """What :func:`solution_texts` can read: None, a string, a dict, or a list / tuple of strings and dicts."""
    if value is None or isinstance(value, (str, dict)):
        return True
    return isinstance(value, (list, tuple)) and all(item is None or isinstance(item, (str, dict)) for item in value)


def guidance_count(successes: int, available: int, group_size: int, pass_fraction: float, trigger: str) -> int:
    """How many teacher solutions a group gets: 0 unless triggered; else ``min(available, floor(pass_fraction * G) -
    successes)`` (the official adaptive k), never more than the group's failed rollouts."""
    target = math.floor(pass_fraction * group_size + 1e-9)
    triggered = successes == 0 if trigger == "all_fail" else successes < target
    if not triggered:
        return 0
    return max(0, min(available, target - successes, group_size - successes))


def answer_token_span(solution: str, answer: str, tokenizer: Any) -> tuple[list[int], int, int]:
    """Token ids of ``solution`` with its last occurrence of ``answer`` tokenized apart, and that span ``[start,
    end)``; ``(ids, 0, 0)`` when the answer does not occur."""
    at = solution.rfind(answer) if answer else -1
    if at < 0:
        return list(tokenizer(solution, add_special_tokens=False)["input_ids"]), 0, 0
    return spans_apart((solution[:at], answer, solution[at + len(answer):]), tokenizer)


def format_reward(solution: str, tags: list[str]) -> float:
    """1.0 when ``solution`` holds each tag of ``tags`` exactly once, in that order (official ``R1_nothink``
    format), else 0.0."""
    if any(solution.count(t) != 1 for t in tags):
        return 0.0
    positions = [solution.index(t) for t in tags]
    return 1.0 if positions == sorted(positions) else 0.0


def ground_truth_answer_text(solution: str, answer: str, tags: list[str]) -> tuple[str, str, str]:
    """``(before, ground truth, after)``: the solution rewritten with ``answer`` as its answer (official
    ``replace_answer_with_gt``, ``R1_nothink``). With exactly one opening tag followed by non-blank text: the text up
    to and including the tag plus the whitespace after it (one space when none); otherwise the whole solution plus
    ``open + " "``. ``after`` is ``" " + close``."""
    open_tag, close_tag = tags
    head, sep, rest = solution.partition(open_tag)
    if solution.count(open_tag) == 1 and rest.strip():
        lead = rest[: len(rest) - len(rest.lstrip(" \n\t\r"))] or " "
        return head + sep + lead, answer, " " + close_tag
    return solution + open_tag + " ", answer, " " + close_tag


def spans_apart(pieces: tuple[str, str, str], tokenizer: Any) -> tuple[list[int], int, int]:
    """Token ids of ``before + middle + after``, each piece tokenized apart, and the middle's span ``[start, end)``."""
    ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) if p else [] for p in pieces]
    return ids[0] + ids[1] + ids[2], len(ids[0]), len(ids[0]) + len(ids[1])


def selection_score(likelihood: float, format_score: float, format_coefficient: float) -> float:
    """The official comprehension score ``(1 - c) * max(likelihood, 0) + c * format`` (shaping ``threshold_0``,
    ``scoreA = 0``)."""
    return (1.0 - format_coefficient) * max(likelihood, 0.0) + format_coefficient * format_score


def mean_probability(logps: torch.Tensor, start: int = 0, end: int | None = None) -> float:
    """Mean of ``exp(logps[start:end])`` (0 for an empty span), the official ``mean_exp_log_softmax``."""
    span = logps[start:end]
    return float(span.float().exp().mean()) if span.numel() else 0.0


def replaced_slots(failed: list[int], k: int, generator: torch.Generator) -> list[int]:
    """``k`` of the group's ``failed`` slots, chosen uniformly at random with ``generator``, in the chosen order."""
    order = torch.randperm(len(failed), generator=generator).tolist()
    return [failed[j] for j in order[:k]]


# ============================================================================================= plugin
class AmpoPlugin(Plugin):
    """Multi-teacher guidance for failing groups, most comprehensible solutions first (sampling stage)."""
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = edits_completions("teacher solutions spliced into all-fail groups")
    claim_metric = ("guided_group_fraction", "groups guided by teacher solutions")

    name = "ampo"
    version = "0.1.0"
    paper = "More Than One Teacher: Adaptive Multi-Guidance Policy Optimization for Diverse Exploration, arXiv:2510.02227"
    summary = "Failing groups get teacher solutions (several teachers), the ones the policy finds likeliest, off-policy."
    Options = AmpoOptions
    official = OfficialSource(
        "EnigmaYYYY/AMPO", "647e2e4", verdict="faithful",
        files=("exp_scripts/train_ampo.sh",),
        note="The official run does not scale advantages by the group std (train_ampo.sh:117): use "
        "scale_rewards='none' (warned).",
    )
    replaces = ("failed completions of guided groups (teacher solutions, off-policy)",)
    reconstructed = (
        "answer_span='answer_tag': the ground truth is tokenized apart from the text around it, and a solution "
        "without a usable <answer> tag keeps all its tokens before the appended answer (official: drops its last "
        "len(suffix) + 5 padded ids)",
        "teacher models are asked once per guided group and process (official: solutions pre-generated in the data)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._teachers: list = []

    def required_columns(self) -> list[str]:
        o = self.options
        cols = [o.solutions_column] if o.teachers == "column" else []
        return cols + ([o.answer_column] if o.selection == "answer_likelihood" else [])

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        scale = getattr(args, "scale_rewards", "group")
        if scale not in ("none", False):
            warnings.warn(
                f"ampo: the official run centres advantages without std scaling (norm_adv_by_std_in_grpo=False, "
                f"train_ampo.sh:117); scale_rewards={scale!r} divides by the group std. Set scale_rewards='none' to "
                "match it.",
                stacklevel=2,
            )
        dataset = getattr(trainer, "train_dataset", None)
        if o.teachers == "column":
            check_column_values(self.name, dataset, o.solutions_column, solutions_ok, SOLUTIONS_ALLOWED)
            check_column_filled(self.name, dataset, o.solutions_column, "it holds the teachers' solutions",
                                blank=lambda v: not solution_texts(v, o.max_teachers),
                                blank_means="without any non-blank solution")
        if o.teachers in ("endpoint", "hf") and not self._teachers:
            urls = o.teacher_base_urls or [None]
            for j, model in enumerate(o.teacher_models[: o.max_teachers]):
                self._teachers.append(shared_teacher(
                    o.teachers, model=model, base_url=urls[j] if len(urls) > 1 else urls[0],
                    api_key_env=o.teacher_api_key_env, temperature=o.teacher_temperature,
                    max_tokens=args.max_completion_length, timeout=o.teacher_timeout,
                    max_retries=o.teacher_max_retries))

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        G, B = ctx.num_generations, len(ctx)
        success = ctx.gather(ctx.success(range(B), rule=o.success_rule)).view(-1, G).cpu()  # (N // G, G)
        counts = success.sum(-1).tolist()
        local_groups = sorted({ctx.group_ids[i] for i in range(B)})
        first_row = {g: next(i for i in range(B) if ctx.group_ids[i] == g) for g in local_groups}
        # which groups could be guided (the same on every process: decided on gathered successes)
        candidates = [g for g in local_groups if guidance_count(counts[g], o.max_teachers, G, o.pass_fraction,
                                                                o.trigger) > 0]
        solutions = run_together(ctx, self.name, self._solutions, ctx, [first_row[g] for g in candidates])
        injected, injected_ok, scores_used = [], [], []
        guided = [(g, texts, guidance_count(counts[g], len(texts), G, o.pass_fraction, o.trigger))
                  for g, texts in zip(candidates, solutions)]
        guided = [(g, texts, k) for g, texts, k in guided if k > 0]
        # one policy forward for every guided group of this process, on every process (a collective service)
        rankings = self._rank_all(ctx, [(first_row[g], texts) for g, texts, _ in guided])
        for (g, texts, k), ranking in zip(guided, rankings):
            ranked = ranking[:k]
            failed = [j for j in range(G) if not bool(success[g, j])]
            generator = torch.Generator().manual_seed((o.seed * 1_000_003 + ctx.step) * 1_000_003 + g)
            for slot, (score, ids) in zip(replaced_slots(failed, len(ranked), generator), ranked):
                for i in range(B):
                    if ctx.group_ids[i] == g and ctx.index_in_group[i] == slot:
                        ctx.replace_row(i, ids, offpolicy=True)
                        ctx.annotations[i]["teacher_guided"] = True
                        injected.append(i)
                        scores_used.append(score)
        if injected:
            injected_ok = ctx.success(injected, rule=o.success_rule).float().tolist()
        n_groups = success.size(0)
        guided = sum(guidance_count(c, o.max_teachers, G, o.pass_fraction, o.trigger) > 0 for c in counts)
        ctx.log_metric("guided_group_fraction", guided / max(n_groups, 1))
        ctx.log_metric("injected_rows", len(injected))
        if injected:
            ctx.log_metric("injected_success_rate", sum(injected_ok) / len(injected_ok))
            ctx.log_metric("selected_score_mean", sum(scores_used) / len(scores_used))

    # ------------------------------------------------------------------------------------------ helpers
    def _solutions(self, ctx: RolloutContext, rows: list[int]) -> list[list[str]]:
        """The teacher solutions of the groups of local ``rows`` (one representative row per group)."""
        o = self.options
        if o.teachers == "column":
            for i in rows:  # a streamed row the construction check could not see (raised on every process together)
                problem = cell_problem(self.name, o.solutions_column, ctx.global_index[i],
                                       ctx.rows[i].get(o.solutions_column), solutions_ok, SOLUTIONS_ALLOWED)
                if problem:
                    raise PluginConfigError(problem)
            return [solution_texts(ctx.rows[i].get(o.solutions_column), o.max_teachers) for i in rows]
        if not rows:
            return []
        conversations = [[{"role": "user", "content": ctx.prompts[i]}] if isinstance(ctx.prompts[i], str)
                         else [dict(m) for m in ctx.prompts[i]] for i in rows]
        answers = [teacher.chat(conversations) for teacher in self._teachers]  # (teachers, rows)
        return [[a[r] for a in answers if isinstance(a[r], str) and a[r].strip()] for r in range(len(rows))]

    def _rank_all(self, ctx: RolloutContext, groups: list[tuple[int, list[str]]]) -> list[list[tuple[float, list[int]]]]:
        """:meth:`_rank` of each ``(row, texts)`` of this process, with ONE ``ctx.policy_logprobs`` call over all of
        them, made on every process (zero rows included): the policy forward is a collective under FSDP / ZeRO-3."""
        o = self.options
        if o.selection == "first":  # no policy forward (the same option on every process)
            max_len = ctx.run.max_completion_length
            return [[(0.0, demonstration_ids(t, ctx.tokenizer, max_len)) for t in texts] for _, texts in groups]
        inputs = [self._score_inputs(ctx, row, texts) for row, texts in groups]
        prompts = [ctx.prompt_ids[row] for (row, _), (_, scored, _) in zip(groups, inputs) for _ in scored]
        logps = ctx.policy_logprobs(prompts, [ids for _, scored, _ in inputs for ids in scored])
        out, at = [], 0
        for (_, texts), (encoded, scored, spans) in zip(groups, inputs):
            out.append(self._ranked(texts, encoded, spans, logps[at:at + len(scored)]))
            at += len(scored)
        return out

    def _score_inputs(self, ctx: RolloutContext, row: int, texts: list[str]):
        """``(encoded, scored, spans)``: each solution's completion ids, the ids scored and answer spans."""
        o = self.options
        max_len = ctx.run.max_completion_length
        encoded = [demonstration_ids(t, ctx.tokenizer, max_len) for t in texts]
        scored, spans = encoded, []
        if o.selection == "answer_likelihood":
            answer = str(ctx.rows[row].get(o.answer_column, ""))
            eos = [int(ctx.tokenizer.eos_token_id)] if ctx.tokenizer.eos_token_id is not None else []
            scored = []
            for j, t in enumerate(texts):
                if o.answer_span == "answer_tag":
                    ids, start, end = spans_apart(ground_truth_answer_text(t, answer, o.format_tags), ctx.tokenizer)
                else:
                    ids, start, end = answer_token_span(t, answer, ctx.tokenizer)
                    encoded[j] = (ids + eos)[:max_len] if max_len else ids + eos  # the same text, as scored
                scored.append((ids + eos)[:max_len] if max_len else ids + eos)
                spans.append((start, min(end, len(scored[j]))))
        return encoded, scored, spans

    def _ranked(self, texts: list[str], encoded: list[list[int]], spans: list[tuple[int, int]],
                logps: list[torch.Tensor]) -> list[tuple[float, list[int]]]:
        """``(score, completion ids)`` of each solution, best first (ties keep the column's order)."""
        o = self.options
        if o.selection == "answer_likelihood":
            likelihoods = [mean_probability(lp, s, e) if e > s else 0.0 for lp, (s, e) in zip(logps, spans)]
        else:
            likelihoods = [mean_probability(lp) for lp in logps]
        scores = [selection_score(lk, format_reward(t, o.format_tags), o.format_coefficient)
                  for lk, t in zip(likelihoods, texts)]
        order = sorted(range(len(texts)), key=lambda j: -scores[j])
        return [(scores[j], encoded[j]) for j in order]
