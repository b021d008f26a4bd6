"""ROVER — Random Policy Valuation for RL with verifiable rewards (arXiv:2509.24981).

In the deterministic, tree-shaped MDP of token generation with a terminal verifiable reward, the optimal action can
be read from the Q-function of the *uniformly random* policy. ROVER therefore regresses Q-values of the uniform
policy, parameterised by the policy's own log-probs relative to the sampling policy, onto a TD target, instead of
running policy iteration with a clipped surrogate. Facts from the official code (tinnerhrhe/ROVER at b0fa587,
``DataParallelROVERActor.update_policy``, ``compute_rover_loss``, ``sum_log_softmax``, recipe ``rover_qwen3_8b.sh``):

1. Rewards become GRPO advantages ``A`` (group mean and std; the recipe's ``adv_estimator=grpo``), broadcast to the
   tokens: here TRL's advantages (or those of the advantage plugins before it).
2. ``Q[b,t] = rho * (lp[b,t] - lp_old[b,t])`` (``rho`` = ``rover_t`` = 1).
3. The uniform policy's value of the next state: ``U[b,t] = rho * (ml[b,t+1] - ml_old[b,t+1]) * m[b,t+1]`` and
   ``U = 0`` at the last position, with ``ml = mean_v log softmax(z)_v = mean_v z_v - logsumexp_v z_v`` over the whole
   vocabulary of the temperature-scaled logits (``ml`` of the current policy, ``ml_old`` of the sampling policy).
4. Target ``y = sg(A + c_U * U)`` (``c_U`` = ``next_q_scale_factor`` = 1).
5. Loss: the token-mean of ``(Q - y)^2`` over the valid tokens. Officially each micro-batch's token-mean, averaged
   over the micro-batches; here ``loss_type='dapo'``, TRL's global token-mean over the batch (equal when every
   micro-batch holds as many valid tokens).
   Optional "rover clip": where ``y > Q > ln(1 + eps_high)`` the Q is replaced by the constant ``ln(1 + eps_high)``,
   and where ``y < Q < ln(1 - eps_low)`` by ``ln(1 - eps_low)`` (no gradient through those tokens).
6. On-policy (one pass over each batch, old log-probs = ``sg(lp)``), ``Q = 0`` and ``U = 0`` in value, and the
   gradient is ``-2 rho A dlp / N``: REINFORCE with GRPO advantages (so ``rho = 1/2`` gives DAPO's gradient there).

Mapping onto TRL: the loss hook replaces the surrogate on every on-policy token (off-policy tokens spliced by
sampling plugins keep their shaped branch). ``ml`` comes from the chunked LM-head statistics of the loss forward
(:mod:`trl_plugins.runtime.head_stats`; the ``(B, T, V)`` logits are never built), ``ml_old`` from one extra no-grad
forward at the advantage stage. ``next_value="auto"`` computes ``U`` only when TRL keeps separate old log-probs (the
loss can run off-policy: ``gradient_accumulation_steps`` not a multiple of ``steps_per_generation * num_iterations``, or
vLLM importance-sampling correction); otherwise ``U`` is exactly 0, as in the official on-policy path.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option

#: Extras key of the sampling policy's mean log-softmax ``ml_old`` (B, T).
OLD_MEAN_LOGSOFTMAX_KEY = "rover_old_mean_log_softmax"


@dataclass
class RoverOptions(PluginOptions):
    rho: float = option(1.0, min=0.0, min_exclusive=True, help="Q-parameterisation scale rover_t (official: 1).")
    next_value_coef: float = option(
        1.0, min=0.0, help="c_U, weight of the uniform policy's next-state value in the target (official: 1)."
    )
    next_value: Literal["auto", "always", "never"] = option(
        "auto",
        help="When to compute U (one extra no-grad forward and LM-head pass): 'auto' only when the loss can run "
        "off-policy (otherwise U is exactly 0, as in the official on-policy path), 'always', or 'never' (U = 0).",
    )
    clip: bool = option(
        False,
        help="The official code's optional 'rover clip': freeze Q at ln(1+epsilon_high) / ln(1-epsilon_low) where it "
        "is already past the bound and the target pushes further.",
        reconstructed=True,
    )


def rover_next_values(ml: torch.Tensor, ml_old: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """``U[b,t] = rho * (ml[b,t+1] - ml_old[b,t+1]) * m[b,t+1]``, 0 at the last position.

    Args: ``ml``, ``ml_old``: (B, T) mean log-softmax of the current / sampling policy; ``mask``: (B, T).
    Returns: (B, T), no grad.
    """
    u = torch.zeros_like(ml)
    u[:, :-1] = rho * (ml[:, 1:] - ml_old[:, 1:]) * mask[:, 1:].to(ml.dtype)
    return u.detach()


def rover_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    next_values: torch.Tensor,
    rho: float,
    next_value_coef: float,
    clip_bounds: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ROVER's per-token TD loss ``(Q - y)^2`` with ``Q = rho (lp - lp_old)`` and ``y = sg(A + c_U U)``.

    Args:
        logps: (B, T) with grad. old_logps: (B, T). advantages: (B, T) or (B, 1). next_values: (B, T) ``U``.
        clip_bounds: ``(ln(1 - eps_low), ln(1 + eps_high))`` for the rover clip, or None.
    Returns:
        ``(loss (B, T), clipped (B, T) bool)``.
    """
    q = rho * (logps - old_logps)
    y = (advantages + next_value_coef * next_values).detach().expand_as(q)
    clipped = torch.zeros_like(q, dtype=torch.bool)
    if clip_bounds is not None:
        low, high = clip_bounds
        qd = q.detach()
        upper = (y > qd) & (qd > high)
        lower = (y < qd) & (qd < low)
        clipped = upper | lower
        q = torch.where(upper, torch.full_like(q, high), torch.where(lower, torch.full_like(q, low), q))
    return (q - y) ** 2, clipped


