"""RepExp — representation-based exploration (arXiv:2510.11686, "Representation-Based Exploration for Language
Models: From Test-Time to Post-Training").

An exploration bonus from the model's own hidden states: a response is rewarded for being novel, in representation
space, with respect to the other responses of its prompt. The feature of a response ``y`` to prompt ``x`` is the mean
over its tokens of the model's last hidden states, ``h(x, y) = (1/T) sum_t h(x, y_{1:t})``; features are reduced by a
sparse random projection and centred on their group's mean; the bonus, times ``beta``, is added to the reward.

Official post-training recipe: ``volcengine/verl@a9fd825`` ``recipe/rep_exp`` (``train_elliptical.sh``,
``workers/elliptical_reward_model_worker.py``, ``README.md``; restated, not copied). Its settings are the defaults:

- bonus ``reward_type=leverage`` (``bonus="leverage"``): the **leverage score**
  ``b_i = z_i^T (lambda I + sum_j z_j z_j^T)^{-1} z_i`` with the sum over **all** responses of the group (``z_i``
  included) and no square root (``_compute_bonuses``; the inverse built by rank-one updates from ``I / lambda``),
  ``lambda = 0.01`` (``ridge``); ``bonus="leave_one_out_sqrt"`` (the elliptical bonus of the paper's test-time
  section, against the other responses only, with a square root) is our variant;
- projection: sklearn's ``SparseRandomProjection(density="auto")`` to ``sparse_dim`` = 32 (MATH, GSM8K) or 128
  (DAPO with AIME) dimensions (``projection_dim``, default 32): entries ``+-sqrt(s / k)`` with probability
  ``1 / (2 s)`` each, ``s = sqrt(d)`` (``projection_density="auto"``; ``"achlioptas"``: ``s = 3``), **redrawn every
  step** (``randomize_sparse_matrix=True``; ``redraw_projection``, here seeded by ``seed`` and the step, the same on
  every process); the features are projected in float32 and the covariance computed in float64;
- no normalisation of the bonuses (``normalization=none``), ``beta = 0.01`` (``train_elliptical.sh``: ``BETA`` 0.01);
- ``turn_off_elliptical_if_none_correct=True``: the bonus is 0 for every response of a group with no correct
  response (``zero_if_none_correct``; correct = verifier value >= ``correct_threshold``); the other gates are off
  (``only_correct=false`` is ``turn_off_elliptical_if_rollout_incorrect=False``).

Here (reward stage): one backbone forward (no LM head, no logits) over the completions gives ``(N, d)`` features
(:meth:`~trl_plugins.RewardContext.policy_features`), projected on each process and gathered; ``beta * b`` fills the
plugin's reward column ``repexp`` (TRL's reward weights and normalisation apply). Memory is bounded: ``(N, k)``
features and one ``k x k`` matrix per group, never token-level hidden states.

Features: the official ones come from a **frozen copy of the base model** (the reward-model worker loads the initial
checkpoint and never updates it): ``features="reference"`` (default) takes them from the reference policy
(:meth:`~trl_plugins.RewardContext.reference_features`: TRL's reference model when ``beta > 0``, the PEFT model with
its adapter off, else a frozen copy of the initial policy kept by the trainer -- one more copy of the weights);
``"policy"`` uses the current policy. Neutral setting: ``beta = 0`` (an all-zero column, no forward, no reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginOptions, RewardContext, hookimpl, option
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE

COLUMN = "repexp"


@dataclass
class RepExpOptions(PluginOptions):
    beta: float = option(0.01, min=0.0, help="Weight of the bonus in the reward column (official 0.01).")
    ridge: float = option(
        0.01, min=0.0, min_exclusive=True, help="lambda of (lambda I + sum_j z_j z_j^T) (official 0.01)."
    )
    bonus: Literal["leverage", "leave_one_out_sqrt"] = option(
        "leverage", help="'leverage' (official): z_i^T (lambda I + sum over the whole group)^-1 z_i, no square root; "
        "'leave_one_out_sqrt': sqrt of the same against the other responses of the group only (our variant).",
    )
    projection_dim: int = option(
        32, min=0, help="Sparse random projection to this many dimensions (official 32 for MATH/GSM8K, 128 for "
        "DAPO with AIME; 0: the full hidden size).",
    )
    projection_density: Literal["auto", "achlioptas"] = option(
        "auto", help="Non-zero share of the projection: 'auto' (official, sklearn's 1 / sqrt(d)) or 'achlioptas' "
        "(1/3).",
    )
    redraw_projection: bool = option(
        True, help="Draw a new projection every step (official randomize_sparse_matrix=True); false: one fixed matrix.",
    )
    features: Literal["reference", "policy"] = option(
        "reference", help="Whose hidden states: 'reference' (official: the frozen base model; TRL's reference model, "
        "the PEFT model with its adapter off, or a frozen copy of the initial policy) or 'policy' (the current "
        "policy; no extra model in memory).",
    )
    center: bool = option(True, help="Centre each group's features on their mean before the bonus (official).")
    zero_if_none_correct: bool = option(
        True, help="Bonus 0 for every response of a group with no correct response (official "
        "turn_off_elliptical_if_none_correct=True; correct: verifier value >= correct_threshold).",
    )
    only_correct: bool = option(
        False, help="Pay the bonus to correct responses only (official turn_off_elliptical_if_rollout_incorrect, "
        "false).",
    )
    correct_threshold: float = option(1.0, help="A response is correct when its verifier value is >= this.")
    seed: int = option(0, help="Seed of the sparse random projection (with redraw_projection: mixed with the step).")


def sparse_projection(d: int, k: int, seed: int, density: str = "achlioptas") -> torch.Tensor:
    """(d, k) sparse random projection: ``sqrt(s/k) * {+1, 0, -1}`` with probabilities ``1/(2s)``, ``1 - 1/s``,
    ``1/(2s)``; ``s = 3`` (``"achlioptas"``) or ``sqrt(d)`` (``"auto"``, sklearn's ``density="auto"``)."""
    s = math.sqrt(d) if density == "auto" else 3.0
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(d, k, generator=g)
    signs = torch.where(u < 1 / (2 * s), 1.0, torch.where(u > 1 - 1 / (2 * s), -1.0, 0.0))
    return signs * math.sqrt(s / k)


def _grouped(features: torch.Tensor, group_size: int, center: bool) -> torch.Tensor:
    z = features.double().view(-1, group_size, features.size(1))
    return z - z.mean(dim=1, keepdim=True) if center else z


def leverage_bonus(features: torch.Tensor, group_size: int, ridge: float, center: bool = True) -> torch.Tensor:
    """The official leverage score of each row in its group (N,):
    ``b_i = z_i^T (ridge I + sum_j z_j z_j^T)^{-1} z_i``, the sum over the whole group (row ``i`` included), ``z`` the
    features (N, k) centred on the group mean when ``center``; float64."""
    z = _grouped(features, group_size, center)
    eye = torch.eye(z.size(2), dtype=z.dtype, device=z.device)
    cov = ridge * eye + z.transpose(1, 2) @ z  # (num_groups, k, k)
    solved = torch.linalg.solve(cov, z.transpose(1, 2))  # (num_groups, k, G)
    return (z * solved.transpose(1, 2)).sum(-1).view(-1).to(features.dtype)


def leave_one_out_bonus(features: torch.Tensor, group_size: int, ridge: float, center: bool = True) -> torch.Tensor:
    """Elliptical bonus of each row against the other rows of its group (N,) (``bonus="leave_one_out_sqrt"``).

    ``b_i = sqrt(z_i^T (ridge I + sum_{j != i} z_j z_j^T)^{-1} z_i)`` with ``z`` the features (N, k), centred on the
    group mean when ``center``.
    """
    k = features.size(1)
    z = _grouped(features, group_size, center)
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
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = True

    name = "repexp"
    version = "0.1.0"
    paper = (
        "Representation-Based Exploration for Language Models: From Test-Time to Post-Training (RepExp), "
        "arXiv:2510.11686"
    )
    summary = "Exploration bonus: leverage score of each response's mean hidden state within its group."
    Options = RepExpOptions
    official = OfficialSource(
        "volcengine/verl", "a9fd825", verdict="faithful",
        files=("recipe/rep_exp/workers/elliptical_reward_model_worker.py", "recipe/rep_exp/train_elliptical.sh"),
        variants=("bonus", "features"),
    )
    reconstructed = ()

    def __init__(self, options=None):
        super().__init__(options)
        self._projection: torch.Tensor | None = None
        # the reference policy's hidden states (features="reference") need a reference model in the trainer
        self.needs_reference_model = self.options.beta > 0 and self.options.features == "reference"

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # the bonus needs whole groups: the reward transform fills the column in
        return [placeholder_column("repexp")]

    def _project(self, features: torch.Tensor, step: int) -> torch.Tensor:
        o = self.options
        k = o.projection_dim
        if k == 0 or k >= features.size(1):
            return features
        if o.redraw_projection:  # a new matrix every step, the same on every process
            self._projection = sparse_projection(features.size(1), k, o.seed * 1_000_003 + step, o.projection_density)
        elif self._projection is None or self._projection.size(0) != features.size(1):
            self._projection = sparse_projection(features.size(1), k, o.seed, o.projection_density)
        return features @ self._projection.to(features.device, features.dtype)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if o.beta == 0:
            return
        hidden = ctx.reference_features() if o.features == "reference" else ctx.policy_features()
        local = self._project(hidden.float(), ctx.step)
        features = ctx.gather(local)
        score = leverage_bonus if o.bonus == "leverage" else leave_one_out_bonus
        bonus = o.beta * score(features, ctx.num_generations, o.ridge, o.center)
        if o.only_correct or o.zero_if_none_correct:
            verdict = torch.nan_to_num(ctx.verifier().float(), nan=-math.inf) >= o.correct_threshold
            verdict = verdict.to(bonus.device)
            if o.zero_if_none_correct:  # a group with no correct response gets no bonus
                any_correct = verdict.view(-1, ctx.num_generations).any(dim=1)
                bonus = bonus * any_correct.repeat_interleave(ctx.num_generations).to(bonus.dtype)
            if o.only_correct:
                bonus = torch.where(verdict, bonus, torch.zeros_like(bonus))
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = bonus.to(rewards.device, rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("bonus", bonus.mean().item())
        ctx.log_metric("bonus_max", bonus.max().item())
