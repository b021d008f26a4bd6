"""REC / OPMD / AsymRE — off-policy group-relative REINFORCE (arXiv:2509.24203, "Group-Relative REINFORCE Is
Secretly an Off-Policy Algorithm: Demystifying Some Myths About GRPO and Its Friends").

The paper derives group-relative REINFORCE without assuming the data came from the current policy: with the group
mean as baseline, ``-A log pi_theta`` is a valid update for stale or injected samples, and what keeps it stable is a
**regulariser**, not importance sampling. Its families, all one per-token loss here (official code:
``yanxi-chen/Trinity-RFT``, ``trinity/algorithm/policy_loss_fn/rec_policy_loss.py``, ``advantage_fn/rec_advantage.py``,
``examples/rec_gsm8k``)::

    r        = sg(pi_theta / pi_old)                                          (token ratio, detached)
    in_range = clip_mode's trust region on r (below)                          (B, T) bool
    A_w      = A            (weight="none")         | A * r   (importance_sampling)
             | A * r_seq    (gspo_importance_sampling, r_seq = exp(masked mean log-ratio of the row))
             | A * exp(A / temp)  (advantage: RED-Weight)
    loss     = -A_w * log pi_theta * in_range  + reg
    reg      = 0 | c * (log pi_theta - log pi_old)^2  (k2: Kimi's OPMD) | -c * log pi_theta  (forward-kl: AsymRE)

``clip_mode`` (REC, regularisation by clipping; a token outside the region gets no gradient):
``one-side`` (official example config, REC-OneSide): ``r <= 1+eps_high`` where ``A >= 0``, ``r >= 1-eps_low`` where
``A <= 0``; ``two-side``: ``1-eps_low <= r <= 1+eps_high``; ``gspo-one-side``: one-side on the sequence ratio; ``ring``:
two-side plus the outer ring ``r <= 1-eps_low'`` (``A >= 0``) / ``r >= 1+eps_high'`` (``A <= 0``); ``none``.
The epsilons are the run's ``epsilon`` / ``epsilon_high`` (official 0.2 / 0.2, TRL's default).

Checked against ``yanxi-chen/Trinity-RFT@9051d6374db5d4199dbe317d33eb1caa2e42a9fb``: the example runs 8 rollouts,
``one-side`` clipping at 0.2 / 0.2 without weighting and without std scaling (``examples/rec_gsm8k/gsm8k.yaml:11-20``);
the ring's outer epsilons are 0.6 / 2.0 (``trinity/algorithm/policy_loss_fn/rec_policy_loss.py:146-147``,
``examples/rec_gsm8k/README.md:167-168``); AsymRE and OPMD use coefficient 0.1 (``README.md:192-193``, ``:209-210``);
the loss is the token mean of the micro-batch (``rec_policy_loss.py:132``), ``gspo-one-side`` the mean of row means
(``:124-130``).

``variant`` picks a named method from the paper's table; ``custom`` (default) uses ``clip_mode``/``weight``/
``regularizer`` as given, whose defaults are the official example (REC-OneSide-NoIS):

* ``reinforce``: no clip, no weight, no regulariser;
* ``grpo``: one-side clip with importance sampling -- the **same gradient as TRL's clipped surrogate** (the paper's
  observation that GRPO is a REC member; the neutral setting of this plugin);
* ``opmd``: no clip, k2 regulariser, coefficient 0.1 (official OPMD config);
* ``asymre``: no clip, forward-kl regulariser, coefficient 0.1 (official AsymRE config; equal to lowering the
  baseline by 0.1).

RED-Drop (``drop="balance"``, advantage stage): in a group with more below-mean than at-or-above-mean rollouts, the
extra negatives (chosen at random, seeded) get advantage 0 and the baseline is the mean of the kept rewards.

The official advantage is ``r - mean`` without std scaling (``std_normalize: false``): set ``scale_rewards="none"``
(warned otherwise, except for ``variant="grpo"``). The official aggregation is the token mean of the micro-batch
(TRL ``loss_type="bnpo"``, or ``"dapo"`` for the batch-global token mean); ``gspo-one-side`` uses the mean of row
means (``"grpo"``). With TRL, ``log pi_old`` equals ``sg(log pi_theta)`` unless the policy moves between generation
and loss (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``); then every ratio is 1, no
token is clipped and the k2 regulariser has no gradient -- exactly as in the official code on fresh data.

Off-policy tokens injected by a sampling plugin: by default (``offpolicy_tokens="rec"``) they take this loss too --
the paper's point is that group REINFORCE needs no importance ratio for them; ``"shaped"`` leaves them to the
framework's shaped branch ``-A p/(p+gamma)``. The loss value of ``weight="importance_sampling"`` is written ``-A r``
with the ratio differentiated (the same gradient as the official ``-A sg(r) log pi``); the gradients equal TRL's
surrogate's, but the logged loss values differ from it when tokens are clipped (by up to 0.41 in the comparison of
issue 28).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    hookimpl,
    option,
)

CLIP_MODES = ("none", "one-side", "two-side", "gspo-one-side", "ring")
WEIGHTS = ("none", "importance_sampling", "gspo_importance_sampling", "advantage")
REGULARIZERS = ("none", "k2", "forward-kl")

#: ``variant`` -> (clip_mode, weight, regularizer, regularizer_coef) of the paper's named methods.
VARIANTS = {
    "reinforce": ("none", "none", "none", 0.0),
    "grpo": ("one-side", "importance_sampling", "none", 0.0),
    "opmd": ("none", "none", "k2", 0.1),
    "asymre": ("none", "none", "forward-kl", 0.1),
}


@dataclass
class RecOptions(PluginOptions):
    variant: Literal["custom", "reinforce", "grpo", "opmd", "asymre"] = option(
        "custom",
        help="A named method (sets clip_mode, weight, regularizer and regularizer_coef; leave those at their "
        "defaults), or 'custom' to use them as given.",
    )
    clip_mode: Literal["none", "one-side", "two-side", "gspo-one-side", "ring"] = option(
        "one-side", help="REC trust region on the detached ratio; tokens outside get no gradient (official example: "
        "one-side)."
    )
    weight: Literal["none", "importance_sampling", "gspo_importance_sampling", "advantage"] = option(
        "none", help="Sample weighting: none (REC-NoIS, official example), the token ratio, the sequence ratio, or "
        "exp(A / temp) (RED-Weight)."
    )
    regularizer: Literal["none", "k2", "forward-kl"] = option(
        "none", help="Additive regulariser: k2 = c (log pi - log pi_old)^2 (OPMD), forward-kl = -c log pi (AsymRE)."
    )
    regularizer_coef: float = option(0.0, min=0.0, help="c of the regulariser (official OPMD / AsymRE: 0.1).")
    epsilon_low_prime: float = option(
        0.6, min=0.0, max=1.0, min_exclusive=True, help="clip_mode='ring': outer lower bound 1 - eps_low' (official 0.6)."
    )
    epsilon_high_prime: float = option(
        2.0, min=0.0, min_exclusive=True, help="clip_mode='ring': outer upper bound 1 + eps_high' (official 2.0)."
    )
    temp: float = option(1.0, min=0.0, min_exclusive=True, help="weight='advantage': temperature of exp(A / temp).")
    drop: Literal["none", "balance"] = option(
        "none", help="RED-Drop: 'balance' zeroes random extra negatives so a group has no more negatives than "
        "positives, and re-centres the kept rewards."
    )
    seed: int = option(0, help="drop='balance': seed of the random choice of dropped negatives (with the step).")
    offpolicy_tokens: Literal["rec", "shaped"] = option(
        "rec", help="Tokens a sampling plugin injected off-policy: this loss ('rec') or the framework's shaped branch."
    )

    def validate(self) -> None:
        if self.variant == "custom":
            return
        defaults = {"clip_mode": "one-side", "weight": "none", "regularizer": "none", "regularizer_coef": 0.0}
        changed = [k for k, v in defaults.items() if getattr(self, k) != v]
        if changed:
            raise PluginConfigError(
                f"Plugin 'rec': variant={self.variant!r} sets {', '.join(defaults)} itself, but {', '.join(changed)} "
                "was also given; use variant='custom' to set them by hand."
            )

    def resolved(self) -> tuple[str, str, str, float]:
        """(clip_mode, weight, regularizer, regularizer_coef) after the variant."""
        if self.variant == "custom":
            return self.clip_mode, self.weight, self.regularizer, self.regularizer_coef
        return VARIANTS[self.variant]


# ============================================================================================= pure functions
def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) masked mean of the (B, T) token log-ratio of each row (GSPO's normalised sequence log-ratio)."""
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def rec_in_range(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_mode: str,
    epsilon_low: float,
    epsilon_high: float,
    epsilon_low_prime: float = 0.6,
    epsilon_high_prime: float = 2.0,
) -> torch.Tensor:
    """REC's trust region: (B, T) bool, True where a token keeps its gradient.

    Args:
        ratio: detached ratio, (B, T) per token or (B, 1) per sequence (``gspo-one-side``).
        advantages: (B, T) or (B, 1).
        clip_mode: one of :data:`CLIP_MODES`.
    """
    pos, neg = advantages >= 0, advantages <= 0
    if clip_mode == "none":
        return torch.ones_like(ratio * advantages, dtype=torch.bool)
    if clip_mode in ("one-side", "gspo-one-side"):
        return ((ratio <= 1 + epsilon_high) & pos) | ((ratio >= 1 - epsilon_low) & neg)
    inner = (ratio >= 1 - epsilon_low) & (ratio <= 1 + epsilon_high)
    if clip_mode == "two-side":
        return inner & torch.ones_like(advantages, dtype=torch.bool)
    if clip_mode == "ring":
        return inner | (pos & (ratio <= 1 - epsilon_low_prime)) | (neg & (ratio >= 1 + epsilon_high_prime))
    raise ValueError(f"clip_mode={clip_mode!r} is unknown; allowed: {', '.join(CLIP_MODES)}.")


