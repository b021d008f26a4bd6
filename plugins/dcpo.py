"""DCPO — Distribution-Centric Policy Optimization (arXiv:2601.12730).

GRPO's entropy falls monotonically: exploration fades. DCPO regulates entropy at the level of the *distribution*:
it pulls the policy toward a target distribution built on-policy, the temperature-``tau`` version of the policy
itself on its correct rollouts (sharper with ``tau < 1`` when entropy is too high, flatter with ``tau > 1`` when it
is too low), by mixing that target into the advantages. Facts from the official code (github.com/597358816/DCPO,
``verl/trainer/ray_trainer.py``, the ``DCPO`` branch of ``fit``; recipe ``examples/qwen-math-7b-DCPO.sh``):

1. ``H``: the entropy estimate of the previous update, the token-mean of ``-log pi(o_t)`` over the sampled tokens
   (the actor's ``entropy_loss`` metric); 0 before the first update.
2. ``tau = 1.2`` if ``H <= H_target`` else ``0.8`` (``H_target`` = ``entropy_base`` = 0.5).
3. Per token, no grad: ``w[b,t] = pi_tau(o_t) / pi_1(o_t) = exp(lp_tau - lp_1)``, the log-probs of the sampled token
   under the policy's logits divided by ``tau`` and by 1.
4. Correct rollouts: ``c_i = 1`` when the reward is above 0.05, else 0; ``p`` = the batch's fraction of them.
5. ``alpha = min(|H_target - H|, 0.1) / p``, then ``alpha <- alpha / (alpha + 1)``.
6. ``A'[i,t] = (1 - alpha) A_i + alpha c_i w[i,t]`` (token-level), trained with the usual surrogate.

Mapping onto TRL: steps 3-6 at the advantage stage (one extra no-grad forward; ``lp_tau`` and ``lp_1`` from the
chunked LM-head statistics of :mod:`trl_plugins.runtime.head_stats`, never the full logits, both from the raw logits as
in the official code whatever the run's ``temperature``); step 1 from the loss stage (the token-mean of ``-lp`` over
the micro-steps since the previous generation batch, all processes), measured on TRL's loss log-probs at the run's
``temperature``; the official entropy is measured at temperature 1 (equal only when ``temperature = 1``). Correctness is decided on the verifier column
(``success_column`` above ``success_threshold``; the official code thresholds the total score). Reconstructed: a
batch with no correct rollout gets ``alpha = 0`` (the official division by ``p = 0`` gives NaN advantages).
``max_alpha = 0`` switches DCPO off (TRL's advantages, no extra forward): the neutral setting.

Official code checked against: ``597358816/DCPO@33f8073`` (faithful with documented options; the files and the deviating
options: ``trl-plugins show dcpo``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    hookimpl,
    option,
)
from trl_plugins.api.success import SuccessOptions

#: Why DCPO refuses the other entropy regulators (``Plugin.conflict_reason``).
ENTROPY_CONTROL_PICK_ONE = (
    "each is a complete remedy for entropy collapse (DCPO steers the entropy to entropy_target through a "
    "temperature-tau target distribution in the advantages; the other regularises the entropy of selected tokens in "
    "the loss); stacked, two controllers act on the same entropy and match neither paper"
)


@dataclass
class DcpoOptions(SuccessOptions):
    entropy_target: float = option(0.5, min=0.0, help="H_target (official entropy_base): the entropy threshold.")
    temperature_high: float = option(
        1.2, min=0.0, min_exclusive=True, help="tau when the entropy is at or below the target (flatter target)."
    )
    temperature_low: float = option(
        0.8, min=0.0, min_exclusive=True, help="tau when the entropy is above the target (sharper target)."
    )
    max_alpha: float = option(
        0.1, min=0.0,
        help="Cap of |H_target - H| before the division by the correct fraction (official: 0.1); 0 switches DCPO "
        "off.",
    )
    success_threshold: float = option(
        0.05, help="A rollout is correct when its verifier column is above this (official: total score > 0.05)."
    )

    def validate(self) -> None:
        if self.temperature_high < 1.0 or self.temperature_low > 1.0:
            raise PluginConfigError(
                f"Options 'temperature_high' and 'temperature_low' of plugin 'dcpo' got {self.temperature_high!r} and "
                f"{self.temperature_low!r}; allowed: temperature_high >= 1 >= temperature_low (flatter target when "
                "the entropy is low, sharper when it is high)."
            )


def dcpo_alpha(entropy: float, target: float, max_alpha: float, correct_fraction: float) -> float:
    """``a = min(|target - entropy|, max_alpha) / p``, returned as ``a / (a + 1)``; 0 when ``p = 0``."""
    if correct_fraction <= 0.0:
        return 0.0
    a = min(abs(target - entropy), max_alpha) / correct_fraction
    return a / (a + 1.0)


def dcpo_advantages(
    advantages: torch.Tensor, correct: torch.Tensor, weights: torch.Tensor, alpha: float
) -> torch.Tensor:
    """``A'[i,t] = (1 - alpha) A[i,t] + alpha c_i w[i,t]``.

    Args:
        advantages: (N,) sequence advantages, or (N, T') token advantages of earlier plugins (``w`` is then cut or
            zero-padded to T').
        correct: (N,) bool. weights: (N, T) ``pi_tau(o) / pi_1(o)``, 0 at padding.
    Returns:
        (N, T) token advantages (T' for token-level input).
    """
    if advantages.dim() == 2:
        width = advantages.size(1)
        weights = weights[:, :width]
        if weights.size(1) < width:
            weights = torch.cat([weights, weights.new_zeros(weights.size(0), width - weights.size(1))], dim=1)
    else:
        advantages = advantages.unsqueeze(1)
    return (1 - alpha) * advantages + alpha * correct.to(weights.dtype).unsqueeze(1) * weights


def temperature_logprobs(head_stats, labels: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp_1, lp_tau)`` (B, T) of the sampled tokens under the raw logits divided by 1 and by ``tau``.

    ``head_stats`` holds the run-temperature-scaled logits ``z / T``; ``z = (z / T) * T`` is recovered chunk by chunk
    (no (B, T, V) tensor). Zero at invalid positions.
    """
    lab = labels.to(head_stats.mask.device)[head_stats.mask].long()  # (N_valid,) row-major, as map_chunks
    run_temperature = head_stats.temperature

    def fn(z, rows):
        z.mul_(run_temperature)  # raw logits (in place: z is this chunk's own block)
        label = z.gather(-1, lab[rows, None]).squeeze(-1)
        lp_1 = label - torch.logsumexp(z, dim=-1)
        lp_tau = label / tau - torch.logsumexp(z / tau, dim=-1)
        return lp_1, lp_tau

    lp_1, lp_tau = head_stats.map_chunks(fn)
    return head_stats.to_bc(lp_1), head_stats.to_bc(lp_tau)


class DcpoPlugin(Plugin):
    """Mix a temperature-tau target distribution on correct rollouts into the advantages, steered by the entropy."""
    claim_metric = ('alpha', 'weight of the distribution-centric term in the advantage')
    image_inputs = True
    multi_turn = True

    name = "dcpo"
    version = "0.1.0"
    paper = (
        "Distribution-Centric Policy Optimization Dominates Exploration-Exploitation Trade-off (DCPO), "
        "arXiv:2601.12730"
    )
    summary = "Entropy control by mixing an on-policy temperature-tau target distribution into the advantages."
    Options = DcpoOptions
    official = OfficialSource(
        "597358816/DCPO", "33f8073", verdict="faithful",
        files=("verl/trainer/ray_trainer.py",),
    )
    replaces = ("the advantages (mixed with the temperature-tau target term, token-level)",)
    conflicts_with = ("siren", "clip_cov", "kl_cov", "lp_reg")
    conflict_reason = ENTROPY_CONTROL_PICK_ONE
    reconstructed = (
        "a batch without a correct rollout gets alpha = 0 (the official code divides by zero)",
        "with steps_per_generation > 1 the entropy estimate averages every micro-step since the previous "
        "generation batch (the official code reads the previous update's metric)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.entropy = 0.0
        self._entropy_measurements: list[float] = []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.entropy_coef != 0 or getattr(args, "use_adaptive_entropy", False):
            raise IncompatiblePluginsError(
                f"dcpo cannot be combined with TRL's entropy bonus (entropy_coef={args.entropy_coef!r}): "
                f"{ENTROPY_CONTROL_PICK_ONE}. Set entropy_coef=0 or disable dcpo."
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.mode != "train":
            return
        if self._entropy_measurements:
            self.entropy = sum(self._entropy_measurements) / len(self._entropy_measurements)
            self._entropy_measurements = []
        if o.max_alpha == 0.0:
            return
        tau = o.temperature_high if self.entropy <= o.entropy_target else o.temperature_low
        correct = ctx.success(o.success_rule)
        alpha = dcpo_alpha(self.entropy, o.entropy_target, o.max_alpha, float(correct.float().mean()))
        stats = ctx.policy_stats(head_stats=True)
        lp_1, lp_tau = temperature_logprobs(stats.head_stats, stats.completion_ids, tau)
        weights = torch.exp(lp_tau - lp_1) * stats.mask  # (B, T)
        weights = ctx.gather_padded(weights.to(ctx.device), dim=1).to(ctx.advantages.device)
        ctx.advantages = dcpo_advantages(ctx.advantages, correct.to(ctx.advantages.device), weights, alpha)
        ctx.log_metric("alpha", alpha)
        ctx.log_metric("tau", tau)
        ctx.log_metric("entropy_estimate", self.entropy)
        ctx.log_metric("correct_fraction", float(correct.float().mean()))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        if ctx.mode == "train":
            self._entropy_measurements.append(ctx.global_masked_mean(-ctx.per_token_logps.detach()))

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"entropy": self.entropy, "measurements": list(self._entropy_measurements)}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.entropy = float(state.get("entropy", 0.0))
        self._entropy_measurements = [float(x) for x in state.get("measurements", [])]
