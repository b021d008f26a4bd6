"""OREAL — Outcome REwArd-based reinforcement Learning (arXiv:2502.06781, "Exploring the Limit of Outcome Reward for
Learning Mathematical Reasoning").

Under binary outcome rewards, behaviour cloning on the positive samples of best-of-N sampling is enough to learn the
KL-regularised optimal policy; negative samples then need **reshaped** rewards so that their gradient is consistent
with the positives'. Facts from the official code (``InternLM/OREAL``: ``train_oreal.py``,
``oreal/datasets/trajectory.py``, ``oreal/configs/oreal_w*_tokenrm_OREAL-7B-SFT_seqlen16k.py``):

1. Reward: +1 for a correct rollout, -1 otherwise (the math judger's verdict; here the verifier column, see
   ``success_column``).
2. Advantage over the G rollouts of a prompt (16 in the official config), before any filtering: RLOO,
   ``A_i = r_i - mean_{j != i} r_j`` (``reward_shaping_type="rloo"``), or ``(r - mean) / (std + 1e-8)`` ("grpo").
3. Filter (``filter_trajectory``): groups that are all correct or all wrong are dropped; of the others one correct
   and one incorrect rollout are kept, chosen at random (``filter="one_pair"``); ``"all_mixed"`` keeps every rollout
   of the mixed groups (``only_keep_1_pair=False``), ``"none"`` keeps every rollout.
4. Loss (per token, no clip)::

       positive rows:  -A * log pi_theta                 summed, / (positive tokens of the batch) * 1.0
       negative rows:  -A * pi_theta / sg(pi_old)        summed, / (negative tokens of the batch) * 0.5

   (``pos_mult_adv=True`` multiplies the behaviour-cloning term by the positive advantage; ``positive_loss_factor``
   1.0, ``negative_loss_factor`` 0.5). ``normalisation="official"`` reproduces the two token counts on top of
   TRL's ``loss_type="dapo"`` (which divides the batch's token sum by its token count): each row is scaled by
   ``tokens / positive tokens`` or ``tokens / negative tokens``. Dropped rows get weight 0.
5. KL to the reference: k3 with coefficient 0.01 -- TRL's own ``beta=0.01`` (the official ``kl_type="unbias"``);
   TRL also applies it to the dropped rows, which the official code leaves out of the batch.

Not here: the official **token-level reward model** (a copy of the policy with a scalar head, trained online on the
sequence-mean logit, whose cumulative-mean sigmoid reweights tokens through ``threshold_rescale``) is a second
trained model, outside the stage contract; the released ``oreal_wo_tokenrm`` config trains without it, which is what
this plugin reproduces. Also not here: the official difficulty re-balancing of the prompt set.

Neutral setting: ``baseline="trl", positive_objective="policy_gradient", filter="none", normalisation="run"`` trains
every row with ``-A pi/sg(pi_old)`` on TRL's advantages and aggregation -- TRL's surrogate whenever no token would be
clipped (the first pass over a batch). Metrics: ``kept_fraction``, ``positive_fraction`` (of kept rows),
``mixed_group_fraction``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from trl_plugins import AdvantageContext, IncompatiblePluginsError, LossContext, Plugin, hookimpl, option
from trl_plugins.success import SuccessOptions

POSITIVE_KEY = "oreal_positive"
SCALE_KEY = "oreal_row_scale"


@dataclass
class OrealOptions(SuccessOptions):
    correct_reward: float = option(1.0, help="Reward of a correct rollout (official judger: 1).")
    incorrect_reward: float = option(-1.0, help="Reward of a wrong rollout (official judger: -1).")
    baseline: Literal["rloo", "grpo", "trl"] = option(
        "rloo", help="Advantage: leave-one-out mean (official), group z-score, or TRL's own advantages (ablation)."
    )
    filter: Literal["one_pair", "all_mixed", "none"] = option(
        "one_pair", help="Rows trained: one random correct + one random wrong per mixed group (official), every row "
        "of mixed groups, or every row."
    )
    positive_objective: Literal["behaviour_cloning", "policy_gradient"] = option(
        "behaviour_cloning", help="Positive rows: -A log pi (official BC scaled by the advantage) or -A pi/sg(pi_old)."
    )
    positive_loss_factor: float = option(1.0, min=0.0, help="Factor of the positive loss (official 1.0).")
    negative_loss_factor: float = option(0.5, min=0.0, help="Factor of the negative loss (official 0.5).")
    normalisation: Literal["official", "run"] = option(
        "official", help="'official': positive and negative token sums each over their own token count (needs "
        "loss_type='dapo'); 'run': the run's loss_type aggregation, factors applied as is."
    )
    seed: int = option(0, help="filter='one_pair': seed of the random pair choice (with the step).")


# ============================================================================================= pure functions
def oreal_rewards(success: torch.Tensor, correct: float = 1.0, incorrect: float = -1.0) -> torch.Tensor:
    """(N,) OREAL's binary rewards from the (N,) bool success mask."""
    return torch.where(success, torch.tensor(correct), torch.tensor(incorrect)).float()


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) ``r_i - mean of the other G-1 rewards of the group``."""
    r = rewards.view(-1, num_generations)
    return (r - (r.sum(-1, keepdim=True) - r) / (num_generations - 1)).view(-1)


def zscore_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) ``(r - mean) / (std + 1e-8)`` per group (unbiased std, as the official code)."""
    r = rewards.view(-1, num_generations)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-8)).view(-1)


