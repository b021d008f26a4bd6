"""Light-IF (TEA-RL) — constraint-checker dense rewards with a token-wise entropy-adaptive bonus (arXiv:2508.03178,
"Light-IF: Endowing LLMs with Generalizable Reasoning via Preview and Self-Checking for Complex Instruction Following").

Light-IF's RL stage (TEA-RL) trains complex instruction following with **rule-based dense rewards** (partial credit for
each satisfied constraint, plus full credit when all are met) and a **token-wise entropy-adaptive** update. Facts from
the official code (Qihoo360/Light-IF @01e9003; restated, not copied):

* Reward (``rl/verl/verl/utils/reward_score/IF.py:526-688``, ``validate_article_step_score_en``; summed in
  ``rl/verl/verl/utils/reward_score/__init__.py:46``): ``score = point_score + acc_score``. ``point_score`` adds a
  fixed credit per satisfied constraint (0.1 for a two-sided count range, 0.05 for a one-sided bound, 0.05 for
  highlights and placeholders, 0.1 for bullets, paragraphs and the repeated request); ``acc_score`` is 1 when every
  constraint holds (``validate_article_en``, ``IF.py:364-524``). The answer is the text after ``</think>``; without it
  every score is 0 (``IF.py:728-741``). Word counts use ``\\b\\w+\\b``, highlights ``*x*`` / ``_x_``, placeholders
  ``[x]``, bullets lines starting with ``"* "``, capital words all-upper words of 2+ characters, keyword counts
  ``str.count`` (case-sensitive). A cosine length reward is computed there but not added to the score.
* Entropy-adaptive term (``rl/verl/verl/trainer/ppo/core_algos.py:890-909``, ``compute_entropy_with_cov``): per token
  ``cov = (A - mean_m A) * (lp - mean_m sg(lp))`` (means over the micro-batch's valid tokens), a per-row softmax of
  ``cov`` over the valid positions, times ``alpha = 10``, clamped to ``[0, ub = 5]``: the weight ``w``; the loss is
  ``pg_loss - agg(w * H)`` with ``H`` the token entropies, i.e. an entropy bonus concentrated on the tokens whose
  log-probability moves most with the advantage. Recipes: ``entropy_coeff = 0`` (no uniform bonus), ``kl_loss_coef
  = 0.001`` (low_var_kl), ``clip_ratio = 1.0``, 8 rollouts, token-mean aggregation.

Here: ``light_if`` is a reward function (TRL column ``light_if``) scoring each completion against the constraints of
its row's ``constraints_column`` (plus the ``constraints`` option's, for every row), and a loss-stage term
``add_token_loss(-w * H)`` aggregated like the surrogate (``loss_type``; the recipes' token-mean is ``dapo``). With
``reward_weight = 0`` and ``entropy_alpha = 0`` the plugin enables no hook (vanilla GRPO).

Constraint schema (one list of dicts per row; unknown types and fields are refused; ``None`` fields count as absent,
as Arrow fills them in for mixed lists; every constraint may set ``weight``, its partial credit):

* ``keyword``: ``word`` (str), ``min`` (int, default 1), ``max`` (int): ``min <= count <= max`` (``min = max = 0``
  forbids the word); weight 0.1 with both bounds, else 0.05.
* ``word_count`` / ``capital_words``: ``min``, ``max`` (at least one): the count in range; weights as ``keyword``.
* ``highlights`` / ``placeholders``: ``min`` (int): at least ``min`` spans; weight 0.05.
* ``bullets``: ``count`` (int): exactly ``count`` bullet lines; weight 0.1.
* ``paragraphs``: ``count`` (int), ``separator`` (str, default a blank line): exactly ``count`` non-empty parts;
  weight 0.1.
* ``starts_with`` / ``ends_with``: ``text`` (str): the answer starts / ends with it; weight 0.1.

Deviations and reconstructions: the entropy weight ``w`` is treated as a weight (no gradient through the covariance;
the official code lets ``lp`` carry one). The defaults ``alpha = 10``, ``ub = 5`` and ``entropy_mode:
"token-level-cov"`` are in ``rl/verl/verl/trainer/config/ppo_trainer.yaml:161-163``; the released
``rl/verl/verl/workers/actor/dp_actor.py:421-456`` reaches the entropy-with-covariance branch only outside
``loss_mode='vanilla'`` and then overwrites ``policy_loss``, so the recipes as released may not apply it -- the
paper's TEA-RL does, and so does this plugin. The constraint types are the English checks of the
official scorer reduced to a declarative schema (the official data stores them as a ``jqzl_prompt`` dict); ``ends_with``
and the paragraphs' separator option are ours. Entropy-SFT (the cold start) is a separate SFT stage, outside GRPO.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_plugins.api import (
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    hookimpl,
    option,
)
from trl_plugins.api.data_checks import cell_problem, check_column_values
from trl_plugins.api.reasons import ENTROPY_PICK_ONE
from trl_plugins.api.text import completion_text

from .clip_cov import check_no_entropy_bonus, token_covariance

COLUMN = "light_if"

_WORDS = re.compile(r"\b\w+\b")
_HIGHLIGHT = re.compile(r"(\*[^*]+\*|_[^_]+_)")
_PLACEHOLDER = re.compile(r"\[[^\[\]]+\]")

# type -> (required fields, optional fields)
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "keyword": (("word",), ("min", "max")),
    "word_count": ((), ("min", "max")),
    "capital_words": ((), ("min", "max")),
    "highlights": (("min",), ()),
    "placeholders": (("min",), ()),
    "bullets": (("count",), ()),
    "paragraphs": (("count",), ("separator",)),
    "starts_with": (("text",), ()),
    "ends_with": (("text",), ()),
}
_TEXT_FIELDS = {"word", "text", "separator"}

CONSTRAINTS_ALLOWED = (
    "a list of constraint dicts, each with 'type' in " + ", ".join(sorted(_FIELDS))
    + " and its fields (see the light_if docs)"
)


# ================================================================================================ constraints
@dataclass(frozen=True)
class Constraint:
    """One parsed constraint: its ``type``, fields and partial credit ``weight``."""

    type: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 0.1


def default_weight(kind: str, fields: Mapping[str, Any]) -> float:
    """The official partial credit of a satisfied constraint: 0.1 for a two-sided range, bullets, paragraphs and the
    prefix; 0.05 for one-sided bounds, highlights and placeholders (``ends_with``: 0.1, ours)."""
    if kind in ("keyword", "word_count", "capital_words"):
        lo = fields.get("min", 1 if kind == "keyword" else None)
        return 0.1 if lo is not None and fields.get("max") is not None else 0.05
    return 0.05 if kind in ("highlights", "placeholders") else 0.1


def parse_constraint(raw: Any) -> Constraint:
    """A :class:`Constraint` from a dict of the schema; ``ValueError`` naming the problem otherwise."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a constraint must be a dict, got {type(raw).__name__} {raw!r:.60}")
    values = {k: v for k, v in raw.items() if v is not None}
    kind = values.pop("type", None)
    if kind not in _FIELDS:
        raise ValueError(f"constraint type {kind!r} is not one of {', '.join(sorted(_FIELDS))}")
    weight = values.pop("weight", None)
    required, optional = _FIELDS[kind]
    unknown = sorted(set(values) - set(required) - set(optional))
    missing = [f for f in required if f not in values]
    if unknown or missing:
        raise ValueError(f"constraint {kind!r} " + (f"has unknown fields {unknown}" if unknown else
                                                    f"lacks the fields {missing}"))
    for name, v in values.items():
        if name in _TEXT_FIELDS:
            if not isinstance(v, str) or not v:
                raise ValueError(f"field {name!r} of constraint {kind!r} must be a non-empty string, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"field {name!r} of constraint {kind!r} must be an integer >= 0, got {v!r}")
    if kind in ("word_count", "capital_words") and not values:
        raise ValueError(f"constraint {kind!r} needs 'min' or 'max'")
    if weight is None:
        weight = default_weight(kind, values)
    elif isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ValueError(f"field 'weight' of constraint {kind!r} must be a number >= 0, got {weight!r}")
    return Constraint(kind, values, float(weight))


def parse_constraints(raw: Any) -> list[Constraint]:
    """The parsed constraints of one row (None or an empty list: none)."""
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"constraints must be a list, got {type(raw).__name__} {raw!r:.60}")
    return [parse_constraint(c) for c in raw]


