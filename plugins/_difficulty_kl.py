"""Per-row scaling of TRL's reference KL term, shared by the plugins whose KL coefficient depends on a problem's
difficulty (``ares``: a per-bucket controller; ``clpo``: a fixed factor on hard problems).

TRL's loss carries ``beta KL_t`` on every completion token, ``KL_t = exp(ref - lp) - (ref - lp) - 1`` (the k3
estimator, times the importance ratio under ``use_bias_correction_kl``). A row whose coefficient should be
``beta m`` gets the extra token term ``beta (m - 1) KL_t``, so that the total is ``beta m KL_t``; ``m = 1`` adds
nothing. Without a reference KL (``beta = 0``) there is nothing to scale.
"""

from __future__ import annotations

import torch

from trl_plugins.api import LossContext


def reference_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """TRL's per-token reference KL ``exp(ref - lp) - (ref - lp) - 1`` (B, T), gradient through ``logps``."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def token_kl(ctx: LossContext, bias_correction: bool) -> torch.Tensor | None:
    """The micro-batch's (B, T) reference KL as TRL's loss weighs it (times ``coef_1`` under
    ``use_bias_correction_kl``); None when the run has no reference KL (``beta = 0``)."""
    if ctx.ref_per_token_logps is None or ctx.beta == 0:
        return None
    kl = reference_kl(ctx.per_token_logps, ctx.ref_per_token_logps)
    return kl * ctx.coef_1 if bias_correction else kl


def scale_row_kl(ctx: LossContext, kl: torch.Tensor, multipliers: torch.Tensor) -> None:
    """Make row ``b``'s KL coefficient ``beta * multipliers[b]``: adds ``beta (m_b - 1) KL_t`` to its tokens.

    Args: kl (B, T) from :func:`token_kl`; multipliers (B,).
    """
    m = multipliers.to(device=kl.device, dtype=kl.dtype).view(-1, 1)
    ctx.add_token_loss(ctx.beta * (m - 1.0) * kl)
