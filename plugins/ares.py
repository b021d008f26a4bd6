"""ARES / AEPO — difficulty-aware token-level entropy shaping (arXiv:2510.08457): reward, KL and HWE branching.

ARES trains with Adaptive-Entropy Policy Optimization (AEPO): a hierarchical entropy reward that shapes how many
high-window-entropy (HWE) moments a response spends, per difficulty bucket, a per-bucket (dynamic) KL coefficient,
and HWE tokens as the exploration triggers of the rollout (the paper: high-entropy windows are the branching points).
Facts from the official code (shawn0728/ARES @146620e; restated, not copied):

1. *Token entropy and HWE count* (``verl/workers/rollout/vllm_rollout_spmd.py:102-157``): with ``H_t`` the entropy of
   the distribution that produced completion token ``t``, a *window* ``W_t = mean(H_{t+1..t+w})`` exists when ``w``
   (``window_size`` = 4, ``experiments/AEPO/config.yaml:72``) tokens follow ``t``. The HWE count ``n_i`` of response
   ``i`` is the number of positions ``t`` whose token is a reasoning trigger (``data/crucial_token_final_version.json``,
   :mod:`trl_plugins_builtin._ares_triggers`; the token text stripped of ``\u2581``/``\u0120`` markers and whitespace,
   lower-cased, ``normalize_token`` l.94-100), whose window exists, and with ``W_t >= tau``.
2. *Threshold* ``tau`` (``get_window_average_entropy_percentile_threshold_list`` l.159-203, ``ray_trainer.py:892-901``):
   per response, the 95th percentile (linear) of its window means, where positions without a full window take the
   mean of the windows before them (the first token's entropy when there is none); ``tau`` is an EMA (0.99) of the
   batch median of those percentiles. A batch is counted with the ``tau`` of the batches before it.
3. *Difficulty and targets* (``ray_trainer.py:775-824``): a prompt is easy when its group accuracy ``a >= 2/3``, medium
   when ``a >= 1/3``, hard otherwise. Target ``n*_d = round(mean over the bucket's prompts of mean_i n_i)``. Bucket
   weight ``alpha_d <- clip(alpha_d + 0.05 delta, 0, 2)`` (initial 0.5, l.199-206), ``delta = mean - n*_d`` for
   easy and medium, ``n*_d - mean`` for hard, on the same batch, before its rewards.
4. *Hierarchical entropy reward* (``examples/reward_function/aepo.py:42-124``): ``Delta = n - n*``, margin
   ``mg = max(1, f_d max(n*, 1))``, ``huber(x; k) = x^2 / (2k)`` for ``x <= k`` else ``x - k/2`` (``x`` clamped at 0),
   ``cap = alpha_d s_d``; correct easy: ``-min(cap, huber(max(Delta - mg, 0)) / (mg + k) cap)``; correct medium: the
   same with ``max(|Delta| - mg, 0)``; wrong easy / medium: ``sigmoid(max(Delta - mg, 0) / T) cap g_d``; correct hard:
   ``sigmoid((Delta + mg) / T) cap`` when ``Delta >= -mg``, else ``-min(cap, huber(-Delta - mg) / (2 (mg + k)) cap)``;
   wrong hard: ``sigmoid(max(Delta - mg, 0) / T) cap``. Constants per (easy, medium, hard): ``f`` = 0.15/0.25/0.35,
   ``k`` = 2/3/4, ``T`` = 2/2.5/3, ``s`` = 1/1/1.2, ``g`` = 0.6/0.8/1. The reward is accuracy plus this bonus: here the
   bonus is the plugin's own reward column (TRL's weights and group normalisation apply).
5. *Dynamic KL* (``verl/workers/actor/dp_actor.py:61-124, 324-376``): the KL loss ``kl_coef * KL_t`` (``kl_coef`` =
   0.01, low-variance k3 estimator) is scaled per response by its bucket's ``beta_d``. Per loss micro-batch, each
   bucket's mean per-sequence KL feeds an EMA (0.97); with ``e = KL_ema / target - 1`` (target 0.01), outside a
   dead-zone (|e| < 0.02) and every 100th micro-batch only, ``e_ema <- 0.97 e_ema + 0.03 e`` and
   ``log beta_d <- log beta_d + 0.05 clip(e_ema, -0.2, 0.2)`` within ``[1e-4, 100]``; ``beta_d`` starts at 1.

TRL mapping. (1)-(4) are a reward transform filling the ``ares`` column; the entropies come from one no-grad forward
of the current policy over the local completions (``RewardContext.policy_entropies``: full-vocabulary entropy, where
the official rollout approximates it from vLLM's top-10 log-probs, plus a tail term for the count but not for the
percentile), and the trigger test reads the
sampled token (the official code reads the top-1 token of the same distribution). (5) takes TRL's reference KL
(``beta`` is ``kl_coef``: set ``beta=0.01`` as ARES does; with ``beta=0`` the KL half has nothing to scale) and adds
``beta (beta_d - 1) KL_t`` per token, so the total is ``beta beta_d KL_t``; the bucket of each row is recomputed from
the verifier at the advantage stage. The controller statistics are summed over processes (the official controller
runs per rank) and TRL's KL is not clamped at +-10 as verl's ``low_var_kl`` is. Image prompts (ARES is multimodal)
are refused: the reward-stage entropy forward conditions on the prompt's text only, and the reward must be final
before TRL's group normalisation, so the advantage stage's image-aware forward comes too late.

HWE-triggered branching (``branch_rollouts`` = R > 0; reconstructed: the official code at @146620e samples its ``n``
rollouts independently, ``vllm_rollout_spmd.py:303-420``, and only counts HWE tokens; the branching is the paper's
and its README's description, "branch only in sustained-uncertainty regions"). The last R rows of each group are
deferred at the prompt stage (``PromptContext.defer``): TRL samples the ``G - R`` roots. After generation, one no-grad
forward gives the roots' entropies; a root's *branch points* are its HWE positions (a trigger token whose following
window has mean entropy ``>= tau``, the same test as the count), highest window mean first; a root without one
branches at its highest window mean instead (reconstructed). Branch row ``j`` (0..R-1) continues root ``j mod (G-R)``
from its ``(j div (G-R))``-th branch point (cycled): its prefix is the root's tokens up to and including the trigger,
and the uncertain window that follows is resampled through the branching seam (``ctx.continue_prefixes``: HF
generation, one collective call per step, counted in the rollout budget; refused under vLLM). The branch rows are
trained like every other row (rewarded, bucketed, counted). ``tau`` is the threshold of the batches before (the first
batch: the median of its roots' percentiles).

Not here (documented in ``docs/coverage.md``): the adaptive cold start (a data-curation SFT stage), the "second chance" KL relaxation (its
``reasoning_soft_cost`` never reaches the official actor: ``dp_actor.py:283`` selects only ``difficulty``), and the
online group filter of ``config.yaml:30-33`` (the ``dynamic_sampling`` plugin). Reconstructed: ``tau`` of the first
training batch is that batch's own median (the official code takes it from a validation pass before training).

Neutral setting: ``alpha_init=[0, 0, 0], alpha_lr=0`` (an all-zero column, no forward), ``dynamic_kl=False`` and
``branch_rollouts=0`` (the default: the official code does not branch).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import context_device, gather_id_lists
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE, VLLM_BRANCHING, samples_outside_hf_generate
from trl_plugins.api.success import placeholder_column

from ._ares_triggers import TRIGGER_WORDS
from ._difficulty_kl import scale_row_kl, token_kl
from ._length import CorrectnessOptions, check_reward_columns, correct_rows, local_completion_ids

BUCKETS = ("easy", "medium", "hard")
BUCKET_KEY = "ares_bucket"
#: Annotation key of a branch row: ``[root's index in group, prefix length]`` (the prefix it shares with its root).
BRANCH_KEY = "ares_branch"
_MARKERS = re.compile("^[\u2581\u0120]+")


def _three(default: list[float]):
    return lambda: list(default)


@dataclass
class AresOptions(CorrectnessOptions):
    window_size: int = option(4, min=1, help="Tokens after a trigger whose mean entropy forms its window (w).")
    threshold_percentile: float = option(
        95.0, min=0.0, max=100.0, help="Per-response percentile of the window means; tau tracks their batch median."
    )
    threshold_ema: float = option(0.99, min=0.0, max=1.0, help="EMA decay of the HWE threshold tau.")
    high_entropy_threshold: float | None = option(
        None, help="A fixed tau instead of the adaptive one (None: adaptive, initialised from the first batch)."
    )
    trigger_words: list[str] | None = option(
        None, help="Reasoning-trigger words (None: the official 174-word list, _ares_triggers.TRIGGER_WORDS)."
    )
    alpha_init: list[float] = option(
        default_factory=_three([0.5, 0.5, 0.5]), help="Initial bonus weight alpha_d for easy, medium, hard."
    )
    alpha_lr: float = option(0.05, min=0.0, help="Step of the alpha_d update from the bucket's deviation from target.")
    alpha_min: float = option(0.0, min=0.0, help="Lower clip of alpha_d.")
    alpha_max: float = option(2.0, min=0.0, help="Upper clip of alpha_d.")
    margin_frac: list[float] = option(
        default_factory=_three([0.15, 0.25, 0.35]), help="Tolerance band f_d: margin = max(min_margin, f_d max(n*, 1))."
    )
    min_margin: float = option(1.0, min=0.0, help="Smallest tolerance margin (HWE tokens).")
    kappa: list[float] = option(default_factory=_three([2.0, 3.0, 4.0]), help="Huber knee k_d per bucket.")
    temperature: list[float] = option(
        default_factory=_three([2.0, 2.5, 3.0]), help="Sigmoid softness T_d of the bonus per bucket."
    )
    cap_scale: list[float] = option(
        default_factory=_three([1.0, 1.0, 1.2]), help="Cap factor s_d per bucket: cap = alpha_d s_d."
    )
    wrong_gain: list[float] = option(
        default_factory=_three([0.6, 0.8, 1.0]), help="Factor g_d of the bonus paid to wrong responses per bucket."
    )
    dynamic_kl: bool = option(True, help="Scale TRL's reference KL per difficulty bucket by beta_d (needs beta > 0).")
    kl_target: list[float] = option(
        default_factory=_three([0.01, 0.01, 0.01]), help="Target per-sequence KL of each bucket's controller."
    )
    kl_beta_init: float = option(1.0, min=0.0, min_exclusive=True, help="Initial beta_d (multiplies TRL's beta).")
    kl_beta_min: float = option(1e-4, min=0.0, min_exclusive=True, help="Lower bound of beta_d.")
    kl_beta_max: float = option(100.0, min=0.0, min_exclusive=True, help="Upper bound of beta_d.")
    kl_ema: float = option(0.97, min=0.0, max=1.0, help="EMA decay of the bucket KL and of the error signal.")
    kl_lr: float = option(0.05, min=0.0, help="Step of the log(beta_d) update.")
    kl_clip: float = option(0.2, min=0.0, help="Cap on |error| per update.")
    kl_deadzone: float = option(0.02, min=0.0, help="|KL / target - 1| below this: no update.")
    kl_update_interval: int = option(100, min=1, help="Update beta_d only on every n-th loss micro-batch.")
    branch_rollouts: int = option(
        0, min=0, reconstructed=True,
        help="HWE-triggered branching: rows per group filled by continuing the group's other rollouts from their "
        "high-window-entropy trigger tokens (0 = off, the official code samples independently; at most "
        "num_generations - 1).",
    )

    def validate(self) -> None:
        for name in ("alpha_init", "margin_frac", "kappa", "temperature", "cap_scale", "wrong_gain", "kl_target"):
            values = getattr(self, name)
            positive = name in ("kappa", "temperature", "kl_target")
            if len(values) != 3 or not all(math.isfinite(v) and (v > 0 if positive else v >= 0) for v in values):
                raise PluginConfigError(
                    f"Option {name!r} of plugin 'ares' got {values!r}; allowed: three finite "
                    f"{'positive' if positive else 'non-negative'} numbers (easy, medium, hard)."
                )
        if not self.alpha_min <= self.alpha_max:
            raise PluginConfigError(f"Option 'alpha_min' of plugin 'ares' got {self.alpha_min!r} > alpha_max="
                                    f"{self.alpha_max!r}; allowed: alpha_min <= alpha_max.")
        if not self.kl_beta_min <= self.kl_beta_init <= self.kl_beta_max:
            raise PluginConfigError(
                f"Option 'kl_beta_init' of plugin 'ares' got {self.kl_beta_init!r}; allowed: within "
                f"[kl_beta_min, kl_beta_max] = [{self.kl_beta_min!r}, {self.kl_beta_max!r}]."
            )
        if self.trigger_words is not None and (
            not self.trigger_words or not all(isinstance(w, str) and normalize_token(w) for w in self.trigger_words)
        ):
            raise PluginConfigError(f"Option 'trigger_words' of plugin 'ares' got {self.trigger_words!r}; allowed: "
                                    "None or a non-empty list of non-blank words.")


# --------------------------------------------------------------------------------------------- pure functions
def normalize_token(text: str) -> str:
    """A token's text as the trigger test reads it: leading ``\u2581`` / ``\u0120`` removed, stripped, lower-cased."""
    return _MARKERS.sub("", text).strip().lower()


