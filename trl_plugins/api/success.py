"""Which rollouts succeeded: one rule for every plugin, decided on a verifier column.

Methods that react to success or failure (hint the all-fail groups, repair the failed rollouts, keep the first
successful refinement, ...) ask "is this answer correct?". The weighted sum of all reward columns does not answer
that: a 0.5 format reward next to an exact verifier makes every well-formatted wrong answer look successful, and a
plugin's placeholder column (filled only at the reward stage) makes every answer look wrong. The rule:

* success is decided on **one reward column**, the verifier: by default the first reward function that is not a
  placeholder (TRL's convention: the accuracy reward comes first), or the column a plugin's ``success_column``
  option names;
* a rollout succeeds when that column's value is **above** ``success_threshold``; a NaN value (the function
  returned None) is a failure;
* placeholder columns (reward functions marked with :func:`mark_placeholder`, whose values a plugin fills in at the
  reward stage) are never the verifier and read as NaN when scored before the reward stage.

Plugins take the two options from :class:`SuccessOptions` and ask the context: ``ctx.success(rows, completions,
rule=self.options.success_rule)`` at the sampling stage (:class:`~trl_plugins.api.contexts.RolloutContext`), or
:func:`success_mask` on ``rewards_per_func`` and the reward function names at the reward and advantage stages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.api.options import PluginOptions, option

#: Attribute set on a reward function whose column a plugin fills in at the reward stage.
PLACEHOLDER_ATTR = "trl_plugins_placeholder"


def mark_placeholder(func: Callable) -> Callable:
    """Mark a reward function as a placeholder column (filled in by a reward transform); returns ``func``."""
    setattr(func, PLACEHOLDER_ATTR, True)
    return func


def placeholder_column(name: str, weight: float | None = None) -> Callable:
    """A placeholder reward function named ``name`` (TRL's column name): it returns 0.0 for every completion, and a
    plugin's reward transform fills the column in once whole groups (or the verifier's verdicts) are known.
    ``weight``, when given, is its TRL reward weight (``reward_weight``)."""

    def column(completions, **kwargs):
        return [0.0] * len(completions)

    column.__name__ = column.__qualname__ = name
    if weight is not None:
        column.reward_weight = weight
    return mark_placeholder(column)


def is_placeholder(func: Any) -> bool:
    """Whether ``func`` (or the function a reward guard wraps) is a placeholder column."""
    return bool(getattr(func, PLACEHOLDER_ATTR, False))


@dataclasses.dataclass(frozen=True)
class SuccessRule:
    """A rollout succeeds when its verifier column is above ``threshold``.

    Attributes:
        column: name of the verifier column; None = the first reward function that is not a placeholder.
        threshold: strict lower bound on the verifier value for a success (NaN is never a success).
    """

    column: str | None = None
    threshold: float = 0.0


#: The default rule: the first non-placeholder reward function, above 0.0.
DEFAULT_RULE = SuccessRule()

def verifier_column(names: Sequence[str], placeholders: Sequence[bool] = (), column: str | None = None) -> int:
    """Index of the verifier column among the K reward functions ``names``.

    ``placeholders``: (K,) flags (empty = none). A named ``column`` must exist and must not be a placeholder.
    """
    flags = list(placeholders) or [False] * len(names)
    if column is not None:
        if column not in names:
            raise PluginConfigError(
                f"success_column={column!r} is not a reward function of the run (reward functions: "
                f"{', '.join(names) or 'none'})."
            )
        k = list(names).index(column)
        if flags[k]:
            raise PluginConfigError(
                f"success_column={column!r} is a placeholder column filled in at the reward stage; name a verifier "
                f"reward function instead (non-placeholder: {', '.join(n for n, p in zip(names, flags) if not p)})."
            )
        return k
    for k, flag in enumerate(flags):
        if not flag:
            return k
    raise PluginConfigError(
        "Success is decided on a verifier reward column, but the run has none besides placeholder columns "
        f"({', '.join(names) or 'no reward functions'}); add a verifier reward function (first in reward_funcs)."
    )


def success_mask(
    values: torch.Tensor, names: Sequence[str], rule: SuccessRule = DEFAULT_RULE, placeholders: Sequence[bool] = ()
) -> torch.Tensor:
    """(n,) bool: ``values[:, verifier] > rule.threshold`` for an (n, K) reward matrix with columns ``names``."""
    if values.dim() != 2 or values.size(1) != len(names):
        raise PluginError(f"success_mask: expected an (n, {len(names)}) reward matrix, got {tuple(values.shape)}.")
    column = values[:, verifier_column(names, placeholders, rule.column)]
    return torch.nan_to_num(column.float(), nan=-torch.inf) > rule.threshold


def weighted_nansum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(n,) TRL's combined reward of ``values`` (n, K) with ``weights`` (K,): the weighted sum over the columns that
    are not NaN (0 where every column is NaN)."""
    return (values * weights.to(values).unsqueeze(0)).nansum(dim=1)


