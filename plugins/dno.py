"""DNO -- Direct Nash Optimization, from "Direct Nash Optimization: Teaching Language Models to Self-Improve with
General Preferences" (arXiv:2404.03715), in its practical form DNO-Prct (the paper's Algorithm 2).

DNO aims at the Nash solution of a **general preference** ``P(y > y' | x)`` (possibly intransitive: no scalar reward
need exist). Each iteration ``t`` is batched on-policy: sample K responses per prompt from ``pi_t``, rank them by their
**win rate** under a preference oracle, keep a **large-margin pair** ``(y+, y-)`` per prompt, and fit the contrastive
(DPO-like) objective towards ``pi_{t+1}``::

    w_i   = mean_{j != i} P(y_i > y_j | x)                          (win rate of row i against its group)
    y+    = argmax_i w_i,  y- = argmin_i w_i,  kept iff w+ - w- > margin
    L     = -log sigmoid( beta * [ (log pi(y+) - log pi_t(y+)) - (log pi(y-) - log pi_t(y-)) ] )

Here one generation batch is one DNO iteration: its G completions of a prompt are the K samples, ``pi_t`` is the
policy that sampled them (TRL's ``old_per_token_logps``; ``reference="previous"``, the paper) or the initial
reference policy (``reference="initial"``: DPO's fixed reference, a variant), and ``log pi(y)`` is the sum of the
completion's token log-probs over its loss mask. The loss is the mean over the kept pairs of the micro-batch, divided
by the gradient-accumulation steps, and takes the place of TRL's surrogate (``mix`` weighs it: 1 is DNO, 0 vanilla
TRL); TRL's KL term (``beta`` of the run) is kept as it is.

The oracle ``P``:

* ``genrm != 'none'``: the project's generative reward model (:mod:`trl_plugins.components.genrm`), asked each
  unordered pair ``(i, j), i < j`` of a group with the pairwise A/B template; its ``pref(i over j)`` in ``[-1, 1]`` is
  read as ``P(y_i > y_j) = (1 + pref) / 2`` (``position_swap=True`` asks both orders and averages them: a judge that
  only ever names A then gives 1/2). A pair without a parsable verdict is left out of both rows' win rates (counted:
  metric ``unparsable_fraction``); a row with no judged pair cannot be chosen.
* ``genrm='none'`` (default: no oracle configured): the task's scalar reward (TRL's weighted sum of the reward
  columns) induces the preference ``P(y_i > y_j) = 1[r_i > r_j] + 1[r_i = r_j] / 2``; rows with a NaN reward cannot be
  chosen. The win rate is then the rank of the reward in its group, and the pair is the best and the worst completion.

No official code was found (searched the stored code and issue indexes; the paper text at hand links none). The
loss and the pair rule follow Algorithm 2 and Sec. 5 of the paper; reconstructed here: ``beta = 0.1`` (DPO's customary
value) and ``margin = 0`` (the paper's margin threshold could not be checked, no text of it being at hand), the
generative judge's prompt (the shared Think-RM-style A/B template, our words), the win rate over the G on-policy
samples only (the paper also ranks a gold response from the teacher, which a GRPO batch does not have), ties of
``argmax`` / ``argmin`` broken by the lower index, and the ``mix`` and ``reference`` options.

Neutral setting: ``mix = 0`` switches every hook off, so the run is vanilla TRL (``assert_reduces_to_vanilla``).
There is no setting at which DNO's loss equals TRL's GRPO surrogate (a logistic loss on one pair against a clipped
policy gradient on every row); the closest equivalence is tested instead: on policy (``pi = pi_t``) the gradient is
``-beta / 2`` times the gradient of ``log pi(y+) - log pi(y-)``, a policy gradient with advantages ``+-beta/2`` on the
pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from trl_plugins.api import (AdvantageContext, LossContext, OfficialSource, PluginError, RewardContext, hookimpl,
                             option)
from trl_plugins.api.engines import trainer_device
from trl_plugins.components.genrm import GenRMOptions, genrm_from_options

from ._group_loss import GroupLossOptions, GroupLossPlugin, take_surrogate_place
from .think_rm import BINARY_TEMPLATE, judge_group_pairs

#: extras riding with the rows to the loss: +1 chosen, -1 rejected, 0 otherwise; the reference log-probs.
PAIR_EXTRA = "dno_pair"
REF_EXTRA = "dno_ref_logps"


@dataclass
class DnoOptions(GroupLossOptions, GenRMOptions):
    plugin_name: ClassVar[str] = "dno"

    genrm: Literal["none", "endpoint", "hf", "scripted"] = option(
        "none", help="Preference oracle: 'none' = the task's scalar reward (r_i > r_j); else a generative RM judging "
        "each pair A/B: an OpenAI-compatible server (genrm_base_url), a local model (genrm_model) or a task's "
        "scripted judge (genrm_oracle). The paper's oracle is GPT-4-Turbo (an endpoint).",
    )
    beta: float = option(0.1, min=0.0, min_exclusive=True, reconstructed=True,
                         help="eta of Algorithm 2: the scale of the log-ratio difference in the logistic loss.")
    margin: float = option(0.0, min=0.0, max=1.0, reconstructed=True,
                           help="Large-margin filter: a group's pair is kept only when the win rates differ by more "
                           "than this (0 drops only groups whose best and worst tie).")
    reference: Literal["previous", "initial"] = option(
        "previous", help="pi_t in the loss: the policy that sampled the batch (DNO-Prct's previous iterate) or the "
        "initial reference policy (DPO's fixed reference; a variant).",
    )
    position_swap: bool = option(True, reconstructed=True, help="Judge each pair in both A/B orders and average "
                                 "(position-bias control; genrm only).")
    k: int = option(1, min=1, help="Sampled judge verdicts per pair and order, averaged (genrm only).")
    genrm_max_unparsable: float = option(
        0.5, min=0.0, max=1.0, reconstructed=True,
        help="Largest share of unparsable sampled verdicts in one reward batch; above it the step fails with an error "
        "naming the judge, the row and the text. A pair without a verdict is left out of both rows' win rates "
        "(counted: metric unparsable_fraction); a row with no judged pair cannot be chosen.",
    )

    def validate(self) -> None:
        if self.genrm == "none":  # no oracle: the judge options are unused
            return
        self.require_base_url("genrm", self.plugin_name, otherwise="genrm='none' (the task's reward as the oracle), "
                              "'hf' with genrm_model, or 'scripted'")
        super().validate()


def win_rates(pref: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's win rate against the other rows of its group.

    Args:
        pref: (N, N) ``P(y_i > y_j)`` in [0, 1] (NaN: not judged), groups of ``group_size`` contiguous rows;
            entries across groups and on the diagonal are ignored.
    Returns:
        (N,) the mean of ``P(y_i > y_j)`` over the judged ``j != i`` of i's group; NaN when none is judged.
    """
    G = group_size
    n = pref.size(0)
    same = torch.arange(n).unsqueeze(1) // G == torch.arange(n).unsqueeze(0) // G
    judged = same & ~torch.eye(n, dtype=torch.bool) & ~torch.isnan(pref)
    counts = judged.sum(dim=1)
    sums = torch.where(judged, pref, torch.zeros_like(pref)).sum(dim=1)
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))


