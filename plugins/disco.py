"""DisCO — Discriminative Constrained Optimization (arXiv:2505.12366).

DisCO replaces GRPO's clipped, group-normalised surrogate by a *discriminative* objective: per question, raise
a score ``s`` of the positive answers and lower it for the negative ones, with no clipping and no std
normalisation (so no difficulty bias), and keep the update close to the old policy with a constraint enforced
by a squared-hinge penalty. For binary rewards:

1. Sequence score ``s_i``: token-mean of ``log pi_theta`` (``score="logL"``) or of the ratio
   ``r = pi_theta / pi_old`` (``score="Lratio"``).
2. Per question: ``P = {R > success_threshold}`` with ``R`` the verifier column (``success_column``: the first reward
   function that is not a placeholder by default; a partial-credit column never makes a response positive), ``N`` the rest. Questions with an empty ``P`` or ``N``
   contribute 0 but still count in the number of questions ``Q``.
3. ``variant="disco"`` (imbalance-aware): ``J = (1/Q) sum_q [mean_P s - tau log sum_N exp(s_j / tau)]``;
   ``variant="disco_b"``: ``J = (1/Q) sum_q [mean_P s - mean_N s]``.
4. Constraint: ``kl = token-mean over valid tokens of (r - 1 - log r)``; penalty
   ``sg(max(beta (kl - delta), 0)) * kl``, whose gradient is that of ``beta/2 max(kl - delta, 0)^2``.
5. Loss = ``-J + penalty``.

TRL splits groups across shuffled micro-batches, so the group structure is turned into **sequence weights at
the advantage stage** (stored as the rows' advantages, chained like any advantage):
``a_i = G/|P_q|`` on positives; ``a_j = -G softmax_j(s_old,N / tau)`` (disco) or ``-G/|N_q|`` (disco_b) on
negatives; 0 in single-class groups. The loss stage replaces the surrogate on every valid on-policy token by
``-a * lp`` (logL) or ``-a * r`` (Lratio), unclipped; with ``loss_type="grpo"`` (per-sequence token-mean, then
batch mean) its gradient is exactly that of ``-J`` when the softmax weights are evaluated at the current policy
(on-policy, e.g. the first micro-step with ``num_iterations=1``). Otherwise the softmax weights are frozen at
``pi_old`` (an approximation: they come from the no-grad forward of the advantage stage, ``s_old`` = token-mean
of the old log-probs; with ``score="Lratio"`` every ``s_old`` is 1, so the softmax is uniform). The KL penalty
is added per micro-batch over its valid tokens (divided by the gradient-accumulation steps, as TRL does for its
own scalar terms).

Defaults (paper / released scripts): delta = 1e-4, beta = 1e3, tau = 10, variant ``disco``. Reconstructed: the
default score ``logL`` (both are in the released code), ``success_threshold`` (the paper assumes binary
rewards; 0 with "above" separates {0, 1}) and leaving off-policy tokens (injected by sampling plugins) on the
framework's shaped branch ``-a f(p)`` rather than replacing them.

Needs ``loss_type="grpo"`` (refused otherwise: another aggregation changes the per-sequence token-mean score).
Replaces the base surrogate, so it cannot be stacked with another surrogate-replacing plugin (e.g. lp_reg).

Official code checked against: ``Optimization-AI/DisCO@bd2b078`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show disco``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, LossContext, OfficialSource, Plugin, hookimpl, option
from trl_plugins.api.success import SuccessOptions


@dataclass
class DiscoOptions(SuccessOptions):
    variant: Literal["disco", "disco_b"] = option(
        "disco", help="'disco': log-sum-exp (softmax) weighting of negatives (imbalance-aware); 'disco_b': plain mean."
    )
    score: Literal["logL", "Lratio"] = option(
        "logL", help="Sequence score: token-mean log-likelihood, or token-mean likelihood ratio to pi_old.",
        reconstructed=True,
    )
    tau: float = option(10.0, min=0.0, min_exclusive=True, help="Temperature of the log-sum-exp over negatives.")
    beta: float = option(1e3, min=0.0, help="Coefficient of the squared-hinge KL penalty.")
    delta: float = option(1e-4, min=0.0, help="KL budget: no penalty while kl <= delta.")


def disco_weights(
    rewards: torch.Tensor, group_size: int, threshold: float, variant: str, tau: float,
    old_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence weights that turn DisCO's grouped objective into a per-row loss.

    Args:
        rewards: (N,) rewards, groups of ``group_size`` contiguous; NaN counts as negative.
        threshold: positive iff reward > threshold.
        variant: "disco" (softmax of ``old_scores / tau`` over the negatives) or "disco_b" (uniform).
        old_scores: (N,) sequence scores under pi_old (only read for "disco").
    Returns:
        weights (N,): ``G/|P|`` on positives, ``-G * softmax`` or ``-G/|N|`` on negatives, 0 in single-class
        groups; positive (N,) bool; mixed (num_groups,) bool.
    """
    G = group_size
    R = rewards.view(-1, G)
    pos = R > threshold  # NaN > x is False
    neg = ~pos
    n_pos = pos.sum(dim=1, keepdim=True)
    n_neg = neg.sum(dim=1, keepdim=True)
    mixed = (n_pos > 0) & (n_neg > 0)
    w_pos = G / n_pos.clamp(min=1).to(torch.float64)
    if variant == "disco":
        s = old_scores.view(-1, G).to(torch.float64) / tau
        s = s.masked_fill(~neg, float("-inf"))
        soft = torch.softmax(s, dim=1)
        soft = torch.nan_to_num(soft, nan=0.0)  # all -inf rows (no negative) give NaN
        w_neg = -G * soft
    else:
        w_neg = (-G / n_neg.clamp(min=1).to(torch.float64)).expand_as(R)
    w = torch.where(pos, w_pos.expand_as(R), w_neg)
    w = torch.where(mixed, w, torch.zeros_like(w))
    return w.view(-1).float(), pos.view(-1), mixed.view(-1)


