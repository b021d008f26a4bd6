"""SEELE — Staying in the Sweet Spot: capability-adaptive hint scaffolding (arXiv:2509.06923).

Instead of reacting to failures, **every** problem is sampled with a hint -- a prefix of its reference solution
(``solution_column``) -- whose length is chosen per problem so that the rollout accuracy sits at the
learning-efficiency sweet spot ``target_accuracy`` (0.5: the paper bounds the loss descent by ``a (1 - a)``).
The G rollouts of a prompt are split into ``rounds`` rounds (paper: m = 4 rounds of n = 8): round 1 uses the
problem's hinting rate from its previous visit (first visit: the pessimistic cold start ``(S - 1) / S`` of its S
solution steps); after each round the (hinting rate, round accuracy) pairs seen so far -- accuracies averaged per
distinct rate -- are fitted by the three-parameter logistic item-response model ``f(p) = b + (1 - b) / (1 + exp(-k
(p + mu)))`` (least squares), and the next round uses ``p = f^-1(target_accuracy)`` (0 when the floor ``b`` already
reaches the target, 1 when the curve never does). The hint is the first ``round(p S)`` solution steps (lines, or
characters with ``unit="chars"``); the last fit's rate is remembered for the problem's next visit. The rounds
after the first are deferred rows filled through the generation service (one collective call per round), so a step
costs exactly G rollouts; all G rows form one group for the advantage, each trained under its own hinted prompt.
A rollout succeeds on the verifier column (``success_column`` / ``success_threshold``, as in ``hint_scaffold``).

Where the hint goes (``hint_in``): the paper writes it at the **start of the response** and trains its tokens
by imitation, ``L = L_RL(generated tokens) + gamma * L_NLL(hint tokens)`` with ``gamma = imitation_coef =
0.001`` (``"response"``, the default). The hint tokens (the hint's lines plus a line break, tokenized apart
[reconstructed]) then lead the completion, flagged off-policy (NaN sampling log-probs), under the original prompt;
at the loss stage they leave the surrogate (``hint_surrogate=false`` [reconstructed]) and get the per-token
term ``-gamma log pi``, aggregated like the surrogate (``loss_type``) [reconstructed]; the generated tokens after
them are trained as usual. Rounds after the first are sampled as continuations of the hint (the generation service's
completion prefix); the first round is TRL's own generation, which cannot start a response with a prefix, so it is
sampled with the hint in the prompt (``template``) and trained with the hint as the response's start, its generated
tokens treated as prompt-swapped (NaN sampling log-probs) [reconstructed]. ``hint_in="prompt"`` keeps the
hint in the training prompt (this project's earlier reading: no imitation term, no hint tokens in the completion).
The fit is our least-squares solver (the paper: LMFIT's TRF), with ``k`` bounded by 50 and ``b`` in [0, 1]
[reconstructed]; the remembered rates are kept per process, keyed by the question text, and saved in checkpoints.
Metric (response placement): ``hint_token_fraction`` (the loss tokens that are hint tokens). Every problem is hinted,
so SEELE has no setting equal to vanilla GRPO (``warmup_steps`` runs plain GRPO first; disable the plugin for that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.option_groups import WarmupOptions
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE

from ._hints import DEFAULT_TEMPLATE, hinted_prompt, question_key

HINT_TOKENS_KEY = "seele_hint_tokens"  # per-row count of leading hint tokens (annotation and loss extra)


@dataclass
class SeeleOptions(WarmupOptions, SuccessOptions):
    solution_column: str = option("solution", help="Dataset column holding the reference solution text.")
    template: str = option(
        DEFAULT_TEMPLATE, help="How the hint joins the question in the prompt; must contain {question} and {hint}."
    )
    rounds: int = option(
        4, min=2, help="Rollout rounds per step (paper: 4); num_generations must be a multiple."
    )
    target_accuracy: float = option(
        0.5, min=0.0, max=1.0, min_exclusive=True, help="The accuracy the hint length aims at (paper: 0.5)."
    )
    unit: Literal["lines", "chars"] = option(
        "lines", reconstructed=True, help="Unit of the hinting rate (paper: solution steps; a step is one line here)."
    )
    hint_in: Literal["response", "prompt"] = option(
        "response", help="The hint starts the response, trained by imitation (paper), or joins the prompt (no "
        "imitation term)."
    )
    imitation_coef: float = option(
        0.001, min=0.0, help="hint_in='response': gamma of the imitation term -gamma log pi on the hint tokens (paper: "
        "0.001; 0 = none)."
    )
    hint_surrogate: bool = option(
        False, reconstructed=True, help="hint_in='response': also train the hint tokens with the RL surrogate (the "
        "shaped off-policy branch) instead of the imitation term alone."
    )

    def validate(self) -> None:
        if "{question}" not in self.template or "{hint}" not in self.template:
            raise PluginConfigError(
                f"Option 'template' of plugin 'seele' got {self.template!r}; it must contain {{question}} and {{hint}}."
            )


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


def hint_token_mask(hint_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1.0 on each row's first ``hint_tokens[b]`` completion tokens that are loss tokens, else 0.

    Args:
        hint_tokens: (B,) leading hint tokens per row. mask: (B, T) loss mask.
    """
    positions = torch.arange(mask.size(1), device=mask.device).unsqueeze(0)
    return (positions < hint_tokens.to(mask.device).unsqueeze(-1)).to(mask.dtype) * mask


