"""Dynamic sampling — DAPO's group filter with in-step refill (arXiv:2503.14476).

DAPO over-samples and filters out the prompts whose G rollouts all succeed or all fail: such a group has zero reward
variance, hence zero GRPO advantage, and only dilutes the batch. Generation continues until the batch is full of
groups with a learning signal. Here the plugin rejects those groups through the refill stage
(``trl_plugins_reject_groups``) and the trainer refills their slots within the step from its refill stream, round
after round, up to ``PluginGRPOConfig.max_refill_rounds`` -- so every optimizer step trains on a full batch and every
refill rollout is counted in the rollout budget (``plugins/framework/refill_rollouts``).

Criteria (option ``criterion``):

* ``"accuracy"`` (the paper's, and verl's ``filter_groups.metric=acc``): reject a group whose success rate is 0 or 1.
  Success is decided on the verifier column (``success_column``, default the first reward function that is not a
  placeholder; a rollout succeeds when that value is above ``success_threshold``), never on the weighted sum.
* ``"reward_std"`` (verl's ``metric=seq_final_reward`` / ``score``): reject a group whose combined reward (TRL's
  weighted sum of the reward columns) has standard deviation ``<= std_tolerance`` (0: all equal).

Only groups generated in the current round are judged (kept groups do not change). A group whose rewards are all NaN
is never rejected by ``reward_std`` (nothing to judge).

Mapping from verl's DAPO recipe (``algorithm.filter_groups``):

============================================ ======================================================================
verl                                           trl-plugins
============================================ ======================================================================
``filter_groups.enable=True``                 ``plugins: [dynamic_sampling]``
``filter_groups.metric=acc``                   ``criterion: accuracy`` (verifier column, ``success_threshold``)
``filter_groups.metric=seq_final_reward``      ``criterion: reward_std``
``filter_groups.max_num_gen_batches=n``        ``max_refill_rounds: n - 1`` (a PluginGRPOConfig field; verl's 0 =
                                               unlimited has no equivalent: give a large number)
limit reached: verl raises                     ``refill_at_limit: error`` (default ``keep``; or ``zero_advantage``)
``data.gen_batch_size`` (over-sampling)        not mapped: each refill round generates exactly the rejected
                                               groups (no surplus groups are generated and thrown away)
============================================ ======================================================================

verl keeps drawing whole generation batches from the training dataloader; the refill stream here is a seeded
permutation of the training set of its own (see ``trl_plugins.runtime.refill``), so the epoch length is unchanged.

Official code checked against: ``volcengine/verl@246cac4`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show dynamic_sampling``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, RefillContext, hookimpl, option
from trl_plugins.api.reasons import REFILLS_GROUPS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_REFILL


@dataclass
class DynamicSamplingOptions(SuccessOptions):
    criterion: Literal["accuracy", "reward_std"] = option(
        "accuracy",
        help="accuracy: reject groups whose success rate (verifier column) is 0 or 1 (DAPO, verl metric=acc); "
        "reward_std: reject groups whose combined reward has std <= std_tolerance (verl metric=seq_final_reward).",
    )
    std_tolerance: float = option(
        0.0, min=0.0, help="reward_std criterion: a group whose reward std is at most this is rejected (0: all equal)."
    )


class DynamicSamplingPlugin(Plugin):
    image_inputs = IMAGES_REFILL
    multi_turn = REFILLS_GROUPS
    claim_metric = ("filtered_fraction", "groups filtered out and refilled")
    name = "dynamic_sampling"
    paper = "DAPO dynamic sampling, arXiv:2503.14476"
    summary = "Reject all-correct / all-wrong (zero-variance) groups and refill the batch within the step."
    Options = DynamicSamplingOptions
    official = OfficialSource(
        "volcengine/verl", "246cac4", verdict="faithful",
        files=("recipe/dapo/dapo_ray_trainer.py",),
        note="The criterion is equal; each refill round generates exactly the rejected groups (no gen_batch_size "
        "over-sampling). DAPO's own repository (BytedTsinghua-SIA/DAPO@33fe317) holds only evaluation code.",
    )

    def degenerate_groups(self, ctx: RefillContext) -> torch.Tensor:
        """(S,) bool: the groups the criterion rejects (all groups, fresh or not)."""
        if self.options.criterion == "accuracy":
            rate = ctx.group_success(self.options.success_rule).float().mean(dim=1)
            return (rate == 0) | (rate == 1)
        rewards = ctx.group_rewards()
        std = rewards.std(dim=1, unbiased=False)
        return ~torch.isnan(std) & (std <= self.options.std_tolerance)

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext) -> None:
        degenerate = self.degenerate_groups(ctx).cpu() & ctx.fresh.cpu()
        if ctx.round == 0:
            ctx.log_metric("filtered_fraction", float(degenerate.float().mean()))
        ctx.reject(degenerate)