def reward_preferences(rewards: torch.Tensor) -> torch.Tensor:
    """(N, N) ``P(y_i > y_j) = 1[r_i > r_j] + 1[r_i = r_j] / 2`` from (N,) scalar rewards (NaN where either is NaN)."""
    r = rewards.float()
    pref = (r.unsqueeze(1) > r.unsqueeze(0)).float() + (r.unsqueeze(1) == r.unsqueeze(0)).float() / 2
    missing = torch.isnan(r).unsqueeze(1) | torch.isnan(r).unsqueeze(0)
    return pref.masked_fill(missing, math.nan)


def select_pairs(rates: torch.Tensor, group_size: int, margin: float) -> torch.Tensor:
    """DNO-Prct's pair per group: the best row against the worst by win rate, kept when they differ by > ``margin``.

    Args:
        rates: (N,) win rates (NaN: the row cannot be chosen).
    Returns:
        (N,) float: +1 on each kept group's chosen row, -1 on its rejected row, 0 elsewhere (ties: lower index).
    """
    per_group = rates.view(-1, group_size)
    valid = ~torch.isnan(per_group)
    best = torch.where(valid, per_group, torch.full_like(per_group, -math.inf)).max(dim=1)
    worst = torch.where(valid, per_group, torch.full_like(per_group, math.inf)).min(dim=1)
    keep = (valid.sum(dim=1) >= 2) & (best.values - worst.values > margin)
    codes = torch.zeros_like(per_group)
    rows = torch.arange(per_group.size(0))[keep]
    codes[rows, best.indices[keep]] = 1.0
    codes[rows, worst.indices[keep]] = -1.0
    return codes.reshape(-1)


