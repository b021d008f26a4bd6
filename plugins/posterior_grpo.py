"""Posterior-GRPO — process rewards only for successful outcomes (arXiv:2508.05170); mode: SophiaVL-R1's
Trust-GRPO trust-weighted, annealed thinking reward (arXiv:2505.17018).

A process reward (here: a PRM's step scores, aggregated) invites reward hacking when it is paid regardless of the
outcome: the policy learns to write convincing steps instead of right answers. Posterior-GRPO pays it **only to
rollouts whose outcome is correct**::

    R_i = R_outcome_i (+ other reward columns) + w * 1[R_outcome_i > outcome_threshold] * agg(PRM step scores of i)

so among correct rollouts the better-reasoned ones are preferred, and a wrong answer can never earn process credit.

``mode="trust"`` (Trust-GRPO, SophiaVL-R1) pays the process ("thinking") reward scaled by a per-group **trust
weight** and an **annealing** factor, as the official SophiaVL-R1 reward code does::

    groups whose rollouts are all correct or all wrong get no process reward (trust_one_sided="zero")
    rows with outcome < trust_min_outcome (0.2) are not scored (process reward 0)
    mu_c, mu_w = mean process reward of the group's correct / incorrect rollouts
    trust_g    = 1 if mu_c >= mu_w else exp(mu_c - mu_w)
    R_i        = R_outcome_i + w * trust_g * exp(-step / T) * agg(PRM step scores of i),   w = 0.3

``trust_one_sided="full"`` (trust 1 for one-sided groups), ``trust_min_outcome=None`` (score every row) and
``process_weight=1.0`` reproduce this project's earlier trust mode (not official).

The process reward is a named reward column (``posterior_process``; TRL's weights -- ``process_weight`` -- and
logging apply). The column is filled at the reward-transform stage, where the gathered outcome column is in view:
the PRM scores only the rows that need it (correct ones in ``posterior`` mode), batched, on the process holding them.

The PRM is the shared component of :mod:`trl_plugins.components.prm` (same options as ``scope``: the two plugins get
one instance -- SCOPE locates errors in failures, Posterior-GRPO rewards the process of successes). The papers train
their own reasoning / thinking reward models; using a PRM's aggregated step scores is our reconstruction, as are the
aggregation (mean), the weight in posterior mode (1.0), the outcome threshold (0.5), and in trust mode the annealing
horizon T (the run's max_steps; the official configuration uses 500 steps). The outcome column is chosen by the
success rule (:mod:`trl_plugins.api.success`): ``outcome_reward``, by default the first reward function that is not a
placeholder column. Metrics: ``process_reward_mean`` (over paid rows), ``paid_fraction``, ``trust_weight_mean``,
``anneal_factor``.

No official code was reachable, so the method is reconstructed from its paper; the trust
mode follows SophiaVL-R1's Trust-GRPO (kxfan2002/SophiaVL-R1@a818494, verl/workers/reward/custom.py) (``trl-plugins show
posterior_grpo``, docs/faithfulness.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.success import SuccessRule, mark_placeholder
from trl_plugins.api.text import completion_text
from trl_plugins.components.prm import PRMOptions, prm_from_options
from trl_plugins.components.steps import aggregate_step_scores

COLUMN = "posterior_process"


@dataclass
class PosteriorGrpoOptions(PRMOptions):
    plugin_name: ClassVar[str] = "posterior_grpo"

    mode: Literal["posterior", "trust"] = option(
        "posterior", help="posterior: process reward only for correct outcomes (P-GRPO); trust: Trust-GRPO "
        "(SophiaVL-R1) trust-weighted, annealed process reward for every rollout."
    )
    outcome_reward: str | None = option(
        None, help="Name of the outcome reward column (None: the first reward function that is not a placeholder)."
    )
    outcome_threshold: float = option(
        0.5, reconstructed=True, help="An outcome is correct when its reward is above this value."
    )
    process_weight: float | None = option(
        None, min=0.0,
        help="TRL reward weight of the process column. None: 0.3 in trust mode (official SophiaVL-R1) and 1.0 in "
        "posterior mode [reconstructed].",
    )
    trust_one_sided: Literal["zero", "full"] = option(
        "zero",
        help="trust mode, groups whose rollouts are all correct or all wrong: no process reward (official "
        "SophiaVL-R1) or the full process reward with trust 1 (not official).",
    )
    trust_min_outcome: float | None = option(
        0.2,
        help="trust mode: only rows whose outcome reward is at least this are scored by the PRM, the others get 0 "
        "(official 0.2); None scores every row (not official).",
    )
    aggregate: Literal["mean", "min", "last", "prod"] = option(
        "mean", reconstructed=True, help="How step scores become one process reward (mean step score by default)."
    )
    anneal: Literal["exp", "none"] = option(
        "exp", help="trust mode: multiply the process reward by exp(-step / anneal_steps) (SophiaVL-R1) or not."
    )
    anneal_steps: float | None = option(
        None, min=0.0, min_exclusive=True, reconstructed=True,
        help="T of the annealing (None: the run's max_steps; the official configuration uses 500).",
    )
    step_separator: str | None = option(None, help="Step separator (None: the PRM's convention).")
    problem_column: str = option("problem", help="Dataset column read by the programmatic PRM.")



#: one process reward from step scores (the shared rule of :mod:`trl_plugins.components.steps`)
aggregate_scores = aggregate_step_scores


def trust_weights(process: torch.Tensor, correct: torch.Tensor, group_size: int,
                  one_sided: float = 0.0) -> torch.Tensor:
    """Trust-GRPO weight per group -> repeated per row (N,): 1 if the correct rollouts' mean process reward is at
    least the incorrect ones', else ``exp(mu_correct - mu_incorrect)`` (< 1); ``one_sided`` for a group whose
    rollouts are all correct or all wrong (official SophiaVL-R1: 0)."""
    P, C = process.view(-1, group_size), correct.view(-1, group_size)
    out = torch.ones(P.size(0))
    for g in range(P.size(0)):
        if not (C[g].any() and (~C[g]).any()):
            out[g] = one_sided
        else:
            mu_c, mu_w = P[g][C[g]].mean(), P[g][~C[g]].mean()
            if mu_c < mu_w:
                out[g] = torch.exp(mu_c - mu_w)
    return out.repeat_interleave(group_size)


def posterior_process_reward(prompts, completions, **kwargs) -> list[float]:
    """Placeholder column: the plugin fills it at the reward-transform stage (the outcome must be known first)."""
    return [0.0] * len(completions)


class PosteriorGrpoPlugin(Plugin):
    """Success-gated (or trust-weighted, annealed) PRM process reward as a reward column (reward stage)."""

    name = "posterior_grpo"
    image_inputs = True
    multi_turn = (
        "its process reward scores the reasoning steps of one answer text; tool-call turns and tool results "
        "are not steps its reward model knows."
    )
    version = "0.1.0"
    paper = (
        "Posterior-GRPO: Rewarding Reasoning Processes in Code Generation, arXiv:2508.05170; SophiaVL-R1: "
        "Reinforcing MLLMs Reasoning with Thinking Reward (Trust-GRPO), arXiv:2505.17018"
    )
    summary = "PRM process reward paid only to correct rollouts (or trust-weighted and annealed, Trust-GRPO)."
    Options = PosteriorGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the trust mode follows SophiaVL-R1's Trust-GRPO "
        "(kxfan2002/SophiaVL-R1@a818494, verl/workers/reward/custom.py).",
        variants=("trust_one_sided", "trust_min_outcome"),
    )
    claim_metric = ("paid_fraction", "rollouts paid a process reward")
    reconstructed = (
        "process reward = mean PRM step score (the papers train holistic reasoning/thinking reward models)",
        "process_weight = 1.0 in posterior mode, outcome_threshold = 0.5",
        "trust mode: annealing horizon T = max_steps",
        "PRM Qwen/Qwen2.5-Math-PRM-7B, shared with scope when configured alike",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.prm = None
        self._max_steps = 1

    def required_columns(self) -> list[str]:
        return [self.options.problem_column] if self.options.prm == "programmatic" else []

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        func = _named(posterior_process_reward, COLUMN)
        func.reward_weight = self.process_weight()
        return [mark_placeholder(func)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._max_steps = max(int(getattr(args, "max_steps", 0) or 0), 1)
        if self.prm is None:
            self.prm = prm_from_options(self.options)
        names = list(trainer.reward_func_names)
        if self.options.outcome_reward is not None and self.options.outcome_reward not in names:
            raise PluginConfigError(
                f"posterior_grpo: outcome_reward={self.options.outcome_reward!r} is not a reward function of the run "
                f"({', '.join(names)})."
            )
        if not [n for n in names if n != COLUMN]:
            raise PluginConfigError("posterior_grpo needs an outcome reward function besides its own column.")

    def process_weight(self) -> float:
        """TRL weight of the process column: the option, else 0.3 in trust mode (official) and 1.0 in posterior."""
        o = self.options
        if o.process_weight is not None:
            return o.process_weight
        return 0.3 if o.mode == "trust" else 1.0

    def anneal_factor(self, step: int) -> float:
        o = self.options
        if o.mode != "trust" or o.anneal == "none":
            return 1.0
        return math.exp(-step / (o.anneal_steps or self._max_steps))

    def _local_process_rewards(self, ctx: RewardContext, rows: list[int]) -> list[float]:
        """(B,) aggregated PRM score of this process's ``rows`` (0.0 for the other rows; one PRM batch)."""
        local = [0.0] * len(ctx.local_rows)
        if rows:
            texts = [completion_text(ctx.local_completions[j]) for j in rows]
            for j, scores in zip(rows, self.prm.score_steps([ctx.local_rows[j] for j in rows], texts)):
                local[j] = aggregate_scores(scores, self.options.aggregate)
        return local

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        names = ctx.reward_func_names
        if COLUMN not in names:
            return
        col = names.index(COLUMN)
        if self.prm is None:
            self.prm = prm_from_options(o)
        outcome = torch.nan_to_num(ctx.verifier(SuccessRule(o.outcome_reward)).float().cpu(), nan=0.0)  # (N,)
        correct = outcome > o.outcome_threshold
        if o.mode == "posterior":
            scored = correct
        else:  # trust: no PRM call for rows that get no process reward anyway
            scored = torch.ones_like(correct) if o.trust_min_outcome is None else outcome >= o.trust_min_outcome
            if o.trust_one_sided == "zero":
                groups = correct.view(-1, ctx.num_generations)
                two_sided = (groups.any(dim=1) & (~groups).any(dim=1)).repeat_interleave(ctx.num_generations)
                scored = scored & two_sided
        local_scored = scored[ctx.process_slice].tolist()
        rows = [j for j in range(len(ctx.local_rows)) if local_scored[j]]
        # (N,) collective; a PRM failing on one process stops every process together
        process = torch.tensor(
            gather_objects_together(ctx, self.name, self._local_process_rewards, ctx, rows), dtype=torch.float32
        )
        if o.mode == "posterior":
            values = torch.where(correct, process, torch.zeros_like(process))
            paid = correct
            ctx.log_metric("paid_fraction", paid.float().mean().item())
        else:
            trust = trust_weights(process, correct, ctx.num_generations,
                                  one_sided=0.0 if o.trust_one_sided == "zero" else 1.0)
            factor = self.anneal_factor(ctx.step)
            values = trust * factor * process
            paid = scored
            ctx.log_metric("trust_weight_mean", trust.mean().item())
            ctx.log_metric("anneal_factor", factor)
        if paid.any():
            ctx.log_metric("process_reward_mean", process[paid].mean().item())
        matrix = ctx.rewards_per_func.clone()
        matrix[:, col] = values.to(matrix)
        ctx.rewards_per_func = matrix


def _named(func, name):
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    wrapper.__name__ = name
    return wrapper
