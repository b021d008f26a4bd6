"""ASPO — Advantage Shaping Policy Optimization, from "Understanding Tool-Integrated Reasoning" (arXiv:2508.19201).

Steers tool-use behaviour (e.g. calling tools earlier) by editing the advantage directly, boundedly, instead of adding
a reward bonus (which the paper finds destabilises training: a bonus shifts the group mean and can flip the sign of
a correct answer's advantage). Facts from the paper: only correct rollouts are shaped; the shaping term is the
group-standardised behaviour feature scaled by ``delta`` and clipped to ``[-k|A|, k|A|]``, so a correct answer keeps
a positive advantage whatever the feature:

    A'_i = A_i + clip(delta * z_i, -k |A_i|, k |A_i|),   z_i = (x_i - mean x) / std x over the group's correct rows

Feature ``x`` (from the turn structure of TRL's tool loop): ``first_call_position`` -- the token index where the
first tool call starts (the completion length without a call), shaped towards earlier calls (``delta < 0`` favours a
smaller x); ``tool_calls`` -- the number of calls, towards more interaction (``delta > 0``).

Rows shaped (``shaped_rows``): by default the correct rollouts with at least one tool call, as the third-party verl
recipe does (the paper releases no code); ``"correct"`` shapes every correct rollout, as the paper's text reads (a
correct row without a call then takes the ``first_call_position`` of its completion length). The group statistics of
``z`` are taken over the shaped rows.

Reconstructed (options, flagged): the defaults ``delta = -1.0`` (with ``first_call_position``) and ``k = 0.7``, the
position of a row without any call (its completion length), and standardisation with the unbiased std (1 when a
group has one correct row). ``delta = 0`` is the neutral setting (TRL's advantages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginOptions, hookimpl, option

EPS = 1e-6


@dataclass
class AspoOptions(PluginOptions):
    feature: Literal["first_call_position", "tool_calls"] = option(
        "first_call_position", help="Behaviour the shaping acts on: where the first tool call starts, or how many calls."
    )
    delta: float = option(
        -1.0, reconstructed=True,
        help="Scale of the standardised feature (negative: smaller feature values, e.g. earlier calls, gain).",
    )
    shaped_rows: Literal["correct_with_call", "correct"] = option(
        "correct_with_call",
        help="Rows shaped (and standardised over): correct rollouts with at least one tool call (the third-party verl "
        "recipe), or every correct rollout (the paper's text).",
    )
    k: float = option(0.7, min=0.0, reconstructed=True,
                      help="Bound of the shaping term as a fraction of |A| (the sign of A never flips for k < 1).")


def row_features(turns: list, feature: str) -> torch.Tensor:
    """(B,) feature per row from its :class:`~trl_plugins.api.turns.TurnStructure`."""
    values = []
    for t in turns:
        if feature == "tool_calls":
            values.append(float(t.num_tool_calls))
        else:
            values.append(float(t.tool_call_spans[0][0]) if t.tool_call_spans else float(len(t.tool_mask)))
    return torch.tensor(values)


def shaping_terms(features: torch.Tensor, correct: torch.Tensor, group_ids: torch.Tensor, delta: float) -> torch.Tensor:
    """(N,) ``delta * z`` on correct rows (z standardised within the group's correct rows), 0 elsewhere."""
    out = torch.zeros_like(features)
    for g in torch.unique(group_ids):
        sel = (group_ids == g) & correct
        x = features[sel]
        if x.numel() == 0:
            continue
        std = x.std() if x.numel() > 1 else torch.tensor(1.0)
        out[sel] = delta * (x - x.mean()) / (std + EPS)
    return out


def bounded_shaping(advantages: torch.Tensor, terms: torch.Tensor, k: float) -> torch.Tensor:
    """``A + clip(term, -k|A|, k|A|)``; ``advantages`` (N,) or (N, T), ``terms`` (N,)."""
    terms = terms.to(advantages.device, advantages.dtype)
    if advantages.dim() == 2:
        terms = terms.unsqueeze(1)
    bound = k * advantages.abs()
    return advantages + torch.maximum(torch.minimum(terms, bound), -bound)


class AspoPlugin(Plugin):
    claim_metric = ('shaped_fraction', 'rows whose advantage the bound shaped')
    name = "aspo"
    image_inputs = True
    multi_turn = True
    version = "0.2.0"
    paper = "Understanding Tool-Integrated Reasoning (ASPO: Advantage Shaping Policy Optimization), arXiv:2508.19201"
    summary = "Bounded advantage shaping of correct rollouts towards a tool-use behaviour (e.g. earlier tool calls)."
    Options = AspoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code and the paper's equation were reachable; the shaped rows follow a third-party verl "
        "recipe (correct rollouts with a tool call); delta and k are reconstructed.",
        variants=("shaped_rows",),
    )
    reconstructed = ("delta = -1.0 and k = 0.7", "first-call position of a row without calls = its length",
                     "shaped_rows='correct_with_call' standardises over the shaped rows")

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if self.options.delta == 0 or not ctx.local_turns:
            return
        local = row_features(ctx.local_turns, self.options.feature).to(ctx.device)
        features = ctx.gather(local).cpu()
        correct = ctx.success().cpu()
        if self.options.shaped_rows == "correct_with_call":
            calls = ctx.gather(row_features(ctx.local_turns, "tool_calls").to(ctx.device)).cpu()
            correct = correct & (calls > 0)
        terms = shaping_terms(features, correct, ctx.group_ids.cpu(), self.options.delta)
        ctx.advantages = bounded_shaping(ctx.advantages, terms, self.options.k)
        ctx.log_metric("shaped_fraction", float((terms != 0).float().mean()))
        ctx.log_metric(f"{self.options.feature}_mean", float(features.mean()))
