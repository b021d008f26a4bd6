"""Sequence-level losses over whole groups that take the place of TRL's surrogate (shared by ``reg_grpo`` and ``p3o``).

Both plugins declare ``needs_whole_groups``, so the loss micro-batch holds whole groups (``ctx.group_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import LossContext, Plugin, PluginOptions, option


@dataclass
class GroupLossOptions(PluginOptions):
    mix: float = option(
        1.0, min=0.0, max=1.0,
        help="Weight of the plugin's group loss; TRL's surrogate keeps 1 - mix (1: the paper; 0: vanilla TRL).",
        reconstructed=True,
    )


class GroupLossPlugin(Plugin):
    """Base of the plugins whose group loss takes the surrogate's place (``take_surrogate_place``): whole groups per
    micro-batch, one surrogate replacer per stack (the surrogate is weighted by ``1 - mix``: another replacer's values
    would be scaled away with it), and ``mix = 0`` switches the loss hook off (TRL's own loss and row shuffle)."""

    needs_whole_groups = True
    replaces_surrogate = True

    def hook_enabled(self, hook: str) -> bool:
        return hook != "trl_plugins_loss" or self.options.mix > 0


def sequence_log_ratios(ctx: LossContext) -> torch.Tensor:
    """(S, G) ``log pi_theta(y|x) - log pi_old(y|x)`` of each completion (the sum over its loss tokens), with grad."""
    mask = ctx.mask.to(ctx.per_token_logps.dtype)
    return ctx.group_rows(((ctx.per_token_logps - ctx.old_per_token_logps) * mask).sum(dim=1))


def row_advantages(ctx: LossContext) -> torch.Tensor:
    """(S, G) each completion's advantage (the masked mean over its tokens: the row's value when constant), no grad."""
    mask = ctx.mask.to(ctx.per_token_logps.dtype)
    advantages = ctx.advantages.expand_as(mask)
    return ctx.group_rows(((advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).detach())


def take_surrogate_place(ctx: LossContext, loss: torch.Tensor, mix: float) -> None:
    """The micro-batch loss becomes ``(1 - mix)`` times TRL's surrogate plus ``mix`` times ``loss`` (a scalar: a mean
    over the micro-batch), divided by the gradient-accumulation steps as TRL's ``grpo`` loss is. TRL's KL term is
    kept whole."""
    one = ctx.per_token_logps.new_tensor(1.0 - mix)
    ctx.scale_tokens(one)
    ctx.add_loss(mix * loss / ctx.gradient_accumulation_steps)
