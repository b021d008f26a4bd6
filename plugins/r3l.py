"""R3L — Reflect, then Retry, with pivotal credit and positive amplification (arXiv:2601.03715).

The policy reflects on its own failed attempt in a structured report, retries with that report as guidance, and
the retry is distilled into the policy *without* the guidance. Facts from the official code (shiweijiezero/R3L,
Trinity-RFT: ``trinity/common/workflows/envs/R3L/*/R3L_workflow.py`` and ``utils.py``,
``trinity/algorithm/advantage_fn/opmd_advantage.py`` (``opmd_reweight_adv``), ``policy_loss_fn/opmd_policy_loss.py``,
``examples/R3L/dapo/opmd_R3L_*.yaml``):

1. Budget: of the ``repeat_times = 8`` rollouts of a task, half are first attempts and half reflect-and-retry
   (one retry per first attempt, ``for i in range(n // 2)``).
2. Reflection by the **same policy**: a system prompt asks for a JSON report with ``trajectory_summary``,
   ``root_cause_analysis``, ``trajectory_outcome`` (``success`` | ``success_but_inefficient`` | ``failure``),
   ``improvement_suggestion`` and ``retry_from_step``; the user message holds the formatted trajectory (steps
   numbered from 0, with the correctness feedback). The text between the first ``{`` and the last ``}`` is parsed.
3. Validation: the three first keys must exist; ``success`` means "perfect" (no retry); the other two outcomes
   need ``improvement_suggestion`` and an integer ``retry_from_step`` in ``0 .. steps-1``. An invalid report or a
   perfect one gives **no retry** (the official group simply has one experience fewer; here the slot keeps its
   own first-attempt sample, since a TRL group has exactly G rows).
4. Guidance: the report (JSON) is rendered into a guidance text appended to the system prompt under
   ``# Previous Attempt Analysis & Guidance``; the retry is sampled under it.
5. The retry is trained under the **original** prompt (guidance removed: prompt swap, "distill trajectory"), in
   the same group as the first attempts.
6. Pivotal credit: the first ``retry_from_step`` steps are masked out of the loss in **both** the first attempt
   and the retry (only the diverging suffix is trained).
7. Positive amplification (advantage, ``opmd_reweight_adv``): ``A = r - baseline`` with the group-mean baseline
   (no std); then if ``r >= 1``: ``A = 1``; elif ``A >= 0``: ``A = 3 A``; negatives unchanged. The GRPO variant
   (``grpo_reweight_adv``) uses the z-score ``(r - mean) / (std + 1e-6)`` instead (``baseline="zscore"``).
8. Loss: OPMD, ``-A log pi`` token-mean divided by ``1 + tau`` (tau = 1), plus a k2 KL to the reference.

Mapping onto TRL (and what differs):

* TRL samples all G rows from the original prompt. Rows ``0 .. G-R-1`` of each group are first attempts and row
  ``G-R+k`` is the retry slot of first attempt ``k`` (``R = floor(retry_fraction * G)``, official 1/2). A slot
  whose reflection is invalid or perfect keeps its own first sample.
* Steps: the official math workflow's first attempt is a 3-attempt dialogue with "Correct/Incorrect" feedback
  turns and a step is an assistant turn; here the first attempt is TRL's single completion and a step is one
  non-empty line (the bundled tasks write one step per line). The trajectory shown for reflection ends with the
  reward feedback ("Correct."/"Incorrect."), decided on the verifier column (``success_column``: the first reward
  function that is not a placeholder by default, above ``success_threshold``); other reward columns never count.
* ``retry_start="pivot"`` (default, reconstructed): the retry replays the first attempt's first
  ``retry_from_step`` steps token-exactly (``prefix_ids``) and continues under the guidance, as the official
  step-environment workflows (WebShop/ALFWorld) replay the pre-pivot steps; ``"beginning"`` retries from scratch
  as the official math workflow does (it still masks the first ``retry_from_step`` steps of both).
* Pivotal credit is a per-row extra consumed at the loss stage that zeroes the weights of the masked tokens
  (``ctx.scale_tokens``); unlike the official action mask, those tokens still count in TRL's token normaliser.
* Loss: TRL's own surrogate by default (``loss="trl"``; use ``loss_type="dapo"`` for the token-mean); ``"opmd"``
  replaces it with ``-A log pi / (1 + tau)`` on every loss token (then this plugin replaces the surrogate and
  cannot stack with another one that does). TRL's KL (``beta``, k3 estimator) replaces the official k2 KL loss.
* Not reproduced: the extra SFT experiences the official code stores in separate groups when the retry improves
  (the reflection turn and the guided retry with reward 1) — a TRL batch has exactly G rows per prompt.
* ``reflection_source="task_feedback"`` replaces the policy's report by one built from a task's verifier, the
  feedback oracle ``feedback_oracle`` (:data:`~trl_plugins.components.feedback.VERIFIER_FEEDBACK`; default
  ``"arithmetic"``, the bundled tasks': outcome from their verifier, root cause and suggestion from its feedback,
  ``retry_from_step`` = first wrong step), for tests and the demo:
  a tiny model almost never writes valid JSON, so with ``"policy"`` nearly every slot keeps its first sample. A batch
  in which no report is valid (nothing retried: the step is GRPO with the amplification only) is warned once and
  logged as ``fallback_no_valid_reflection`` (1.0 for such a batch).

Neutral setting: ``retry_fraction=0``, ``baseline="trl"``, ``amplify=false`` (and ``loss="trl"``) is plain GRPO.

Official code checked against: ``shiweijiezero/R3L@d503f6c`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show r3l``, docs/faithfulness.md).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.contexts import context_device
from trl_plugins.api.reasons import EDITS_COMPLETIONS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import completion_text
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE
from trl_plugins.components.feedback import VERIFIER_FEEDBACK, feedback_oracle

PIVOT_KEY = "r3l_pivot_tokens"
GUIDANCE_HEADER = "# Previous Attempt Analysis & Guidance"
OUTCOMES = ("success", "success_but_inefficient", "failure")

DEFAULT_REFLECTION_SYSTEM = """You review your own previous attempt at a task and write a diagnosis that a later \
attempt can use.