def constraints_ok(raw: Any) -> bool:
    try:
        parse_constraints(raw)
    except ValueError:
        return False
    return True


def _in_range(n: int, lo: int | None, hi: int | None) -> bool:
    return (lo is None or n >= lo) and (hi is None or n <= hi)


def _paragraphs(text: str, separator: str) -> int:
    return sum(1 for p in text.split(separator) if p.strip())


_CHECKS: dict[str, Callable[[str, Mapping[str, Any]], bool]] = {
    "keyword": lambda t, f: _in_range(t.count(f["word"]), f.get("min", 1), f.get("max")),
    "word_count": lambda t, f: _in_range(len(_WORDS.findall(t)), f.get("min"), f.get("max")),
    "capital_words": lambda t, f: _in_range(sum(1 for w in t.split() if w.isupper() and len(w) >= 2),
                                            f.get("min"), f.get("max")),
    "highlights": lambda t, f: len(_HIGHLIGHT.findall(t)) >= f["min"],
    "placeholders": lambda t, f: len(_PLACEHOLDER.findall(t)) >= f["min"],
    "bullets": lambda t, f: sum(1 for line in t.split("\n") if line.startswith("* ")) == f["count"],
    "paragraphs": lambda t, f: _paragraphs(t, f.get("separator", "\n\n")) == f["count"],
    "starts_with": lambda t, f: t.startswith(f["text"]),
    "ends_with": lambda t, f: t.rstrip().endswith(f["text"]),
}


