"""RuscaRL — Rubric-Scaffolded Reinforcement Learning (arXiv:2508.16949).

Rubrics serve twice: as an explicit scaffold that guides *exploration* (a system block listing some rubric items is
added to the generation prompt) and as the *reward* (an LLM judge checks each rubric item). The scaffold is given
generously to some rows of a group and sparingly to others, and fades out over training. Facts from the official
code (IANNXANG/RuscaRL):

1. Intra-group differentiation: row ``i`` of a group of ``G`` gets ``lambda_i = (G-1-i)/(G-1)`` ("linear": row 0
   sees every item, row G-1 none; ``G = 1`` gives 1) or ``lambda_i = 1 if i < k_full else 0`` ("binary").
2. Inter-step decay ("step_sigmoid"): with ``t`` the 1-based step and ``T`` the total steps,
   ``x = clip((t-1)/(T-1), 0, 1)`` and ``sigma = 1/(1 + exp(s (x - x0)))`` (clipped to [0, 1]); the paper runs
   ``x0 = 0.2, s = 125`` (our defaults): sigma ~ 1 until ~15 % of training, 0.5 at 20 %, ~0.002 at 25 %.
   Other rules of the code: "step_linear" ``(T - t)/(T - 1)``, "step_power" ``(1 - x)^n`` (n = 1 by default, as
   the official configuration); "constant" is 1.
3. Ratio ``rho_i = lambda_i * sigma``. With ``N`` rubric items: ``rho >= 1`` shows all items in order; otherwise
   ``k = round(N * rho)`` (Python's round: half to even) items drawn uniformly without replacement (seeded here by
   ``seed``, the step and the row's global index; the original is unseeded). "math_linear": the format item
   (second to last) always, the first ``round(rho (N - 2))`` other items in order, the final-answer item (last)
   only when ``rho = 1``.
4. Scaffold (our wording of the official structure): a header, "points to include" (positive items with their
   points), "points to avoid" (negative items with their penalty; items worth 0 points are left out, as the
   official code does), a closing request, and (default on) a warning
   not to mention or reveal the criteria. ``k = 0``: no system block (``add_base_when_zero=False``, the paper's
   script) or a bare base system line.
5. Prompt swap: rows are **generated** under the scaffolded prompt and **trained** under the original prompt
   (``participate_training=False``, the paper); the sampling log-probs of swapped rows are NaN, so TRL's vLLM
   importance-sampling correction leaves them alone. Evaluation never sees a scaffold (hooks run in training only).
6. Reward: one judge call per rubric item on the **original** conversation (system messages removed; the judge
   never sees the scaffold) plus the completion; ``S = sum_j met_j p_j / sum_{p_j > 0} p_j`` (0 without positive
   items), not clipped (``S < 0`` when penalties are met). It is added as the reward column ``ruscarl_rubric``.
   Items tagged for rule checking (a ``verifier:rule`` tag with ``function:math_verify`` and ``parameters:<answer>``)
   are checked by rule, as the official code does, not by the judge: met when the completion's final answer equals
   ``<answer>`` (the official code calls the ``math_verify`` package; here the answer is the last ``\\boxed{}`` or last
   number, compared after normalisation -- a reconstruction). ``rule_items="judge"`` sends them to the judge.
   A row with an *empty* rubric list is refused when training starts (``empty_rubrics='error'``) or, with
   ``empty_rubrics='skip'``, scored ``None`` (TRL leaves it out of the weighted sum) -- never a silent 0.

Defaults are the paper's launch script (linear group decay, step_sigmoid, x0 = 0.2, s = 125,
``add_base_when_zero=False``, warning on, no participation in training; judge sampling temperature 0.7, top-p 0.8,
top-k 20, presence penalty 1.5, max 2048 tokens, thinking off; 10 parse retries).

Injection (documented deviation): the scaffold is inserted as a system **message** before the chat template is
applied. The official code prepends a templated system block to the already-templated prompt tokens; both give the
same tokens for templates that add nothing of their own before the first message (Llama: BOS then the blocks);
templates that insert a default system prompt when none is given (Qwen2.5) get the scaffold instead of the default
block rather than before it. ``injection="merge_system"`` merges it into an existing leading system message.

Judge backends: "endpoint" (OpenAI-compatible server, e.g. ``vllm serve``), "hf" (a local model by name/path) or
"rule" (a task's rule-based judge: the verdict oracle ``judge_oracle`` of
:data:`~trl_plugins.components.judge.RUBRIC_VERDICTS`, by default the bundled tasks'). A dead or garbled judge
raises an error naming the URL.

Official code checked against: ``hhh2210/RuscaRL@1b61829`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show ruscarl``, docs/faithfulness.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, PromptContext, hookimpl, option
from trl_plugins.api.answers import extract_boxed_or_last_number, normalize_answer
from trl_plugins.api.text import completion_text
from trl_plugins.components.judge import (
    RUBRIC_VERDICTS,
    EndpointJudge,
    HFJudge,
    JudgeEndpointOptions,
    JudgeRequest,
    RubricJudge,
    RuleJudge,
)

HEADER = "You are a helpful assistant. When you answer, keep in mind the evaluation criteria below."
BASE_SYSTEM = "You are a helpful assistant."
INCLUDE_HEADER = "Points to include in your answer:"
AVOID_HEADER = "Points to avoid in your answer:"
CLOSING = "Give a complete and helpful answer that follows these guidelines."
WARNING = (
    "Important: do not mention, quote or hint at these criteria in your answer; revealing them counts as cheating "
    "and is penalised."
)


@dataclass
class RuscaRLOptions(JudgeEndpointOptions):
    scaffold: bool = option(True, help="Add rubric scaffolds to generation prompts (false = rubric reward only).")
    group_decay: Literal["linear", "binary"] = option(
        "linear", help="Intra-group reveal fraction: linear (G-1-i)/(G-1), or binary (1 for the first k_full rows)."
    )
    k_full: int = option(1, min=0, help="Rows of a group that see every item in the 'binary' group decay.")
    step_rule: Literal["step_sigmoid", "step_linear", "step_power", "constant"] = option(
        "step_sigmoid", help="Inter-step decay of the scaffold over training."
    )
    x0: float = option(0.2, min=0.0, max=1.0, help="Midpoint of the step sigmoid (fraction of training).")
    steepness: float = option(125.0, min=0.0, help="Steepness s of the step sigmoid.")
    power: float = option(1.0, min=0.0, help="Exponent n of the 'step_power' rule (1 - x)^n (official default: 1).")
    selection: Literal["random", "math_linear"] = option(
        "random", help="Which k items are shown: a seeded random subset, or the math_linear rule."
    )
    seed: int = option(0, help="Seed of the random item subsets (with the step and the row's global index).")
    add_base_when_zero: bool = option(
        False, help="With k = 0 items, add a bare base system message (true) or leave the prompt untouched (false)."
    )
    warning: bool = option(True, help="End the scaffold with the warning not to reveal the criteria.")
    injection: Literal["system_message", "merge_system"] = option(
        "system_message",
        help="Insert the scaffold as a new leading system message, or merge it into an existing leading one.",
    )
    participate_training: bool = option(
        False, help="Train under the scaffolded prompt (ablation) instead of the original one (prompt swap)."
    )
    rubrics_column: str = option("rubrics", help="Dataset column with the HealthBench-style rubric items.")
    reward_weight: float = option(1.0, help="TRL reward weight of the ruscarl_rubric column.")
    empty_rubrics: Literal["error", "skip"] = option(
        "error",
        help="Rows whose rubric list is empty or missing: refuse the dataset when training starts (error), or give "
        "them no scaffold and no rubric reward (skip: None, which TRL leaves out of the weighted reward sum).",
    )
    judge: Literal["endpoint", "hf", "rule"] = option(
        "endpoint", help="Judge backend: OpenAI-compatible endpoint, local HF model, or the bundled rule-based judge."
    )
    judge_max_concurrency: int = option(64, min=1, help="Judge requests in flight at once.")
    judge_temperature: float = option(0.7, min=0.0, help="Judge sampling temperature.")
    judge_top_p: float = option(0.8, min=0.0, max=1.0, help="Judge top-p.")
    judge_top_k: int = option(20, help="Judge top-k (sent to vLLM-style servers; -1 disables).")
    judge_presence_penalty: float = option(1.5, help="Judge presence penalty (endpoint).")
    judge_max_tokens: int = option(2048, min=1, help="Maximum judge answer tokens.")
    judge_enable_thinking: bool = option(
        False, help="Sent as chat_template_kwargs.enable_thinking (Qwen3 judges run non-thinking in the paper)."
    )
    judge_parse_retries: int = option(10, min=0, help="Re-asks of a judge answer that holds no parsable verdict.")
    judge_on_unparsable: Literal["error", "false"] = option(
        "error", help="After the retries: raise (default, never a silent zero) or count the item as not met (code)."
    )
    judge_problem_column: str = option("problem", help="Dataset column the rule-based judge reads (judge='rule').")
    judge_oracle: str = option(
        "arithmetic",
        help="judge='rule': the rubric verdict oracle by name (components.judge.RUBRIC_VERDICTS; 'arithmetic' = the "
        "bundled tasks') or 'package.module:function' (fn(item, problem, completion) -> bool).",
    )
    rule_items: Literal["rule", "judge"] = option(
        "rule",
        help="Rubric items tagged 'verifier:rule' + 'function:math_verify' + 'parameters:<answer>': checked by rule "
        "(official; final answer equals <answer>, exact match after normalisation instead of the math_verify package) "
        "or sent to the judge like the other items (not official).",
    )

    def validate(self) -> None:
        self.require_base_url("judge", "ruscarl", otherwise="judge='hf' / 'rule'")
        if self.judge == "rule":
            RUBRIC_VERDICTS.check(self.judge_oracle, "Option 'judge_oracle' of plugin 'ruscarl': ")


# --------------------------------------------------------------------------------------------- schedule
def group_ratio(index_in_group: int, group_size: int, rule: str = "linear", k_full: int = 1) -> float:
    """lambda_i: the intra-group reveal fraction of row ``index_in_group`` (0-based) in a group of ``group_size``."""
    if rule == "binary":
        return 1.0 if index_in_group < k_full else 0.0
    if group_size <= 1:
        return 1.0
    return (group_size - 1 - index_in_group) / (group_size - 1)


def step_decay(
    step: int, total_steps: int, rule: str = "step_sigmoid", x0: float = 0.2, steepness: float = 125.0,
    power: float = 1.0,
) -> float:
    """sigma(t) for the 1-based step ``step`` of ``total_steps``; in [0, 1]."""
    if rule == "constant":
        return 1.0
    T = max(int(total_steps), 1)
    x = 0.0 if T <= 1 else min(max((step - 1) / (T - 1), 0.0), 1.0)
    if rule == "step_sigmoid":
        z = steepness * (x - x0)
        value = 0.0 if z > 700 else 1.0 / (1.0 + math.exp(z))
    elif rule == "step_linear":
        value = 1.0 if T <= 1 else (T - step) / (T - 1)
    elif rule == "step_power":
        value = (1.0 - x) ** power
    else:
        raise ValueError(f"unknown step rule {rule!r}")
    return min(max(value, 0.0), 1.0)


def select_items(items: list[dict], rho: float, selection: str, rng: random.Random) -> list[dict]:
    """The rubric items shown at reveal ratio ``rho``: all (in order) when ``rho >= 1``, else ``round(N rho)``
    uniformly drawn items ("random"), or the math_linear rule (format item always, first ``round(rho (N-2))``
    others in order, final-answer item only at ``rho = 1``)."""
    n = len(items)
    if rho >= 1.0:
        return list(items)
    if selection == "math_linear":
        if n < 2:
            return list(items[: round(n * rho)])
        head = items[: n - 2]
        return list(head[: round(rho * (n - 2))]) + [items[n - 2]]
    k = round(n * rho)
    return rng.sample(list(items), k) if k > 0 else []


def _points(p: Any) -> str:
    value = float(p)
    return str(int(value)) if value == int(value) else f"{value:g}"


def scaffold_text(items: list[dict], warning: bool = True) -> str:
    """The scaffold system text for the shown ``items`` (positive ones to include, negative ones to avoid)."""
    include = [it for it in items if float(it["points"]) > 0]
    avoid = [it for it in items if float(it["points"]) < 0]  # 0-point items are left out (official)
    parts = [HEADER]
    j = 0
    if include:
        lines = [INCLUDE_HEADER]
        for it in include:
            j += 1
            lines.append(f"Criterion {j}: {it['criterion']} (worth {_points(it['points'])} points)")
        parts.append("\n".join(lines))
    if avoid:
        lines = [AVOID_HEADER]
        for it in avoid:
            j += 1
            lines.append(f"Criterion {j}: {it['criterion']} (penalty: {_points(abs(float(it['points'])))} points)")
        parts.append("\n".join(lines))
    parts.append(CLOSING)
    if warning:
        parts.append(WARNING)
    return "\n\n".join(parts)


def with_system(prompt: Any, text: str, injection: str = "system_message") -> Any:
    """The prompt with ``text`` as a leading system message (or merged into an existing one); strings get it
    prepended as a paragraph."""
    if isinstance(prompt, str):
        return f"{text}\n\n{prompt}"
    messages = [dict(m) for m in prompt]
    if injection == "merge_system" and messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{text}\n\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": text}, *messages]


def rubric_reward_value(items: list[dict], verdicts: list[bool]) -> float:
    """``sum(met points) / sum(positive points)``; 0.0 without positive items; not clipped."""
    total = sum(float(it["points"]) for it in items if float(it["points"]) > 0)
    if total <= 0:
        return 0.0
    return sum(float(it["points"]) for it, met in zip(items, verdicts, strict=True) if met) / total


def rule_verdict(item: dict, completion: str) -> bool | None:
    """The verdict of a rubric item tagged for rule checking, or None for an item the judge grades.

    An item is rule-checked when one of its ``tags`` starts with ``verifier:rule`` and it names
    ``function:math_verify`` with ``parameters:<answer>`` (the official tags): it is met when the completion's final
    answer (last ``\\boxed{}``, else last number) equals ``<answer>`` after
    :func:`~trl_plugins.api.answers.normalize_answer`.
    """
    tags = [str(t) for t in (item.get("tags") or [])]
    if not any(t.startswith("verifier:rule") for t in tags):
        return None
    function = next((t.split(":", 1)[1] for t in tags if t.startswith("function:")), None)
    parameter = next((t.split(":", 1)[1] for t in tags if t.startswith("parameters:")), None)
    if function != "math_verify" or parameter is None:
        return None
    answer = extract_boxed_or_last_number(completion)
    return answer is not None and normalize_answer(answer) == normalize_answer(parameter)


def original_conversation(prompt: Any) -> list[dict]:
    """The conversation the judge sees: the original prompt's messages without system messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt if m.get("role") != "system"]