Steps of the attempt are numbered from 0. Work out what happened, ask "why" repeatedly until you reach the first \
decision that went wrong, and turn it into one reusable rule.

Reply with a single JSON object and nothing else:
{
  "trajectory_summary": "what the attempt did, in one or two sentences",
  "root_cause_analysis": "the chain of why-questions down to the first real mistake",
  "trajectory_outcome": "success" | "success_but_inefficient" | "failure",
  "improvement_suggestion": "a self-contained principle to apply next time (omit when the outcome is success)",
  "retry_from_step": the number of the first step that must change (omit when the outcome is success)
}"""

DEFAULT_REFLECTION_USER = "Trajectory of the previous attempt:\n\n{trajectory}\n\nAnswer with the JSON object only."

DEFAULT_GUIDANCE = """An analysis of an earlier attempt at this same task is given below. Use its lessons while \
solving the task, but do not mention the analysis or an earlier attempt in your answer.

{report}"""


@dataclass
class R3LOptions(SuccessOptions):
    retry_fraction: float = option(
        0.5, min=0.0, max=0.5,
        help="Fraction of each group used as reflect-and-retry slots (official: half); 0 turns retries off.",
    )
    reflection_source: Literal["policy", "task_feedback"] = option(
        "policy",
        help="'policy': the policy writes the JSON report (R3L). 'task_feedback': the report is built from the "
        "bundled tasks' verifier feedback (tests/demo; needs the 'problem' column).",
    )
    retry_start: Literal["pivot", "beginning"] = option(
        "pivot",
        help="'pivot': replay the first attempt's first retry_from_step steps, then continue under the guidance "
        "(official step-environment workflows); 'beginning': retry from scratch (official math workflow).",
        reconstructed=True,
    )
    pivotal_credit: bool = option(
        True, help="Zero the loss on the first retry_from_step steps of both the first attempt and its retry."
    )
    baseline: Literal["mean", "zscore", "trl"] = option(
        "mean",
        help="Advantage before amplification: r - group mean (OPMD, official R3L config), the GRPO z-score, or "
        "TRL's own advantages.",
    )
    amplify: bool = option(
        True, help="Positive amplification: r >= success_reward -> A = 1; elif A >= 0 -> A *= amplify_scale."
    )
    amplify_scale: float = option(3.0, min=0.0, help="Multiplier of non-negative advantages (official: 3).")
    success_reward: float = option(
        1.0, help="Advantage stage: verifier-column value (success_column) at or above which a rollout counts as a full "
        "success (A = 1); other reward columns never make a full success (official: the verifier's score 1)."
    )
    success_threshold: float = option(
        0.5, help="Reflection feedback: an attempt is 'Correct.' when its verifier column (success_column) is above "
        "this (official: the math verifier's score is 1)."
    )
    loss: Literal["trl", "opmd"] = option(
        "trl", help="'trl': keep TRL's surrogate (loss_type); 'opmd': -A log pi / (1 + tau) on every loss token."
    )
    opmd_tau: float = option(1.0, min=0.0, help="tau of the OPMD loss (divides by 1 + tau).")
    retry_as_offpolicy: bool = option(
        False, help="Train retry tokens through the framework's shaped off-policy branch (not in R3L)."
    )
    reflection_system_prompt: str = option(DEFAULT_REFLECTION_SYSTEM, help="System prompt of the reflection request.")
    reflection_user_template: str = option(
        DEFAULT_REFLECTION_USER, help="User message of the reflection request; must contain {trajectory}."
    )
    guidance_template: str = option(
        DEFAULT_GUIDANCE, help="Guidance text appended to the system prompt for the retry; must contain {report}."
    )
    problem_column: str = option("problem", help="Dataset column with the task (reflection_source='task_feedback').")
    feedback_oracle: str = option(
        "arithmetic",
        help="reflection_source='task_feedback': the verifier feedback oracle by name (components.feedback."
        "VERIFIER_FEEDBACK; 'arithmetic' = the bundled tasks') or 'package.module:function', reading problem_column.",
    )

    def validate(self) -> None:
        if self.reflection_source == "task_feedback":
            VERIFIER_FEEDBACK.check(self.feedback_oracle, "Option 'feedback_oracle' of plugin 'r3l': ")
        if "{trajectory}" not in self.reflection_user_template:
            raise PluginConfigError(
                f"Option 'reflection_user_template' of plugin 'r3l' got {self.reflection_user_template!r}; it must "
                "contain {trajectory}."
            )
        if "{report}" not in self.guidance_template:
            raise PluginConfigError(
                f"Option 'guidance_template' of plugin 'r3l' got {self.guidance_template!r}; it must contain "
                "{report}."
            )


# ================================================================================================ pure functions
def split_lines_as_steps(text: str) -> list[str]:
    """The steps of a completion: its non-empty lines, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def format_trajectory(question: str, steps: list[str], feedback: str) -> str:
    """The trajectory shown to the reflection request: the task, the numbered steps (from 0), the feedback."""
    lines = [f"Task:\n{question}", ""]
    if steps:
        lines += [f"Step {k}: {s}" for k, s in enumerate(steps)]
    else:
        lines.append("(the attempt is empty)")
    lines += ["", f"Feedback: {feedback}"]
    return "\n".join(lines)