def sequence_scores(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean of ``values`` (B, T) over ``mask`` (B, T) per row: (B,)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def disco_token_loss(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, weights: torch.Tensor, score: str
) -> torch.Tensor:
    """Unclipped per-token DisCO loss: ``-a * lp`` (logL) or ``-a * exp(lp - lp_old)`` (Lratio).

    Args:
        per_token_logps: (B, T) with grad; old_per_token_logps: (B, T); weights: (B, 1) or (B, T).
    Returns:
        (B, T); its token-mean per row is ``-a_i s_i``.
    """
    if score == "logL":
        return -weights * per_token_logps
    return -weights * torch.exp(per_token_logps - old_per_token_logps)


def kl_hinge_penalty(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, beta: float, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared-hinge KL constraint: ``sg(max(beta (kl - delta), 0)) * kl``.

    ``kl`` is the token-mean over ``mask`` of ``r - 1 - log r``, ``r = exp(lp - lp_old)``; the penalty's gradient
    equals that of ``beta/2 * max(kl - delta, 0)^2`` and is zero while ``kl <= delta``.

    Args:
        per_token_logps: (B, T) with grad; old_per_token_logps, mask: (B, T).
    Returns:
        penalty (0-d, with grad) and kl (0-d, with grad).
    """
    log_r = per_token_logps - old_per_token_logps
    per_token = torch.exp(log_r) - 1 - log_r
    m = mask.to(per_token.dtype)
    kl = (per_token * m).sum() / m.sum().clamp(min=1.0)
    coef = torch.clamp(beta * (kl.detach() - delta), min=0.0)
    return coef * kl, kl


class DiscoPlugin(Plugin):
    """Discriminative objective with a squared-hinge KL constraint (advantage + loss stages)."""

    name = "disco"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "DisCO: Reinforcing Large Reasoning Models with Discriminative Constrained Optimization, arXiv:2505.12366"
    summary = "Unclipped discriminative score objective (positives up, negatives down) with a squared-hinge KL."
    Options = DiscoOptions
    official = OfficialSource(
        "Optimization-AI/DisCO", "bd2b078", verdict="faithful",
        files=("verl/verl/trainer/ppo/core_algos.py", "verl/verl/workers/actor/dp_actor.py"),
    )
    claim_metric = ("mixed_group_fraction", "groups with both signs")
    replaces = (
        "the advantages (DisCO sequence weights)",
        "the base surrogate on on-policy tokens (the score objective)",
    )
    overwrites = ("advantages",)  # recomputed from the rewards: runs first in the advantage chain
    loss_types = ("grpo",)
    loss_types_reason = (
        "the DisCO score is a token-mean per response, which only the per-sequence token-mean of loss_type='grpo' "
        "keeps"
    )
    replaces_surrogate = True
    reconstructed = (
        "score defaults to logL (the released code has logL and Lratio variants)",
        "positive = verifier column (success_column) above success_threshold (the paper assumes binary rewards)",
        "off-policy tokens from sampling plugins keep the shaped branch -a f(p) instead of being replaced",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.top_entropy_quantile < 1.0:
            warnings.warn(
                f"disco: top_entropy_quantile={args.top_entropy_quantile} masks tokens after the DisCO loss, so the "
                "sequence score is no longer a token-mean over the whole response.",
                stacklevel=2,
            )
        if args.beta != 0.0:
            warnings.warn(
                f"disco: beta={args.beta} adds TRL's reference-KL on top of DisCO's own KL constraint (the paper uses "
                "only the constraint); set beta=0 to match it.",
                stacklevel=2,
            )
        if args.off_policy_mask_threshold is not None:
            warnings.warn(
                "disco: off_policy_mask_threshold drops negative-weight sequences from the DisCO objective.",
                stacklevel=2,
            )
        # advantage plugins listed before disco: the stack runs disco first in that chain (Plugin.overwrites)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        old_scores = None
        if o.variant == "disco":
            if o.score == "logL":
                stats = ctx.policy_stats()
                old_scores = ctx.gather(sequence_scores(stats.per_token_logps, stats.mask))
            else:  # at theta = theta_old every ratio is 1
                old_scores = torch.ones_like(ctx.rewards)
        weights, positive, mixed = disco_weights(
            ctx.verifier(o.success_rule), ctx.num_generations, o.success_threshold, o.variant, o.tau, old_scores
        )
        ctx.advantages = weights.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
        ctx.log_metric("positive_fraction", positive.float().mean().item())
        ctx.log_metric("mixed_group_fraction", mixed.float().mean().item())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        valid = ctx.mask.bool() & ~ctx.offpolicy_mask
        values = disco_token_loss(ctx.per_token_logps, ctx.old_per_token_logps, ctx.advantages, o.score)
        ctx.replace_tokens(valid, values.expand_as(ctx.per_token_logps))
        penalty, kl = kl_hinge_penalty(ctx.per_token_logps, ctx.old_per_token_logps, ctx.mask, o.beta, o.delta)
        ctx.add_loss(penalty / ctx.gradient_accumulation_steps)
        ctx.log_metric("kl", kl.item())
        ctx.log_metric("kl_penalty_active", float(kl.item() > o.delta))