def satisfied(answer: str, constraint: Constraint) -> bool:
    """Whether ``answer`` meets ``constraint``."""
    return _CHECKS[constraint.type](answer, constraint.fields)


def dense_score(answer: str, constraints: Sequence[Constraint], all_bonus: float) -> float:
    """``sum_c weight_c 1[c holds] + all_bonus 1[every c holds]``; 0 for a row without constraints."""
    if not constraints:
        return 0.0
    held = [satisfied(answer, c) for c in constraints]
    return sum(c.weight for c, ok in zip(constraints, held) if ok) + (all_bonus if all(held) else 0.0)


def final_answer(text: str, think_end: str | None) -> str | None:
    """The text after the last ``think_end`` (stripped); None when the tag is missing; the whole text without a tag."""
    if think_end is None:
        return text.strip()
    return text.rsplit(think_end, 1)[1].strip() if think_end in text else None


# ================================================================================================ entropy term
def entropy_weights(advantages: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor, alpha: float,
                    ub: float) -> torch.Tensor:
    """(B, T) TEA-RL weights ``clamp(alpha * softmax_row(cov), 0, ub)`` on the valid tokens, 0 elsewhere (no grad).

    Args:
        advantages: (B, T) token advantages. logps: (B, T) log-probs. mask: (B, T) valid tokens.
    """
    m = mask.bool()
    cov = token_covariance(advantages, logps, mask).masked_fill(~m, float("-inf"))
    soft = torch.softmax(cov, dim=-1).nan_to_num(0.0)  # a row without valid tokens: all -inf -> NaN -> 0
    return (soft * alpha).clamp(0.0, ub) * m