def dno_loss(log_ratios: torch.Tensor, pair_codes: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The contrastive DNO-Prct loss over the kept pairs of whole groups.

    Args:
        log_ratios: (S, G) ``log pi(y|x) - log pi_t(y|x)`` per completion (sums over its loss tokens; with grad).
        pair_codes: (S, G) +1 chosen, -1 rejected, 0 other (from :func:`select_pairs`); a group without +1 has no pair.
        beta: the scale of the log-ratio difference.
    Returns:
        ``(loss, z)``: the mean over kept pairs of ``-log sigmoid(z)``, ``z = beta (s+ - s-)`` (0 times the inputs when
        no group holds a pair, so the graph stays connected), and the (P,) margins ``z`` of the P kept pairs.
    """
    chosen = (pair_codes > 0).to(log_ratios.dtype)
    rejected = (pair_codes < 0).to(log_ratios.dtype)
    kept = chosen.sum(dim=1) > 0
    z = beta * ((log_ratios * chosen).sum(dim=1) - (log_ratios * rejected).sum(dim=1))[kept]
    if z.numel() == 0:
        return (log_ratios * 0).sum(), z
    return F.softplus(-z).mean(), z


class DnoPlugin(GroupLossPlugin):
    """Best-vs-worst pairs by a preference oracle's win rate in each group, trained with DNO-Prct's contrastive loss."""

    name = "dno"
    version = "0.1.0"
    paper = ("Direct Nash Optimization: Teaching Language Models to Self-Improve with General Preferences (DNO), "
             "arXiv:2404.03715")
    summary = "Best-vs-worst win-rate pair per group from a preference oracle; DPO-like loss against the sampler."
    Options = DnoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found (none linked from the paper); the pair rule (best vs worst win rate, large "
        "margin) and the contrastive loss against the previous iterate follow Algorithm 2 (DNO-Prct); beta, margin, "
        "the judge prompt and the win rate over the on-policy samples only (no gold response) are reconstructed.",
    )
    claim_metric = ("pair_accuracy", "kept pairs whose implicit reward ranks the chosen above the rejected")
    multi_turn = True
    image_inputs = True
    replaces = ("the base surrogate (DNO-Prct's logistic loss on each group's best-vs-worst pair)",)
    reconstructed = (
        "beta = 0.1 and margin = 0 (win-rate units; strict: ties are dropped)",
        "win rates over the G on-policy samples only (the paper also ranks a gold teacher response)",
        "no oracle configured: the scalar reward's preference 1[r_i > r_j] + 1[r_i = r_j] / 2",
        "judge prompt: the shared A/B template of think_rm (our words); P = (1 + pref) / 2",
        "ties of argmax / argmin broken by the lower index; a group's loss is the mean over the kept pairs",
        "mix (ours): (1 - mix) TRL surrogate + mix DNO; reference='initial' (DPO's fixed reference) is a variant",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.grm = None
        self._device = None
        self._rates: torch.Tensor | None = None
        self.needs_reference_model = self.options.reference == "initial" and self.options.mix > 0

    def _judged(self) -> bool:
        return self.options.genrm != "none"

    def multi_turn_refusal(self) -> str | None:
        """Multi-turn rollouts: the scalar-reward oracle works; a generative judge reads answer texts only."""
        if self._judged():
            return (f"with genrm={self.options.genrm!r}, its generative judge compares two answer texts to one "
                    "question; tool calls and tool results are not part of the compared responses (genrm='none' "
                    "works on multi-turn rollouts).")
        return None

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: the scalar-reward oracle works; a generative judge reads the prompt as text."""
        if self._judged():
            return (f"with genrm={self.options.genrm!r}, its generative judge reads the prompt as text, which would "
                    "not see the prompt's image (genrm='none' works with image prompts).")
        return None

    def hook_enabled(self, hook: str) -> bool:
        if self.options.mix <= 0:
            return False
        if hook == "trl_plugins_transform_rewards":
            return self._judged()
        return True

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._device = trainer_device(trainer)
        if self._judged() and self.grm is None:
            self.grm = self._build()

    def _build(self):
        return genrm_from_options(self.options, BINARY_TEMPLATE, k=self.options.k, aggregate="mean",
                                  device=self._device)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        if self.grm is None:
            self.grm = self._build()
        per_row = judge_group_pairs(self.grm, ctx, self.name, self.options.position_swap)
        n = len(per_row)
        pref = torch.full((n, n), math.nan)
        judged = unparsable = 0
        for i, row in enumerate(per_row):
            for j, value in row:
                judged += 1
                if math.isnan(value):
                    unparsable += 1
                    continue
                pref[i, j], pref[j, i] = (1 + value) / 2, (1 - value) / 2
        if judged:
            ctx.log_metric("unparsable_fraction", unparsable / judged)
        self._rates = win_rates(pref, ctx.num_generations)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        G = ctx.num_generations
        if self._judged():
            if self._rates is None or self._rates.numel() != ctx.rewards.numel():
                raise PluginError(
                    f"dno: no oracle win rates for the {ctx.rewards.numel() // G} groups of this batch (the reward "
                    "stage did not judge it).")
            rates = self._rates
        else:
            rates = win_rates(reward_preferences(ctx.rewards.detach().cpu()), G)
        codes = select_pairs(rates.float(), G, self.options.margin)
        ctx.extras[PAIR_EXTRA] = codes.to(ctx.rewards.device)
        kept = (codes > 0).view(-1, G).any(dim=1)
        ctx.log_metric("pair_fraction", kept.float().mean().item())
        if kept.any():
            spread = rates.view(-1, G)[kept]
            ctx.log_metric("win_rate_margin", (spread.nan_to_num(0.5).max(dim=1).values
                                               - spread.nan_to_num(0.5).min(dim=1).values).mean().item())
        if self.options.reference == "initial":
            ctx.set_local_extra(REF_EXTRA, ctx.reference_logprobs())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        if self.options.reference == "initial":
            reference = ctx.extras[REF_EXTRA].to(ctx.per_token_logps.dtype)
        else:
            reference = ctx.old_per_token_logps
        mask = ctx.mask.to(ctx.per_token_logps.dtype)
        log_ratios = ctx.group_rows(((ctx.per_token_logps - reference.detach()) * mask).sum(dim=1))
        codes = ctx.group_rows(ctx.extras[PAIR_EXTRA].reshape(-1).to(log_ratios.device))
        loss, z = dno_loss(log_ratios, codes, self.options.beta)
        take_surrogate_place(ctx, loss, self.options.mix)
        # each row of a kept pair carries its pair's accuracy (z > 0); other rows weigh 0 in the global mean
        G = codes.size(1)
        accurate = torch.zeros_like(codes)
        kept = (codes > 0).any(dim=1)
        accurate[kept] = (z.detach() > 0).to(codes.dtype).unsqueeze(1).expand(-1, G)
        weight = kept.to(codes.dtype).unsqueeze(1).expand(-1, G).reshape(-1, 1)
        ctx.log_metric("pair_accuracy", ctx.global_masked_mean(accurate.reshape(-1, 1), weight))
