"""OTC-PO — Optimal Tool Call-controlled Policy Optimization (arXiv:2504.14870).

A tool-efficiency reward for tool agents: among correct answers, the one reached with the fewest tool calls scores
highest. The correctness reward is multiplied by a tool coefficient ``r_tool`` in (0, 1] (so a wrong answer stays at
0 and is never rewarded for saving calls). With ``m`` the tool calls of a rollout (from the turn structure TRL's
tool loop produces) and ``c`` a smoothing constant:

* OTC-PPO (``variant="ppo"``): ``r_tool = cos(m * pi / (2m + c))`` -- 1 without calls, decaying with every call;
* OTC-GRPO (``variant="grpo"``, default): ``n`` = the fewest calls among the **correct** rollouts of the group (the
  estimate of the optimal number of calls); ``f(m, n) = 0`` if ``m = n = 0``, ``m`` if ``n = 0``, else
  ``2nm / (m + n)``; ``r_tool = 1`` if ``f = n = 0``, ``cos(m * pi / (2m + c))`` if ``n = 0``, else
  ``sin(f * pi / (2n))`` -- 1 exactly at ``m = n``, lower for fewer or more calls.

The reward is ``alpha * r_tool * r_correct`` on the verifier column (correct: value > 0, so ``otc_po`` must run
before reward transforms that give incorrect rollouts partial credit, such as ``e_grpo``; checked at construction). Reconstructed (options, flagged): ``c`` (the
paper calls it a smoothing constant; default 1.0 here), ``alpha`` 1.0, the group as the scope of ``n`` (the paper's
estimate may also use earlier rollouts of the same question), and ``strength`` (our mixing weight: 0 leaves the
reward unchanged, the neutral setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginOptions,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.success import verifier_column


@dataclass
class OtcPoOptions(PluginOptions):
    variant: Literal["grpo", "ppo"] = option(
        "grpo", help="'grpo': optimal calls n estimated per group (OTC-GRPO); 'ppo': cosine decay in the calls (OTC-PPO)."
    )
    c: float = option(1.0, min=0.0, min_exclusive=True, reconstructed=True,
                      help="Smoothing constant of the cosine decay cos(m*pi/(2m+c)).")
    alpha: float = option(1.0, min=0.0, min_exclusive=True, reconstructed=True,
                          help="Scale of the tool-integrated reward alpha * r_tool * r_correct.")
    column: str | None = option(
        None, help="Reward column to reshape (default: the verifier column, the first non-placeholder one)."
    )
    strength: float = option(
        1.0, min=0.0, max=1.0,
        help="Mix of the OTC reward into the column: (1 - s) r + s * alpha * r_tool * r (0: unchanged; ours).",
    )


def cosine_coefficient(m: torch.Tensor, c: float) -> torch.Tensor:
    """OTC-PPO's ``cos(m pi / (2m + c))`` for (N,) call counts ``m``."""
    m = m.float()
    return torch.cos(m * math.pi / (2 * m + c))


def grpo_coefficient(m: torch.Tensor, n: torch.Tensor, c: float) -> torch.Tensor:
    """OTC-GRPO's ``r_tool`` for (N,) call counts ``m`` and per-row optimal counts ``n`` (see the module docstring)."""
    m, n = m.float(), n.float()
    f = torch.where(n == 0, m, 2 * n * m / (m + n).clamp(min=1e-9))
    f = torch.where((m == 0) & (n == 0), torch.zeros_like(f), f)
    sine = torch.sin(f * math.pi / (2 * n.clamp(min=1e-9)))
    out = torch.where(n == 0, cosine_coefficient(m, c), sine)
    return torch.where((f == 0) & (n == 0), torch.ones_like(out), out)


def optimal_calls(calls: torch.Tensor, correct: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(N,) per row: the fewest calls among the correct rows of its group (0 where the group has none correct)."""
    out = torch.zeros_like(calls)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        good = calls[sel & correct]
        out[sel] = good.min() if good.numel() else 0
    return out


class OtcPoPlugin(Plugin):
    claim_metric = ('tool_calls_mean', 'tool calls per rollout')
    name = "otc_po"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "OTC: Optimal Tool Calls via Reinforcement Learning, arXiv:2504.14870"
    summary = "Tool-efficiency reward: correct answers reached with the fewest tool calls score highest."
    Options = OtcPoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the reward matches the paper's formula as restated by a review page and a "
        "third-party transcription; c and alpha are reconstructed.",
    )
    replaces = ("the verifier column's reward (times the tool coefficient)",)
    reconstructed = ("c = 1.0 and alpha = 1.0", "n estimated within the group only")

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        names = list(getattr(args, "plugins", []) or [])
        if "e_grpo" in names and names.index("e_grpo") < names.index(self.name):
            raise IncompatiblePluginsError(
                "otc_po must come before e_grpo in `plugins`: otc_po reads correctness from the verifier column "
                "(> 0), and after e_grpo incorrect rollouts hold partial credit there."
            )

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        opts = self.options
        if opts.strength == 0:
            return
        local_calls = [t.num_tool_calls for t in ctx.local_turns] or [0] * len(ctx.local_rows)
        calls = torch.tensor(ctx.gather_object(local_calls), dtype=torch.long)
        rewards = ctx.rewards_per_func
        placeholders = list(ctx.run.placeholder_columns)
        k = verifier_column(ctx.reward_func_names, placeholders if len(placeholders) == rewards.size(1) else [],
                            opts.column)
        value = rewards[:, k].clone()
        correct = value.nan_to_num(0.0).cpu() > 0
        if opts.variant == "ppo":
            coefficient = cosine_coefficient(calls, opts.c)
        else:
            coefficient = grpo_coefficient(calls, optimal_calls(calls, correct, ctx.group_ids.cpu()), opts.c)
        shaped = opts.alpha * coefficient.to(value.device) * value
        rewards = rewards.clone()
        rewards[:, k] = (1 - opts.strength) * value + opts.strength * shaped
        ctx.rewards_per_func = rewards
        ctx.log_metric("tool_calls_mean", float(calls.float().mean()))
        ctx.log_metric("r_tool_mean", float(coefficient[correct].mean()) if correct.any() else 1.0)
