"""RepExp — representation-based exploration (arXiv:2510.11686, "Representation-Based Exploration for Language
Models: From Test-Time to Post-Training").

An exploration bonus from the model's own hidden states: a response is rewarded for being novel, in representation
space, with respect to the other responses. What the paper states: the feature of a response ``y`` to prompt ``x`` is
the mean over its tokens of the model's hidden states, ``h(x, y) = (1/T) sum_t h(x, y_{1:t})``; features are reduced by
a sparse random projection and mean-centred; novelty is the **elliptical bonus** of linear bandits,
``b(h) = sqrt(h^T (lambda I + sum_j h_j h_j^T)^{-1} h)`` over the other responses' features ``h_j``; in RL
post-training the bonus is added to the reward.

Here (reward stage): one backbone forward (no LM head, no logits) over the completions gives ``(N, d)`` features
(:meth:`~trl_plugins.RewardContext.policy_features`); a fixed sparse random projection (Achlioptas: entries
``+-sqrt(3/k)`` with probability 1/6 each, 0 otherwise; seeded) maps them to ``k = projection_dim``; each group is
centred on its mean and each response gets the elliptical bonus against the **other responses of its group**
(leave-one-out); ``beta * b`` fills the plugin's reward column ``repexp`` (TRL's reward weights and normalisation
apply). Memory is bounded: ``(N, k)`` features and one ``k x k`` matrix per group, never token-level hidden states
(the forward keeps only each chunk's per-row means).

Reconstructed (the post-training recipe's details were not available to us; each is an option): the leave-one-out
scope (the group), ``lambda = 1``, ``k = 64``, ``beta = 0.1``, features from the current policy (not a frozen copy),
the bonus paid to every response (``only_correct=false``). Neutral setting: ``beta = 0`` (an all-zero column, no
forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_plugins import Plugin, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.success import placeholder_column

COLUMN = "repexp"


@dataclass
class RepExpOptions(PluginOptions):
    beta: float = option(0.1, min=0.0, help="Weight of the elliptical bonus in the reward column.", reconstructed=True)
    ridge: float = option(
        1.0, min=0.0, min_exclusive=True, help="lambda of (lambda I + sum_j h_j h_j^T).", reconstructed=True
    )
    projection_dim: int = option(
        64, min=0, help="Sparse random projection to this many dimensions (0: the full hidden size).",
        reconstructed=True,
    )
    center: bool = option(True, help="Centre each group's features on their mean before the bonus.")
    only_correct: bool = option(
        False, help="Pay the bonus to correct responses only (verifier column, see correct_threshold).",
        reconstructed=True,
    )
    correct_threshold: float = option(1.0, help="With only_correct: a response is correct when its verifier value is "
                                      ">= this.")
    seed: int = option(0, help="Seed of the sparse random projection.")


def sparse_projection(d: int, k: int, seed: int) -> torch.Tensor:
    """(d, k) Achlioptas sparse random projection: ``sqrt(3/k) * {+1, 0, -1}`` with probabilities 1/6, 2/3, 1/6."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(d, k, generator=g)
    signs = torch.where(u < 1 / 6, 1.0, torch.where(u > 5 / 6, -1.0, 0.0))
    return signs * math.sqrt(3.0 / k)


def leave_one_out_bonus(features: torch.Tensor, group_size: int, ridge: float, center: bool = True) -> torch.Tensor:
    """Elliptical bonus of each row against the other rows of its group (N,).

    ``b_i = sqrt(z_i^T (ridge I + sum_{j != i} z_j z_j^T)^{-1} z_i)`` with ``z`` the features (N, k), centred on the
    group mean when ``center``.
    """
    N, k = features.shape
    z = features.double().view(-1, group_size, k)
    if center:
        z = z - z.mean(dim=1, keepdim=True)
    eye = torch.eye(k, dtype=z.dtype, device=z.device)
    bonus = torch.zeros(z.shape[:2], dtype=z.dtype, device=z.device)
    for g in range(z.size(0)):
        full = z[g].T @ z[g]
        for i in range(group_size):
            v = z[g, i]
            cov = ridge * eye + full - torch.outer(v, v)
            bonus[g, i] = torch.sqrt(torch.clamp(v @ torch.linalg.solve(cov, v), min=0.0))
    return bonus.view(-1).to(features.dtype)


class RepExpPlugin(Plugin):
    """Representation-novelty bonus from hidden states, against the rest of the group (reward stage)."""
    claim_metric = ('bonus', 'representation-novelty bonus')
    multi_turn = True

    name = "repexp"
    version = "0.1.0"
    paper = (
        "Representation-Based Exploration for Language Models: From Test-Time to Post-Training (RepExp), "
        "arXiv:2510.11686"
    )
    summary = "Exploration bonus: elliptical novelty of each response's mean hidden state against its group."
    Options = RepExpOptions
    reconstructed = (
        "leave-one-out within the group, lambda=1, projection_dim=64, beta=0.1, current-policy features, bonus for "
        "every response (the post-training recipe's details were not available)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._projection: torch.Tensor | None = None

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # the bonus needs whole groups: the reward transform fills the column in
        return [placeholder_column("repexp")]

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        k = self.options.projection_dim
        if k == 0 or k >= features.size(1):
            return features
        if self._projection is None or self._projection.size(0) != features.size(1):
            self._projection = sparse_projection(features.size(1), k, self.options.seed)
        return features @ self._projection.to(features.device, features.dtype)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if o.beta == 0:
            return
        local = self._project(ctx.policy_features().float())
        features = ctx.gather(local)
        bonus = o.beta * leave_one_out_bonus(features, ctx.num_generations, o.ridge, o.center)
        if o.only_correct:
            verdict = torch.nan_to_num(ctx.verifier().float(), nan=-math.inf) >= o.correct_threshold
            bonus = torch.where(verdict.to(bonus.device), bonus, torch.zeros_like(bonus))
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = bonus.to(rewards.device, rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("bonus", bonus.mean().item())
        ctx.log_metric("bonus_max", bonus.max().item())
