"""E-GRPO — Entity-aware GRPO ("Repurposing Synthetic Data for Fine-grained Search Agent Supervision",
arXiv:2510.24694).

Search agents trained with an outcome reward treat a "near miss" (the right entities found, a wrong final answer)
like a total failure. E-GRPO gives incorrect rollouts a partial reward proportional to their **entity match rate**:
``gamma_i`` = the fraction of the question's ground-truth entities that appear in the rollout's reasoning. Facts from
the paper: correct rollouts keep reward 1; incorrect ones get ``alpha * gamma_hat_i`` with ``gamma_hat`` the match
rate normalised within the group; ``alpha`` around 0.3 worked best in its ablation.

Implemented as a reward transform of the verifier column (success is decided on it before the bonus is added).
Reconstructed (options, flagged): the normalisation (``gamma_i / max_j gamma_j`` over the group, 0 when no rollout
of the group matched any entity), case-insensitive substring matching, and which text counts as reasoning
(``scope="assistant"``: the assistant turns, tool results excluded -- finding an entity in a search result does not
count until the agent writes it). ``alpha = 0`` is the neutral setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.data_checks import cell_problem, check_column_values
from trl_plugins.api.success import verifier_column


@dataclass
class EGrpoOptions(PluginOptions):
    alpha: float = option(0.3, min=0.0, max=1.0, help="Scale of the partial reward of incorrect rollouts (paper: 0.3).")
    entities_column: str = option("entities", help="Dataset column with the ground-truth entities (list of strings).")
    normalise: Literal["group_max", "none"] = option(
        "group_max", reconstructed=True, help="Match rate divided by the best match rate of the group, or raw."
    )
    scope: Literal["assistant", "all"] = option(
        "assistant", reconstructed=True,
        help="Text searched for entities: the assistant turns, or every message (tool results included).",
    )
    column: str | None = option(None, help="Reward column to reshape (default: the verifier column).")


def reasoning_text(completion: Any, scope: str) -> str:
    if isinstance(completion, str):
        return completion
    return "\n".join(
        str(m.get("content") or "") for m in completion or []
        if isinstance(m, dict) and (scope == "all" or m.get("role") == "assistant")
    )


ENTITIES_ALLOWED = "a list of strings (the ground-truth entities), or None for a row without entities"


def entities_ok(value: Any) -> bool:
    """A list (or tuple) of strings, or None; text is refused (it would be matched character by character)."""
    return value is None or (isinstance(value, (list, tuple)) and all(isinstance(e, str) for e in value))


def match_rate(text: str, entities: list[str]) -> float:
    """Fraction of ``entities`` found in ``text`` (case-insensitive substrings); 0 for no entities."""
    if not entities:
        return 0.0
    lowered = text.lower()
    return sum(1 for e in entities if str(e).lower() in lowered) / len(entities)


def normalised_rates(rates: torch.Tensor, group_ids: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "none":
        return rates
    out = torch.zeros_like(rates)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        best = rates[sel].max()
        if best > 0:
            out[sel] = rates[sel] / best
    return out


class EGrpoPlugin(Plugin):
    claim_metric = ('entity_match_rate', 'gold entities matched by failed rollouts')
    name = "e_grpo"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "Repurposing Synthetic Data for Fine-grained Search Agent Supervision (E-GRPO), arXiv:2510.24694"
    summary = "Entity partial credit: incorrect rollouts earn alpha times their (group-normalised) entity match rate."
    Options = EGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found: the entity-reward normalisation and its scope are reconstructed.",
    )
    replaces = ("the verifier column's reward of incorrect rollouts",)
    reconstructed = ("group normalisation by the best match rate", "substring matching of entities")

    def required_columns(self) -> list[str]:
        return [self.options.entities_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        check_column_values(self.name, getattr(trainer, "train_dataset", None), self.options.entities_column,
                            entities_ok, ENTITIES_ALLOWED)

    def _local_rates(self, ctx: RewardContext) -> list[float]:
        opts = self.options
        rates = []
        for i, (completion, row) in enumerate(zip(ctx.local_completions, ctx.local_rows)):
            entities = row.get(opts.entities_column)
            row_index = (ctx.process_slice.start or 0) + i
            problem = cell_problem(self.name, opts.entities_column, row_index, entities, entities_ok, ENTITIES_ALLOWED)
            if problem:  # a streamed row: text would be matched character by character
                raise PluginConfigError(problem)
            rates.append(match_rate(reasoning_text(completion, opts.scope), list(entities or [])))
        return rates

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        opts = self.options
        if opts.alpha == 0:
            return
        rates = torch.tensor(gather_objects_together(ctx, self.name, self._local_rates, ctx), dtype=torch.float32)
        placeholders = list(ctx.run.placeholder_columns)
        rewards = ctx.rewards_per_func.clone()
        k = verifier_column(ctx.reward_func_names, placeholders if len(placeholders) == rewards.size(1) else [],
                            opts.column)
        value = rewards[:, k]
        incorrect = (value.nan_to_num(0.0) <= 0).cpu()
        bonus = opts.alpha * normalised_rates(rates, ctx.group_ids.cpu(), opts.normalise)
        rewards[:, k] = torch.where(incorrect.to(value.device), bonus.to(value.device), value)
        ctx.rewards_per_func = rewards
        ctx.log_metric("entity_match_rate", float(rates.mean()))
        ctx.log_metric("near_miss_fraction", float((incorrect & (rates > 0)).float().mean()))
