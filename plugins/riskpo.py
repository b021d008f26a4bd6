"""RiskPO — Risk-based Policy Optimization with a Mixed Value-at-Risk objective (arXiv:2510.00911).

GRPO optimises the mean reward, which lets easy questions dominate the signal. RiskPO optimises a risk
measure of the reward distribution instead, and enriches that distribution by **bundling** questions:

1. Bundles: consecutive groups of ``bundle_size`` prompts of the generation batch (TRL keeps each prompt's G
   rows consecutive). When the number of prompts is not a multiple of ``bundle_size`` the last bundle is
   smaller.
2. "Papers": paper ``k`` (``k = 0 .. G-1``) of a bundle takes the ``k``-th response of every question in it;
   its score is ``S_k = sum of those rewards``. A bundle has G papers.
3. Per bundle: ``q_lo = quantile_alpha(S)``, ``q_hi = quantile_beta(S)`` (linear interpolation) and
   ``sigma_B = std(S)`` (unbiased; 1 with a single paper).
4. Range-VaR part: ``gR = ((S - q_lo)^+ - (S - q_hi)^+ [+ (q_lo - q_hi)]) / (beta - alpha + eps)``, the bracket
   only with ``natural_baseline``.
5. Mixing: risk-averse (default) ``gC = -(q_lo - S)^+ / (alpha + eps)``; risk-seeking
   ``gC = (S - q_hi)^+ / (1 - beta + eps)``. ``A_paper = (w gC + gR) / (w + 1)``.
6. With ``norm_by_std``: ``A_paper /= sigma_B + eps``.
7. Credit to response ``i`` of the paper (question ``q(i)``):
   ``uniform``: ``A_paper``; ``std``: ``A_paper / (std_q + eps)`` (a question std <= 1e-3 counts as 1);
   ``sum_mean``: ``rho_i = R_i - mean_q``, ``A_paper rho_i / sum(rho)`` over the paper when
   ``|sum(rho)| > 1e-6``, else ``A_paper / m`` (``m`` questions in the bundle); ``score``:
   ``(0.5 if R_i > 0 else 1.5) A_paper``.
8. The sequence advantage is broadcast over the tokens and trained with TRL's surrogate.

Defaults are the paper's DAPO-math recipe: alpha = 0.2, beta = 0.8,
bundle_size = 5, w = 1.5, credit ``sum_mean``, ``natural_baseline = False``. The MATH recipes use beta = 0.9,
credit ``std`` and ``natural_baseline = True``. The released code also runs an SGD quantile tracker, but it
updates *after* the advantages of a step are computed and never feeds them, so the quantiles here are the
per-bundle empirical ones (as in practice in the released code). Reconstructed: ``eps`` (1e-6), the
``norm_by_std`` default (on, as verl's GRPO default), the ``1 - beta + eps`` guard of the risk-seeking term
and, for a smaller last bundle, ``A_paper / m`` with its real size ``m`` (so a paper's credits still sum to
``A_paper``). A NaN reward (no reward function applied) counts as 0 in the paper scores and gets advantage 0.

RiskPO replaces the advantage entirely: no setting of it reduces to GRPO's ``(R - mean) / std`` (with
``bundle_size = 1`` and uniform credit it is a per-question quantile-clipped advantage instead).

Official code checked against: ``RTkenny/RiskPO@65ec40c`` (faithful with documented options; the files and the deviating
options: ``trl-plugins show riskpo``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginConfigError, PluginOptions, hookimpl, option


@dataclass
class RiskPOOptions(PluginOptions):
    alpha: float = option(0.2, min=0.0, max=1.0, help="Lower quantile level of the paper scores (q_lo).")
    beta: float = option(0.8, min=0.0, max=1.0, help="Upper quantile level of the paper scores (q_hi).")
    bundle_size: int = option(5, min=1, help="Consecutive prompts (groups) bundled together.")
    w: float = option(1.5, min=0.0, help="Weight of the tail term gC against the range term gR.")
    risk: Literal["averse", "seeking"] = option(
        "averse", help="'averse': gC penalises papers below q_lo (MVaR, default); 'seeking': rewards those above q_hi."
    )
    credit: Literal["sum_mean", "uniform", "std", "score"] = option(
        "sum_mean", help="How a paper's advantage is credited to its responses (see the module docstring)."
    )
    natural_baseline: bool = option(False, help="Add (q_lo - q_hi) to the range term (the MATH recipes do).")
    norm_by_std: bool = option(
        True, help="Divide A_paper by the bundle's paper-score std (+ eps).", reconstructed=True
    )
    eps: float = option(1e-6, min=0.0, help="Small constant in every denominator.", reconstructed=True)

    def validate(self) -> None:
        if self.alpha >= self.beta:
            raise PluginConfigError(
                f"Options 'alpha' and 'beta' of plugin 'riskpo' got alpha={self.alpha!r}, beta={self.beta!r}; "
                "allowed: alpha < beta."
            )


def bundle_ids(num_groups: int, bundle_size: int) -> torch.Tensor:
    """Bundle of each group: consecutive groups of ``bundle_size`` (the last one may be smaller). (num_groups,)"""
    return torch.arange(num_groups) // bundle_size


def paper_advantages(
    scores: torch.Tensor, alpha: float, beta: float, w: float, risk: str, natural_baseline: bool,
    norm_by_std: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MVaR advantage of the papers of one bundle.

    Args:
        scores: (n,) paper scores S (n = G papers).
    Returns:
        A_paper (n,), q_lo and q_hi (0-d tensors).
    """
    S = scores.double()
    q_lo = torch.quantile(S, alpha)
    q_hi = torch.quantile(S, beta)
    sigma = S.std() if S.numel() > 1 else torch.ones((), dtype=S.dtype)
    g_r = torch.clamp(S - q_lo, min=0) - torch.clamp(S - q_hi, min=0)
    if natural_baseline:
        g_r = g_r + (q_lo - q_hi)
    g_r = g_r / (beta - alpha + eps)
    if risk == "averse":
        g_c = -torch.clamp(q_lo - S, min=0) / (alpha + eps)
    else:
        g_c = torch.clamp(S - q_hi, min=0) / (1 - beta + eps)
    adv = (w * g_c + g_r) / (w + 1)
    if norm_by_std:
        adv = adv / (sigma + eps)
    return adv, q_lo, q_hi