def parse_report(text: str) -> dict | None:
    """The JSON object between the first ``{`` and the last ``}`` of ``text`` (the whole text otherwise), or None."""
    first, last = text.find("{"), text.rfind("}")
    candidate = text[first : last + 1] if first != -1 and last != -1 and first < last else text
    try:
        report = json.loads(candidate)
    except (ValueError, TypeError):
        return None
    return report if isinstance(report, dict) else None


def validate_report(report: dict | None, total_steps: int) -> tuple[bool, bool, int]:
    """``(is_valid, is_perfect, retry_from_step)`` as the official validation decides.

    Valid needs ``trajectory_summary``, ``root_cause_analysis`` and a known ``trajectory_outcome``; ``success`` is
    perfect (no retry); otherwise ``improvement_suggestion`` and an integer ``retry_from_step`` in
    ``[0, total_steps)`` are required (``total_steps`` is at least 1, so an empty attempt can retry from 0).
    """
    if not isinstance(report, dict) or not all(
        k in report for k in ("trajectory_summary", "root_cause_analysis", "trajectory_outcome")
    ):
        return False, False, 0
    outcome = report["trajectory_outcome"]
    if outcome == "success":
        return True, True, 0
    if outcome not in OUTCOMES:
        return False, False, 0
    if report.get("improvement_suggestion") is None or report.get("retry_from_step") is None:
        return False, False, 0
    try:
        step = int(report["retry_from_step"])
    except (ValueError, TypeError):
        return False, False, 0
    if step < 0 or step >= max(total_steps, 1):
        return False, False, 0
    return True, False, step