def pair_filter(success: torch.Tensor, num_generations: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """(N,) bool keep mask of ``filter`` ``mode``: ``one_pair`` (one random correct and one random wrong row of each
    mixed group), ``all_mixed`` (every row of mixed groups), ``none`` (every row)."""
    s = success.view(-1, num_generations)
    if mode == "none":
        return torch.ones_like(success, dtype=torch.bool)
    mixed = s.any(-1) & ~s.all(-1)
    keep = mixed.unsqueeze(-1).expand_as(s).clone()
    if mode == "one_pair":
        keep[:] = False
        for g in torch.nonzero(mixed).flatten().tolist():
            for pool in (torch.nonzero(s[g]).flatten(), torch.nonzero(~s[g]).flatten()):
                keep[g, pool[torch.randint(pool.numel(), (1,), generator=generator)]] = True
    elif mode != "all_mixed":
        raise ValueError(f"filter={mode!r} is unknown; allowed: one_pair, all_mixed, none.")
    return keep.view(-1)


def row_scales(
    positive: torch.Tensor,
    keep: torch.Tensor,
    lengths: torch.Tensor,
    positive_factor: float,
    negative_factor: float,
    normalisation: str,
) -> torch.Tensor:
    """(N,) per-row factor of the loss: 0 on dropped rows; with ``"official"`` normalisation
    ``tokens / positive tokens * positive_factor`` on kept positives and ``tokens / negative tokens * negative_factor``
    on kept negatives (``tokens`` = all rows' loss tokens, dapo's denominator), else the factors alone.

    Args:
        positive, keep: (N,) bool. lengths: (N,) loss tokens per row.
    """
    lengths = lengths.float()
    pos_rows, neg_rows = (positive & keep).float(), (~positive & keep).float()
    if normalisation == "official":
        total = lengths.sum()
        pos_scale = total / (lengths * pos_rows).sum().clamp(min=1.0) * positive_factor
        neg_scale = total / (lengths * neg_rows).sum().clamp(min=1.0) * negative_factor
    else:
        pos_scale, neg_scale = torch.tensor(positive_factor), torch.tensor(negative_factor)
    return pos_rows * pos_scale + neg_rows * neg_scale


def oreal_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    positive: torch.Tensor,
    scale: torch.Tensor,
    positive_objective: str = "behaviour_cloning",
) -> torch.Tensor:
    """(B, T) per-token loss: positives ``-A log pi`` (or ``-A r``), negatives ``-A r`` with the unclipped ratio
    ``r = pi / sg(pi_old)``; each row times ``scale``.

    Args:
        per_token_logps, old_per_token_logps: (B, T). advantages: (B, 1) or (B, T).
        positive: (B,) bool. scale: (B,) row factors (:func:`row_scales`).
    """
    ratio = torch.exp(per_token_logps - old_per_token_logps.detach())
    negative_loss = -(ratio * advantages)
    if positive_objective == "behaviour_cloning":
        positive_loss = -advantages * per_token_logps
    elif positive_objective == "policy_gradient":
        positive_loss = negative_loss
    else:
        raise ValueError(f"positive_objective={positive_objective!r} is unknown; allowed: behaviour_cloning, "
                         "policy_gradient.")
    loss = torch.where(positive.bool().unsqueeze(-1), positive_loss, negative_loss)
    return loss * scale.to(loss.dtype).unsqueeze(-1)