class RoverPlugin(Plugin):
    """Regress the uniform policy's Q-values (parameterised by log-prob ratios) onto a TD target (loss stage)."""
    claim_metric = ('td_loss', 'TD loss of the uniform-policy Q-values')
    image_inputs = True
    multi_turn = True

    name = "rover"
    version = "0.1.0"
    paper = "Random Policy Valuation is Enough for LLM Reasoning with Verifiable Rewards (ROVER), arXiv:2509.24981"
    summary = "Replaces the clipped surrogate by a TD regression of the uniform policy's Q-values (log-prob ratios)."
    Options = RoverOptions
    official = OfficialSource(
        "tinnerhrhe/ROVER", "b0fa587", verdict="faithful",
        files=("Math/verl/workers/actor/dp_actor.py",),
        note="Equal per token; the loss is averaged with TRL's global token mean (officially per micro-batch).",
    )
    needs_head_stats = True
    replaces_surrogate = True
    replaces = ("the base surrogate on every on-policy token (the TD loss (Q - y)^2)",)
    reconstructed = ("the rover clip is off by default and uses TRL's epsilon_low / epsilon_high as its bounds",)

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.loss_type != "dapo":
            warnings.warn(
                f"rover: the official loss is a token-mean (per micro-batch; loss_type='dapo' is the closest, a "
                f"batch-global token-mean); got {args.loss_type!r}.",
                stacklevel=2,
            )
        generate_every = args.steps_per_generation * args.num_iterations
        off_policy = args.gradient_accumulation_steps % generate_every != 0 or (
            args.use_vllm and getattr(args, "vllm_importance_sampling_correction", False)
        )
        mode = self.options.next_value
        self._with_next_value = mode == "always" or (mode == "auto" and off_policy)

    def _next_value_on(self) -> bool:
        return getattr(self, "_with_next_value", self.options.next_value == "always")

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if ctx.mode != "train" or not self._next_value_on():
            return
        stats = ctx.policy_stats(head_stats=True)
        ctx.set_local_extra(OLD_MEAN_LOGSOFTMAX_KEY, stats.head_stats.mean_log_softmax())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps
        if self._next_value_on() and OLD_MEAN_LOGSOFTMAX_KEY in ctx.extras:
            ml = ctx.head_stats().mean_log_softmax().to(lp.device)
            next_values = rover_next_values(ml, ctx.extras[OLD_MEAN_LOGSOFTMAX_KEY].to(lp.device), ctx.mask, o.rho)
        else:
            next_values = torch.zeros_like(lp)
        low = math.log(1 - ctx.epsilon_low) if ctx.epsilon_low < 1 else -math.inf
        bounds = (low, math.log(1 + ctx.epsilon_high)) if o.clip else None
        values, clipped = rover_token_loss(
            lp, ctx.old_per_token_logps, ctx.advantages, next_values, o.rho, o.next_value_coef, bounds
        )
        ctx.replace_tokens(ctx.mask.bool() & ~ctx.offpolicy_mask, values)
        ctx.log_metric("td_loss", ctx.global_masked_mean(values.detach()))
        ctx.log_metric("next_value_abs", ctx.global_masked_mean(next_values.abs()))
        if o.clip:
            ctx.log_metric("clipped_fraction", ctx.global_masked_mean(clipped.float()))