def with_guidance(prompt: Any, guidance: str) -> Any:
    """The prompt with the guidance appended to its system message (one is added when there is none)."""
    block = f"{GUIDANCE_HEADER}\n{guidance}"
    if isinstance(prompt, str):
        return f"{block}\n\n{prompt}"
    messages = copy.deepcopy(prompt)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


def step_prefix_tokens(token_texts: list[str], steps: int) -> int:
    """How many leading tokens cover the first ``steps`` steps (non-empty lines) with their line breaks.

    Returns every token when the text has fewer complete steps.
    """
    if steps <= 0:
        return 0
    done, nonempty = 0, False
    for n, piece in enumerate(token_texts, start=1):
        for ch in piece:
            if ch == "\n":
                if nonempty:
                    done += 1
                    nonempty = False
                    if done == steps:
                        return n
            elif not ch.isspace():
                nonempty = True
    return len(token_texts)


def r3l_advantages(
    rewards: torch.Tensor, group_size: int, baseline: str, amplify: bool, scale: float, success: float,
    trl_advantages: torch.Tensor | None = None, verifier: torch.Tensor | None = None,
) -> torch.Tensor:
    """R3L advantages of whole groups (official ``opmd_reweight_adv`` / ``grpo_reweight_adv``).

    Args:
        rewards: (N,) combined rewards, groups contiguous (NaN = no reward: advantage 0).
        baseline: "mean" (r - group mean), "zscore" ((r - mean) / (std + 1e-6), unbiased std) or "trl"
            (``trl_advantages`` (N,) or (N, T) as given).
        amplify: apply ``v >= success -> 1``, ``elif A >= 0 -> scale * A``, with ``v`` the ``verifier`` column (N,)
            when given (the plugin passes it: partial-credit columns never make a full success), else ``rewards``.
    Returns:
        (N,) advantages, or (N, T) when ``trl_advantages`` is (N, T) and baseline is "trl".
    """
    r = rewards.view(-1, group_size).float()
    valid = ~torch.isnan(r)
    if baseline == "trl":
        adv = trl_advantages.clone().float()
    else:
        filled = torch.nan_to_num(r, nan=0.0)
        count = valid.sum(dim=1, keepdim=True).clamp(min=1)
        mean = filled.sum(dim=1, keepdim=True) / count
        adv = filled - mean
        if baseline == "zscore":
            var = ((filled - mean) ** 2 * valid).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
            adv = adv / (var.sqrt() + 1e-6)
        adv = torch.where(valid, adv, torch.zeros_like(adv)).view(-1)
    if not amplify:
        return adv
    flat_r = r.reshape(-1) if verifier is None else verifier.reshape(-1).float().to(r.device)
    shape = (-1,) + (1,) * (adv.dim() - 1)
    full = (flat_r >= success).view(shape)
    amplified = torch.where(adv >= 0, adv * scale, adv)
    return torch.where(full, torch.ones_like(adv), amplified)