def imitation_term(per_token_logps: torch.Tensor, hint_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """(B, T) SEELE's imitation term ``-coef * log pi`` on the hint tokens (0 elsewhere)."""
    return -coef * per_token_logps * hint_mask.to(per_token_logps.dtype)


class SeelePlugin(Plugin):
    """Every problem sampled with a solution-prefix hint whose length is fitted per problem to reach the target
    accuracy (sampling stage; with the hint in the response, its imitation term at the advantage and loss stages)."""

    name = "seele"
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = (
        "it edits completions after generation (replace_row / in-step generation), and the generation service samples "
        "single-turn text without running tools, so the edited rows would lose their tool-call turns."
    )
    version = "0.1.0"
    paper = ("SEELE: Staying in the Sweet Spot: Responsive Reasoning Evolution via Capability-Adaptive Hint "
             "Scaffolding, arXiv:2509.06923")
    summary = "Every problem hinted with a solution prefix whose length is fitted per problem to a target accuracy."
    Options = SeeleOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the paper body was unreachable; the parts in the abstract and summaries "
        "match (the 3PL inverse for the hint length); the hint unit and surrogate are reconstructed.",
    )
    claim_metric = ("mean_hint_rate", "fraction of the solution revealed")
    replaces = ("the prompts (hinted) of every row, and with the hint in the response the leading completion tokens",)
    reconstructed = (
        "the 3PL fit's solver and bounds, per-process memory of the rates; with the hint in the response: its "
        "tokenization (lines plus a line break), the first round sampled with the hint in the prompt, the imitation "
        "term aggregated like the surrogate and the hint tokens left out of the surrogate",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.rates: dict[str, float] = {}  # question -> hinting rate of its last fit

    def required_columns(self) -> list[str]:
        return [self.options.solution_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        G = args.num_generations
        if G % self.options.rounds:
            raise PluginConfigError(
                f"Option 'rounds' of plugin {self.name!r} got {self.options.rounds}; num_generations={G} must be a "
                f"multiple of it (each round samples num_generations / rounds rollouts per problem)."
            )

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"rates": dict(self.rates)}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        state = state or {}
        # "seele_rates": checkpoints of hint_scaffold with schedule='seele' (the deprecated spelling, one release)
        self.rates = {str(k): float(v) for k, v in state.get("rates", state.get("seele_rates", {})).items()}

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        o = self.options
        if o.warming_up(ctx.step):
            return
        per_round = ctx.num_generations // o.rounds
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] >= per_round:
                ctx.defer(i)
                continue
            solution = self._solution(ctx, i)
            rate = self.rates.get(question_key(ctx.prompts[i]), cold_start_rate(solution, o.unit))
            prompt = self._prompt(ctx.prompts[i], solution, rate)
            ctx.generation_prompts[i] = prompt
            if o.hint_in == "prompt":
                ctx.training_prompts[i] = prompt
            ctx.annotations[i].update(hint_rate=rate, seele_round=0)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Rounds 2..m: fit each problem's accuracy-hint curve on the rounds so far, sample the next round's rows
        from the predicted rate (one collective generation call per round), remember the final fit's rate."""
        o, G, B = self.options, ctx.num_generations, len(ctx)
        if o.warming_up(ctx.step):
            return
        per_round = G // o.rounds
        rounds = [ctx.index_in_group[i] // per_round for i in range(B)]
        state = torch.full((B, 2), float("nan"))  # (success, hinting rate) of each local row, NaN until sampled
        first = [i for i in range(B) if rounds[i] == 0]
        if o.hint_in == "response":  # sampled with the hint in the prompt: trained with it leading the response
            for i in first:
                hint = self._hint_ids(ctx, i, float(ctx.annotations[i]["hint_rate"]))
                if hint:
                    self._set_hinted_row(ctx, i, hint, hint + list(ctx.completion_ids[i]), None, prompt_swapped=True)
        if first:
            state[first, 0] = ctx.success(first, rule=o.success_rule).float().cpu()
            state[first, 1] = torch.tensor([float(ctx.annotations[i]["hint_rate"]) for i in first])
        rates: list[float] = []
        for r in range(1, o.rounds + 1):
            seen = ctx.gather(state.to(ctx.device)).cpu().view(-1, G, 2)  # (groups, G, 2)
            rates = []
            for g in range(seen.size(0)):
                hist = seen[g, : r * per_round].view(r, per_round, 2)
                rates.append(rate_for_accuracy(o.target_accuracy, *fit_three_pl(
                    hist[:, 0, 1].tolist(), hist[:, :, 0].mean(-1).tolist())))
            if r == o.rounds:
                break
            rows = [i for i in range(B) if rounds[i] == r]
            if o.hint_in == "response":
                hints = [self._hint_ids(ctx, i, rates[ctx.group_ids[i]]) for i in rows]
                completions = ctx.service.generate(prompts=[ctx.prompts[i] for i in rows], prefix_ids=hints)
                for i, hint, completion in zip(rows, hints, completions):
                    self._set_hinted_row(ctx, i, hint, completion.completion_ids, completion.logprobs,
                                         prompt_swapped=False)
            else:
                prompts = [self._prompt(ctx.prompts[i], self._solution(ctx, i), rates[ctx.group_ids[i]])
                           for i in rows]
                completions = ctx.service.generate(prompts=prompts)  # every process calls, maybe with none
                for i, prompt, completion in zip(rows, prompts, completions):
                    ctx.replace_row(i, completion.completion_ids, logprobs=completion.logprobs, training_prompt=prompt,
                                    prompt_swapped=False)
            for i in rows:
                ctx.annotations[i].update(hint_rate=rates[ctx.group_ids[i]], seele_round=r)
            if rows:
                state[rows, 0] = ctx.success(rows, rule=o.success_rule).float().cpu()
                state[rows, 1] = torch.tensor([rates[ctx.group_ids[i]] for i in rows])
            ctx.log_metric(f"round_{r}_accuracy", float(seen[:, (r - 1) * per_round: r * per_round, 0].mean()))
        final = ctx.gather(state.to(ctx.device)).cpu().view(-1, G, 2)
        ctx.log_metric(f"round_{o.rounds}_accuracy", float(final[:, -per_round:, 0].mean()))
        ctx.log_metric("mean_hint_rate", float(final[:, :, 1].mean()))
        ctx.log_metric("extra_rollouts", 0.0)
        for i in range(B):  # the rate for the problem's next visit
            self.rates[question_key(ctx.prompts[i])] = rates[ctx.group_ids[i]]

    def _hint_ids(self, ctx: RolloutContext, i: int, rate: float) -> list[int]:
        """Token ids of row ``i``'s hint at ``rate`` as the start of a response (its lines and a line break); []
        for an empty hint."""
        hint = seele_hint(self._solution(ctx, i), rate, self.options.unit)
        return list(ctx.tokenizer(hint + "\n", add_special_tokens=False)["input_ids"]) if hint else []

    @staticmethod
    def _set_hinted_row(ctx: RolloutContext, i: int, hint: list[int], ids: list[int], logprobs, *,
                        prompt_swapped: bool) -> None:
        """Row ``i`` := ``ids`` (the hint's tokens first, flagged off-policy) under the original prompt."""
        limit = ctx.run.max_completion_length
        ids = list(ids)[:limit] if limit else list(ids)
        n_hint = min(len(hint), len(ids))
        lps = None if logprobs is None else list(logprobs)[: len(ids)]
        ctx.replace_row(i, ids, offpolicy=[True] * n_hint + [False] * (len(ids) - n_hint), logprobs=lps,
                        training_prompt=ctx.prompts[i], prompt_swapped=prompt_swapped)
        ctx.annotations[i][HINT_TOKENS_KEY] = n_hint

    # ------------------------------------------------------------------------------------------ imitation term
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if self.options.hint_in != "response":
            return
        counts = [float(a.get(HINT_TOKENS_KEY, 0)) for a in ctx.annotations]
        if any(counts):
            ctx.extras[HINT_TOKENS_KEY] = torch.tensor(counts, device=ctx.advantages.device)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        counts = ctx.extras.get(HINT_TOKENS_KEY)
        if counts is None:
            return
        hint = hint_token_mask(counts, ctx.mask)  # (B, T)
        if not o.hint_surrogate:
            ctx.scale_tokens(1.0 - hint)
        if o.imitation_coef > 0:
            ctx.add_token_loss(imitation_term(ctx.per_token_logps, hint, o.imitation_coef))
        ctx.log_metric("hint_token_fraction", float(hint.sum() / ctx.mask.sum().clamp(min=1)))

    def _solution(self, ctx, i: int) -> str:
        solution = ctx.rows[i].get(self.options.solution_column)
        if not isinstance(solution, str) or not solution.strip():
            raise PluginConfigError(
                f"{self.name}: row {ctx.global_index[i]} has no reference solution in column "
                f"{self.options.solution_column!r} (got {solution!r}); SEELE hints every problem."
            )
        return solution

    def _prompt(self, prompt: Any, solution: str, rate: float) -> Any:
        hint = seele_hint(solution, rate, self.options.unit)
        return hinted_prompt(prompt, hint, self.options.template) if hint else prompt