class RuscaRLPlugin(Plugin):
    """Rubric scaffolds for exploration and rubric-judge rewards (sampling + reward stages)."""

    name = "ruscarl"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Breaking the Exploration Bottleneck: Rubric-Scaffolded Reinforcement Learning for General LLM "
        "Reasoning (RuscaRL), arXiv:2508.16949"
    )
    summary = "Graded rubric scaffolds in generation prompts (decaying) and a per-item rubric judge reward."
    Options = RuscaRLOptions
    official = OfficialSource(
        "hhh2210/RuscaRL", "1b61829", verdict="faithful",
        files=("verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py",),
        variants=("rule_items",),
    )
    claim_metric = ("rubric_score_clipped", "rubric score")
    replaces = ("the generation prompts (rubric scaffolds)",)
    reconstructed = (
        "rule-checked items: exact match of the normalised final answer (official: the math_verify package)",
        "seeded item subsets (seed, step, global row index); the original draws them unseeded",
        "scaffold inserted as a system message before templating (official: templated block prepended to tokens)",
        "judge_on_unparsable='error': the official code counts an unparsable verdict as not met",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.judge: RubricJudge | None = None
        self._total_steps = 1

    def required_columns(self) -> list[str]:
        cols = [self.options.rubrics_column]
        if self.options.judge == "rule":
            cols.append(self.options.judge_problem_column)
        return cols

    # ------------------------------------------------------------------------------------------ lifecycle
    def build_judge(self) -> RubricJudge:
        o = self.options
        if o.judge == "rule":
            return RuleJudge(problem_column=o.judge_problem_column, oracle=o.judge_oracle)
        if o.judge == "hf":
            return HFJudge(
                o.judge_model, max_new_tokens=o.judge_max_tokens, temperature=o.judge_temperature,
                top_p=o.judge_top_p, top_k=o.judge_top_k, parse_retries=o.judge_parse_retries,
                on_unparsable=o.judge_on_unparsable,
            )
        endpoint = o.endpoint_config("judge", max_concurrency=o.judge_max_concurrency)
        sampling = {
            "temperature": o.judge_temperature, "top_p": o.judge_top_p, "max_tokens": o.judge_max_tokens,
            "presence_penalty": o.judge_presence_penalty,
            "chat_template_kwargs": {"enable_thinking": o.judge_enable_thinking},
        }
        if o.judge_top_k > 0:
            sampling["top_k"] = o.judge_top_k
        return EndpointJudge(endpoint, sampling, parse_retries=o.judge_parse_retries,
                             on_unparsable=o.judge_on_unparsable)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        plugin = self

        def ruscarl_rubric(prompts, completions, **kwargs):
            return plugin.score(prompts, completions, kwargs)

        ruscarl_rubric.reward_weight = self.options.reward_weight
        return [ruscarl_rubric]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.judge is None:
            self.judge = self.build_judge()
        self._total_steps = max(int(getattr(args, "max_steps", 0) or 0), 1)
        self.check_dataset(getattr(trainer, "train_dataset", None))

    def check_dataset(self, dataset: Any) -> None:
        """Refuse a (map-style) dataset whose rubric column holds something other than lists (e.g. text), and, with
        ``empty_rubrics='error'``, one with rows without rubric items, up front."""
        column = self.options.rubrics_column
        if dataset is None or not hasattr(dataset, "__len__"):
            return
        names = getattr(dataset, "column_names", None)
        if names is not None and column not in names:
            return  # required_columns() reports a missing column
        values = dataset[column]
        wrong = [i for i, items in enumerate(values) if items is not None and not isinstance(items, (list, tuple))]
        if wrong:
            raise PluginConfigError(
                f"ruscarl: column {column!r} holds {type(values[wrong[0]]).__name__} {values[wrong[0]]!r:.60} in row "
                f"{wrong[0]} ({len(wrong)} of {len(values)} rows are not lists); each row needs a list of rubric "
                "items (mappings with 'criterion' and 'points')."
            )
        empty = [i for i, items in enumerate(values) if not items]
        if empty and self.options.empty_rubrics == "error":
            raise PluginConfigError(
                f"ruscarl: {len(empty)} of {len(dataset)} rows have no rubric items in column {column!r} (first: row "
                f"{empty[0]}); they would get no scaffold and no reward. Fix the data, or set empty_rubrics: skip to "
                "leave those rows out of the rubric reward."
            )

    # ------------------------------------------------------------------------------------------ reward
    def score(self, prompts: list, completions: list, columns: dict) -> list[float | None]:
        """Rubric reward of each row: one judge request per rubric item, all rows' items in one batch (``None`` for
        a row without items, with ``empty_rubrics='skip'``)."""
        if self.judge is None:
            self.judge = self.build_judge()
        rubrics = columns.get(self.options.rubrics_column)
        if rubrics is None:
            raise PluginConfigError(
                f"ruscarl: the reward function got no {self.options.rubrics_column!r} column "
                f"(columns: {', '.join(sorted(columns))})."
            )
        keys = [k for k in columns if k not in ("trainer_state", "log_extra", "log_metric", "environments")]
        requests, spans, rule_checked = [], [], 0
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            row = {k: columns[k][i] for k in keys}
            items = list(rubrics[i] or [])
            if not items and self.options.empty_rubrics == "error":
                raise PluginConfigError(
                    f"ruscarl: row {i} of the reward batch has no rubric items in column "
                    f"{self.options.rubrics_column!r}; fix the data or set empty_rubrics: skip."
                )
            start = len(requests)
            conversation = original_conversation(prompt)
            text = completion_text(completion)
            by_rule = [rule_verdict(item, text) if self.options.rule_items == "rule" else None for item in items]
            rule_checked += sum(v is not None for v in by_rule)
            requests.extend(JudgeRequest(conversation, text, item, row) for item, v in zip(items, by_rule) if v is None)
            spans.append((start, len(requests), items, by_rule))
        graded = self.judge.grade(requests) if requests else []
        scores = []
        for a, b, items, by_rule in spans:
            judged = iter(graded[a:b])
            verdicts = [next(judged) if v is None else v for v in by_rule]
            scores.append(rubric_reward_value(items, verdicts) if items else None)
        scored = [s for s in scores if s is not None]
        log_metric = columns.get("log_metric")
        if callable(log_metric) and scored:
            log_metric("plugins/ruscarl/rubric_score_clipped", sum(min(max(s, 0.0), 1.0) for s in scored) / len(scored))
            log_metric("plugins/ruscarl/judge_requests", float(len(requests)))
            log_metric("plugins/ruscarl/rule_checked_items", float(rule_checked))
        return scores

    # ------------------------------------------------------------------------------------------ sampling
    def total_steps(self, ctx: PromptContext) -> int:
        """T: the trainer's ``state.max_steps`` once training runs (epochs resolved), else ``args.max_steps``."""
        T = ctx.run.max_steps
        return T if T > 0 else self._total_steps

    def row_ratio(self, index_in_group: int, group_size: int, step: int, total_steps: int) -> tuple[float, float]:
        """(rho_i, sigma) at the 0-based ``step`` (RuscaRL counts steps from 1)."""
        o = self.options
        lam = group_ratio(index_in_group, group_size, o.group_decay, o.k_full)
        sigma = step_decay(step + 1, total_steps, o.step_rule, o.x0, o.steepness, o.power)
        return lam * sigma, sigma

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        o = self.options
        if not o.scaffold:
            return
        T = self.total_steps(ctx)
        ratios, shown = [], []
        sigma = 1.0
        for i in range(len(ctx.rows)):
            rho, sigma = self.row_ratio(ctx.index_in_group[i], ctx.num_generations, ctx.step, T)
            items = list(ctx.rows[i].get(o.rubrics_column) or [])
            rng = random.Random(f"ruscarl:{o.seed}:{ctx.step}:{ctx.global_index[i]}")
            chosen = select_items(items, rho, o.selection, rng)
            ratios.append(rho)
            shown.append(len(chosen) / len(items) if items else 0.0)
            ctx.annotations[i]["rubric_ratio"] = round(rho, 4)
            ctx.annotations[i]["rubric_items"] = len(chosen)
            if chosen:
                text = scaffold_text(chosen, o.warning)
            elif o.add_base_when_zero:
                text = BASE_SYSTEM
            else:
                continue
            scaffolded = with_system(ctx.prompts[i], text, o.injection)
            ctx.generation_prompts[i] = scaffolded
            if o.participate_training:
                ctx.training_prompts[i] = scaffolded
        ctx.log_metric("step_decay", sigma)
        if ratios:
            ctx.log_metric("mean_ratio", sum(ratios) / len(ratios))
            ctx.log_metric("mean_items_shown_fraction", sum(shown) / len(shown))