def rec_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_mode: str = "one-side",
    weight: str = "none",
    regularizer: str = "none",
    regularizer_coef: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    epsilon_low_prime: float = 0.6,
    epsilon_high_prime: float = 2.0,
    temp: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The REC-family per-token loss (see the module docstring).

    Args:
        per_token_logps: (B, T) log pi_theta, with grad.
        old_per_token_logps: (B, T) log pi_old.
        advantages: (B, 1) or (B, T).
        mask: (B, T) loss mask (for the sequence ratio).
    Returns:
        ``(loss (B, T), in_range (B, T) bool)``.
    """
    log_ratio = per_token_logps - old_per_token_logps
    ratio = torch.exp(log_ratio)
    seq_ratio = torch.exp(sequence_log_ratio(log_ratio, mask))
    region_ratio = seq_ratio.detach() if clip_mode == "gspo-one-side" else ratio.detach()
    in_range = rec_in_range(region_ratio, advantages, clip_mode, epsilon_low, epsilon_high, epsilon_low_prime,
                            epsilon_high_prime).expand_as(per_token_logps)
    keep = in_range.to(per_token_logps.dtype)
    if weight == "importance_sampling":  # -A sg(r) grad log pi == -A grad r: written in ratio form (TRL's value)
        loss = -(ratio * advantages) * keep
    elif weight == "gspo_importance_sampling":
        loss = -(advantages * seq_ratio.detach()) * per_token_logps * keep
    elif weight == "advantage":
        loss = -(advantages * torch.exp(advantages / temp)) * per_token_logps * keep
    elif weight == "none":
        loss = -advantages * per_token_logps * keep
    else:
        raise ValueError(f"weight={weight!r} is unknown; allowed: {', '.join(WEIGHTS)}.")
    if regularizer == "k2":
        loss = loss + regularizer_coef * (per_token_logps - old_per_token_logps).square()
    elif regularizer == "forward-kl":
        loss = loss - regularizer_coef * per_token_logps
    elif regularizer != "none":
        raise ValueError(f"regularizer={regularizer!r} is unknown; allowed: {', '.join(REGULARIZERS)}.")
    return loss, in_range


def balance_drop(rewards: torch.Tensor, num_generations: int, generator: torch.Generator) -> torch.Tensor:
    """RED-Drop's keep mask: (N,) bool, False on randomly chosen extra negatives of each group.

    A rollout is positive when its reward is at least the group mean; in a group with more negatives than positives,
    ``negatives - positives`` negatives are dropped (uniformly at random with ``generator``).

    Args:
        rewards: (N,) combined rewards, group-contiguous (N = groups * G).
    """
    groups = rewards.view(-1, num_generations)
    keep = torch.ones_like(groups, dtype=torch.bool)
    for g in range(groups.size(0)):
        positive = groups[g] >= groups[g].mean()
        extra = int((~positive).sum()) - int(positive.sum())
        if extra > 0:
            negatives = torch.nonzero(~positive).flatten()
            chosen = negatives[torch.randperm(negatives.numel(), generator=generator)[:extra]]
            keep[g, chosen] = False
    return keep.view(-1)


def kept_mean_advantages(rewards: torch.Tensor, keep: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) ``r - mean of the kept rewards of the group`` on kept rows, 0 on dropped ones (a group keeping at most one
    row has baseline 0, as the official code)."""
    r, k = rewards.view(-1, num_generations), keep.view(-1, num_generations).to(rewards.dtype)
    count = k.sum(-1, keepdim=True)
    mean = torch.where(count > 1, (r * k).sum(-1, keepdim=True) / count.clamp(min=1.0), torch.zeros_like(count))
    return ((r - mean) * k).view(-1)


