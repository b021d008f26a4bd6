"""GTPO — conflict-token protection and entropy filtering (arXiv:2508.03772, "GTPO: Trajectory-Based Policy
Optimization in Large Language Models", Simoni et al.).

(Another paper, arXiv:2508.04349, uses the same acronym for entropy-shaped token rewards; this plugin is not it.)

GRPO pushes the same token in opposite directions when it appears at the same position in a positively and a
negatively rewarded completion of one group (shared structure: a format prefix, a closing tag). GTPO protects
such *conflict tokens*: it skips their negative update and amplifies their positive one. It also drops
completions whose policy entropy is too high and nudges the others' advantages down by their entropy, so
neither a KL term nor a reference model is needed. Facts from the official code (winstonsmith1897/GTPO
@5d33811, ``build_conflict_mask``, ``gtpo_compute_loss``, ``UnslothEfficientGTPO.forward``; restated, not copied):

1. Conflict tokens, per group, among *active* completions (``A != 0``; positive ``A > 0``, negative ``A < 0``,
   signs of the advantages before entropy shaping): the token at position ``t`` of a completion is a raw conflict
   when the same ``(t, token id)`` pair occurs in at least one positive and one negative completion. Only the
   **initial contiguous run** from ``t = 0`` counts (a cumulative product). A second pass aligns the completions
   at their **end** (position counted from the last token) and counts the terminal run the same way.
2. Token weights: a conflict token of a positive completion gets ``positive_weight`` (2), of a negative one
   ``negative_weight`` (0, its negative update is skipped); every other token 1. The forward and backward
   weights multiply (a token in both runs of a positive completion gets 4). Inactive completions keep 1.
3. Each completion's loss is divided by ``max(n_conflict, 1)`` (``divide_by_conflicts``). The official code counts
   ``n_conflict`` by OR-ing the forward run's mask with the terminal run's mask while the latter is still in
   end-aligned coordinates, so a completion with both runs counts the **longer** run, not both
   (``conflict_count="longer_run"``, default). ``conflict_count="union"`` counts the tokens in either run at their
   true positions (the plugin's earlier count; up to twice the official one).
4. Entropy filter: ``Hbar_i`` = the completion's mean full-vocabulary entropy under the current policy (no
   grad). ``Hbar_i > entropy_threshold`` (0.7, about ln 2) sets ``A_i = 0`` (the completion is dropped);
   otherwise ``A_i <- A_i - entropy_scale * Hbar_i`` (0.1), for every completion including ``A_i = 0`` ones.
5. Objective: per-completion token-mean of ``-delta_t A_i r_t`` with ``r = 1`` carrying gradient (on-policy
   REINFORCE), no KL. In TRL this is the weight ``delta / max(n_conflict, 1)`` on TRL's surrogate, whose value
   and gradient equal that at ``r = 1``; ``loss_type="grpo"`` gives the per-completion token-mean. The official
   code **sums** the completions' losses (its backward returns the summed gradient and ignores the gradient
   accumulation scaling), where TRL averages them over the micro-batch and divides by the accumulation steps:
   ``completion_reduction="sum"`` (default) multiplies the weights by ``B * gradient_accumulation_steps`` so that
   with ``loss_type="grpo"`` the step's gradient is the official sum; ``"mean"`` keeps TRL's scale (the two differ
   by a constant factor, which Adam mostly absorbs but gradient clipping does not).

Everything group-level (conflicts, counts) and the entropy filter are computed at the **advantage stage** over
the global batch (TRL shuffles and splits the batch before the loss), from one no-grad forward of the current
policy over the generation batch (``ctx.policy_stats()``, shared with other plugins that need it); the per-token
weights ride to the loss as per-row extras. The entropy is TRL's (temperature-scaled) entropy; the official code
uses raw logits (identical at temperature 1). Tokens are compared only at valid (loss-mask) positions.

Defaults (official ``config.yaml`` and constants): entropy_threshold = 0.7, entropy_scale = 0.1,
positive_weight = 2, negative_weight = 0, beta = 0. The neutral setting ``positive_weight = negative_weight = 1``,
``divide_by_conflicts = false``, ``entropy_threshold = None``, ``entropy_scale = 0``,
``completion_reduction = "mean"`` is exactly TRL's loss.

Incompatible: LLDS ("pick one": both protect the likelihood of tokens in good responses; ``docs/compatibility.md``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, LossContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.reasons import LIKELIHOOD_PICK_ONE

WEIGHT_KEY = "gtpo_token_weights"


@dataclass
class GtpoOptions(PluginOptions):
    positive_weight: float = option(2.0, min=0.0, help="Weight of a conflict token in a positive completion.")
    negative_weight: float = option(
        0.0, min=0.0, help="Weight of a conflict token in a negative completion (0 = skip its negative update)."
    )
    terminal_run: bool = option(True, help="Also protect the conflict run aligned at the completions' end.")
    divide_by_conflicts: bool = option(
        True, help="Divide each completion's loss by max(n_conflict, 1), as the official code (count: conflict_count)."
    )
    conflict_count: Literal["longer_run", "union"] = option(
        "longer_run",
        help="n_conflict: longer_run (official: its mask OR mixes forward and end-aligned positions, which counts "
        "the longer of the two runs) or union (tokens in either run at their true positions).",
    )
    completion_reduction: Literal["sum", "mean"] = option(
        "sum",
        help="sum (official): completions' losses add up (weights x B x gradient_accumulation_steps, exact with "
        "loss_type='grpo'); mean: TRL's average over completions.",
    )
    entropy_threshold: float | None = option(
        0.7, min=0.0, help="Completions with mean entropy above this get A = 0; None disables the filter."
    )
    entropy_scale: float = option(0.1, min=0.0, help="A <- A - entropy_scale * mean entropy for kept completions.")


# ------------------------------------------------------------------------------------------ pure functions
def _raw_conflicts(ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """(G, T) bool: valid ``(t, id)`` pairs of active rows that occur in a positive and in a negative row."""
    same = (ids.unsqueeze(1) == ids.unsqueeze(0)) & valid.unsqueeze(1) & valid.unsqueeze(0)  # (G, G, T)
    in_pos = (same & pos.view(1, -1, 1)).any(1)
    in_neg = (same & neg.view(1, -1, 1)).any(1)
    return in_pos & in_neg & valid & (pos | neg).unsqueeze(1)


def _initial_run(raw: torch.Tensor) -> torch.Tensor:
    """(G, T) bool: the contiguous run of True from t = 0 (cumulative product)."""
    return torch.cumprod(raw.long(), dim=1).bool()


def _right_align(x: torch.Tensor, lengths: torch.Tensor, fill) -> torch.Tensor:
    """Reverse each row's first ``lengths[i]`` entries to the front: ``out[i, s] = x[i, lengths[i] - 1 - s]``."""
    T = x.size(1)
    s = torch.arange(T, device=x.device).unsqueeze(0)
    src = lengths.unsqueeze(1) - 1 - s
    ok = src >= 0
    out = x.gather(1, src.clamp(min=0))
    return torch.where(ok, out, torch.full_like(out, fill))