def window_means(entropy: torch.Tensor, window: int) -> torch.Tensor:
    """``W_t = mean(H_{t+1..t+w})`` for the ``max(L - w, 0)`` positions ``t`` followed by a full window.

    Args: entropy (L,). Returns (max(L - w, 0),).
    """
    if entropy.numel() <= window:
        return entropy.new_zeros(0)
    return entropy[1:].unfold(0, window, 1).mean(-1)


def window_percentile(entropy: torch.Tensor, window: int, percentile: float) -> float:
    """One response's percentile (linear) of its window means, positions without a full window taking the mean of the
    windows before them (the first token's entropy when there is none); 0 for an empty response."""
    if entropy.numel() == 0:
        return 0.0
    full = window_means(entropy.float(), window)
    fill = full.mean() if full.numel() else entropy[0].float()
    values = torch.cat([full, fill.expand(entropy.numel() - full.numel())])
    return float(torch.quantile(values, percentile / 100.0))


def hwe_count(entropy: torch.Tensor, is_trigger: torch.Tensor, window: int, tau: float) -> int:
    """Number of trigger positions with a full window whose mean entropy is ``>= tau``.

    Args: entropy (L,); is_trigger (L,) bool (the token at ``t`` is a reasoning trigger).
    """
    means = window_means(entropy.float(), window)
    return int(((means >= tau) & is_trigger[: means.numel()]).sum())


