"""The reward column of a pointwise generative reward model (shared by ``deepseek_grm`` and ``libra_rm``).

A subclass names its column and its metric, and builds its judge (:meth:`PointwiseGenRMPlugin.build_judge`, a
:class:`~trl_plugins.components.genrm.GenerativeRewardModel` with a pointwise template); this base declares the
column with the weight ``options.reward_weight``, builds the judge when the trainer is configured (on the run's
device for a local judge), and fills the column at the reward-transform stage with
:func:`~trl_plugins.components.genrm.pointwise_column` (rows without a verdict at their group's mean, metric
``unparsable_fraction``), logging the mean verdict of the rows that have one as ``score_metric``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from trl_plugins.api import Plugin, RewardContext, hookimpl
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.success import placeholder_column
from trl_plugins.components.genrm import pointwise_column


class PointwiseGenRMPlugin(Plugin):
    """Base of the plugins whose reward column is a pointwise generative RM's aggregated verdict."""

    #: the reward column the verdicts fill
    column: ClassVar[str] = ""
    #: the metric holding the mean verdict of the rows that have one
    score_metric: ClassVar[str] = "score_mean"

    def __init__(self, options=None):
        super().__init__(options)
        self.grm = None
        self._device = None

    def build_judge(self):
        """The plugin's :class:`~trl_plugins.components.genrm.GenerativeRewardModel` (``self._device`` places a local
        judge)."""
        raise NotImplementedError

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(self.column, self.options.reward_weight)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._device = trainer_device(trainer)
        if self.grm is None:
            self.grm = self.build_judge()

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """(N,) column ``self.column`` = the judge's aggregated verdicts (group mean where none parsed)."""
        if self.column not in ctx.reward_func_names:
            return
        if self.grm is None:
            self.grm = self.build_judge()
        scores = pointwise_column(ctx, self.grm, self.name, self.column)
        if not torch.isnan(scores).all():
            ctx.log_metric(self.score_metric, scores.nanmean().item())
