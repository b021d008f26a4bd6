"""EPO — Entropy-regularized Policy Optimization for LLM agents (arXiv:2509.22576).

Entropy control for multi-turn agents trained on sparse outcome rewards, in three parts. Facts from the paper's
abstract and the official code (github.com/WujiangXu/EPO, ``verl/workers/actor/dp_actor.py``,
``verl/trainer/ppo/ray_trainer.py``, ``agent_system/multi_turn_rollout/rollout_loop.py``). Defaults are the two EPO
runs of the official README (``WujiangXu/EPO@5b6fa98e034639b95afbfb24f98d1cb1e5197542``: ``README.md:97`` ScienceWorld,
``:100`` ALFWorld: token scope, band 0 / 2.0, phase weights on, penalty 0.05 / 0.1) on top of
``examples/general_running_server.sh:34-36`` (entropy coefficient 0.001, smoothing coefficient 1.0, penalty 0.1);
the script's own band default is 0.5 / 1.5 (``:31-32``) and the config's 0.8 / 1.2
(``verl/trainer/config/ppo_trainer.yaml:91-92``). The constant penalty is ``dp_actor.py:344`` / ``:367``, the
turn-25 gate ``dp_actor.py:772-778``, the phase horizon of 150 epochs ``dp_actor.py:793``.

1. **Entropy regularisation over the multi-turn episode**: an entropy bonus on every model token of every turn,
   aggregated like the policy loss: ``loss += -lambda * (H_t - c * w_k * P_t)`` per token (official
   ``entropy_coeff`` lambda = 0.001 in its run script, ``entropy_smooth_coeff`` c = 1.0).
2. **Entropy smoothing**: a historical average entropy ``Hbar_u`` per turn index u (official: the mean token entropy
   of the rollouts' u-th turn, measured on the rollout policy each training step, averaged over **all** past steps,
   the current one included). A token whose entropy leaves the band ``[k_l * Hbar_u, k_r * Hbar_u]`` is penalised
   by ``P_t`` (official out-of-band penalty alpha = 0.1; band 0 / 2.0 in the README's runs, 0.5 / 1.5 in the run
   script's defaults, 0.8 / 1.2 in the config's; token-level by default, or per sequence).
3. **Phase-based weighting** ``w_k`` of the smoothing penalty over training (official ``enable_smooth_weights``):
   from 1.0 down to 0.8 in the first half of the horizon (``1 - 0.2 (1 - exp(-2 p))``), then down to 0
   (``0.8 exp(-3 p)``), p the progress within each half.

Deliberate differences (options, flagged):

* ``penalty_form="hinge"`` [reconstructed] (default): ``P_t = alpha * dist(H_t, band)``, the distance outside the
  band, so the penalty's gradient pulls the entropy back into the band, as the paper describes. The official code's
  penalty is the constant alpha on every out-of-band token (``penalty_form="indicator"``), which carries no gradient:
  it shifts the loss value only.
* The official code applies smoothing only to turns with index >= 25 (half of its ``max_step`` default 50, read
  from a misspelt config key), a gate evaluated per micro-batch (``dp_actor.py:778``); ``smooth_from_turn``
  (default 0) sets the first smoothed turn, judged per turn over the whole batch.
* A turn index absent from a step's rollouts does not enter that index's average (the official code left-pads the
  per-turn list with zeros, which shifts indices); ``history_window`` > 0 keeps the last k steps only (official:
  all).

The per-turn averages are measured once per generation batch at the advantage stage (the policy that generated,
one no-grad forward shared with other plugins through ``ctx.policy_stats``), as global means over every process,
and saved in checkpoints. ``entropy_coef=0`` switches EPO off (vanilla TRL). TRL's own entropy bonus
(``entropy_coef`` of the config) is refused alongside, as are the other entropy remedies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import ENTROPY_PICK_ONE


@dataclass
class EpoOptions(PluginOptions):
    entropy_coef: float = option(
        0.001, min=0.0, help="lambda, weight of the entropy term (official run script: 0.001); 0 switches EPO off."
    )
    smooth_coef: float = option(
        1.0, min=0.0, help="c, weight of the smoothing penalty inside the entropy term (official entropy_smooth_coeff)."
    )
    penalty: float = option(
        0.1, min=0.0, help="alpha, the out-of-band penalty (official entropy_smooth_out_range_penalty: 0.1 in the "
        "README's ALFWorld run and the defaults, 0.05 in its ScienceWorld run).")
    band_low: float = option(
        0.0, min=0.0, help="k_l: the band's lower edge is k_l times the historical mean (official README runs 0; run "
        "script default 0.5, config default 0.8).")
    band_high: float = option(
        2.0, min=0.0, help="k_r: the band's upper edge is k_r times the historical mean (official README runs 2.0; run "
        "script default 1.5, config default 1.2).")
    penalty_form: Literal["hinge", "indicator"] = option(
        "hinge", reconstructed=True,
        help="'hinge': alpha times the distance of the entropy outside the band (its gradient pulls entropy back into "
        "the band); 'indicator': alpha on every out-of-band token, as the official code, which is constant and "
        "carries no gradient.",
    )
    scope: Literal["token", "sequence"] = option(
        "token", help="Compare each token's entropy with the band ('token', official default) or each turn's mean "
        "entropy ('sequence', official 'seq': one verl-agent sample is one turn).",
    )
    history: Literal["per_turn", "global"] = option(
        "per_turn", help="Historical mean per turn index (official) or one mean over all turns.")
    history_window: int = option(0, min=0, help="Average over the last k training steps; 0: all past steps (official).")
    smooth_from_turn: int = option(
        0, min=0, help="Smooth only turns with index >= this (official: 25, half its max_step default of 50).")
    phase_weighting: bool = option(
        True, help="Weight the smoothing penalty by the official phase schedule (1.0 -> 0.8 -> 0 over the horizon; "
        "on in the README's runs, off in the run script's and config's defaults).")
    phase_steps: int | None = option(
        None, min=1, help="Horizon of the phase schedule in optimizer steps; None: the run's max_steps (official: "
        "150 epochs).",
    )

    def validate(self) -> None:
        if self.band_low > self.band_high:
            raise PluginConfigError(
                f"Options 'band_low'={self.band_low} and 'band_high'={self.band_high} of plugin 'epo' make an empty "
                "band; allowed: band_low <= band_high."
            )


def phase_weight(step: int, horizon: int) -> float:
    """The official phase schedule ``w_k``: 1 -> 0.8 (slow, rate 2) over the first half, 0.8 -> 0 (rate 3) after."""
    if horizon <= 0:
        return 1.0
    step = min(max(step, 0), horizon)
    half = horizon // 2
    if step <= half:
        return 1.0 if half == 0 else 1.0 - 0.2 * (1.0 - math.exp(-2.0 * step / half))
    return 0.8 * math.exp(-3.0 * (step - half) / (horizon - half))


def band_penalty(entropy: torch.Tensor, reference: torch.Tensor, low: float, high: float, alpha: float, form: str
                 ) -> torch.Tensor:
    """P: the smoothing penalty of each entry of ``entropy`` against the band ``[low * ref, high * ref]``.

    Args:
        entropy: (B, T) entropies (with grad for the hinge's gradient). reference: (B, T) historical means, NaN
            where the entry is not smoothed (penalty 0 there).
    Returns:
        (B, T): ``alpha * (relu(low*ref - H) + relu(H - high*ref))`` ("hinge") or ``alpha * [H outside the open
        band]`` ("indicator", no gradient).
    """
    smoothed = ~torch.isnan(reference)
    ref = reference.nan_to_num(0.0).to(entropy.dtype)
    lower, upper = low * ref, high * ref
    if form == "indicator":
        outside = (entropy.detach() <= lower) | (entropy.detach() >= upper)
        return torch.where(smoothed & outside, torch.full_like(entropy, alpha), torch.zeros_like(entropy)).detach()
    distance = torch.relu(lower - entropy) + torch.relu(entropy - upper)
    return torch.where(smoothed, alpha * distance, torch.zeros_like(entropy))


def turn_means(entropies: torch.Tensor, turn_ids: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(width,) sums and counts of the token entropies per turn index (tokens with turn id -1 left out).

    Args: entropies (B, T); turn_ids (B, T) long, -1 outside the loss's assistant tokens.
    """
    valid = turn_ids >= 0
    index = turn_ids.clamp(min=0, max=max(width - 1, 0)).flatten()
    sums = torch.zeros(width, dtype=torch.float64).scatter_add_(
        0, index, torch.where(valid, entropies, torch.zeros_like(entropies)).flatten().double())
    counts = torch.zeros(width, dtype=torch.float64).scatter_add_(0, index, valid.flatten().double())
    return sums, counts


def historical_means(history: list[list[float | None]]) -> list[float | None]:
    """Per turn index, the mean of the recorded per-step means (None entries -- turns absent that step -- skipped)."""
    width = max([len(h) for h in history] + [0])
    out: list[float | None] = []
    for u in range(width):
        values = [h[u] for h in history if u < len(h) and h[u] is not None]
        out.append(sum(values) / len(values) if values else None)
    return out


class EpoPlugin(Plugin):
    """Multi-turn entropy bonus with smoothing against historical per-turn entropy and phase weighting (loss stage)."""

    name = "epo"
    version = "0.1.0"
    paper = "EPO: Entropy-regularized Policy Optimization for LLM Agents Reinforcement Learning, arXiv:2509.22576"
    summary = "Entropy bonus for multi-turn agents, smoothed toward each turn's historical entropy, phase-weighted."
    Options = EpoOptions
    official = OfficialSource(
        "WujiangXu/EPO", "5b6fa98", verdict="faithful",
        files=("README.md", "verl/workers/actor/dp_actor.py"),
        non_official_defaults={
            "smooth_from_turn": "25, half its max_step of 50; 0 here smooths every turn of short episodes",
            "phase_steps": "150 epochs; here the run's max_steps",
        },
    )
    image_inputs = True
    multi_turn = True
    claim_metric = ("out_of_band_fraction", "tokens whose entropy left the historical band")
    overwrites = ()
    conflicts_with = ("clip_cov", "kl_cov", "lp_reg", "siren")
    conflict_reason = ENTROPY_PICK_ONE
    reconstructed = (
        "penalty_form='hinge': a differentiable band penalty (the official penalty is a constant, without gradient)",
        "smooth_from_turn=0 (official: turns >= 25); absent turns skip the per-turn average (official: zero-padded)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.history: list[list[float | None]] = []
        self.reference: list[float | None] = []
        self.step = 0

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.entropy_coef != 0 or getattr(args, "use_adaptive_entropy", False):
            raise IncompatiblePluginsError(
                f"epo cannot be combined with TRL's entropy bonus (entropy_coef={args.entropy_coef!r}): EPO is itself "
                "an entropy bonus (its option entropy_coef). Set entropy_coef=0 or disable epo."
            )

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history], "step": self.step}

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        self.history = [list(h) for h in state["history"]]
        self.step = int(state["step"])
        self.reference = historical_means(self.history)

    def horizon(self, run_max_steps: int = 0) -> int:
        """The phase schedule's horizon: ``phase_steps``, else the run's max_steps (``ctx.run.max_steps``: TRL's once
        training started, epochs resolved)."""
        if self.options.phase_steps is not None:
            return self.options.phase_steps
        return max(int(run_max_steps or 0), 1)

    def weight(self, run_max_steps: int = 0) -> float:
        """w_k of the current step (1.0 without phase weighting); ``run_max_steps`` as for :meth:`horizon`."""
        return phase_weight(self.step, self.horizon(run_max_steps)) if self.options.phase_weighting else 1.0

    # ------------------------------------------------------------------------------------------ advantage stage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Record this generation batch's per-turn mean entropy (global over processes) into the history."""
        if ctx.mode != "train" or self.options.entropy_coef == 0:
            return
        self.step = int(ctx.step)
        stats = ctx.policy_stats()
        turn_ids = self._turn_ids(stats.mask, None if ctx.turn_ids is None else ctx.turn_ids[ctx.process_slice])
        width = int(ctx.gather(torch.tensor([int(turn_ids.max().item()) + 1 if turn_ids.numel() else 0],
                                            device=ctx.device)).max().item())
        width = max(width, 1)
        sums, counts = turn_means(stats.entropies.detach().float().cpu(), turn_ids.cpu(), width)
        totals = ctx.gather(torch.stack([sums, counts]).unsqueeze(0).to(ctx.device)).sum(dim=0).cpu()
        means = [float(s / c) if c > 0 else None for s, c in zip(totals[0].tolist(), totals[1].tolist())]
        self.history.append(means)
        if self.options.history_window:
            self.history = self.history[-self.options.history_window:]
        self.reference = historical_means(self.history)
        ctx.log_metric("batch_entropy", float(totals[0].sum() / totals[1].sum().clamp(min=1)))

    def _turn_ids(self, mask: torch.Tensor, turn_ids: torch.Tensor | None) -> torch.Tensor:
        """(B, T) turn index of each loss token (all 0 for ``history='global'`` or single-turn rows), -1 elsewhere."""
        T = mask.size(1)
        if turn_ids is None or self.options.history == "global":
            ids = torch.zeros_like(mask, dtype=torch.long)
        else:
            ids = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
            width = min(T, turn_ids.size(1))
            ids[:, :width] = turn_ids[:, :width].to(mask.device)
        return torch.where(mask.bool(), ids, torch.full_like(ids, -1))

    # ------------------------------------------------------------------------------------------ loss stage
    def reference_per_token(self, turn_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) historical mean entropy of each token's turn; NaN where not smoothed (no history for that turn,
        turn before ``smooth_from_turn``, tool results and padding)."""
        ref = torch.tensor([math.nan if r is None else r for r in self.reference] or [math.nan], dtype=torch.float32)
        ids = turn_ids.cpu()
        values = ref[ids.clamp(min=0, max=ref.numel() - 1)]
        keep = (ids >= max(self.options.smooth_from_turn, 0)) & (ids >= 0) & (ids < ref.numel())
        return torch.where(keep, values, torch.full_like(values, math.nan)).to(turn_ids.device)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        if o.entropy_coef == 0:
            return
        entropies = ctx.entropies
        turn_ids = self._turn_ids(ctx.mask, ctx.turn_ids)
        reference = self.reference_per_token(turn_ids)
        compared = entropies
        if o.scope == "sequence":  # each turn's mean entropy, broadcast over its tokens
            compared = _turn_mean_per_token(entropies, turn_ids)
        penalty = band_penalty(compared, reference, o.band_low, o.band_high, o.penalty, o.penalty_form)
        weight = self.weight(ctx.run.max_steps)
        ctx.add_token_loss(-o.entropy_coef * (entropies - o.smooth_coef * weight * penalty))
        smoothed = ~torch.isnan(reference) & ctx.mask.bool()
        outside = smoothed & (penalty.detach() > 0)
        ctx.log_metric("entropy", ctx.global_masked_mean(entropies.detach()))
        ctx.log_metric("out_of_band_fraction", ctx.global_masked_mean(outside.float()))
        ctx.log_metric("penalty_mean", ctx.global_masked_mean(penalty.detach()))
        ctx.log_metric("phase_weight", weight)


def _turn_mean_per_token(entropies: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): each token gets the mean entropy of its row's turn (with grad); tokens with turn id -1 keep their own."""
    width = int(turn_ids.max().item()) + 1 if turn_ids.numel() and turn_ids.max() >= 0 else 1
    valid = turn_ids >= 0
    index = turn_ids.clamp(min=0)
    zeros = torch.zeros(entropies.size(0), width, dtype=entropies.dtype, device=entropies.device)
    sums = zeros.scatter_add(1, index, torch.where(valid, entropies, torch.zeros_like(entropies)))
    counts = zeros.detach().scatter_add(1, index, valid.to(entropies.dtype))
    means = sums / counts.clamp(min=1)
    return torch.where(valid, torch.gather(means, 1, index), entropies)
