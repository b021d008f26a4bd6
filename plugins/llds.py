"""LLDS — Lazy Likelihood-Displacement Stabilisation (arXiv:2512.04220, "On GRPO Collapse in Search-R1: The Lazy
Likelihood-Displacement Death Spiral").

In tool-integrated GRPO the likelihood of *good* responses stagnates and then falls (Lazy Likelihood
Displacement); low-confidence responses inflate gradients and training collapses. LLDS is a likelihood-preserving
regulariser that acts only when a trajectory's likelihood actually drops during the update, and only on the
tokens responsible. Facts from the official code (vengdeng/LLDS-On-Group-Relative-Policy-Optimization-Collapse-
in-Search-R1 @c19a094, ``verl/workers/actor/dp_actor.py::update_policy`` with ``chunk_sums_vectorized``,
``train_grpo_nqhot.sh``; restated, not copied):

1. Preserving set ``P = {m = 1, A >= 0}`` (non-negative-advantage tokens).
2. Gate. ``gate="action"`` (A-gate, ``chunk_noreduce=true``, the paper's best): every contiguous run of ``P``
   along the sequence is one *action* (with a tool mask, the model's turns between tool outputs); an action is
   gated when its summed log-likelihood change ``sum_t (sg(lp_old) - sg(lp))`` is ``> threshold`` (its likelihood
   dropped). ``gate="response"`` (R-gate): the same sum over the whole response's ``P`` tokens.
3. Responsible tokens: inside a gated action (response), the per-token penalty is ``max(0, lp_old - lp)``
   (gradient through ``lp``; zero where the token's own likelihood did not drop).
4. ``L = L_pg + lam * token-mean(penalty)``. The official code takes the micro-batch token-mean; here the term is
   an additive token term aggregated like the surrogate (``loss_type="dapo"`` / ``"bnpo"`` give a token-mean).

Defaults (``train_grpo_nqhot.sh``): lam = 0.2 (``NO_REDUCE_LAMBDA``), threshold = 0 (``REDUCE_THRES``), A-gate.
Not implemented: the optional lower weight on answer spans (``mask_answer``, off in the released script) and its
adaptive variant.

LLDS needs the policy to move between the rollout and the update: when TRL skips ``old_per_token_logps``
(``num_iterations = 1`` and one optimizer step per generation batch) ``lp_old = sg(lp)``, nothing is gated and the
run is exactly vanilla GRPO (configure warns). Use ``num_iterations > 1`` or ``steps_per_generation >
gradient_accumulation_steps`` (the paper's verl runs take several mini-batch steps per rollout batch).

Incompatible: GTPO ("pick one": both protect the likelihood of tokens in good responses; LLDS is meant for
tool/search RL; ``docs/compatibility.md``).

Official code checked against: ``vengdeng/LLDS-On-Group-Relative-Policy-Optimization-Collapse-in-Search-R1@c19a094``
(faithful with documented options; the files and the deviating options: ``trl-plugins show llds``,
docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.loss_types import policy_moves_before_loss
from trl_plugins.api.reasons import LIKELIHOOD_PICK_ONE


@dataclass
class LldsOptions(PluginOptions):
    lam: float = option(0.2, min=0.0, help="Weight of the likelihood-preserving penalty (NO_REDUCE_LAMBDA).")
    gate: Literal["action", "response"] = option(
        "action",
        help="'action': gate each contiguous run of preserved tokens (A-gate, best); 'response': per response.",
    )
    threshold: float = option(
        0.0, help="A gate opens when the summed log-likelihood drop of its action/response exceeds this value."
    )


# ------------------------------------------------------------------------------------------ pure functions
def action_ids(preserve: torch.Tensor) -> torch.Tensor:
    """(B, T) long: 1..K numbering of the contiguous runs of ``preserve`` in each row, 0 outside them."""
    p = preserve.bool()
    prev = torch.nn.functional.pad(p[:, :-1], (1, 0), value=False)
    starts = p & ~prev
    return starts.long().cumsum(dim=1) * p.long()


def likelihood_gate(drop: torch.Tensor, preserve: torch.Tensor, gate: str, threshold: float) -> torch.Tensor:
    """(B, T) bool: preserved tokens whose action (or response) lost likelihood, ``sum drop > threshold``.

    Args:
        drop: (B, T) per-token ``lp_old - lp`` (detached inside). preserve: (B, T) bool set P.
        gate: "action" (contiguous runs of P) or "response" (all of a row's P).
    """
    p = preserve.bool()
    d = torch.where(p, drop.detach().float(), torch.zeros_like(drop, dtype=torch.float32))
    if gate == "response":
        return p & (d.sum(-1, keepdim=True) > threshold)
    ids = action_ids(p)  # (B, T)
    B = ids.size(0)
    K = int(ids.max()) if ids.numel() else 0
    sums = torch.zeros(B, K + 1, dtype=d.dtype, device=d.device).scatter_add_(1, ids, d)  # column 0: outside runs
    return p & (sums.gather(1, ids) > threshold)


def llds_penalty(logps: torch.Tensor, old_logps: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """(B, T) ``max(0, lp_old - lp)`` on gated tokens, 0 elsewhere (gradient through ``logps``)."""
    penalty = torch.relu(old_logps.detach() - logps)
    return torch.where(gated, penalty, torch.zeros_like(penalty))


class LldsPlugin(Plugin):
    """Penalises likelihood drops of non-negative-advantage actions, only where they happen (loss stage)."""

    name = "llds"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "On GRPO Collapse in Search-R1: The Lazy Likelihood-Displacement Death Spiral (LLDS), arXiv:2512.04220"
    summary = "Likelihood-preserving penalty on the tokens of good actions whose likelihood dropped during the update."
    Options = LldsOptions
    official = OfficialSource(
        "vengdeng/LLDS-On-Group-Relative-Policy-Optimization-Collapse-in-Search-R1", "c19a094", verdict="faithful",
        files=("verl/workers/actor/dp_actor.py",),
    )
    claim_metric = ("regularised_token_fraction", "tokens regularised")
    conflicts_with = ("gtpo",)
    conflict_reason = LIKELIHOOD_PICK_ONE
    reconstructed = (
        "the penalty is an additive token term aggregated like the surrogate (loss_type); the official code adds "
        "the micro-batch token-mean (equal with loss_type='dapo' / 'bnpo' up to TRL's normaliser)",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if not policy_moves_before_loss(args, trainer.num_iterations) and self.options.lam > 0:
            warnings.warn(
                "llds: with num_iterations=1 and one optimizer step per generation batch the policy never moves "
                "between rollout and update (lp_old = lp), so LLDS never activates; use num_iterations > 1 or "
                "steps_per_generation > gradient_accumulation_steps.",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        lp = ctx.per_token_logps
        adv = ctx.advantages.expand_as(lp)
        preserve = ctx.mask.bool() & (adv >= 0)
        drop = ctx.old_per_token_logps - lp.detach()
        gated = likelihood_gate(drop, preserve, o.gate, o.threshold)
        penalty = llds_penalty(lp, ctx.old_per_token_logps, gated)
        ctx.add_token_loss(o.lam * penalty)
        ctx.log_metric("gated_token_fraction", ctx.global_masked_mean(gated.float()))
        ctx.log_metric("regularised_token_fraction", ctx.global_masked_mean((penalty.detach() > 0).float()))
        ctx.log_metric("penalty", ctx.global_masked_mean(penalty.detach()))