def branch_points(
    entropy: torch.Tensor, is_trigger: torch.Tensor, window: int, tau: float, count: int
) -> tuple[list[int], int]:
    """A root's ``count`` branch points: its HWE positions (trigger with a full window of mean ``>= tau``), highest
    window mean first, cycled; without one, the position of the highest window mean (the first token when the root
    has no full window). Returns (positions, number of HWE positions).

    Args: entropy (L,); is_trigger (L,) bool.
    """
    means = window_means(entropy.float(), window)
    hwe = ((means >= tau) & is_trigger[: means.numel()]).nonzero().flatten()
    if hwe.numel():
        order = hwe[means[hwe].argsort(descending=True, stable=True)].tolist()
    else:
        order = [int(means.argmax())] if means.numel() else [0]
    return [order[k % len(order)] for k in range(count)], int(hwe.numel())


def branch_slot(index_in_group: int, group_size: int, branches: int) -> tuple[int, int] | None:
    """``(root, k)`` of a branch row: the index in group of the root it continues and which of that root's branch
    points; None for a root (the first ``G - R`` rows of a group are roots, the last R branches)."""
    roots = group_size - branches
    j = index_in_group - roots
    return None if j < 0 else (j % roots, j // roots)


def difficulty_buckets(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool -> (N/G,) bucket per group: 0 easy (accuracy >= 2/3), 1 medium (>= 1/3), 2 hard (exact in counts)."""
    hits = correct.long().view(-1, group_size).sum(dim=1)
    return torch.where(3 * hits >= 2 * group_size, 0, torch.where(3 * hits >= group_size, 1, 2)).long()


def bucket_targets(counts: torch.Tensor, buckets: torch.Tensor, group_size: int) -> tuple[list, list]:
    """Per bucket: ``round(mean over its prompts of the group-mean count)`` and that mean (None when absent).

    Args: counts (N,) HWE counts; buckets (N/G,). Returns two lists of 3.
    """
    per_prompt = counts.float().view(-1, group_size).mean(dim=1)
    means = [float(per_prompt[buckets == b].mean()) if bool((buckets == b).any()) else None for b in range(3)]
    return [None if m is None else float(round(m)) for m in means], means


def update_alpha(alpha: list[float], means: list, targets: list, lr: float, low: float, high: float) -> list[float]:
    """``alpha_d + lr delta`` clipped to ``[low, high]``: ``delta = mean - target`` (easy, medium), ``target - mean``
    (hard); buckets absent from the batch (mean None) keep their weight."""
    out = list(alpha)
    for b in range(3):
        if means[b] is not None:
            delta = means[b] - targets[b] if b < 2 else targets[b] - means[b]
            out[b] = min(max(alpha[b] + lr * delta, low), high)
    return out


def huber(x: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """``x^2 / (2k)`` for ``x <= k``, else ``x - k/2`` (``x`` clamped at 0 first)."""
    x = x.clamp(min=0)
    return torch.where(x <= kappa, 0.5 * x * x / kappa, x - 0.5 * kappa)


def entropy_bonus(counts: torch.Tensor, targets: torch.Tensor, buckets: torch.Tensor, correct: torch.Tensor,
                  alpha: torch.Tensor, o: AresOptions) -> torch.Tensor:
    """ARES's hierarchical entropy reward per response (module docstring, point 4).

    Args: (N,) tensors: HWE counts, the targets of each row's bucket, the bucket (0 easy, 1 medium, 2 hard), correct
    (bool), the bucket weight alpha of each row. Returns (N,) float.
    """
    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=counts.device)[buckets]

    n, target = counts.float(), targets.float()
    delta = n - target
    margin = torch.maximum(per_row(o.margin_frac) * target.clamp(min=1.0), torch.full_like(n, o.min_margin))
    kappa, temp = per_row(o.kappa), per_row(o.temperature)
    cap = alpha.float() * per_row(o.cap_scale)
    over = (delta - margin).clamp(min=0)
    gain = torch.sigmoid(over / temp) * cap * per_row(o.wrong_gain)
    easy_pen = -torch.minimum(cap, huber(over, kappa) / (margin + kappa) * cap)
    medium_pen = -torch.minimum(cap, huber(delta.abs() - margin, kappa) / (margin + kappa) * cap)
    hard_bonus = torch.where(
        delta >= -margin,
        torch.sigmoid((delta + margin) / temp) * cap,
        -torch.minimum(cap, 0.5 * huber(-delta - margin, kappa) / (margin + kappa) * cap),
    )
    right = torch.where(buckets == 0, easy_pen, torch.where(buckets == 1, medium_pen, hard_bonus))
    return torch.where(correct, right, gain)


class AresPlugin(Plugin):
    """ARES's difficulty-aware HWE reward (reward stage) and per-bucket dynamic KL coefficient (loss stage)."""

    name = "ares"
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = "its HWE count reads windows of token entropies over the whole completion, tool results included."
    version = "0.2.0"
    paper = ("ARES: Multimodal Adaptive Reasoning via Difficulty-Aware Token-Level Entropy Shaping (AEPO), "
             "arXiv:2510.08457")
    summary = ("Rewards or penalises high-window-entropy reasoning moments per difficulty bucket and scales the "
               "reference KL per bucket with a dynamic controller; optionally branches rollouts at HWE tokens.")
    Options = AresOptions
    official = OfficialSource(
        "shawn0728/ARES", "146620e", verdict="faithful",
        files=("examples/reward_function/aepo.py", "verl/trainer/ray_trainer.py",
               "verl/workers/rollout/vllm_rollout_spmd.py", "verl/workers/actor/dp_actor.py",
               "experiments/AEPO/config.yaml"),
        note="Reward and KL as official; the HWE-triggered branching (off by default) is reconstructed from the "
        "paper (the official rollout samples independently); the cold start is not here. Full-vocabulary "
        "entropy (official: vLLM top-10 plus tail), trigger test on the sampled token (official: the top-1 token), "
        "controller statistics summed over processes, TRL's unclamped k3 KL; tau of the first batch from that batch.",
    )
    claim_metric = ("hwe_count", "high-window-entropy reasoning moments per response")
    reconstructed = (
        "tau of the first training batch is that batch's median (official: a validation pass)",
        "HWE-triggered branching (the official code does not branch): the last branch_rollouts rows of a group "
        "continue the other rows from their HWE trigger tokens, highest window entropy first",
    )

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self.alpha = [float(a) for a in o.alpha_init]
        self.targets: list = [None, None, None]
        self.threshold: float | None = o.high_entropy_threshold
        self.kl_beta = [float(o.kl_beta_init)] * 3
        self.kl_last: list = [None, None, None]
        self.kl_error = [0.0, 0.0, 0.0]
        self.kl_updates = 0
        self.bias_correction = False
        self._words: frozenset[str] | None = None
        self._trigger_cache: dict[int, bool] = {}
        self._pending = False  # the prompt stage deferred the branch rows of this step

    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_transform_advantages", "trl_plugins_loss"):
            return self.options.dynamic_kl
        if hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation"):
            return self.options.branch_rollouts > 0
        return True

    def multi_turn_refusal(self) -> str | None:
        if self.options.branch_rollouts > 0:
            return ("its HWE branches continue through the branching seam, which samples single-turn text without "
                    "running tools; set branch_rollouts=0 for tool rollouts.")
        return None

    @property
    def neutral_reward(self) -> bool:
        return all(a == 0 for a in self.options.alpha_init) and self.options.alpha_lr == 0

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(self.name)]  # the bonus needs whole groups: the reward transform fills it in

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        R = self.options.branch_rollouts
        if R and samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"ares with branch_rollouts={R} (HWE-triggered branching) cannot run with use_vllm=True or continuous "
                f"batching: {VLLM_BRANCHING} Or set branch_rollouts=0 (independent rollouts).")
        if R >= args.num_generations:
            raise PluginConfigError(
                f"Option 'branch_rollouts' of plugin 'ares' got {R} with num_generations={args.num_generations}; "
                "allowed: 0 <= branch_rollouts <= num_generations - 1 (a group needs at least one root to branch from).")
        check_reward_columns(self.name, trainer, self.options, own=self.name)
        self.bias_correction = bool(getattr(args, "use_bias_correction_kl", False))
        if self.options.dynamic_kl and float(getattr(args, "beta", 0.0)) == 0.0:
            warnings.warn("ares: dynamic_kl scales TRL's reference KL, which is off (beta=0); ARES uses beta=0.01 "
                          "(kl_coef). Only the entropy reward acts.", stacklevel=2)

    # ------------------------------------------------------------------------------------------ branching
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer the last ``branch_rollouts`` rows of every group: TRL samples the roots only."""
        G, R = ctx.num_generations, self.options.branch_rollouts
        ctx.defer_slots(lambda k: k >= G - R)
        self._pending = True  # on every process, whatever its rows: the next hook's collectives run everywhere

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Fill the branch rows with continuations of their roots from the roots' HWE trigger tokens (collective:
        one forward, up to three gathers and one branching call on every process)."""
        if not self._pending:  # e.g. a refill round: its rows were sampled independently
            return
        self._pending = False
        o, G, B, R = self.options, ctx.num_generations, len(ctx), self.options.branch_rollouts
        roots = [i for i in range(B) if ctx.index_in_group[i] < G - R]
        entropies = [h.float().cpu() for h in ctx.policy_entropies(roots)]  # collective
        device = context_device(ctx)
        tau = self.threshold
        if tau is None:  # first batch: the median of the roots' percentiles, over every process
            local = torch.full((B,), float("nan"), dtype=torch.float64)
            for i, h in zip(roots, entropies):
                local[i] = window_percentile(h, o.window_size, o.threshold_percentile)
            tau = float(torch.nanquantile(ctx.gather(local.to(device)).cpu(), 0.5))
        local_points = torch.full((B, R + 1), -1, dtype=torch.long)  # R branch points and the HWE count
        for i, h in zip(roots, entropies):
            points, found = branch_points(h, self.is_trigger(list(ctx.completion_ids[i]), ctx.tokenizer),
                                          o.window_size, tau, R)
            local_points[i] = torch.tensor(points + [found], dtype=torch.long)
        points = ctx.gather(local_points.to(device)).cpu()
        is_root = set(roots)
        root_ids = gather_id_lists(ctx, [ctx.completion_ids[i] if i in is_root else [] for i in range(B)])
        limit = ctx.run.max_completion_length
        rows, prompts, prefixes, room, cuts, at_hwe = [], [], [], [], [], []
        for i in range(B):
            slot = branch_slot(ctx.index_in_group[i], G, R)
            if slot is None:
                continue
            g = ctx.group_ids[i] * G + slot[0]
            cut = min(int(points[g, slot[1]]) + 1, max(len(root_ids[g]) - 1, 0), limit - 1)  # keep the trigger token
            rows.append(i)
            prompts.append(list(ctx.prompt_ids[i]))
            prefixes.append(root_ids[g][:cut])
            room.append(limit - cut)
            cuts.append(cut)
            at_hwe.append(int(points[g, R]) > 0)
        continuations = ctx.continue_prefixes(prompts, prefixes, room)  # collective, even with no request
        for i, c, cut in zip(rows, continuations, cuts):
            lps = None if ctx.sampling_logprobs is None else [float("nan")] * cut + list(c.logprobs)
            ctx.replace_row(i, c.completion_ids, logprobs=lps)
            ctx.annotations[i][BRANCH_KEY] = [branch_slot(ctx.index_in_group[i], G, R)[0], cut]
        ctx.log_metric("branch_rollouts", float(len(rows)))
        if rows:
            ctx.log_metric("branch_position", sum(cuts) / len(cuts))
            ctx.log_metric("branch_at_hwe_fraction", sum(at_hwe) / len(at_hwe))

    # ------------------------------------------------------------------------------------------ reward stage
    def is_trigger(self, ids: list[int], tokenizer) -> torch.Tensor:
        """(L,) bool: the token's normalised text (``decode([id])``) is a trigger word; decoded once per id."""
        tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        if self._words is None:
            self._words = frozenset(normalize_token(w) for w in (self.options.trigger_words or TRIGGER_WORDS))
        new = sorted({int(i) for i in ids} - self._trigger_cache.keys())
        if new:
            texts = tok.batch_decode([[i] for i in new])
            self._trigger_cache.update({i: normalize_token(t) in self._words for i, t in zip(new, texts)})
        return torch.tensor([self._trigger_cache[int(i)] for i in ids], dtype=torch.bool)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Fill the ``ares`` column with the entropy bonus (one no-grad forward over the local rows)."""
        o = self.options
        ids = local_completion_ids(ctx, self.name)
        if self.neutral_reward:  # neutral: an all-zero column, no forward
            return
        entropies = [h.float().cpu() for h in ctx.policy_entropies()]
        percentiles = ctx.gather_object([window_percentile(h, o.window_size, o.threshold_percentile)
                                         for h in entropies])
        train = ctx.mode == "train"
        batch_tau = float(torch.quantile(torch.tensor(percentiles, dtype=torch.float64), 0.5)) if percentiles else 0.0
        tau = self.threshold if self.threshold is not None else batch_tau
        local = [hwe_count(h, self.is_trigger(list(row), ctx.tokenizer), o.window_size, tau)
                 for h, row in zip(entropies, ids)]
        device = ctx.rewards_per_func.device
        counts = torch.tensor(ctx.gather_object(local), dtype=torch.float32, device=device)
        if train and o.high_entropy_threshold is None:  # the next batch counts with the updated threshold
            self.threshold = batch_tau if self.threshold is None else (
                o.threshold_ema * self.threshold + (1 - o.threshold_ema) * batch_tau)
        G = ctx.num_generations
        correct = correct_rows(ctx, o).to(device)
        groups = difficulty_buckets(correct, G)
        targets, means = bucket_targets(counts, groups, G)
        alpha = update_alpha(self.alpha, means, targets, o.alpha_lr, o.alpha_min, o.alpha_max)
        if train:
            self.alpha, self.targets = alpha, [t if t is not None else s for t, s in zip(targets, self.targets)]
        buckets = groups.repeat_interleave(G)
        row_targets = torch.tensor([t if t is not None else 0.0 for t in targets], device=device)[buckets]
        row_alpha = torch.tensor(alpha, device=device)[buckets]
        bonus = entropy_bonus(counts, row_targets, buckets, correct, row_alpha, o)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(self.name)] = bonus.to(rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("hwe_count", counts.mean().item())
        ctx.log_metric("threshold", tau)
        ctx.log_metric("bonus", bonus.mean().item())
        for b, name in enumerate(BUCKETS):
            ctx.log_metric(f"alpha_{name}", alpha[b])
            ctx.log_metric(f"fraction_{name}", (buckets == b).float().mean().item())
            if targets[b] is not None:
                ctx.log_metric(f"target_{name}", targets[b])

    # ------------------------------------------------------------------------------------- advantage + loss
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Send each row's difficulty bucket (from the verifier, as at the reward stage) to the loss stage."""
        correct = correct_rows(ctx, self.options)
        G = ctx.num_generations
        ctx.extras[BUCKET_KEY] = difficulty_buckets(correct, G).repeat_interleave(G).to(ctx.rewards.device)

    def update_kl_controller(self, kl_sum: torch.Tensor, rows: torch.Tensor) -> None:
        """One micro-batch of the per-bucket controller (module docstring, point 5).

        Args: kl_sum (3,) sum of the per-sequence mean KL of each bucket's rows; rows (3,) their numbers.
        """
        o = self.options
        self.kl_updates += 1
        for b in range(3):
            if float(rows[b]) == 0:
                continue
            current = float(kl_sum[b]) / float(rows[b])
            last = current if self.kl_last[b] is None else self.kl_last[b]
            kl = (1 - o.kl_ema) * current + o.kl_ema * last
            self.kl_last[b] = kl
            error = kl / max(o.kl_target[b], 1e-8) - 1.0
            if abs(error) < o.kl_deadzone or self.kl_updates % o.kl_update_interval != 0:
                continue
            self.kl_error[b] = (1 - o.kl_ema) * error + o.kl_ema * self.kl_error[b]
            step = min(max(self.kl_error[b], -o.kl_clip), o.kl_clip)
            beta = min(max(self.kl_beta[b], o.kl_beta_min), o.kl_beta_max)
            log_beta = min(max(math.log(beta) + o.kl_lr * step, math.log(o.kl_beta_min)), math.log(o.kl_beta_max))
            self.kl_beta[b] = math.exp(log_beta)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        kl = token_kl(ctx, self.bias_correction)
        if kl is None or BUCKET_KEY not in ctx.extras:
            return
        buckets = ctx.extras[BUCKET_KEY].reshape(-1).long().to(ctx.per_token_logps.device)
        if ctx.mode == "train":
            with torch.no_grad():
                mask = ctx.mask.float()
                seq_kl = (kl.detach() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                onehot = torch.nn.functional.one_hot(buckets, 3).to(seq_kl.dtype)
                stats = ctx.gather(torch.cat([seq_kl @ onehot, onehot.sum(0)]).unsqueeze(0)).view(-1, 6).sum(0)
            self.update_kl_controller(stats[:3].cpu(), stats[3:].cpu())
        scale_row_kl(ctx, kl, torch.tensor(self.kl_beta, dtype=kl.dtype, device=kl.device)[buckets])
        for b, name in enumerate(BUCKETS):
            ctx.log_metric(f"kl_beta_{name}", self.kl_beta[b])

    # ------------------------------------------------------------------------------------------------ state
    @hookimpl
    def trl_plugins_state_dict(self):
        return {"alpha": list(self.alpha), "targets": list(self.targets), "threshold": self.threshold,
                "kl_beta": list(self.kl_beta), "kl_last": list(self.kl_last), "kl_error": list(self.kl_error),
                "kl_updates": self.kl_updates}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.alpha = [float(a) for a in state.get("alpha", self.alpha)]
        self.targets = list(state.get("targets", self.targets))
        self.threshold = state.get("threshold", self.threshold)
        self.kl_beta = [float(b) for b in state.get("kl_beta", self.kl_beta)]
        self.kl_last = list(state.get("kl_last", self.kl_last))
        self.kl_error = [float(e) for e in state.get("kl_error", self.kl_error)]
        self.kl_updates = int(state.get("kl_updates", self.kl_updates))
