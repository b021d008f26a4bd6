"""Hint scaffolding — GHPO (arXiv:2507.10628) and Scaf-GRPO (arXiv:2510.19807).

Groups in which every rollout fails give GRPO no signal (the "learning cliff"). This plugin re-generates
them, within the step, from prompts carrying growing hints (a prefix of the dataset's reference solution, or
Scaf-GRPO's tiered hints, below):

* ``replace="group"`` (GHPO, the default): the whole all-fail group is re-generated with a hint of the first
  25 % of the reference solution (by characters); if it still fails, 50 %, then 75 %. The first hinted group
  that contains a success **replaces** the original group. If no level succeeds, the last hinted group (75 %)
  replaces it, as GHPO's code does (it replaces the group unconditionally at each level and retries only the groups
  still all-wrong); ``on_no_success="original"`` keeps the original rollouts instead (this project's earlier choice).
* ``replace="one"`` (Scaf-GRPO's replacement rule): for each level, one hinted rollout is generated per all-fail
  group; the minimal level that yields a success replaces **one** failed rollout of the group (slot
  ``replace_index``); if no level succeeds the group is kept.

Hints: ``hints="solution_prefix"`` (default) uses prefixes of the reference solution, as GHPO. Scaf-GRPO's own
hints are different: pre-generated **tiers** (knowledge, then planning, then solution steps), tried from the most
abstract up; ``hints="tiered"`` reads them from ``hints_column`` (a dict ``{"knowledge": [...], "planning": [...],
"solution": [...]}``, each a list of parts or one string) and tries cumulative levels: for each tier of ``tiers`` in
order (default knowledge then solution: the official script leaves planning out) and ``k = 1 .. parts``, the hint is
every part of the earlier tiers plus the first ``k`` parts of this tier (up to 4 + 4 = 8 levels in the paper's data;
the cumulative reading is reconstructed). Scaf-GRPO = ``replace="one"``, ``hints="tiered"``, ``warmup_steps=50``.

Training prompt: both papers train the replaced rows under the **hinted** prompt by default (on-policy with
respect to the hint; GHPO always, Scaf-GRPO ``replace_hint_prompt=False``). ``train_prompt="original"`` places
the hinted completion after the original prompt instead (prompt swap, Scaf-GRPO ``replace_hint_prompt=True``);
its sampling log-probs are then NaN (no vLLM IS correction), and ``swapped_as_offpolicy=true`` additionally
trains its tokens through the shaped off-policy branch ``-A p/(p+gamma)``.

A group "fails" when no rollout succeeds on the **verifier column** (the first reward function unless
``success_column`` names another; a rollout succeeds when that value is above ``success_threshold``, 0.0 by default:
GHPO tests ``accuracy <= 0``). Other reward columns never change the verdict: GHPO's own recipe adds a 0.5-weighted
format reward, and a weighted sum would count every well-formatted wrong answer as a success. The hint is introduced, as in
GHPO, by a sentence saying it is the beginning of the answer. Scaf-GRPO's first 50 steps are plain GRPO:
``warmup_steps`` (default 0, GHPO) reproduces that. Extra rollouts count in the rollout budget and are logged
(``plugins/hint_scaffold/extra_rollouts``, summed over processes), as are the all-fail and rescued group fractions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from trl_plugins import Plugin, PluginConfigError, RolloutContext, hookimpl, option
from trl_plugins.success import SuccessOptions

DEFAULT_TEMPLATE = "{question}\n\nThe following text is the beginning of the answer, which you can refer to:\n{hint}"


@dataclass
class HintScaffoldOptions(SuccessOptions):
    hint_fractions: list[float] = option(
        default_factory=lambda: [0.25, 0.5, 0.75],
        help="Growing fractions of the reference solution used as hints, tried in order (GHPO: 25/50/75 %).",
    )
    replace: Literal["group", "one"] = option(
        "group",
        help="'group': the hinted group replaces the all-fail group (GHPO); 'one': the minimal successful level "
        "replaces one row (Scaf-GRPO's replacement rule, with solution-prefix hints, not Scaf-GRPO's tiered hints).",
    )
    hints: Literal["solution_prefix", "tiered"] = option(
        "solution_prefix",
        help="Hint content: prefixes of the reference solution (GHPO), or Scaf-GRPO's tiered hints from hints_column, "
        "tried as cumulative levels (knowledge parts, then solution parts).",
    )
    hints_column: str = option(
        "hints", help="hints='tiered': dataset column holding a dict tier -> list of hint parts (or one string)."
    )
    tiers: list[str] = option(
        default_factory=lambda: ["knowledge", "solution"],
        help="hints='tiered': tiers tried in order (official Scaf-GRPO script: knowledge then solution; planning "
        "disabled).",
    )
    tiered_template: str = option(
        "{question}\n\nHint:\n{hint}",
        help="hints='tiered': how the hint joins the question; must contain {question} and {hint} [reconstructed].",
    )
    on_no_success: Literal["last_hint", "original"] = option(
        "last_hint",
        help="replace='group', when no hint level succeeds: 'last_hint' trains the last hinted group (official GHPO "
        "code); 'original' keeps the original rollouts (not official).",
    )
    train_prompt: Literal["hinted", "original"] = option(
        "hinted", help="Train replaced rows under the hinted prompt (both papers) or the original one (prompt swap)."
    )
    swapped_as_offpolicy: bool = option(
        False, help="With train_prompt='original', train the hinted tokens through the shaped off-policy branch."
    )
    hint_unit: Literal["chars", "lines"] = option(
        "chars", help="Unit of the hint prefix: characters (GHPO) or whole solution lines."
    )
    solution_column: str = option("solution", help="Dataset column holding the reference solution text.")
    template: str = option(
        DEFAULT_TEMPLATE, help="How the hint joins the question; must contain {question} and {hint}."
    )
    replace_index: int = option(0, min=0, help="Slot replaced in 'one' mode (index within the group).")
    warmup_steps: int = option(0, min=0, help="Plain GRPO for this many steps first (Scaf-GRPO uses 50).")

    def validate(self) -> None:
        if not self.hint_fractions or any(not (0.0 < f <= 1.0) for f in self.hint_fractions):
            raise PluginConfigError(
                f"Option 'hint_fractions' of plugin 'hint_scaffold' got {self.hint_fractions!r}; allowed: a non-empty "
                "list of fractions in (0, 1]."
            )
        if not self.tiers:
            raise PluginConfigError("Option 'tiers' of plugin 'hint_scaffold' must name at least one tier.")
        for key in ("{question}", "{hint}"):
            if key not in self.tiered_template:
                raise PluginConfigError(
                    f"Option 'tiered_template' of plugin 'hint_scaffold' got {self.tiered_template!r}; it must "
                    f"contain {key}."
                )
        if "{question}" not in self.template or "{hint}" not in self.template:
            raise PluginConfigError(
                f"Option 'template' of plugin 'hint_scaffold' got {self.template!r}; it must contain {{question}} "
                "and {hint}."
            )


def hint_text(solution: str, fraction: float, unit: str) -> str:
    """The first ``fraction`` of ``solution``: ``ceil(fraction * len)`` characters, or whole lines (at least one)."""
    if unit == "lines":
        lines = solution.splitlines()
        return "\n".join(lines[: _prefix_count(fraction, len(lines))])
    return solution[: _prefix_count(fraction, len(solution))]


def _prefix_count(fraction: float, n: int) -> int:
    """``max(1, ceil(fraction * n))``, robust to float error (0.07 * 100 = 7.000000000000001 must give 7)."""
    return max(1, math.ceil(round(fraction * n, 9)))


def tiered_levels(hints: Any, tiers: list[str]) -> list[tuple[str, int, str]]:
    """Scaf-GRPO's cumulative hint levels from one row's tiered hints: ``(tier, k, text)`` for each tier in order and
    ``k = 1 .. len(parts)``, the text joining every part of the earlier tiers and the first ``k`` parts of this one.

    ``hints``: a dict tier -> list of parts (or one string = one part); a missing or empty tier gives no level.
    """
    if not isinstance(hints, dict):
        return []
    levels, earlier = [], []
    for tier in tiers:
        parts = hints.get(tier) or []
        parts = [parts] if isinstance(parts, str) else [str(p) for p in parts if p]
        for k in range(1, len(parts) + 1):
            levels.append((tier, k, "\n".join(earlier + parts[:k])))
        earlier += parts
    return levels


def hinted_prompt(prompt: Any, hint: str, template: str) -> Any:
    """The prompt with ``hint`` joined to its last user message (conversational) or to the text."""
    if isinstance(prompt, str):
        return template.format(question=prompt, hint=hint)
    messages = copy.deepcopy(prompt)
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = template.format(question=message["content"], hint=hint)
            return messages
    raise PluginConfigError("hint_scaffold: the prompt has no user message to attach the hint to.")


class HintScaffoldPlugin(Plugin):
    """Re-generate all-fail groups from growing reference-solution hints (sampling stage)."""

    name = "hint_scaffold"
    multi_turn = (
        "it edits completions after generation (replace_row / splice / in-step generation), and the "
        "generation service samples single-turn text without running tools, so the edited rows would lose "
        "their tool-call turns."
    )
    version = "0.1.0"
    paper = (
        "GHPO: Adaptive Guidance for Stable and Efficient LLM Reinforcement Learning, arXiv:2507.10628; "
        "Scaf-GRPO: Scaffolded Group Relative Policy Optimization for Enhancing LLM Reasoning, "
        "arXiv:2510.19807"
    )
    summary = "All-fail groups are re-generated with growing hints: solution prefixes (GHPO) or tiered hints (Scaf-GRPO)."
    Options = HintScaffoldOptions
    replaces = ("the completions of all-fail groups (hinted re-generations)",)
    reconstructed = (
        (
            "hints='tiered': levels are cumulative (earlier tiers in full, then the first k parts of the current "
            "tier), and the tiered_template wording"
        ),
    )

    def required_columns(self) -> list[str]:
        return [self.options.hints_column if self.options.hints == "tiered" else self.options.solution_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o, G = self.options, args.num_generations
        if o.replace == "one" and o.replace_index >= G:
            raise PluginConfigError(
                f"Option 'replace_index' of plugin 'hint_scaffold' got {o.replace_index}; allowed: a slot of the "
                f"group, 0 to {G - 1} (num_generations={G})."
            )

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if ctx.step < o.warmup_steps:
            return
        G = ctx.num_generations
        rule = o.success_rule
        local_success = ctx.success(range(len(ctx)), rule=rule)
        success = ctx.gather(local_success).view(-1, G)  # (N // G, G), decided on the verifier column only
        failing = set(torch.nonzero(~success.any(dim=1)).flatten().tolist())
        ctx.log_metric("all_fail_group_fraction", len(failing) / success.size(0))
        self._check_solutions(ctx, failing)
        levels = [self._levels(ctx, i) if ctx.group_ids[i] in failing else [] for i in range(len(ctx))]
        group_levels = self._group_level_counts(ctx, levels, success.size(0))  # (N // G,) levels of each group
        rescued: set[int] = set()
        extra = 0
        for n_level in range(max(group_levels, default=0)):
            open_groups = {g for g in failing - rescued if n_level < group_levels[g]}
            if o.replace == "group":
                rows = [i for i in range(len(ctx)) if ctx.group_ids[i] in open_groups]
            else:
                rows = [
                    i for i in range(len(ctx))
                    if ctx.group_ids[i] in open_groups and ctx.index_in_group[i] == o.replace_index
                ]
            prompts = [levels[i][n_level][1] for i in rows]
            completions = ctx.service.generate(prompts=prompts)  # every process calls, maybe with none
            extra += len(open_groups) * (G if o.replace == "group" else 1)  # all processes: open_groups is global
            new_success = ctx.success(rows, [self._as_completion(ctx, i, c) for i, c in zip(rows, completions)],
                                      rule=rule)
            marks = torch.zeros_like(local_success)
            if rows:
                marks[torch.tensor(rows, device=marks.device)] = new_success.to(marks.device)
            level_success = ctx.gather(marks).view(-1, G).any(dim=1)
            newly = {g for g in open_groups if bool(level_success[g])}
            # GHPO replaces the group at every level; only the last level's group stays when none succeeds
            keep_last = o.replace == "group" and o.on_no_success == "last_hint"
            for i, prompt, completion in zip(rows, prompts, completions):
                last = n_level == group_levels[ctx.group_ids[i]] - 1
                if ctx.group_ids[i] in newly or (keep_last and last):
                    self._replace(ctx, i, prompt, completion, levels[i][n_level][0])
            rescued |= newly
            if not any(n_level + 1 < group_levels[g] for g in failing - rescued):  # global: same on every process
                break
        ctx.log_metric("rescued_group_fraction", len(rescued) / success.size(0))
        ctx.log_metric("extra_rollouts", extra)

    def _group_level_counts(self, ctx: RolloutContext, levels: list[list], num_groups: int) -> list[int]:
        """Number of hint levels of every group (global; 0 for groups that are not hinted). Solution prefixes give
        every group the same count; tiered hints are gathered (one collective)."""
        if self.options.hints == "solution_prefix":
            return [len(self.options.hint_fractions)] * num_groups
        counts = ctx.gather(torch.tensor([len(x) for x in levels], dtype=torch.long)).view(num_groups, -1)
        return counts.max(dim=1).values.tolist()

    def _levels(self, ctx: RolloutContext, i: int) -> list[tuple[Any, Any]]:
        """``(annotation, hinted prompt)`` of every hint level of local row ``i``, in the order they are tried."""
        o = self.options
        if o.hints == "tiered":
            return [(f"{tier}:{k}", hinted_prompt(ctx.prompts[i], text, o.tiered_template))
                    for tier, k, text in tiered_levels(ctx.rows[i].get(o.hints_column), o.tiers)]
        return [(level, self._hinted(ctx, i, level)) for level in o.hint_fractions]

    def _check_solutions(self, ctx: RolloutContext, failing: set[int]) -> None:
        """Every process raises together when a row to hint has no solution (no process left in a collective)."""
        bad = [i for i in range(len(ctx)) if ctx.group_ids[i] in failing and not self._has_hints(ctx, i)]
        flags = ctx.gather(torch.tensor([ctx.global_index[bad[0]] if bad else -1]))
        offenders = [int(x) for x in flags.tolist() if x >= 0]
        if offenders:
            o = self.options
            what = (f"no tiered hints (a dict with a non-empty {o.tiers} entry) in column {o.hints_column!r}"
                    if o.hints == "tiered" else
                    f"no reference solution in column {o.solution_column!r} (a non-empty string is needed)")
            raise PluginConfigError(f"hint_scaffold: row {offenders[0]} has {what} to build hints.")

    def _has_hints(self, ctx: RolloutContext, i: int) -> bool:
        o = self.options
        if o.hints == "tiered":
            return bool(tiered_levels(ctx.rows[i].get(o.hints_column), o.tiers))
        return self._solution(ctx, i) is not None

    def _solution(self, ctx: RolloutContext, i: int) -> str | None:
        solution = ctx.rows[i].get(self.options.solution_column)
        return solution if isinstance(solution, str) and solution else None

    def _hinted(self, ctx: RolloutContext, i: int, level: float) -> Any:
        solution = ctx.rows[i].get(self.options.solution_column)
        if not isinstance(solution, str) or not solution:
            raise PluginConfigError(
                f"hint_scaffold: row {ctx.global_index[i]} has no reference solution in column "
                f"{self.options.solution_column!r} (got {solution!r})."
            )
        return hinted_prompt(ctx.prompts[i], hint_text(solution, level, self.options.hint_unit), self.options.template)

    @staticmethod
    def _as_completion(ctx: RolloutContext, i: int, completion) -> Any:
        return ctx.decode(completion.completion_ids, i)

    def _replace(self, ctx: RolloutContext, i: int, prompt: Any, completion, level: Any) -> None:
        o = self.options
        if o.train_prompt == "hinted":
            ctx.replace_row(
                i, completion.completion_ids, logprobs=completion.logprobs, training_prompt=prompt, prompt_swapped=False
            )
        else:
            ctx.replace_row(
                i, completion.completion_ids, offpolicy=o.swapped_as_offpolicy, logprobs=completion.logprobs,
                prompt_swapped=True,
            )
        ctx.annotations[i]["hint_level"] = level