def credit_responses(
    paper_adv: torch.Tensor, rewards: torch.Tensor, credit: str, eps: float
) -> torch.Tensor:
    """Credit each paper's advantage to its responses.

    Args:
        paper_adv: (G,) A_paper of the bundle's papers.
        rewards: (m, G) rewards of the bundle's m questions (row q = question q's G responses; NaN read as 0).
        credit: "uniform", "std", "sum_mean" or "score".
    Returns:
        (m, G) response advantages; column k holds the credits of paper k.
    """
    R = rewards.double()
    m, G = R.shape
    A = paper_adv.double().unsqueeze(0).expand(m, G)
    if credit == "uniform":
        return A.clone()
    if credit == "std":
        std_q = R.std(dim=1, keepdim=True) if G > 1 else torch.ones(m, 1, dtype=R.dtype)
        std_q = torch.where(std_q <= 1e-3, torch.ones_like(std_q), std_q)
        return A / (std_q + eps)
    if credit == "sum_mean":
        rho = R - R.mean(dim=1, keepdim=True)
        total = rho.sum(dim=0, keepdim=True)  # (1, G): sum over the paper's responses
        use_rho = total.abs() > 1e-6
        safe = torch.where(use_rho, total, torch.ones_like(total))
        return torch.where(use_rho, A * rho / safe, A / m)
    if credit == "score":
        return torch.where(R > 0, 0.5 * A, 1.5 * A)
    raise ValueError(f"unknown credit {credit!r}; allowed: uniform, std, sum_mean, score")


