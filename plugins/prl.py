"""PRL — Process Reward Learning (arXiv:2601.10201, "Process Reward Learning Improves LLMs' Reasoning Ability and
Broadens the Reasoning Boundary").

PRL decomposes the KL-regularised objective ``E[R] - (1/eta) KL(pi || pi_ref)`` over the steps of a response: the
process reward of a step is the outcome signal minus ``1/eta`` times the log-ratio between the policy and the
reference accumulated from that step to the end of the response. No PRM and no tree search: only the reference
log-probs. Facts from the official code (MaxwellJryao/Process-Reward-Learning @1ee49fa, the ``prm`` branch of the
trainer's advantage step and ``compute_prm_outcome_advantage``; restated, not copied):

1. Per token ``d_t = log pi_old(o_t) - log pi_ref(o_t)`` on the completion mask; the suffix sum
   ``S_t = sum_{j >= t} d_j`` (the policy's excess log-likelihood from ``t`` to the end).
2. ``advantage="outcome"`` (official ``prm.adv=orm``, the default recipe): the outcome term is the GRPO advantage of
   the row (here TRL's own, ``scale_rewards`` applies); ``r_t = A - S_t / eta``. The response is split into steps
   (``step_split``): fixed ``step_len`` tokens (default 256), or steps ending at a newline / double-newline token; the
   last valid token always ends a step. Every token takes ``r`` of the end of its step.
3. ``advantage="raw"`` (official ``prm.adv=prm``): the outcome term is the raw reward ``R`` and every token keeps its
   own ``r_t = R - S_t / eta`` (no normalisation, no steps).

Defaults: ``eta = 200``, ``step_len = 256``, ``step_split = "length"``, ``advantage = "outcome"`` (the ``prm``
branch's settings, not a published PRL run: the official run script @1ee49fa trains plain GRPO, so it fixes none of
PRL's values). The reference policy (TRL's reference model when ``beta != 0``; under PEFT the model with
its adapter switched off; for full fine-tuning with ``beta = 0`` a frozen copy of the initial policy kept by the
trainer) comes from :meth:`~trl_plugins.AdvantageContext.reference_logprobs`; the official recipe sets the KL loss
coefficient to 0, i.e. ``beta = 0``. The log-probs of the sampling policy are the advantage stage's no-grad forward
(:meth:`~trl_plugins.AdvantageContext.policy_stats`). The official code fills each token from the next *non-zero*
step value; this plugin takes the value at the step's end even when it is exactly 0 (a deliberate difference that
only matters on exact zeros). The newline split compares each token id with the first id of the tokenizer's
encoding of ``"\\n"`` (``"\\n\\n"``) without special tokens; the official code encodes with special tokens
included, so its "newline" id is the BOS id on tokenizers that prepend one (Llama-3) and its newline split never
fires there. Neutral setting: ``eta = inf`` leaves TRL's
advantages untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginConfigError, PluginOptions, hookimpl, option
from trl_plugins.api.reasons import ADVANTAGE_PICK_ONE


@dataclass
class PrlOptions(PluginOptions):
    eta: float = option(
        200.0, min=0.0, min_exclusive=True, allow_nonfinite=True,
        help="Inverse KL weight: the process term is -(suffix log-ratio) / eta (official run script: 200); inf: off.",
    )
    advantage: Literal["outcome", "raw"] = option(
        "outcome",
        help="'outcome' (official prm.adv=orm): TRL's group advantage minus the process term, per step; 'raw' "
        "(official prm.adv=prm): the raw reward minus the process term, per token.",
    )
    step_split: Literal["length", "newline", "double_newline"] = option(
        "length", help="Where steps end with advantage='outcome': every step_len tokens, or at '\\n' / '\\n\\n' tokens."
    )
    step_len: int = option(256, min=1, help="Tokens per step with step_split='length' (official run script: 256).")


def suffix_log_ratio(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``S_t = sum_{j >= t} m_j (logps_j - ref_logps_j)`` (B, T); 0 on padding after the last valid token."""
    d = (logps - ref_logps) * mask
    return d.flip(-1).cumsum(-1).flip(-1) * (mask > 0)


