"""SSL — Sweet Spot Learning (arXiv:2601.22491): tiered rewards, progressively amplified toward the sweet spot.

A binary verifier treats every success alike and every failure alike. SSL grades how close a rollout came to the
"sweet spot" of the solution space with a task-specific proximity score (distance zones of a click around the target
for GUI perception; the fraction of matched cells or steps for reasoning and planning), **discretises** it into K
zones (the paper finds K = 4 best: fewer zones approach the binary reward, more zones pass on the scorer's noise),
and adds a tier reward that grows progressively from the outer zone to the sweet spot, scaled by a weight alpha. The
tiers keep the order of the solutions (a closer rollout never earns less) while the discretisation filters the small,
noisy differences a continuous score would pass on.

Here, per rollout, with ``s`` the graded score (the ``score_column`` reward column, by default the verifier column),
normalised to ``[0, 1]`` by ``score_min`` / ``score_max``:

* zone ``z = min(floor(s K), K - 1)`` (equal-width zones: quartiles for K = 4; the sweet spot ``s = 1`` is the top
  zone);
* tier ``t(z) = (b^z - 1) / (b^(K-1) - 1)`` for an amplification base ``b > 1`` (each zone's step is ``b`` times the
  previous one's: progressively amplified), ``z / (K - 1)`` for ``b = 1`` (evenly spaced);
* the plugin's own reward column ``sweet_spot`` holds ``alpha * t(z)`` (TRL adds it to the other columns with
  weight 1); a NaN score (the scorer did not apply) gets 0.

``alpha = 0`` is the neutral setting (an all-zero column: vanilla TRL).

No official code was found, and the paper's method section was not available to us beyond its abstract and summaries:
the zone boundaries (equal width), the amplification ``b^z`` and its base 2, alpha = 0.5 and the additive combination
with the verifier are reconstructed (``trl-plugins show sweet_spot``, docs/faithfulness.md). The domain scorers (the
GUI distance zones, the 3x3 block matches) are the task's: give their score as a reward column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.success import SuccessRule, placeholder_column

COLUMN = "sweet_spot"


@dataclass
class SweetSpotOptions(PluginOptions):
    alpha: float = option(0.5, min=0.0, help="Weight of the tier reward (0: off).", reconstructed=True)
    zones: int = option(4, min=2, help="K, the number of zones the graded score is cut into (paper: 4 is best).")
    amplification: float = option(
        2.0, min=1.0, help="Base b of the tier t(z) = (b^z - 1) / (b^(K-1) - 1): each zone's step is b times the "
        "previous one's (1: evenly spaced tiers).", reconstructed=True,
    )
    score_column: str | None = option(
        None, help="Reward column holding the graded proximity score (default: the verifier column, the first reward "
        "function that is not a placeholder)."
    )
    score_min: float = option(0.0, help="Score of the farthest rollout (maps to 0; lower scores are clamped).")
    score_max: float = option(1.0, help="Score of the sweet spot (maps to 1; higher scores are clamped).")

    def validate(self) -> None:
        if not self.score_min < self.score_max:
            raise PluginConfigError(
                f"Options 'score_min' and 'score_max' of plugin 'sweet_spot' got {self.score_min!r} and "
                f"{self.score_max!r}; allowed: score_min < score_max (the score range mapped onto [0, 1])."
            )


def zone_index(scores: torch.Tensor, zones: int) -> torch.Tensor:
    """(N,) long zone in ``0 .. K-1`` of (N,) scores in ``[0, 1]`` (equal-width zones; NaN -> zone 0)."""
    s = torch.nan_to_num(scores.float(), nan=0.0).clamp(0.0, 1.0)
    return torch.clamp(torch.floor(s * zones), max=zones - 1).long()


def tier_reward(zone: torch.Tensor, zones: int, amplification: float) -> torch.Tensor:
    """(N,) tier in ``[0, 1]`` of (N,) zones: ``(b^z - 1) / (b^(K-1) - 1)``, or ``z / (K - 1)`` for ``b = 1``."""
    z = zone.double()
    if amplification == 1.0:
        return z / (zones - 1)
    return (amplification ** z - 1) / (amplification ** (zones - 1) - 1)


class SweetSpotPlugin(Plugin):
    """SSL's tiered, progressively amplified reward from a graded proximity score, in its own column (reward)."""

    name = "sweet_spot"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "SSL: Sweet Spot Learning for Differentiated Guidance in Agentic Optimization, arXiv:2601.22491"
    summary = "Tiered reward: a graded score cut into K zones, progressively amplified toward the sweet spot."
    Options = SweetSpotOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the method section was not available: equal-width zones, the b^z "
        "amplification, alpha = 0.5 and the additive combination with the verifier are reconstructed from the "
        "abstract and summaries (K = 4 is the paper's).",
    )
    claim_metric = ("zone_mean", "mean zone of the rollouts (0: farthest)")
    reconstructed = (
        "equal-width zones over the normalised score",
        "tier (b^z - 1) / (b^(K-1) - 1) with b = 2",
        "alpha = 0.5, added to the verifier in the plugin's own column",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        names = list(trainer.reward_func_names)
        column = self.options.score_column
        if column is not None and column not in names:
            raise PluginConfigError(
                f"sweet_spot: score_column={column!r} is not a reward column (columns: {', '.join(names)})."
            )
        if column is None and not [n for n in names if n != COLUMN]:
            raise PluginConfigError("sweet_spot needs a graded reward function (the score) besides its own column.")

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN)]  # needs the score column: the reward transform fills it in

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        raw = ctx.verifier(SuccessRule(o.score_column))  # (N,) the graded score column
        scores = (raw.double() - o.score_min) / (o.score_max - o.score_min)
        zone = zone_index(scores, o.zones)
        values = o.alpha * tier_reward(zone, o.zones, o.amplification)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("zone_mean", float(zone.float().mean()))
        ctx.log_metric("sweet_spot_fraction", float((zone == o.zones - 1).float().mean()))
        ctx.log_metric("tier_reward_mean", float(values.mean()))
        ctx.log_metric("unscored_fraction", float(torch.isnan(raw).float().mean()))
