"""FBOS-RL — Feedback-Driven Bi-Objective Synergistic Reinforcement Learning (arXiv:2605.20256).

GRPO samples every rollout from the same prompt; beyond the policy's reach no good rollout appears and the update has
no direction. FBOS-RL spends part of the group's budget on a **second, feedback-guided round**: the verifier's
natural-language feedback on a round-1 attempt is folded into a feedback-augmented prompt (FAP), and the policy
samples again under it. Two objectives use the result:

* **EPA** (exploitation-oriented policy alignment): successful round-2 rollouts are trained under the **original**
  prompt -- a prompt swap, so their tokens are off-policy for ``pi(.|x)``: shaped branch ``-A p/(p+gamma)``
  (LUFFY, gamma = 0.1) and NaN sampling log-probs. Each copy replaces the failed round-1 attempt whose feedback
  produced it (the group keeps G rows; copies cost no generation).
* **ECC** (exploration-oriented capability cultivation): the round-2 rows are trained under their FAP, fully
  on-policy, so that sampling under feedback keeps improving.

Budget (equal to GRPO's, as the paper compares): G = G1 + G2 per group. Rows ``0..G1-1`` of a group are sampled in
the trainer's first round; rows ``G1..G-1`` are **deferred** (``PromptContext.defer``: the trainer does not sample
them) and filled in round 2 through the generation service, one collective call per batch -- exactly G rollouts per
prompt, G1 under x and G2 under FAPs. Round-2 slot ``s`` takes its FAP from the ``s``-th failed round-1 attempt,
cycling when fewer than G2 failed; groups without failure sample their round-2 rows under x (``all_success``).
Success and failure are decided on the verifier column (``success_column``: the first reward function that is not a
placeholder by default, above ``success_threshold``); other reward columns never change the verdict.

Advantages (advantage stage, global batch): sub-groups per prompt -- rows under x (round 1 and EPA copies) and ECC
rows -- each normalised on its own (``A = r - mean``, divided by the sub-group std when ``scale_rewards="group"``);
ECC rows are weighted by ``ecc_weight``. Schedule ``joint`` trains both objectives every step; ``alternate``
makes even steps EPA-only (ECC weight 0) and odd steps ECC-only (no EPA copies).

Only the three-stage flow is known (the abstract and public summaries, no code, no equations). Every other choice
is a **reconstruction**, an option with our default: G1 = G/2, the feedback source, no answer leak, the FAP format
(multi-turn: original turns, the attempt, then the feedback and a revise request), failed-first source selection,
EPA placement (replace the failed source, at most one per group) and its off-policy treatment (shaped), ECC weight 1,
joint schedule, sub-group advantages.

Feedback sources (``feedback``). The paper's verifier is rule-based and its feedback names where the error is, why,
and format violations. ``"task"`` is a task's own step-checking verifier, the feedback oracle named by
``feedback_oracle`` (:data:`~trl_plugins.components.feedback.VERIFIER_FEEDBACK`; default ``"arithmetic"``, the
**bundled arithmetic tasks'**, which reads their ``problem`` column and checks every step). ``"rule"`` is the
generic rule-based verifier for any dataset with a reference final answer (``answer`` column): format violations
(empty solution, no extractable final answer, several different boxed answers), a wrong final answer (never stating
the right one unless ``leak_answer``), and an error location (the first step before the answer whose result is the
reference value: the error comes after it; otherwise the step stating the wrong answer). ``"simple_gt"``/``"simple"``
are Critique-GRPO's critique strings (with or without the ground truth); ``"judge"`` asks an LLM.

Where the public summaries disagree (recorded in the options' help):

* **Joint or alternating updates.** One public summary of the full paper says the optimisation *alternates* between
  EPA and ECC; the abstract calls them two mutually reinforcing objectives, and another summary says they are
  optimised *jointly*. ``schedule="joint"`` (default: both every step, ECC weighted by lambda) or ``"alternate"``
  (EPA-only and ECC-only steps).
* **What the comparison holds equal.** The first abstract compares "under an identical number of rollouts", the
  revised one "under both an identical number of rollouts and the same number of training steps", the HTML version
  "an identical rollout budget (i.e., the same training steps)". The default split G = G1 + G2 satisfies both: the
  same G rollouts per prompt and step as GRPO. Under the other reading (the same step count, with the feedback round
  spent on top of GRPO's G rollouts) compare against GRPO with G1 = its G: set ``num_generations`` to
  G1 + G2 and ``g1`` to the baseline's group size (the group then costs G1 + G2 rollouts per step).

Stacking: with another advantage plugin placed **before** ``fbos_rl`` (e.g. ``canon``), ``advantage="recentre"``
centres that plugin's advantages within the FBOS sub-groups instead of recomputing them from rewards.
Metrics: ``round1_success_rate``, ``round2_success_rate``, ``rescued_group_fraction``, ``epa_fraction``,
``ecc_fraction``, ``ecc_weight``.

No official code was reachable, so the method is reconstructed from its paper; compared with
the paper's abstract: the feedback round, the sub-group split, the schedules and the off-policy correction are
reconstructed (``trl-plugins show fbos_rl``, docs/faithfulness.md).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import extract_boxed, find_numbers, get_extractor, normalize_answer
from trl_plugins.api.collectives import gather_id_lists, run_together
from trl_plugins.api.contexts import context_device
from trl_plugins.api.option_groups import OffPolicyOptions, WarmupOptions
from trl_plugins.api.reasons import EDITS_COMPLETIONS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_DEFERRED_ROWS
from trl_plugins.components.feedback import VERIFIER_FEEDBACK, feedback_oracle
from trl_plugins.components.judge import JudgeEndpointOptions
from trl_plugins.components.steps import question_text, split_steps
from trl_plugins.components.teacher import shared_teacher

DEFAULT_REVISE = "Revise your solution using this feedback. Reason step by step and state the final answer."
DEFAULT_SINGLE_TURN = (
    "{question}\n\nA previous attempt:\n{response}\n\nFeedback on it:\n{feedback}\n\n"
    "Write a corrected solution. Reason step by step and state the final answer."
)
JUDGE_SYSTEM = (
    "You check solutions. Point out the first mistake in the solution below and say briefly how to fix it, without "
    "writing the full corrected solution. If the solution is correct, say so."
)
ROLES = ("round1", "epa", "ecc")


@dataclass
class FbosRlOptions(JudgeEndpointOptions, OffPolicyOptions, WarmupOptions, SuccessOptions):
    reconstructed_options = ("gamma",)  # the off-policy treatment of EPA copies is ours
    g1: int | None = option(
        None, min=1, reconstructed=True,
        help="Round-1 rollouts per group (G1); the other G - G1 are feedback-guided round-2 rollouts. None: G // 2. "
        "The summaries read two ways: the same rollouts per step as GRPO (this split of G) or the same step count "
        "with the feedback round on top (set num_generations = G1 + G2 and g1 = the baseline's G).",
    )
    feedback: Literal["task", "rule", "simple_gt", "simple", "judge"] = option(
        "task", reconstructed=True,
        help="Feedback text. task: a task's step verifier, the oracle feedback_oracle (default the bundled arithmetic "
        "tasks', which needs their 'problem' column); rule: generic rule-based feedback for any dataset with a "
        "reference answer (format violations, wrong final answer, error location); simple_gt / simple: "
        "'correct/incorrect' with / without the ground truth; judge: an LLM.",
    )
    feedback_oracle: str = option(
        "arithmetic",
        help="feedback='task': the verifier feedback oracle by name (components.feedback.VERIFIER_FEEDBACK; "
        "'arithmetic' = the bundled tasks') or 'package.module:function', reading problem_column.",
    )
    extractor: str = option(
        "boxed_or_last_number",
        help="feedback='rule': final-answer extractor (task, boxed, last_number, boxed_or_last_number, or "
        "'package.module:function').",
    )
    step_separator: str = option("\n", help="feedback='rule': what separates the steps of a solution.")
    format_hint: str = option(
        "State the final answer as \\boxed{...}.",
        help="feedback='rule': the instruction added to a format violation.",
    )
    leak_answer: bool = option(
        False, reconstructed=True, help="Append the correct final answer to the feedback of failed attempts."
    )
    judge: Literal["endpoint", "hf"] = option("endpoint", help="feedback='judge': an endpoint or a local HF model.")
    judge_max_tokens: int = option(256, min=1, help="Longest judge feedback in tokens.")
    all_success: Literal["original", "feedback"] = option(
        "original", reconstructed=True,
        help="A group with no failed round-1 attempt: sample its round-2 rows under the original prompt, or give "
        "feedback ('Correct.') on its attempts anyway.",
    )
    fap_format: Literal["multi_turn", "single_turn"] = option(
        "multi_turn", reconstructed=True,
        help="FAP as a conversation (question, attempt as assistant turn, feedback as user turn) or as one user "
        "message (single_turn_template). String prompts always use single_turn.",
    )
    revise_instruction: str = option(DEFAULT_REVISE, help="Request appended to the feedback in multi_turn FAPs.")
    single_turn_template: str = option(
        DEFAULT_SINGLE_TURN, help="single_turn FAP; must contain {question}, {response} and {feedback}."
    )
    epa: bool = option(True, help="Train successful round-2 rollouts under the original prompt (EPA).")
    epa_offpolicy: Literal["shaped", "plain"] = option(
        "shaped", reconstructed=True,
        help="EPA tokens: the shaped off-policy branch (LUFFY) or the plain surrogate with ratio 1 (RuscaRL-style).",
    )
    epa_max_per_group: int = option(1, min=1, reconstructed=True, help="Most EPA copies per group.")
    ecc_weight: float = option(1.0, min=0.0, reconstructed=True, help="lambda: weight of ECC rows' advantages.")
    schedule: Literal["joint", "alternate"] = option(
        "joint", reconstructed=True,
        help="joint: EPA + lambda ECC every step; alternate: even steps EPA only, odd steps ECC only. The public "
        "summaries disagree: one reads the optimisation as alternating between EPA and ECC, another as joint.",
    )
    advantage: Literal["subgroup", "recentre", "none"] = option(
        "subgroup", reconstructed=True,
        help="subgroup: normalise rewards within (prompt, x-rows) and (prompt, ECC rows); recentre: centre the "
        "incoming advantages within those sub-groups; none: keep them.",
    )
    success_threshold: float = option(
        0.5, help="A rollout is correct when its verifier column (success_column) is above this value."
    )
    problem_column: str = option("problem", help="Dataset column read by feedback='task'.")
    answer_column: str = option("answer", help="Dataset column with the ground-truth answer.")

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'fbos_rl': {exc}.") from exc
        if not self.step_separator:
            raise PluginConfigError("Option 'step_separator' of plugin 'fbos_rl' must be a non-empty string.")
        for key in ("{question}", "{response}", "{feedback}"):
            if key not in self.single_turn_template:
                raise PluginConfigError(
                    f"Option 'single_turn_template' of plugin 'fbos_rl' must contain {key}; got "
                    f"{self.single_turn_template!r}."
                )
        self.require_base_url("judge", "fbos_rl", active=self.feedback == "judge", when="feedback='judge'",
                              otherwise="judge='hf'")
        if self.feedback == "task":
            VERIFIER_FEEDBACK.check(self.feedback_oracle, "Option 'feedback_oracle' of plugin 'fbos_rl': ")


# ============================================================================================= pure functions
def feedback_prompt(prompt: Any, response: str, feedback: str, fmt: str, instruction: str, template: str) -> Any:
    """The feedback-augmented prompt (FAP) of ``prompt`` for an attempt ``response`` and its ``feedback``.

    multi_turn (conversational prompts): the original turns, the attempt as an assistant turn, then a user turn with
    the feedback and ``instruction``. single_turn: the last user message replaced by ``template`` filled with the
    question, the attempt and the feedback (string prompts: the filled template).
    """
    if isinstance(prompt, str):
        return template.format(question=prompt, response=response, feedback=feedback)
    messages = copy.deepcopy(list(prompt))
    if fmt == "multi_turn":
        return messages + [
            {"role": "assistant", "content": response},
            {"role": "user", "content": f"{feedback}\n\n{instruction}"},
        ]
    for j in range(len(messages) - 1, -1, -1):
        if messages[j].get("role") == "user":
            messages[j] = {**messages[j], "content": template.format(
                question=question_text([messages[j]]), response=response, feedback=feedback)}
            return messages[: j + 1]
    raise PluginConfigError("fbos_rl: the prompt has no user message to build a feedback prompt from.")


def simple_feedback(correct: bool, answer: Any = None) -> str:
    """Critique-GRPO-style critiques: ``simple`` (answer None) or ``simple_gt`` (with the ground truth)."""
    verdict = "The solution is correct." if correct else "The solution is incorrect."
    return verdict if answer is None else f"{verdict} The correct final answer is {answer}."


def _boxed_answers(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` of ``text``, in order."""
    out, rest = [], text
    while (found := extract_boxed(rest)) is not None:
        out.append(found)
        rest = rest[: rest.rfind("\\boxed")]
    return out[::-1]


