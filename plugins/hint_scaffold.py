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

SEELE (arXiv:2509.06923, ``schedule="seele"``): instead of reacting to failures, **every** problem is sampled with a
hint -- a prefix of its reference solution -- whose length is chosen per problem so that the rollout accuracy sits
at the learning-efficiency sweet spot ``target_accuracy`` (0.5: the paper bounds the loss descent by ``a (1 - a)``).
The G rollouts of a prompt are split into ``seele_rounds`` rounds (paper: m = 4 rounds of n = 8): round 1 uses the
problem's hinting rate from its previous visit (first visit: the pessimistic cold start ``(S - 1) / S`` of its S
solution steps); after each round the (hinting rate, round accuracy) pairs seen so far -- accuracies averaged per
distinct rate -- are fitted by the three-parameter logistic item-response model ``f(p) = b + (1 - b) / (1 + exp(-k
(p + mu)))`` (least squares), and the next round uses ``p = f^-1(target_accuracy)`` (0 when the floor ``b`` already
reaches the target, 1 when the curve never does). The hint is the first ``round(p S)`` solution steps (lines, or
characters with ``seele_unit="chars"``); the last fit's rate is remembered for the problem's next visit. The rounds
after the first are deferred rows filled through the generation service (one collective call per round), so a step
costs exactly G rollouts; all G rows form one group for the advantage, each trained under its own hinted prompt.
Differences, documented: the paper writes the hint at the start of the response and adds an imitation term (gamma =
0.001) on its tokens; here the hint is part of the prompt (TRL's first generation round has no completion prefix), so
there is no imitation term. The fit is our least-squares solver (the paper: LMFIT's TRF), with ``k`` bounded by 50
and ``b`` in [0, 1] [reconstructed]; the remembered rates are kept per process, keyed by the question text, and saved
in checkpoints.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from trl_plugins import Plugin, PluginConfigError, PromptContext, RolloutContext, hookimpl, option
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
    schedule: Literal["on_failure", "seele"] = option(
        "on_failure", help="'on_failure': hint all-fail groups after generation (GHPO, Scaf-GRPO); 'seele': every "
        "problem gets a solution-prefix hint whose length is fitted per problem to reach target_accuracy (SEELE)."
    )
    seele_rounds: int = option(
        4, min=2, help="schedule='seele': rollout rounds per step (paper: 4); num_generations must be a multiple."
    )
    target_accuracy: float = option(
        0.5, min=0.0, max=1.0, min_exclusive=True, help="schedule='seele': the accuracy the hint length aims at "
        "(paper: 0.5)."
    )
    seele_unit: Literal["lines", "chars"] = option(
        "lines", reconstructed=True, help="schedule='seele': unit of the hinting rate (paper: solution steps; a step "
        "is one line here)."
    )

    def validate(self) -> None:
        if self.schedule == "seele" and self.hints != "solution_prefix":
            raise PluginConfigError(
                f"Option 'schedule' of plugin 'hint_scaffold' got 'seele' with hints={self.hints!r}; SEELE's hints are "
                "solution prefixes (hints='solution_prefix')."
            )
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


# ============================================================================================= SEELE
#: Upper bound of the 3PL discrimination k in the fit [reconstructed: the paper's fitted curves reach k = 50.00].
SEELE_K_MAX = 50.0


def three_pl(p: torch.Tensor, k: float, mu: float, b: float) -> torch.Tensor:
    """SEELE's item-response model of accuracy against hinting rate: ``b + (1 - b) / (1 + exp(-k (p + mu)))``."""
    return b + (1 - b) * torch.sigmoid(k * (p + mu))


def fit_three_pl(rates: list[float], accuracies: list[float], iterations: int = 200) -> tuple[float, float, float]:
    """Least-squares fit of :func:`three_pl` to (hinting rate, accuracy) pairs; accuracies are averaged per distinct
    rate first (the paper's Eq. 13). ``k`` in (0, 50), ``b`` in (0, 1), ``mu`` free; deterministic (L-BFGS from
    ``k = 10, mu = -0.5, b = 0.02``). Returns ``(k, mu, b)``."""
    by_rate: dict[float, list[float]] = {}
    for p, a in zip(rates, accuracies):
        by_rate.setdefault(round(float(p), 9), []).append(float(a))
    p = torch.tensor(list(by_rate), dtype=torch.float64)
    a = torch.tensor([sum(v) / len(v) for v in by_rate.values()], dtype=torch.float64)
    u = torch.tensor(math.log(10.0 / (SEELE_K_MAX - 10.0)), dtype=torch.float64, requires_grad=True)
    mu = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)
    v = torch.tensor(math.log(0.02 / 0.98), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([u, mu, v], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = ((three_pl(p, SEELE_K_MAX * torch.sigmoid(u), mu, torch.sigmoid(v)) - a) ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float(SEELE_K_MAX * torch.sigmoid(u)), float(mu), float(torch.sigmoid(v))


def rate_for_accuracy(target: float, k: float, mu: float, b: float) -> float:
    """``f^-1(target)`` of :func:`three_pl`, clipped to [0, 1]: 0 when the floor ``b`` reaches the target."""
    if target <= b:
        return 0.0
    ratio = (1 - b) / (target - b) - 1
    if ratio <= 0:
        return 1.0
    return min(1.0, max(0.0, -mu - math.log(ratio) / k))


def solution_units(solution: str, unit: str) -> int:
    """Length of a solution in hinting units: non-empty lines (steps) or characters."""
    return len([line for line in solution.splitlines() if line.strip()]) if unit == "lines" else len(solution)


def seele_hint(solution: str, rate: float, unit: str) -> str:
    """The first ``round(rate * S)`` units of ``solution`` (S = :func:`solution_units`); empty for a zero rate."""
    if unit == "lines":
        lines = [line for line in solution.splitlines() if line.strip()]
        return "\n".join(lines[: round(rate * len(lines))])
    return solution[: round(rate * len(solution))]


def cold_start_rate(solution: str, unit: str) -> float:
    """The paper's pessimistic first rate ``(S - 1) / S``: every step but the last is revealed."""
    n = solution_units(solution, unit)
    return (n - 1) / n if n > 0 else 0.0


class HintScaffoldPlugin(Plugin):
    """Re-generate all-fail groups from growing reference-solution hints (sampling stage)."""

    name = "hint_scaffold"
    version = "0.1.0"
    paper = (
        "GHPO: Adaptive Guidance for Stable and Efficient LLM Reinforcement Learning, arXiv:2507.10628; "
        "Scaf-GRPO: Scaffolded Group Relative Policy Optimization for Enhancing LLM Reasoning, "
        "arXiv:2510.19807; "
        "SEELE: Staying in the Sweet Spot: Responsive Reasoning Evolution via Capability-Adaptive Hint Scaffolding, "
        "arXiv:2509.06923"
    )
    summary = ("All-fail groups re-generated with growing hints (GHPO, Scaf-GRPO tiers), or per-problem fitted hint "
               "lengths (SEELE).")
    Options = HintScaffoldOptions
    replaces = ("the completions of all-fail groups (hinted re-generations)",)
    reconstructed = (
        (
            "hints='tiered': levels are cumulative (earlier tiers in full, then the first k parts of the current "
            "tier), and the tiered_template wording"
        ),
        "schedule='seele': the hint is part of the prompt (paper: the response's start, with an imitation term), the "
        "3PL fit's solver and bounds, and per-process memory of the rates",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.seele_rates: dict[str, float] = {}

    def required_columns(self) -> list[str]:
        return [self.options.hints_column if self.options.hints == "tiered" else self.options.solution_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o, G = self.options, args.num_generations
        if o.schedule == "seele" and G % o.seele_rounds:
            raise PluginConfigError(
                f"Option 'seele_rounds' of plugin 'hint_scaffold' got {o.seele_rounds}; num_generations={G} must be a "
                f"multiple of it (each round samples num_generations / seele_rounds rollouts per problem)."
            )
        if o.replace == "one" and o.replace_index >= G:
            raise PluginConfigError(
                f"Option 'replace_index' of plugin 'hint_scaffold' got {o.replace_index}; allowed: a slot of the "
                f"group, 0 to {G - 1} (num_generations={G})."
            )

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"seele_rates": dict(self.seele_rates)}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.seele_rates = {str(k): float(v) for k, v in (state or {}).get("seele_rates", {}).items()}

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        o = self.options
        if o.schedule != "seele" or ctx.step < o.warmup_steps:
            return
        per_round = ctx.num_generations // o.seele_rounds
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] >= per_round:
                ctx.defer(i)
                continue
            solution = self._seele_solution(ctx, i)
            rate = self.seele_rates.get(_question_key(ctx.prompts[i]), cold_start_rate(solution, o.seele_unit))
            prompt = self._seele_prompt(ctx.prompts[i], solution, rate)
            ctx.generation_prompts[i] = ctx.training_prompts[i] = prompt
            ctx.annotations[i].update(hint_rate=rate, seele_round=0)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if ctx.step < o.warmup_steps:
            return
        if o.schedule == "seele":
            self._seele_rounds(ctx)
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

    # ------------------------------------------------------------------------------------------ SEELE
    def _seele_rounds(self, ctx: RolloutContext) -> None:
        """Rounds 2..m: fit each problem's accuracy-hint curve on the rounds so far, sample the next round's rows
        from the predicted rate (one collective generation call per round), remember the final fit's rate."""
        o, G, B = self.options, ctx.num_generations, len(ctx)
        per_round = G // o.seele_rounds
        rounds = [ctx.index_in_group[i] // per_round for i in range(B)]
        state = torch.full((B, 2), float("nan"))  # (success, hinting rate) of each local row, NaN until sampled
        first = [i for i in range(B) if rounds[i] == 0]
        if first:
            state[first, 0] = ctx.success(first, rule=o.success_rule).float().cpu()
            state[first, 1] = torch.tensor([float(ctx.annotations[i]["hint_rate"]) for i in first])
        rates: list[float] = []
        for r in range(1, o.seele_rounds + 1):
            seen = ctx.gather(state.to(ctx.device)).cpu().view(-1, G, 2)  # (groups, G, 2)
            rates = []
            for g in range(seen.size(0)):
                hist = seen[g, : r * per_round].view(r, per_round, 2)
                rates.append(rate_for_accuracy(o.target_accuracy, *fit_three_pl(
                    hist[:, 0, 1].tolist(), hist[:, :, 0].mean(-1).tolist())))
            if r == o.seele_rounds:
                break
            rows = [i for i in range(B) if rounds[i] == r]
            prompts = [self._seele_prompt(ctx.prompts[i], self._seele_solution(ctx, i), rates[ctx.group_ids[i]])
                       for i in rows]
            completions = ctx.service.generate(prompts=prompts)  # every process calls, maybe with none
            for i, prompt, completion in zip(rows, prompts, completions):
                ctx.replace_row(i, completion.completion_ids, logprobs=completion.logprobs, training_prompt=prompt,
                                prompt_swapped=False)
                ctx.annotations[i].update(hint_rate=rates[ctx.group_ids[i]], seele_round=r)
            if rows:
                state[rows, 0] = ctx.success(rows, rule=o.success_rule).float().cpu()
                state[rows, 1] = torch.tensor([rates[ctx.group_ids[i]] for i in rows])
            ctx.log_metric(f"round_{r}_accuracy", float(seen[:, (r - 1) * per_round: r * per_round, 0].mean()))
        final = ctx.gather(state.to(ctx.device)).cpu().view(-1, G, 2)
        ctx.log_metric(f"round_{o.seele_rounds}_accuracy", float(final[:, -per_round:, 0].mean()))
        ctx.log_metric("mean_hint_rate", float(final[:, :, 1].mean()))
        ctx.log_metric("extra_rollouts", 0.0)
        for i in range(B):  # the rate for the problem's next visit
            self.seele_rates[_question_key(ctx.prompts[i])] = rates[ctx.group_ids[i]]

    def _seele_solution(self, ctx, i: int) -> str:
        solution = ctx.rows[i].get(self.options.solution_column)
        if not isinstance(solution, str) or not solution.strip():
            raise PluginConfigError(
                f"hint_scaffold: row {ctx.global_index[i]} has no reference solution in column "
                f"{self.options.solution_column!r} (got {solution!r}); schedule='seele' hints every problem."
            )
        return solution

    def _seele_prompt(self, prompt: Any, solution: str, rate: float) -> Any:
        hint = seele_hint(solution, rate, self.options.seele_unit)
        return hinted_prompt(prompt, hint, self.options.template) if hint else prompt

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


def _question_key(prompt: Any) -> str:
    """The key of a problem in SEELE's memory of hinting rates: its prompt text."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