# ============================================================================================= plugin
class OrealPlugin(Plugin):
    """Behaviour cloning on positives, reshaped rewards on negatives, one pair per mixed group (advantage, loss)."""

    name = "oreal"
    version = "0.1.0"
    paper = "Exploring the Limit of Outcome Reward for Learning Mathematical Reasoning (OREAL), arXiv:2502.06781"
    summary = "Behaviour cloning on positive rollouts, reshaped (leave-one-out) rewards on negatives, pair filtering."
    Options = OrealOptions
    replaces_surrogate = True
    replaces = ("the advantages (leave-one-out on +-1 rewards)", "the base surrogate on every loss token")

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.normalisation == "official" and args.loss_type != "dapo":
            raise IncompatiblePluginsError(
                f"oreal: normalisation='official' divides positive and negative token sums by their own counts on top "
                f"of loss_type='dapo', but loss_type={args.loss_type!r}. Set loss_type='dapo', or normalisation='run'."
            )
        if o.baseline == "rloo" and args.num_generations < 2:
            raise IncompatiblePluginsError("oreal: the leave-one-out baseline needs num_generations >= 2.")

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        success = ctx.success(o.success_rule).cpu()
        if o.baseline == "trl":
            advantages = ctx.advantages.float().cpu()
            if advantages.dim() > 1:
                raise IncompatiblePluginsError("oreal: baseline='trl' needs per-row advantages (N,) before it.")
        else:
            rewards = oreal_rewards(success, o.correct_reward, o.incorrect_reward)
            advantages = rloo_advantages(rewards, G) if o.baseline == "rloo" else zscore_advantages(rewards, G)
        generator = torch.Generator().manual_seed(o.seed * 1_000_003 + ctx.step)
        keep = pair_filter(success, G, o.filter, generator)
        scale = row_scales(success, keep, ctx.completion_lengths.cpu(), o.positive_loss_factor,
                           o.negative_loss_factor, o.normalisation)
        device = ctx.advantages.device
        ctx.advantages = (advantages * keep.float()).to(device=device, dtype=ctx.advantages.dtype)
        ctx.extras[POSITIVE_KEY] = success.float().to(device)
        ctx.extras[SCALE_KEY] = scale.to(device)
        s = success.view(-1, G)
        ctx.log_metric("kept_fraction", keep.float().mean().item())
        ctx.log_metric("positive_fraction", (success & keep).sum().item() / max(int(keep.sum()), 1))
        ctx.log_metric("mixed_group_fraction", (s.any(-1) & ~s.all(-1)).float().mean().item())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        if POSITIVE_KEY not in ctx.extras:  # a batch the advantage hook did not see
            return
        positive, scale = ctx.extras[POSITIVE_KEY], ctx.extras[SCALE_KEY]
        values = oreal_token_loss(ctx.per_token_logps, ctx.old_per_token_logps, ctx.advantages, positive > 0.5,
                                  scale, self.options.positive_objective)
        ctx.replace_tokens(ctx.mask.bool(), values)
