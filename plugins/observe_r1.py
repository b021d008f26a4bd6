"""Observe-R1 — dynamic progressive RL (arXiv:2505.12432): bonus reward, per-sample dynamic weighting, data ladder.

Three pieces of the paper's recipe that are not its multimodal format, each an option. Facts from the official code
(``zrguo/Observe-R1@418547a``, ``openrlhf/trainer/ppo_utils/experience_maker.py``,
``compute_advantages_and_returns``, lines 519-554; defaults ``openrlhf/cli/train_ppo_ray.py`` lines 355-360 and 404,
recipe ``scripts/train_r1.sh``):

1. **Bonus reward** (``--use_bonus``, on in the recipe): in each group, the **shortest correct** response (tokens;
   the first one on a tie) gets ``+bonus_coef`` (0.2) -- only when that length is above ``bonus_constraint`` (100
   tokens). Correct: the integer part of the reward (accuracy 0/1 + format 0.5), i.e. the verifier.
2. **Dynamic weighting** (``--use_dyna_weight``, on in the recipe): with ``p`` the fraction of correct responses in
   the group, every advantage of the group (the group-normalised reward, after the bonus) is multiplied by
   ``w = 4 * diff_coef * p * (1 - p)`` (``diff_coef`` 1.8): the weight peaks (1.8) at ``p = 1/2``, the most
   uncertain, medium-difficulty prompts, and fades toward the solved and the unsolved ones.
3. **Data ladder**: the NeuraLadder data is ordered from easy to hard and read in that order: the recipe passes
   ``--shuffle``, which *disables* shuffling (``action="store_false"``). Here ``data_ladder`` keeps the training
   dataset's order (or sorts it, stably, by ``ladder_column`` ascending), repeating each prompt G times as TRL's
   sampler does.

The bonus is the plugin's own reward column ``observe_r1`` (TRL's reward weights apply), so the group normalisation
sees it as in the official code; the weight multiplies TRL's advantages at the advantage stage (TRL's std epsilon
1e-4, official 1e-9). Correctness is decided on the verifier column (``success_column`` / ``success_threshold``).

Deviation (documented): in a group without any correct response the official code adds the bonus to the group's
first response (``torch.min`` over all-infinite lengths returns index 0, and infinity exceeds the constraint); here
such groups get no bonus. The paper's format reward (``<observe>``/``<think>``/``<answer>`` tags, 0.5) is a task
reward function, not part of this plugin. ``bonus_coef = 0``, ``dynamic_weighting = False`` and ``data_ladder =
False`` together are the neutral setting (vanilla TRL).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS
from trl_plugins.api.success import SuccessOptions, placeholder_column

COLUMN = "observe_r1"


@dataclass
class ObserveR1Options(SuccessOptions):
    bonus_coef: float = option(
        0.2, min=0.0, help="Bonus added to the shortest correct response of a group (official --bonus_reward_coef; 0: "
        "off)."
    )
    bonus_constraint: int = option(
        100, min=0, help="The bonus is paid only when that shortest correct response is longer than this many tokens "
        "(official --bonus_constraint)."
    )
    dynamic_weighting: bool = option(
        True, help="Multiply each group's advantages by 4 * diff_coef * p (1 - p), p = its fraction correct "
        "(official --use_dyna_weight)."
    )
    diff_coef: float = option(1.8, min=0.0, min_exclusive=True, help="Peak weight of the dynamic weighting (at p = 1/2).")
    data_ladder: bool = option(
        True, help="Draw prompts in the dataset's order (easy to hard), without shuffling, as the official recipe; "
        "False: TRL's sampler."
    )
    ladder_column: str | None = option(
        None, help="With data_ladder: sort the prompts (stably) by this dataset column, ascending, instead of keeping "
        "the dataset's order."
    )

    def validate(self) -> None:
        if self.ladder_column is not None and not self.data_ladder:
            raise PluginConfigError(
                f"Option 'ladder_column' of plugin 'observe_r1' got {self.ladder_column!r} with data_ladder=False; "
                "the column orders the data ladder: set data_ladder=True, or leave ladder_column unset."
            )


def shortest_correct_bonus(lengths: torch.Tensor, correct: torch.Tensor, group_size: int, bonus: float,
                           constraint: int) -> torch.Tensor:
    """(N,) bonus: ``bonus`` on the shortest correct row of each group (first on ties) when its length > constraint.

    Args:
        lengths: (N,) completion lengths in tokens. correct: (N,) bool. Groups are ``group_size`` contiguous rows.
    """
    L = torch.where(correct, lengths.double(), torch.full_like(lengths, float("inf"), dtype=torch.float64))
    shortest, index = L.view(-1, group_size).min(dim=1)
    paid = torch.isfinite(shortest) & (shortest > constraint)  # no correct row: no bonus (see the module docstring)
    out = torch.zeros(L.view(-1, group_size).shape, dtype=torch.float64)
    out[paid, index[paid]] = bonus
    return out.view(-1)


def dynamic_weights(correct: torch.Tensor, group_size: int, diff_coef: float) -> torch.Tensor:
    """(N/G,) ``4 * diff_coef * p * (1 - p)`` with ``p`` each group's fraction of correct rows."""
    p = correct.double().view(-1, group_size).mean(dim=1)
    return 4 * diff_coef * p * (1 - p)


