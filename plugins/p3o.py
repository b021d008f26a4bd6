"""P3O — Pairwise Proximal Policy Optimization, from "Pairwise Proximal Policy Optimization: Harnessing Relative
Feedback for LLM Alignment" (arXiv:2310.00212).

A trajectory-wise policy gradient on reward *differences* between two responses to the same prompt, so the update is
invariant to a per-prompt shift of the reward, made proximal by PPO's clipping applied to the pair. Facts from the
paper (Sec. 4):

1. Pairwise policy gradient: ``E_{y1, y2} [(r(y1) - r(y2)) grad(log pi(y1|x) - log pi(y2|x)) / 2]``.
2. With samples from ``pi_old``, the pair's importance ratio is ``rho = pi_theta(y1) pi_old(y2) / (pi_old(y1)
   pi_theta(y2)) = exp(s1 - s2)``, ``s = log pi_theta(y|x) - log pi_old(y|x)`` the trajectory (sequence) log-ratio.
3. Joint clipping (the paper's V2): ``L = -min(rho D, clip(rho, 1 - eps, 1 + eps) D)`` with ``D = (r1 - r2) / 2``;
   at ``rho = 1`` its gradient is (1).

Here every ordered pair ``(i, j), i != j`` of a group is used (the paper draws two responses per prompt; with G > 2
the ordered pairs are our reconstruction, symmetric in the two responses) and the loss is the mean over the pairs of
the micro-batch's groups, divided by the gradient-accumulation steps; the clip range is TRL's (``1 - epsilon``,
``1 + epsilon_high``). The reward difference is taken from the advantages, ``D = (A_i - A_j) / 2``: with
``scale_rewards="none"`` that is the paper's ``(r_i - r_j) / 2`` exactly (TRL's group mean cancels); with TRL's default
``"group"`` it is divided by the group's reward std (a documented variant). The KL to the reference stays TRL's
``beta`` term (the paper folds the KL into the reward; reconstructed). The option ``mix`` (ours) keeps ``1 - mix`` of
TRL's surrogate: 1 is P3O, 0 is vanilla TRL (neutral setting).

The pairs need the whole group in the loss: the plugin declares ``needs_whole_groups``
(:mod:`trl_plugins.runtime.whole_groups`). No official code was reachable (none is linked from the paper); the
reconstructed parts are listed above.
"""

from __future__ import annotations

import torch

from trl_plugins.api import LossContext, OfficialSource, hookimpl
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES

from ._group_loss import (GroupLossOptions, GroupLossPlugin, row_advantages, sequence_log_ratios,
                          take_surrogate_place)


def pairwise_clipped_loss(log_ratios: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                          eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P3O's jointly clipped loss over every ordered pair ``(i, j), i != j`` of each group.

    Args:
        log_ratios: (S, G) sequence log-ratios ``s`` (with grad). advantages: (S, G) (no grad).
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]`` of the pair ratio ``exp(s_i - s_j)``.
    Returns:
        ``(loss, clipped)``: the mean over pairs of ``-min(rho D, clip(rho) D)``, ``D = (A_i - A_j) / 2``, and the
        (S, G, G) bool mask of pairs whose clipped branch is active (diagonal False).
    """
    G = log_ratios.size(1)
    rho = torch.exp(log_ratios.unsqueeze(2) - log_ratios.unsqueeze(1))  # (S, G, G): rho[i, j] = exp(s_i - s_j)
    diff = (advantages.unsqueeze(2) - advantages.unsqueeze(1)) / 2
    unclipped = rho * diff
    clipped_value = torch.clamp(rho, 1 - eps_low, 1 + eps_high) * diff
    off_diagonal = ~torch.eye(G, dtype=torch.bool, device=log_ratios.device)
    per_pair = -torch.minimum(unclipped, clipped_value)
    loss = per_pair[:, off_diagonal].mean()
    clipped = (clipped_value.detach() < unclipped.detach()) & off_diagonal
    return loss, clipped


class P3oPlugin(GroupLossPlugin):
    """Pairwise trajectory policy gradient on advantage differences with the pair ratio PPO-clipped (loss stage)."""

    name = "p3o"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "Pairwise Proximal Policy Optimization: Harnessing Relative Feedback for LLM Alignment (P3O), arXiv:2310.00212"
    summary = "Pairwise trajectory policy gradient on reward differences with PPO clipping of the pair's ratio."
    Options = GroupLossOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code is linked from the paper; the loss follows Sec. 4 (joint clipping, V2); every ordered "
        "pair of a group, the advantage differences as reward differences and the mix option are reconstructed.",
    )
    claim_metric = ("pair_clip_fraction", "pairs whose ratio is clipped")
    replaces = ("the base surrogate (the jointly clipped pairwise trajectory loss)",)
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = "P3O is PPO's clipped surrogate on pairs; cispo, sapo and vespo replace that clipping."
    reconstructed = (
        "every ordered pair (i, j), i != j, of a group (the paper: two responses per prompt)",
        "reward difference from the advantages, (A_i - A_j) / 2 (exact with scale_rewards='none')",
        "mix (ours): (1 - mix) TRL surrogate + mix P3O; 1 is the paper, 0 is vanilla",
    )

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        loss, clipped = pairwise_clipped_loss(sequence_log_ratios(ctx), row_advantages(ctx), ctx.epsilon_low,
                                              ctx.epsilon_high)
        take_surrogate_place(ctx, loss, self.options.mix)
        G = ctx.num_generations
        per_row = (clipped.float().sum(dim=2) / max(G - 1, 1)).reshape(-1, 1)  # each row's share of clipped pairs
        ctx.log_metric("pair_clip_fraction", ctx.global_masked_mean(per_row, torch.ones_like(per_row)))