# ================================================================================================ plugin
@dataclass
class LightIfOptions(PluginOptions):
    constraints_column: str | None = option(
        "constraints", help="Dataset column holding each row's list of constraint dicts (schema in the docs); None = "
        "only the 'constraints' option.",
    )
    constraints: list[dict] = option(
        default_factory=list, help="Constraint dicts applied to every row, after its column's; e.g. "
        "[{'type': 'word_count', 'max': 50}].",
    )
    all_bonus: float = option(1.0, min=0.0, help="Reward added when every constraint holds (official acc_score).")
    think_end: str | None = option(
        "</think>", help="Tag ending the reasoning: the answer is the text after it and a completion without it scores "
        "0 (official); None = the whole completion is the answer (models without a thinking block).",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the light_if column; 0 = no reward function.")
    entropy_alpha: float = option(
        10.0, min=0.0, help="TEA-RL scale of the per-row softmax of the covariance (official cov_alpha); 0 = no "
        "entropy term.",
    )
    entropy_ub: float = option(5.0, min=0.0, min_exclusive=True,
                               help="Upper clamp of the per-token entropy weight (official clip_cov_ub).")

    def validate(self) -> None:
        try:
            parse_constraints(self.constraints)
        except ValueError as exc:
            raise PluginConfigError(
                f"Option 'constraints' of plugin 'light_if' got {self.constraints!r:.80}; {exc}; allowed: "
                f"{CONSTRAINTS_ALLOWED}."
            ) from exc
        if self.think_end == "":
            raise PluginConfigError("Option 'think_end' of plugin 'light_if' got ''; allowed: a non-empty tag or None.")
        if self.reward_weight != 0 and self.constraints_column is None and not self.constraints:
            raise PluginConfigError(
                "Options of plugin 'light_if': constraints_column=None and constraints=[] leave nothing to check; "
                "allowed: a constraints column, constraint dicts, or reward_weight=0."
            )


class LightIfPlugin(Plugin):
    """Constraint-checker dense rewards (reward stage) and the token-wise entropy-adaptive bonus (loss stage)."""

    name = "light_if"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Light-IF: Endowing LLMs with Generalizable Reasoning via Preview and Self-Checking for Complex Instruction "
        "Following (TEA-RL), arXiv:2508.03178"
    )
    summary = "Partial credit per satisfied instruction constraint, plus an entropy bonus on high-covariance tokens."
    Options = LightIfOptions
    official = OfficialSource(
        "Qihoo360/Light-IF", "01e9003", verdict="faithful",
        files=("rl/verl/verl/utils/reward_score/IF.py", "rl/verl/verl/utils/reward_score/__init__.py",
               "rl/verl/verl/trainer/ppo/core_algos.py", "rl/verl/verl/trainer/config/ppo_trainer.yaml"),
        note="Constraints from a declarative column instead of the official jqzl_prompt dict; the entropy weight "
        "carries no gradient; the bonus is aggregated by loss_type (the recipes' token-mean is dapo).",
    )
    claim_metric = ("all_satisfied_fraction", "completions meeting every constraint")
    conflicts_with = ("clip_cov", "kl_cov", "lp_reg", "siren")
    conflict_reason = ENTROPY_PICK_ONE
    reconstructed = (
        "constraints read from a declarative dataset column (type + fields); ends_with and the paragraph separator "
        "are ours",
        "the TEA-RL weight is detached (a weight, not a gradient path)",
        "a row without constraints scores 0",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._static = parse_constraints(self.options.constraints)

    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook == "trl_plugins_loss":
            return o.entropy_alpha > 0
        if hook == "trl_plugins_reward_functions":
            return o.reward_weight != 0
        return o.entropy_alpha > 0 or o.reward_weight != 0

    def required_columns(self) -> list[str]:
        o = self.options
        return [o.constraints_column] if o.reward_weight != 0 and o.constraints_column else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.entropy_alpha > 0:
            check_no_entropy_bonus(self.name, args)
        if o.reward_weight != 0 and o.constraints_column is not None:
            check_column_values(self.name, getattr(trainer, "train_dataset", None), o.constraints_column,
                                constraints_ok, CONSTRAINTS_ALLOWED)

    def score(self, completion: Any, raw_constraints: Any) -> tuple[float, bool]:
        """(dense score, every constraint held) of one completion against its row's constraints and the option's."""
        constraints = parse_constraints(raw_constraints) + self._static
        answer = final_answer(completion_text(completion), self.options.think_end)
        if answer is None or not constraints:
            return 0.0, False
        return dense_score(answer, constraints, self.options.all_bonus), all(satisfied(answer, c) for c in constraints)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        column = self.options.constraints_column

        def light_if(completions, **kwargs):
            rows = kwargs.get(column) if column else None
            rows = [None] * len(completions) if rows is None else rows
            for i, raw in enumerate(rows):  # a streamed row (the reward guard raises it on every process together)
                problem = cell_problem(self.name, column or "constraints", i, raw, constraints_ok, CONSTRAINTS_ALLOWED)
                if problem:
                    raise PluginConfigError(problem.replace(f" in row {i};", f" in row {i} of the reward call;"))
            return [self.score(c, raw)[0] for c, raw in zip(completions, rows)]

        light_if.reward_weight = self.options.reward_weight
        return [light_if]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        """Log the fraction of completions meeting every constraint (the paper's strict accuracy)."""
        if self.options.reward_weight == 0:
            return
        column = self.options.constraints_column
        held = [self.score(c, row.get(column) if column else None)[1]
                for c, row in zip(ctx.local_completions, ctx.local_rows)]
        held = ctx.gather_object(held)
        ctx.log_metric("all_satisfied_fraction", sum(held) / max(len(held), 1))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps.detach()
        w = entropy_weights(ctx.advantages.expand_as(lp), lp, ctx.mask, o.entropy_alpha, o.entropy_ub)
        ctx.add_token_loss(-w.to(ctx.entropies.dtype) * ctx.entropies)
        ctx.log_metric("entropy_weight_mean", ctx.global_masked_mean(w))