def combined_reward(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(n,) TRL's combined reward as its advantages use it: :func:`weighted_nansum`, NaN where every column is NaN
    (an unscorable row)."""
    combined = weighted_nansum(values, weights)
    combined[torch.isnan(values).all(dim=1)] = torch.nan
    return combined


@dataclasses.dataclass(frozen=True)
class RewardColumns:
    """What the reward functions say about n candidate completions, column by column.

    Attributes:
        values: (n, K) float tensor, one column per reward function; NaN where a function returned None and in
            every placeholder column.
        names: K reward function names (TRL's column names).
        weights: (K,) TRL's reward weights.
        placeholders: K flags, True for a placeholder column.
    """

    values: torch.Tensor
    names: list[str]
    weights: torch.Tensor
    placeholders: tuple[bool, ...] = ()

    @classmethod
    def of(cls, result: Any) -> RewardColumns:
        """Accept a scorer's result: a RewardColumns, an (n, K) matrix or an (n,) vector (one column, weight 1)."""
        if isinstance(result, RewardColumns):
            return result
        values = torch.as_tensor(result)
        if values.dim() == 1:
            values = values.unsqueeze(1)
        K = values.size(1)
        return cls(values, [f"reward_{k}" for k in range(K)], torch.ones(K), (False,) * K)

    def weighted_sum(self) -> torch.Tensor:
        """(n,) TRL's combined reward: the weighted nansum over columns (0 where every column is NaN)."""
        return weighted_nansum(self.values, self.weights)

    def verifier(self, rule: SuccessRule = DEFAULT_RULE, missing: float = float("nan")) -> torch.Tensor:
        """(n,) values of the verifier column; ``missing`` where it returned None (NaN by default; ``-inf`` keeps
        such rows comparable: never above a threshold, never the best)."""
        column = self.values[:, verifier_column(self.names, self.placeholders, rule.column)]
        return column if math.isnan(missing) else torch.nan_to_num(column, nan=missing)

    def success(self, rule: SuccessRule = DEFAULT_RULE) -> torch.Tensor:
        """(n,) bool: the rollouts the rule counts as successes."""
        return success_mask(self.values, self.names, rule, self.placeholders)


def check_success_columns(plugins: Sequence[Any], names: Sequence[str], placeholders: Sequence[bool]) -> None:
    """At construction: every plugin with :class:`SuccessOptions` can find its verifier column among the run's reward
    functions ``names`` (raises :class:`PluginConfigError` naming the plugin otherwise)."""
    for plugin in plugins:
        options = getattr(plugin, "options", None)
        if isinstance(options, SuccessOptions):
            try:
                verifier_column(names, placeholders, options.success_column)
            except PluginConfigError as exc:
                raise PluginConfigError(f"Plugin {plugin.name!r}: {exc}") from None


@dataclasses.dataclass
class SuccessOptions(PluginOptions):
    """Option mixin of plugins that decide success (see the module docstring for the rule)."""

    success_column: str | None = option(
        None,
        help="Reward function whose value decides success (the verifier); default: the first reward function that "
        "is not a placeholder column (TRL's convention: accuracy first). Other columns never change the verdict.",
    )
    success_threshold: float = option(
        0.0, help="A rollout succeeds when its verifier column's value is above this (NaN = failure)."
    )

    @property
    def success_rule(self) -> SuccessRule:
        return SuccessRule(self.success_column, self.success_threshold)
