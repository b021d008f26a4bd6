"""Hint scaffolding — GHPO (arXiv:2507.10628) and Scaf-GRPO (arXiv:2510.19807).

Groups in which every rollout fails give GRPO no signal (the "learning cliff"). This plugin re-generates
them, within the step, from prompts carrying a growing prefix of the dataset's reference solution:

* ``replace="group"`` (GHPO, the default): the whole all-fail group is re-generated with a hint of the first
  25 % of the reference solution (by characters); if it still fails, 50 %, then 75 %. The first hinted group
  that contains a success **replaces** the original group. If no level succeeds the original rollouts stay.
* ``replace="one"`` (Scaf-GRPO): for each level, one hinted rollout is generated per all-fail group; the
  minimal level that yields a success replaces **one** failed rollout of the group (slot ``replace_index``).

Training prompt: both papers train the replaced rows under the **hinted** prompt by default (on-policy with
respect to the hint; GHPO always, Scaf-GRPO ``replace_hint_prompt=False``). ``train_prompt="original"`` places
the hinted completion after the original prompt instead (prompt swap, Scaf-GRPO ``replace_hint_prompt=True``);
its sampling log-probs are then NaN (no vLLM IS correction), and ``swapped_as_offpolicy=true`` additionally
trains its tokens through the shaped off-policy branch ``-A p/(p+gamma)``.

A group "fails" when no rollout's weighted reward exceeds ``success_threshold``. The hint is introduced, as in
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
from trl_plugins import Plugin, PluginConfigError, PluginOptions, RolloutContext, hookimpl, option

DEFAULT_TEMPLATE = "{question}\n\nThe following text is the beginning of the answer, which you can refer to:\n{hint}"


@dataclass
class HintScaffoldOptions(PluginOptions):
    hint_fractions: list[float] = option(
        default_factory=lambda: [0.25, 0.5, 0.75],
        help="Growing fractions of the reference solution used as hints, tried in order (GHPO: 25/50/75 %).",
    )
    replace: Literal["group", "one"] = option(
        "group", help="'group': hinted group replaces the all-fail group (GHPO); 'one': one row (Scaf-GRPO)."
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
    success_threshold: float = option(0.0, help="A rollout succeeds when its weighted reward is above this value.")
    replace_index: int = option(0, min=0, help="Slot replaced in 'one' mode (index within the group).")
    warmup_steps: int = option(0, min=0, help="Plain GRPO for this many steps first (Scaf-GRPO uses 50).")

    def validate(self) -> None:
        if not self.hint_fractions or any(not (0.0 < f <= 1.0) for f in self.hint_fractions):
            raise PluginConfigError(
                f"Option 'hint_fractions' of plugin 'hint_scaffold' got {self.hint_fractions!r}; allowed: a non-empty "
                "list of fractions in (0, 1]."
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
    version = "0.1.0"
    paper = "GHPO, arXiv:2507.10628; Scaf-GRPO, arXiv:2510.19807"
    summary = "All-fail groups are re-generated with growing reference-solution hints (GHPO / Scaf-GRPO)."
    Options = HintScaffoldOptions
    replaces = ("the completions of all-fail groups (hinted re-generations)",)
    reconstructed = ("when no hint level succeeds the original rollouts are kept (GHPO's code path is not stated)",)

    def required_columns(self) -> list[str]:
        return [self.options.solution_column]

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if ctx.step < o.warmup_steps:
            return
        G = ctx.num_generations
        local_scores = ctx.score(range(len(ctx)))
        scores = ctx.gather(local_scores)  # (N,)
        success = (scores > o.success_threshold).view(-1, G)
        failing = set(torch.nonzero(~success.any(dim=1)).flatten().tolist())
        ctx.log_metric("all_fail_group_fraction", len(failing) / success.size(0))
        self._check_solutions(ctx, failing)
        rescued: set[int] = set()
        extra = 0
        for level in o.hint_fractions:
            open_groups = failing - rescued
            if o.replace == "group":
                rows = [i for i in range(len(ctx)) if ctx.group_ids[i] in open_groups]
            else:
                rows = [
                    i for i in range(len(ctx))
                    if ctx.group_ids[i] in open_groups and ctx.index_in_group[i] == min(o.replace_index, G - 1)
                ]
            prompts = [self._hinted(ctx, i, level) for i in rows]
            completions = ctx.service.generate(prompts=prompts)  # every process calls, maybe with none
            extra += len(open_groups) * (G if o.replace == "group" else 1)  # all processes: open_groups is global
            new_scores = ctx.score(rows, [self._as_completion(ctx, i, c) for i, c in zip(rows, completions)])
            marks = torch.full_like(local_scores, -math.inf)
            if rows:
                marks[torch.tensor(rows, device=marks.device)] = new_scores.to(marks.dtype)
            level_success = (ctx.gather(marks) > o.success_threshold).view(-1, G).any(dim=1)
            newly = {g for g in open_groups if bool(level_success[g])}
            for i, prompt, completion in zip(rows, prompts, completions):
                if ctx.group_ids[i] in newly:
                    self._replace(ctx, i, prompt, completion, level)
            rescued |= newly
            if not (failing - rescued):
                break
        ctx.log_metric("rescued_group_fraction", len(rescued) / success.size(0))
        ctx.log_metric("extra_rollouts", extra)

    def _check_solutions(self, ctx: RolloutContext, failing: set[int]) -> None:
        """Every process raises together when a row to hint has no solution (no process left in a collective)."""
        bad = [i for i in range(len(ctx)) if ctx.group_ids[i] in failing and not self._solution(ctx, i)]
        flags = ctx.gather(torch.tensor([ctx.global_index[bad[0]] if bad else -1]))
        offenders = [int(x) for x in flags.tolist() if x >= 0]
        if offenders:
            raise PluginConfigError(
                f"hint_scaffold: row {offenders[0]} has no reference solution in column "
                f"{self.options.solution_column!r} (a non-empty string is needed to build hints)."
            )

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

    def _replace(self, ctx: RolloutContext, i: int, prompt: Any, completion, level: float) -> None:
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