# ============================================================================================= plugin
class RecPlugin(Plugin):
    """Off-policy group REINFORCE: REC clipping, OPMD / AsymRE regularisers, RED weighting (advantage, loss)."""
    image_inputs = True
    multi_turn = True
    claim_metric = ("clipped_token_fraction", "tokens clipped by the REC rule")

    name = "rec"
    version = "0.1.0"
    paper = (
        "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm: Demystifying Some Myths About GRPO and Its "
        "Friends, arXiv:2509.24203"
    )
    summary = "Off-policy group REINFORCE losses: REC clipping (one/two-side, ring), OPMD and AsymRE regularisers."
    Options = RecOptions
    official = OfficialSource(
        "yanxi-chen/Trinity-RFT", "9051d63", verdict="equal",
        note="Gradients equal; logged loss values differ from TRL's surrogate where tokens are clipped (documented).",
    )
    replaces_surrogate = True
    replaces = ("the base surrogate on every loss token (off-policy tokens too unless offpolicy_tokens='shaped')",)

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        scale = getattr(args, "scale_rewards", "group")
        if self.options.variant != "grpo" and scale not in ("none", False):
            warnings.warn(
                f"rec: the official advantage is r - group mean without std scaling; scale_rewards={scale!r} divides "
                "by the group std. Set scale_rewards='none' to match it.",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.drop != "balance":
            return
        generator = torch.Generator().manual_seed(o.seed * 1_000_003 + ctx.step)
        rewards = torch.nan_to_num(ctx.rewards.float().cpu(), nan=0.0)
        keep = balance_drop(rewards, ctx.num_generations, generator)
        ctx.advantages = kept_mean_advantages(rewards, keep, ctx.num_generations).to(ctx.advantages)
        ctx.log_metric("dropped_fraction", 1.0 - keep.float().mean().item())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        clip_mode, weight, regularizer, coef = o.resolved()
        values, in_range = rec_token_loss(
            ctx.per_token_logps, ctx.old_per_token_logps, ctx.advantages, ctx.mask,
            clip_mode=clip_mode, weight=weight, regularizer=regularizer, regularizer_coef=coef,
            epsilon_low=ctx.epsilon_low, epsilon_high=ctx.epsilon_high, epsilon_low_prime=o.epsilon_low_prime,
            epsilon_high_prime=o.epsilon_high_prime, temp=o.temp,
        )
        tokens = ctx.mask.bool()
        if o.offpolicy_tokens == "shaped":
            tokens = tokens & ~ctx.offpolicy_mask.bool()
        ctx.replace_tokens(tokens, values)
        ctx.log_metric("clipped_token_fraction", ctx.global_masked_mean((~in_range).float()))