def _step_values(step: str) -> set[str]:
    """The results one step writes, normalised: its boxed answers, and the numbers after its last ``=`` (all of
    its numbers when it has none), so that the operands of ``a op b = c`` do not count."""
    results = step.rsplit("=", 1)[1] if "=" in step else step
    return {normalize_answer(v) for v in find_numbers(results) + _boxed_answers(step)}


def rule_feedback(text: str, reference: Any, extractor: Any, separator: str = "\n",
                  format_hint: str = "State the final answer as \\boxed{...}.") -> str:
    """Rule-based verifier feedback for any task with a reference final answer (the correct answer never stated).

    In order: an empty solution; several different ``\\boxed`` answers, or no final answer ``extractor`` can find
    (format violations, followed by ``format_hint``); a correct final answer; a wrong one, located: the first step
    before the answer's step whose result is the reference value ("the error comes after it"), else the step
    that states the wrong answer (steps are the non-empty pieces between ``separator``, numbered from 1).

    >>> rule_feedback("3+4=7\\n7*2=14\\n14+1=15\\nAnswer: 15", "14", get_extractor("last_number"))
    'The final answer 15 is incorrect. Step 2 already reaches the expected result; the first error comes after it.'
    """
    steps = [s.text for s in split_steps(text, separator)]
    if not steps:
        return f"The solution is empty. Solve the problem step by step. {format_hint}"
    boxed = {normalize_answer(b) for b in _boxed_answers(text)}
    if len(boxed) > 1:
        return f"Format problem: the solution gives {len(boxed)} different final answers. {format_hint}"
    predicted = extractor(text)
    if predicted is None:
        return f"Format problem: no final answer could be found. {format_hint}"
    expected, got = normalize_answer(str(reference)), normalize_answer(predicted)
    if got == expected:
        return "The final answer is correct."
    stating = [k for k, s in enumerate(steps) if got in _step_values(s) or predicted in s]
    answer_step = stating[-1] if stating else len(steps) - 1
    reached = [k for k in range(answer_step) if expected in _step_values(steps[k])]
    if reached:
        where = f"Step {reached[0] + 1} already reaches the expected result; the first error comes after it."
    else:
        where = f"No step reaches the expected result: the error is in step {answer_step + 1} or before it."
    return f"The final answer {predicted} is incorrect. {where}"