def step_end_mask(mask: torch.Tensor, completion_ids: torch.Tensor, split: str, step_len: int,
                  separator_id: int | None = None) -> torch.Tensor:
    """(B, T) bool: tokens that end a step (every ``step_len``-th token, or a separator token) and the last valid
    token of each row."""
    valid = mask > 0
    B, T = mask.shape
    if split == "length":
        ends = ((torch.arange(T, device=mask.device) + 1) % step_len == 0).expand(B, T) & valid
    else:
        ends = (completion_ids == separator_id) & valid
    lengths = valid.long().sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    ends = ends.clone()
    ends[rows, lengths[rows] - 1] = True
    return ends


def fill_from_step_end(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each token takes ``values`` at the first step end at or after it (B, T); 0 after the last step end."""
    B, T = values.shape
    positions = torch.arange(T, device=values.device).expand(B, T)
    marked = torch.where(ends, positions, torch.full_like(positions, T))
    next_end = marked.flip(-1).cummin(-1).values.flip(-1)
    padded = torch.cat([values, torch.zeros(B, 1, dtype=values.dtype, device=values.device)], dim=1)
    return padded.gather(1, next_end)


def prl_token_advantages(outcome: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                         eta: float, ends: torch.Tensor | None) -> torch.Tensor:
    """PRL's token advantages (B, T): ``r_t = outcome - S_t / eta``, filled from step ends when ``ends`` is given.

    Args:
        outcome: (B,) the outcome term (GRPO advantage or raw reward). logps, ref_logps, mask: (B, T).
        ends: (B, T) bool step ends (:func:`step_end_mask`), or None for per-token values.
    """
    r = (outcome.unsqueeze(1) - suffix_log_ratio(logps, ref_logps, mask) / eta) * (mask > 0)
    return r if ends is None else fill_from_step_end(r, ends) * (mask > 0)


class PrlPlugin(Plugin):
    """Process rewards from the KL-regularised objective with reference log-probs (advantage stage)."""
    claim_metric = ('process_term', 'process term of the token advantage')
    image_inputs = True
    multi_turn = True

    name = "prl"
    version = "0.1.0"
    paper = (
        "PRL: Process Reward Learning Improves LLMs' Reasoning Ability and Broadens the Reasoning Boundary, "
        "arXiv:2601.10201"
    )
    summary = "Per-step process rewards: outcome advantage minus the policy/reference log-ratio to the end, over eta."
    Options = PrlOptions
    official = OfficialSource(
        "MaxwellJryao/Process-Reward-Learning", "1ee49fa", verdict="faithful",
        files=("verl/trainer/ppo/ray_trainer.py",),
        note="Equal apart from the documented exact-zero rule; the official run script runs plain GRPO.",
    )
    replaces = ("the advantages (token-level process rewards)",)
    needs_reference_model = True
    conflicts_with = {"canon": ADVANTAGE_PICK_ONE, "riskpo": ADVANTAGE_PICK_ONE}
    reconstructed = (
        "each token takes the step-end value even when it is exactly 0 (official: the next non-zero one)",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._separator = None
        if self.options.step_split != "length" and self.options.advantage == "outcome":
            tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
            text = "\n" if self.options.step_split == "newline" else "\n\n"
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise PluginConfigError(f"prl: the tokenizer encodes {text!r} to no token; use step_split='length'.")
            self._separator = ids[0]

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if math.isinf(o.eta):
            return
        stats = ctx.policy_stats()
        ref = ctx.reference_logprobs().to(stats.per_token_logps.dtype)
        local = ctx.process_slice
        if o.advantage == "outcome":
            base = ctx.advantages if ctx.advantages.dim() == 1 else ctx.advantages[:, 0]
            outcome = base[local]
            ends = step_end_mask(stats.mask, stats.completion_ids, o.step_split, o.step_len, self._separator)
        else:
            outcome = torch.nan_to_num(ctx.rewards[local], nan=0.0)
            ends = None
        token_adv = prl_token_advantages(outcome.to(ref.dtype), stats.per_token_logps, ref, stats.mask, o.eta, ends)
        ctx.advantages = ctx.gather_padded(token_adv.to(ctx.advantages.dtype), dim=1)
        kl = suffix_log_ratio(stats.per_token_logps, ref, stats.mask)[:, :1].squeeze(1)
        ctx.log_metric("sequence_log_ratio", float(kl.mean()))
        ctx.log_metric("process_term", float(((kl / o.eta).abs()).mean()))