# ================================================================================================ plugin
class R3LPlugin(Plugin):
    """Reflect-then-retry with prompt swap, pivotal credit and positive amplification (sampling, advantage, loss)."""

    name = "r3l"
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = (
        "R³L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal Credit, and"
        " Positive Amplification, arXiv:2601.03715"
    )
    summary = "Half the group reflects on a first attempt and retries with the guidance; retries distilled unguided."
    Options = R3LOptions
    official = OfficialSource(
        "shiweijiezero/R3L", "d503f6c", verdict="faithful",
        files=(
            "trinity/algorithm/advantage_fn/opmd_advantage.py",
            "trinity/algorithm/policy_loss_fn/opmd_policy_loss.py",
        ),
    )
    claim_metric = ("retry_improved_fraction", "retries that beat the first attempt")
    replaces = (
        "half of each group's completions (reflect-and-retry)",
        "the advantages",
        "the base surrogate on every loss token when loss='opmd'",
    )
    reconstructed = (
        "a step is one non-empty completion line and the first attempt is TRL's single completion (official: "
        "assistant turns of a 3-attempt feedback dialogue)",
        "retry_start='pivot' replays the pre-pivot steps (official step environments); the official math workflow "
        "retries from the beginning",
        "a slot whose reflection is invalid or perfect keeps its own first sample (the official group has one "
        "experience fewer)",
        "pivotal credit zeroes token weights; the masked tokens still count in TRL's normaliser",
    )

    def overwritten(self) -> tuple[str, ...]:
        # baseline 'mean' / 'zscore' recompute the advantages from the rewards; 'trl' amplifies the incoming ones
        return () if self.options.baseline == "trl" else ("advantages",)

    def __init__(self, options=None):
        super().__init__(options)
        # only the OPMD loss replaces TRL's surrogate (checked per instance by the stack)
        self.replaces_surrogate = self.options.loss == "opmd"

    def required_columns(self) -> list[str]:
        return [self.options.problem_column] if self.options.reflection_source == "task_feedback" else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.options.retry_fraction > 0 and int(self.options.retry_fraction * trainer.num_generations) == 0:
            raise PluginConfigError(
                f"r3l: retry_fraction={self.options.retry_fraction} leaves no retry slot with "
                f"num_generations={trainer.num_generations}; use a larger group or retry_fraction=0."
            )

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        G = ctx.num_generations
        R = int(o.retry_fraction * G)
        if R == 0:
            return
        first_count = G - R
        for i in range(len(ctx)):
            ctx.annotations[i]["r3l"] = "first" if ctx.index_in_group[i] < first_count else "slot"
        # every process needs the paired first attempt, which may live on another process
        all_ids = gather_id_lists(ctx, ctx.completion_ids)
        all_correct = None
        if o.reflection_source == "policy":  # the reflection shows the attempt's correctness (verifier column only)
            all_correct = ctx.gather(ctx.success(range(len(ctx)), rule=o.success_rule)).cpu().tolist()
        slots = [i for i in range(len(ctx)) if ctx.index_in_group[i] >= first_count]
        pairs = {i: ctx.group_ids[i] * G + (ctx.index_in_group[i] - first_count) for i in slots}

        tokenizer = ctx.tokenizer
        firsts = {i: all_ids[pairs[i]] for i in slots}
        first_texts = {i: completion_text(ctx.decode(firsts[i], i)) for i in slots}
        steps = {i: split_lines_as_steps(first_texts[i]) for i in slots}

        # 1. reflection reports (one collective generation call when the policy writes them)
        if o.reflection_source == "policy":
            requests = [self._reflection_prompt(ctx, i, steps[i], all_correct[pairs[i]]) for i in slots]
            replies = ctx.service.generate(prompts=requests)
            reports = {i: parse_report(reply.text) for i, reply in zip(slots, replies)}
        else:
            reports = {i: self._task_report(ctx, i, first_texts[i], steps[i]) for i in slots}

        # 2. validation and retries (one collective generation call)
        retry_rows, retry_prompts, prefixes, pivots = [], [], [], {}
        n_valid = n_perfect = 0
        for i in slots:
            is_valid, is_perfect, step = validate_report(reports[i], len(steps[i]))
            n_valid += is_valid
            n_perfect += is_valid and is_perfect
            if not is_valid or is_perfect:
                ctx.annotations[i]["r3l"] = "kept_perfect" if is_valid else "kept_invalid"
                continue
            guidance = o.guidance_template.format(report=json.dumps(reports[i], indent=2, ensure_ascii=False))
            first_pivot = step_prefix_tokens(_token_texts(firsts[i], tokenizer), step) if step else 0
            prefix = firsts[i][:first_pivot] if o.retry_start == "pivot" else []
            retry_rows.append(i)
            retry_prompts.append(with_guidance(ctx.prompts[i], guidance))
            prefixes.append(prefix)
            pivots[i] = (step, first_pivot)
        retries = ctx.service.generate(prompts=retry_prompts, prefix_ids=prefixes)
        for i, completion in zip(retry_rows, retries):
            step, first_pivot = pivots[i]
            ctx.replace_row(
                i, completion.completion_ids, offpolicy=o.retry_as_offpolicy, logprobs=completion.logprobs,
                prompt_swapped=True,  # trained under the original prompt: the guidance is distilled away
            )
            if o.retry_start == "pivot":
                retry_pivot = min(first_pivot, len(ctx.completion_ids[i]))
            else:
                retry_pivot = step_prefix_tokens(_token_texts(ctx.completion_ids[i], tokenizer), step)
            ctx.annotations[i].update(
                r3l="retry", r3l_pair=pairs[i], r3l_step=step,
                r3l_pivot_tokens=retry_pivot if o.pivotal_credit else 0,
                r3l_first_pivot_tokens=first_pivot if o.pivotal_credit else 0,
            )
        n = max(len(slots), 1)
        valid_and_slots = ctx.gather(torch.tensor([[n_valid, len(slots)]], device=context_device(ctx))).sum(dim=0)
        self.report_fallback(
            ctx, "no_valid_reflection", int(valid_and_slots[1]) > 0 and int(valid_and_slots[0]) == 0,
            "no reflection report of this batch was valid JSON with a usable step, so no attempt was retried and the "
            "step reduced to GRPO with the R3L advantage amplification. A policy too weak to write the report "
            "causes this; reflection_source='task_feedback' (bundled tasks) or a stronger model avoid it.",
        )
        ctx.log_metric("valid_reflection_fraction", n_valid / n)
        ctx.log_metric("perfect_reflection_fraction", n_perfect / n)
        ctx.log_metric("retry_fraction", len(retry_rows) / n)
        ctx.log_metric("extra_rollouts", len(retries) + (len(slots) if o.reflection_source == "policy" else 0))

    def _reflection_prompt(self, ctx: RolloutContext, i: int, steps: list[str], correct: bool) -> Any:
        o = self.options
        feedback = "Correct." if correct else "Incorrect."
        trajectory = format_trajectory(_question(ctx.prompts[i]), steps, feedback)
        user = o.reflection_user_template.format(trajectory=trajectory)
        if isinstance(ctx.prompts[i], str):
            return f"{o.reflection_system_prompt}\n\n{user}"
        return [{"role": "system", "content": o.reflection_system_prompt}, {"role": "user", "content": user}]

    def _task_report(self, ctx: RolloutContext, i: int, text: str, steps: list[str]) -> dict:
        """A report from the task's verifier (feedback_oracle), in the schema the policy would write."""
        raw = ctx.rows[i].get(self.options.problem_column)
        if raw is None:
            raise PluginConfigError(
                f"r3l: reflection_source='task_feedback' needs the column {self.options.problem_column!r} "
                f"(row {ctx.global_index[i]} has none)."
            )
        verdict = feedback_oracle(self.options.feedback_oracle)(raw, text)
        note = verdict.message
        if verdict.correct:
            return {"trajectory_summary": f"{len(steps)} steps, correct answer.", "root_cause_analysis": note,
                    "trajectory_outcome": "success"}
        k = verdict.first_error
        k = min(k if k is not None else len(steps), max(len(steps) - 1, 0))
        return {
            "trajectory_summary": f"{len(steps)} steps, no correct answer.",
            "root_cause_analysis": note,
            "trajectory_outcome": "failure",
            "improvement_suggestion": note,
            "retry_from_step": k,
        }

    # ------------------------------------------------------------------------------------------ advantage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        N = ctx.rewards.size(0)
        pivots = torch.zeros(N, dtype=torch.long, device=ctx.rewards.device)
        retry_rows, improved = 0, 0
        for g, ann in enumerate(ctx.annotations):
            if ann.get("r3l") != "retry":
                continue
            retry_rows += 1
            pivots[g] = int(ann.get("r3l_pivot_tokens", 0))
            first = int(ann["r3l_pair"])
            pivots[first] = max(int(pivots[first]), int(ann.get("r3l_first_pivot_tokens", 0)))
            improved += bool(ctx.rewards[g] > ctx.rewards[first])
        if retry_rows:
            ctx.log_metric("retry_improved_fraction", improved / retry_rows)
            retry_mask = torch.tensor([a.get("r3l") == "retry" for a in ctx.annotations], device=ctx.rewards.device)
            ctx.log_metric("retry_reward_mean", float(torch.nan_to_num(ctx.rewards[retry_mask]).mean()))
        if o.pivotal_credit and bool((pivots > 0).any()):
            ctx.extras[PIVOT_KEY] = pivots
        if o.baseline == "trl" and not o.amplify:
            return
        ctx.advantages = r3l_advantages(
            ctx.rewards, G, o.baseline, o.amplify, o.amplify_scale, o.success_reward,
            trl_advantages=ctx.advantages if o.baseline == "trl" else None, verifier=ctx.verifier(o.success_rule),
        )

    # ------------------------------------------------------------------------------------------ loss
    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        if o.loss == "opmd":
            lp = ctx.per_token_logps
            values = -ctx.advantages.expand_as(lp) * lp / (1.0 + o.opmd_tau)
            ctx.replace_tokens(ctx.mask.bool(), values)
        pivots = ctx.extras.get(PIVOT_KEY)
        if pivots is not None and bool((pivots > 0).any()):
            T = ctx.mask.size(1)
            positions = torch.arange(T, device=ctx.mask.device).unsqueeze(0)
            weights = (positions >= pivots.to(ctx.mask.device).unsqueeze(1)).to(ctx.per_token_logps.dtype)
            ctx.scale_tokens(weights)
            ctx.log_metric("pivot_masked_token_fraction", ctx.global_masked_mean(1.0 - weights))


# ================================================================================================ helpers
def _question(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            content = message.get("content", "")
            return content if isinstance(content, str) else str(content)
    return ""


def _token_texts(ids: list[int], tokenizer: Any) -> list[str]:
    """Decoded text of each token on its own."""
    return [tokenizer.decode([int(t)]) for t in ids]