def round2_sources(round1_rewards: torch.Tensor, num_round2: int, threshold: float, all_success: str) -> list:
    """Index (in the group) of the round-1 attempt each round-2 slot gets feedback on, or None (original prompt).

    Failed attempts first, in order, cycling when fewer than ``num_round2`` failed; a group with no failure gives
    None for every slot (``all_success="original"``) or cycles over all attempts (``"feedback"``).

    >>> round2_sources(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, 0.5, "original")
    [1, 3, 1, 3]
    """
    failed = [j for j, r in enumerate(round1_rewards.tolist()) if not r > threshold]
    pool = failed or (list(range(len(round1_rewards))) if all_success == "feedback" else [])
    return [pool[s % len(pool)] if pool else None for s in range(num_round2)]


def subgroup_advantages(rewards: torch.Tensor, keys: torch.Tensor, scale: str) -> torch.Tensor:
    """``A = r - mean`` within each sub-group (rows sharing a key), divided by the sub-group's std (``"group"``,
    Bessel-corrected, + 1e-4 as TRL), the batch std (``"batch"``) or nothing (``"none"``). NaN rewards get 0 and
    are left out of the statistics; a one-row sub-group gets 0.

    Args:
        rewards: (N,) combined rewards. keys: (N,) long, e.g. ``group_id * 2 + is_ecc``.
    Returns: (N,) advantages.
    """
    r = rewards.float()
    valid = ~torch.isnan(r)
    adv = torch.zeros_like(r)
    std_all = r[valid].std() if int(valid.sum()) > 1 else torch.tensor(0.0)
    for key in torch.unique(keys).tolist():
        rows = (keys == key) & valid
        if not rows.any():
            continue
        values = r[rows]
        centred = values - values.mean()
        if scale == "group":
            std = values.std() if values.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + 1e-4)
        elif scale == "batch":
            centred = centred / (std_all + 1e-4)
        adv[rows] = centred
    return adv