def ladder_order(dataset, column: str | None) -> list[int]:
    """Prompt indices of the data ladder: the dataset's order, or sorted stably by ``column`` ascending."""
    n = len(dataset)
    if column is None:
        return list(range(n))
    values = list(dataset[column])
    return sorted(range(n), key=lambda i: values[i])


class LadderSampler:
    """TRL's ``RepeatSampler`` layout over a fixed order (no shuffling): chunks of ``batch_size`` prompt indices,
    each index ``mini_repeat_count`` times in a row, each chunk ``repeat_count`` times; an incomplete last chunk is
    dropped, as TRL does."""

    def __init__(self, order: list[int], mini_repeat_count: int, batch_size: int, repeat_count: int):
        self.order, self.mini_repeat_count = order, mini_repeat_count
        self.batch_size, self.repeat_count = batch_size, repeat_count

    def __iter__(self) -> Iterator[int]:
        chunks = [self.order[i:i + self.batch_size] for i in range(0, len(self.order), self.batch_size)]
        for chunk in (c for c in chunks if len(c) == self.batch_size):
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return (len(self.order) // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


class ObserveR1Plugin(Plugin):
    """Observe-R1's bonus for the shortest correct answer, uncertainty-weighted advantages and data ladder."""

    name = "observe_r1"
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    image_inputs = True
    version = "0.1.0"
    paper = ("Observe-R1: Unlocking Reasoning Abilities of MLLMs with Dynamic Progressive Reinforcement Learning, "
             "arXiv:2505.12432")
    summary = "Bonus for the shortest correct answer, advantages weighted by 4p(1-p) per group, easy-to-hard data order."
    Options = ObserveR1Options
    official = OfficialSource(
        "zrguo/Observe-R1", "418547a", verdict="faithful",
        files=("openrlhf/trainer/ppo_utils/experience_maker.py", "openrlhf/cli/train_ppo_ray.py",
               "scripts/train_r1.sh"),
        note="A group without a correct response gets no bonus (the official code pays its first response); TRL's "
        "group std epsilon (1e-4) instead of 1e-9; the multimodal format reward is the task's.",
        variants=("ladder_column",),
    )
    claim_metric = ("dynamic_weight_mean", "mean per-group advantage weight 4 c p (1 - p)")
    reconstructed = ("no bonus in a group without a correct response (the official code pays its first row)",)

    def required_columns(self) -> list[str]:
        return [self.options.ladder_column] if self.options.ladder_column else []

    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook == "trl_plugins_train_sampler":
            return o.data_ladder
        if hook == "trl_plugins_transform_advantages":
            return o.dynamic_weighting
        return True

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN)]  # the bonus needs whole groups: the reward transform fills it in

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        return LadderSampler(ladder_order(dataset, self.options.ladder_column), sampler.mini_repeat_count,
                             sampler.batch_size, sampler.repeat_count)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if ctx.local_completion_ids is None:
            raise PluginError("observe_r1 needs the completions' token ids at the reward stage (the bonus).")
        lengths = torch.tensor(ctx.gather_object([len(ids) for ids in ctx.local_completion_ids]), dtype=torch.long)
        correct = ctx.success(o.success_rule).cpu()
        bonus = shortest_correct_bonus(lengths, correct, ctx.num_generations, o.bonus_coef, o.bonus_constraint)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = bonus.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("bonus_fraction", float((bonus > 0).double().mean()))
        ctx.log_metric("correct_length", float(lengths[correct].double().mean()) if correct.any() else 0.0)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        G = ctx.num_generations
        weights = dynamic_weights(ctx.success(self.options.success_rule).cpu(), G, self.options.diff_coef)
        rows = weights.repeat_interleave(G).to(ctx.advantages)
        shape = (-1,) + (1,) * (ctx.advantages.dim() - 1)
        ctx.advantages = ctx.advantages * rows.view(shape)
        ctx.log_metric("dynamic_weight_mean", float(weights.mean()))