def riskpo_advantages(
    rewards: torch.Tensor, group_size: int, bundle_size: int, alpha: float, beta: float, w: float, risk: str,
    credit: str, natural_baseline: bool, norm_by_std: bool, eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RiskPO advantages of a whole generation batch.

    Args:
        rewards: (N,) combined rewards, N = num_groups * G, groups contiguous and in prompt order.
        group_size: G (= number of papers per bundle).
    Returns:
        advantages (N,) float32 and batch statistics (mean q_lo, q_hi, paper score, fraction below q_lo).
    """
    G = group_size
    R = rewards.view(-1, G).double()
    nan = torch.isnan(R)
    R = torch.nan_to_num(R, nan=0.0)
    n_groups = R.size(0)
    adv = torch.zeros_like(R)
    q_los, q_his, below, paper_means = [], [], [], []
    for start in range(0, n_groups, bundle_size):
        block = R[start:start + bundle_size]  # (m, G)
        S = block.sum(dim=0)  # (G,) paper scores
        a_paper, q_lo, q_hi = paper_advantages(S, alpha, beta, w, risk, natural_baseline, norm_by_std, eps)
        adv[start:start + bundle_size] = credit_responses(a_paper, block, credit, eps)
        q_los.append(float(q_lo))
        q_his.append(float(q_hi))
        below.append(float((S < q_lo).double().mean()))
        paper_means.append(float(S.mean()))
    adv[nan] = 0.0
    n = max(len(q_los), 1)
    stats = {
        "q_low": sum(q_los) / n,
        "q_high": sum(q_his) / n,
        "paper_score": sum(paper_means) / n,
        "below_q_low_fraction": sum(below) / n,
    }
    return adv.view(-1).float(), stats


class RiskPOPlugin(Plugin):
    """Mixed Value-at-Risk advantages over bundles of questions (advantage stage)."""

    name = "riskpo"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "RiskPO: Risk-based Policy Optimization via Verifiable Reward for LLM Post-Training, arXiv:2510.00911"
    summary = "Advantages from a Mixed Value-at-Risk objective over 'papers' of bundled questions."
    Options = RiskPOOptions
    official = OfficialSource(
        "RTkenny/RiskPO", "65ec40c", verdict="faithful",
        files=("verl/trainer/ppo/core_algos.py",),
    )
    claim_metric = ("abs_advantage", "mean |advantage| (risk-weighted)")
    replaces = ("the advantages",)
    overwrites = ("advantages",)  # recomputed from the rewards: runs first in the advantage chain
    reconstructed = (
        "eps = 1e-6 in every denominator",
        "norm_by_std defaults to on (verl's GRPO default; the recipes do not show it)",
        "the risk-seeking tail term divides by 1 - beta + eps (guard against beta = 1)",
        "a smaller last bundle credits A_paper / m with its real size m under sum_mean",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        G = args.num_generations
        batch = getattr(args, "generation_batch_size", None)  # global (all processes)
        if batch:
            prompts = batch // G
            if 0 < prompts < self.options.bundle_size:
                warnings.warn(
                    f"riskpo: a generation batch holds {prompts} prompt(s), fewer than bundle_size="
                    f"{self.options.bundle_size}; each bundle will hold {prompts} question(s).",
                    stacklevel=2,
                )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        adv, stats = riskpo_advantages(
            ctx.rewards, ctx.num_generations, o.bundle_size, o.alpha, o.beta, o.w, o.risk, o.credit,
            o.natural_baseline, o.norm_by_std, o.eps,
        )
        ctx.advantages = adv.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
        for key, value in stats.items():
            ctx.log_metric(key, value)
        ctx.log_metric("abs_advantage", adv.abs().mean().item())