def recentre(advantages: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Subtract each sub-group's mean advantage ((N,) or (N, T): row means are used for the mean)."""
    out = advantages.clone()
    per_row = out if out.dim() == 1 else out.mean(dim=1)
    for key in torch.unique(keys).tolist():
        rows = keys == key
        shift = per_row[rows].mean()
        out[rows] = out[rows] - shift
    return out


# ============================================================================================= plugin
class FbosRlPlugin(Plugin):
    """Feedback-guided second round within the group budget; EPA (prompt swap) + ECC (FAP) objectives."""

    name = "fbos_rl"
    image_inputs = IMAGES_DEFERRED_ROWS
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = "FBOS-RL: Feedback-Driven Bi-Objective Synergistic Reinforcement Learning, arXiv:2605.20256"
    summary = "G1 rollouts, verifier feedback, G2 rollouts under feedback prompts; EPA under x + ECC under the FAP."
    Options = FbosRlOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; compared with the paper's abstract: the feedback round, the sub-group split, "
        "the schedules and the off-policy correction are reconstructed.",
    )
    claim_metric = ("rescued_group_fraction", "groups rescued by the feedback round")
    replaces = (
        "part of each group's completions (feedback-guided round 2)",
        "the advantages (EPA / ECC normalisation)",
    )
    reconstructed = (
        "budget split G1 = G // 2 (4 + 4 of G = 8); round-2 rows are deferred, so exactly G rollouts per prompt",
        ("feedback='task': the bundled tasks' step verifier (those tasks only; 'rule' for other datasets with a "
         "reference answer); no answer leak (leak_answer=false)"),
        "schedule='joint': the public summaries disagree on joint vs alternating EPA/ECC updates",
        "fap_format='multi_turn': original turns + attempt (assistant) + feedback and a revise request (user)",
        "round-2 sources: failed attempts first, cycling; groups without failure sample round 2 under x",
        "EPA: a successful round-2 rollout replaces its failed source (at most 1 per group), shaped off-policy",
        "ECC: round-2 rows trained under their FAP, weight lambda = 1; schedule 'joint'",
        "advantages normalised within (prompt, rows under x) and (prompt, ECC rows) sub-groups",
        "gamma = 0.1 of the shaped off-policy branch (LUFFY)",
    )

    def overwritten(self) -> tuple[str, ...]:
        # advantage='subgroup' recomputes them from the rewards per sub-group; 'recentre' / 'none' adjust them
        return ("advantages",) if self.options.advantage == "subgroup" else ()

    def __init__(self, options=None):
        super().__init__(options)
        self.judge = None
        self._scale = "group"

    def required_columns(self) -> list[str]:
        o = self.options
        cols = []
        if o.feedback == "task":
            cols.append(o.problem_column)
        if o.feedback in ("simple_gt", "rule") or o.leak_answer:
            cols.append(o.answer_column)
        return cols

    def num_round1(self, G: int) -> int:
        """G1 for a group size G (G itself: no second round)."""
        g1 = self.options.g1 if self.options.g1 is not None else G // 2
        return min(max(g1, 1), G) if G >= 2 else G

    def active(self, step: int, G: int) -> bool:
        return not self.options.warming_up(step) and self.num_round1(G) < G

    def epa_step(self, step: int) -> bool:
        """Whether EPA copies are made at ``step`` (always, unless schedule='alternate' and the step is odd)."""
        return self.options.schedule == "joint" or step % 2 == 0

    def ecc_weight(self, step: int) -> float:
        o = self.options
        return o.ecc_weight if o.schedule == "joint" or step % 2 == 1 else 0.0

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        G = args.num_generations
        if o.g1 is not None and o.g1 > G:
            raise PluginConfigError(f"fbos_rl: g1={o.g1} exceeds num_generations={G} (the group budget).")
        if self.num_round1(G) >= G:
            warnings.warn(f"fbos_rl: g1 = G = {G}: no feedback round, the run is plain GRPO.", stacklevel=2)
        self._scale = getattr(trainer, "scale_rewards", getattr(args, "scale_rewards", "group"))
        names = [p.name for p in trainer.plugin_stack if "advantage" in p.stages()]
        later = names[names.index(self.name) + 1:] if self.name in names else []
        if later and o.advantage != "none":
            warnings.warn(
                f"fbos_rl: advantage plugins after it in the order ({', '.join(later)}) replace its sub-group "
                "advantages; put them before fbos_rl and use advantage='recentre' to compose.",
                stacklevel=2,
            )
        if o.feedback == "judge" and self.judge is None:
            self.judge = shared_teacher(o.judge, **o.endpoint_kwargs("judge"), max_tokens=o.judge_max_tokens)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        G = ctx.num_generations
        if not self.active(ctx.step, G):
            return
        g1 = self.num_round1(G)
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] >= g1:
                ctx.defer(i)  # sampled in round 2: the group still costs exactly G rollouts
                ctx.annotations[i]["fbos_role"] = "ecc"
            else:
                ctx.annotations[i]["fbos_role"] = "round1"

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        G, B = ctx.num_generations, len(ctx)
        if not self.active(ctx.step, G):
            return
        g1, device = self.num_round1(G), context_device(ctx)
        round1 = [i for i in range(B) if ctx.index_in_group[i] < g1]
        round2 = [i for i in range(B) if ctx.index_in_group[i] >= g1]
        in_round1 = set(round1)

        # round 1: rewards and attempts of every group, gathered (a group may straddle processes)
        local = torch.full((B,), math.nan)
        if round1:
            # the verifier column only (success rule); a verifier None is -inf (NaN marks unscored rows here)
            local[round1] = ctx.reward_columns(round1).verifier(o.success_rule, missing=-math.inf).float().cpu()
        r1 = ctx.gather(local.to(device)).cpu()
        attempts = gather_id_lists(ctx, [ctx.completion_ids[i] if i in in_round1 else [] for i in range(B)])
        tok = ctx.tokenizer

        # round 2: one prompt per deferred row (a FAP, or the original prompt for groups without failure)
        sources: dict[int, int] = {}  # local round-2 row -> global row of its round-1 attempt
        for i in round2:
            base = ctx.group_ids[i] * G
            src = round2_sources(r1[base: base + g1], G - g1, o.success_threshold, o.all_success)[
                ctx.index_in_group[i] - g1]
            if src is not None:
                sources[i] = base + src
        fap_rows = [i for i in round2 if i in sources]
        texts = [tok.decode(attempts[sources[i]], skip_special_tokens=True) for i in fap_rows]
        correct = [bool(r1[sources[i]] > o.success_threshold) for i in fap_rows]
        # collective: a judge failure or a row without its problem column on one process stops every process
        feedbacks = run_together(ctx, self.name, self._feedback, ctx, fap_rows, texts, correct)
        faps = {
            i: feedback_prompt(ctx.prompts[i], text, fb, o.fap_format, o.revise_instruction, o.single_turn_template)
            for i, text, fb in zip(fap_rows, texts, feedbacks)
        }
        completions = ctx.service.generate(prompts=[faps.get(i, ctx.prompts[i]) for i in round2])  # collective
        for i, c in zip(round2, completions):
            ids, lps = (c.completion_ids, c.logprobs) if c.completion_ids else ([tok.eos_token_id], None)
            if i in faps:
                ctx.replace_row(i, ids, logprobs=lps, training_prompt=faps[i], prompt_swapped=False)
                ctx.annotations[i].update(fbos_role="ecc", fbos_source=sources[i] % G)
            else:  # no failure to learn from: an ordinary rollout under x
                ctx.replace_row(i, ids, logprobs=lps)
                ctx.annotations[i]["fbos_role"] = "round1"

        # round-2 rewards (FAP rows only), gathered with their sources
        local2 = torch.full((B, 2), math.nan)
        if fap_rows:
            local2[fap_rows, 0] = ctx.reward_columns(fap_rows).verifier(o.success_rule, missing=-math.inf).float().cpu()
            local2[fap_rows, 1] = torch.tensor([float(sources[i]) for i in fap_rows])
        r2 = ctx.gather(local2.to(device)).cpu()
        epa_rows = self._epa(ctx, r1, r2, fap_rows, G, g1) if o.epa and self.epa_step(ctx.step) else []
        self._log(ctx, r1, r2, epa_rows, G, g1, device)

    def _feedback(self, ctx: RolloutContext, rows: list[int], texts: list[str], correct: list[bool]) -> list[str]:
        o = self.options
        answers = [ctx.rows[i].get(o.answer_column) for i in rows]
        if o.feedback == "task":
            verifier = feedback_oracle(o.feedback_oracle)
            out = []
            for i, text in zip(rows, texts):
                raw = ctx.rows[i].get(o.problem_column)
                if not raw:
                    bundled = o.feedback_oracle == "arithmetic"
                    only = " works only on the bundled arithmetic tasks and" if bundled else ""
                    raise PluginConfigError(
                        f"fbos_rl: feedback='task' (feedback_oracle={o.feedback_oracle!r}){only} needs the column "
                        f"{o.problem_column!r}; on another dataset with a reference answer use feedback='rule'."
                    )
                out.append(verifier(raw, text).message)
        elif o.feedback == "rule":
            extractor = get_extractor(o.extractor)
            out = []
            for i, text, answer in zip(rows, texts, answers):
                if answer is None:
                    raise PluginConfigError(
                        f"fbos_rl: feedback='rule' needs the reference answer in column {o.answer_column!r}; row "
                        f"{ctx.global_index[i]} has none."
                    )
                out.append(rule_feedback(text, answer, extractor, o.step_separator, o.format_hint))
        elif o.feedback == "simple_gt":
            out = [simple_feedback(ok, a) for ok, a in zip(correct, answers)]
        elif o.feedback == "simple":
            out = [simple_feedback(ok) for ok in correct]
        else:
            judge = self.judge
            if judge is None:
                raise PluginConfigError("fbos_rl: feedback='judge' but no judge was configured.")
            conversations = []
            for i, text in zip(rows, texts):
                user = f"## Question\n{question_text(ctx.prompts[i])}\n\n## Solution\n{text}"
                if o.leak_answer:
                    user += f"\n\n## Correct final answer\n{ctx.rows[i].get(o.answer_column)}"
                conversations.append([{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}])
            out = judge.chat(conversations) if conversations else []
        if o.leak_answer and o.feedback in ("task", "rule", "simple"):
            out = [fb if ok else f"{fb} The correct final answer is {a}." for fb, ok, a in zip(out, correct, answers)]
        return out

    def _epa(self, ctx, r1, r2, fap_rows, G, g1) -> list[int]:
        """Copy successful round-2 rollouts onto the failed attempts they came from (decided on gathered data)."""
        o = self.options
        in_fap = set(fap_rows)
        round2_ids = gather_id_lists(ctx, [ctx.completion_ids[i] if i in in_fap else [] for i in range(len(ctx))])
        targets: dict[int, int] = {}  # global round-1 row -> global round-2 row
        for g in range(r1.numel() // G):
            taken = 0
            for s in range(g1, G):
                n = g * G + s
                reward, src = float(r2[n, 0]), r2[n, 1]
                if taken >= o.epa_max_per_group or math.isnan(reward) or not reward > o.success_threshold:
                    continue
                src = int(src)
                if src in targets or r1[src] > o.success_threshold:
                    continue
                targets[src] = n
                taken += 1
        done = []
        for i in range(len(ctx)):
            n = targets.get(ctx.global_index[i])
            if n is None:
                continue
            ctx.replace_row(i, round2_ids[n], offpolicy=o.epa_offpolicy == "shaped", prompt_swapped=True)
            ctx.annotations[i].update(fbos_role="epa", fbos_source=n % G)
            done.append(i)
        return done

    def _log(self, ctx, r1, r2, epa_rows, G, g1, device) -> None:
        N = r1.numel()
        n_epa = ctx.gather(torch.tensor([float(len(epa_rows))], device=device)).sum().item()
        r1g = r1.view(-1, G)[:, :g1]
        r2g = r2[:, 0].view(-1, G)[:, g1:]
        r2_valid = ~torch.isnan(r2g)
        all_fail = ~(r1g > self.options.success_threshold).any(dim=1)
        rescued = (all_fail & ((r2g > self.options.success_threshold) & r2_valid).any(dim=1)).float().mean().item()
        ctx.log_metric("round1_success_rate", (r1g > self.options.success_threshold).float().mean().item())
        if r2_valid.any():
            success2 = (r2g[r2_valid] > self.options.success_threshold).float().mean().item()
            ctx.log_metric("round2_success_rate", success2)
        ctx.log_metric("rescued_group_fraction", rescued)
        ctx.log_metric("epa_fraction", n_epa / N)
        ctx.log_metric("ecc_fraction", r2_valid.sum().item() / N)

    # ------------------------------------------------------------------------------------------ advantage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        if not self.active(ctx.step, G) or not any("fbos_role" in a for a in ctx.annotations):
            return  # eval batches and warm-up steps keep TRL's advantages
        is_ecc = torch.tensor([a.get("fbos_role") == "ecc" for a in ctx.annotations], device=ctx.rewards.device)
        keys = ctx.group_ids.to(is_ecc.device) * 2 + is_ecc.long()
        if o.advantage == "subgroup":
            advantages = subgroup_advantages(ctx.rewards, keys.to(ctx.rewards.device), self._scale).to(ctx.advantages)
        elif o.advantage == "recentre":
            advantages = recentre(ctx.advantages, keys.to(ctx.advantages.device))
        else:
            advantages = ctx.advantages.clone()
        weight = self.ecc_weight(ctx.step)
        scale = torch.where(is_ecc, torch.tensor(weight), torch.tensor(1.0)).to(advantages)
        ctx.advantages = advantages * (scale if advantages.dim() == 1 else scale.unsqueeze(1))
        ctx.log_metric("ecc_weight", weight)