def conflict_runs(
    ids: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, group_size: int, terminal_run: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conflict tokens of every group: the initial run (from t = 0) and the terminal run (aligned at the end).

    Args:
        ids: (N, T) completion token ids. mask: (N, T) valid tokens (right-padded). advantages: (N,) per-completion
            advantages (their signs define positive / negative; 0 = inactive). group_size: G (groups contiguous).
        terminal_run: compute the end-aligned run too (else all False).
    Returns:
        ``(forward, terminal)``: two (N, T) bool masks in the original positions.
    """
    N, T = ids.shape
    valid = mask.bool()
    fwd = torch.zeros(N, T, dtype=torch.bool, device=ids.device)
    rev = torch.zeros_like(fwd)
    lengths = valid.long().sum(-1)
    pos_all, neg_all = advantages > 0, advantages < 0
    for start in range(0, N, group_size):
        g = slice(start, start + group_size)
        pos, neg = pos_all[g], neg_all[g]
        if not (pos.any() and neg.any()):
            continue
        fwd[g] = _initial_run(_raw_conflicts(ids[g], valid[g], pos, neg))
        if terminal_run:
            ids_r = _right_align(ids[g], lengths[g], -1)
            valid_r = _right_align(valid[g], lengths[g], False)
            run_r = _initial_run(_raw_conflicts(ids_r, valid_r, pos, neg))
            # back to original positions: position t of row i is reversed index lengths[i] - 1 - t
            rev[g] = _right_align(run_r, lengths[g], False)
    return fwd & valid, rev & valid


def conflict_weights(
    forward: torch.Tensor, terminal: torch.Tensor, advantages: torch.Tensor, positive_weight: float,
    negative_weight: float,
) -> torch.Tensor:
    """(N, T) ``delta``: per pass, conflict tokens get ``positive_weight`` / ``negative_weight`` by the row's sign,
    others 1; the two passes multiply. ``advantages``: (N,)."""
    w_conf = torch.where(advantages > 0, positive_weight, negative_weight).to(torch.float32).unsqueeze(1)
    one = torch.ones((), dtype=torch.float32, device=forward.device)
    return torch.where(forward, w_conf, one) * torch.where(terminal, w_conf, one)


def conflict_counts(forward: torch.Tensor, terminal: torch.Tensor, mode: str) -> torch.Tensor:
    """(N,) number of conflict tokens per completion. forward, terminal: (N, T) bool runs in original positions.

    ``"union"``: tokens in either run. ``"longer_run"``: ``max(len(forward run), len(terminal run))``, what the
    official code's OR of the forward mask with the (still end-aligned) terminal mask counts, both runs starting
    at index 0 of their own alignment.
    """
    if mode == "union":
        return (forward | terminal).sum(-1)
    return torch.maximum(forward.sum(-1), terminal.sum(-1))


def entropy_filter(
    advantages: torch.Tensor, mean_entropy: torch.Tensor, threshold: float | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_i = 0`` where ``Hbar_i > threshold``, else ``A_i - scale * Hbar_i``.

    Args:
        advantages: (N,) or (N, T). mean_entropy: (N,). threshold: None disables the drop.
    Returns:
        (new advantages with the input's shape, (N,) bool of dropped completions).
    """
    h = mean_entropy.to(advantages.dtype)
    dropped = torch.zeros_like(h, dtype=torch.bool) if threshold is None else h > threshold
    if advantages.dim() == 2:
        h, keep = h.unsqueeze(1), dropped.unsqueeze(1)
    else:
        keep = dropped
    shaped = advantages - scale * h if scale != 0 else advantages
    return torch.where(keep, torch.zeros_like(shaped), shaped), dropped


def _row_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) per-completion advantage: as is when 1-D, the masked mean of token advantages when 2-D."""
    if advantages.dim() == 1:
        return advantages
    width = mask.size(1)
    adv = advantages[:, :width] if advantages.size(1) >= width else torch.nn.functional.pad(
        advantages, (0, width - advantages.size(1))
    )
    m = mask.to(adv.dtype)
    return (adv * m).sum(-1) / m.sum(-1).clamp(min=1.0)


class GtpoPlugin(Plugin):
    """Conflict-token protection and entropy-filtered advantages (advantage + loss stage)."""

    name = "gtpo"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "GTPO: Trajectory-Based Policy Optimization in Large Language Models, arXiv:2508.03772"
    summary = "Protects tokens shared by good and bad completions of a group; drops high-entropy completions."
    Options = GtpoOptions
    official = OfficialSource(
        "winstonsmith1897/GTPO", "5d33811", verdict="faithful",
        files=("gtpo/gtpo_training.py",),
        variants=("conflict_count",),
    )
    claim_metric = ("conflict_token_fraction", "conflict tokens")
    conflicts_with = ("llds",)
    conflict_reason = LIKELIHOOD_PICK_ONE
    reconstructed = (
        "with (N, T) token advantages from an earlier plugin, a completion's sign is that of its masked-mean "
        "advantage (the paper has one advantage per completion)",
        "tokens are compared only at loss-mask positions (the official code compares every non-pad id)",
    )

    gradient_accumulation_steps = 1  # set at configure (completion_reduction='sum')

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.gradient_accumulation_steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        loss_type = getattr(args, "loss_type", "grpo")
        if loss_type != "grpo":
            warnings.warn(
                f"gtpo: the official loss is a per-completion token mean (loss_type='grpo'); with "
                f"loss_type={loss_type!r} TRL's {loss_type} aggregation weighs the completions instead.",
                stacklevel=2,
            )
        if args.beta != 0:
            warnings.warn(
                f"gtpo: the method needs no KL term (the paper uses beta=0); beta={args.beta} keeps TRL's "
                "reference KL.",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        stats = ctx.policy_stats()
        local_width = stats.completion_ids.size(1)
        ids = ctx.gather_padded(stats.completion_ids, dim=1, pad_value=-1)  # (N, T_max)
        mask = ctx.completion_mask().bool()  # (N, T_max)
        row_adv = _row_advantage(ctx.advantages, mask)
        forward, terminal = conflict_runs(ids, mask, row_adv, ctx.num_generations, o.terminal_run)
        if not o.terminal_run:
            terminal = torch.zeros_like(forward)
        delta = conflict_weights(forward, terminal, row_adv, o.positive_weight, o.negative_weight)
        active = (row_adv != 0).unsqueeze(1)
        conflict = (forward | terminal) & active
        if o.divide_by_conflicts:
            counts = conflict_counts(forward & active, terminal & active, o.conflict_count)
            delta = delta / counts.clamp(min=1).unsqueeze(1).to(delta.dtype)
        ctx.set_local_extra(WEIGHT_KEY, delta[ctx.process_slice, :local_width].clone())
        ctx.advantages, dropped = entropy_filter(
            ctx.advantages, stats.mean_entropy, o.entropy_threshold, o.entropy_scale
        )
        n_valid = max(1, int(mask.sum()))
        ctx.log_metric("conflict_token_fraction", float(conflict.sum()) / n_valid)
        negative_conflicts = conflict & (row_adv < 0).unsqueeze(1)
        ctx.log_metric("negative_conflict_token_fraction", float(negative_conflicts.sum()) / n_valid)
        ctx.log_metric("dropped_completion_fraction", float(dropped.float().mean()))
        ctx.log_metric("mean_entropy", float(stats.mean_entropy.mean()))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        weights = ctx.extras[WEIGHT_KEY][:, : ctx.per_token_logps.size(1)].to(ctx.per_token_logps.dtype)
        if self.options.completion_reduction == "sum":  # TRL averages over the B rows and the accumulation steps
            weights = weights * (ctx.per_token_logps.size(0) * self.gradient_accumulation_steps)
        ctx.scale_tokens(weights)
