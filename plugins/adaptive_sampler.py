"""Adaptive prompt sampler — variance- and accuracy-aware selection of the prompts TRL draws.

Three data-level methods that decide *which prompts* enter a generation batch, from a per-prompt history of
outcomes, before anything is generated (so zero-variance groups are avoided rather than filtered):

* **MMR1 Variance-Aware Sampling** (arXiv:2509.21268): each prompt gets a Variance Promotion Score
  ``VPS = a * OVS + b * TDS`` — OVS the outcome variance ``p (1 - p)`` of its correctness rate ``p``, TDS the
  diversity of its trajectories — and each batch mixes VPS-weighted draws (share ``variance_mix``) with uniform
  draws. Here OVS is scaled to ``4 p (1 - p)`` (in [0, 1]) and TDS is the fraction of distinct completions in the
  prompt's last group (a cheap proxy of the paper's trajectory diversity, off by default). A prompt never drawn
  has ``p = prior_accuracy`` (0.5: maximal variance, so new prompts are tried early).
* **RuleReasoner domain-aware dynamic sampling** (arXiv:2506.08672; official code ``compute_weights``): every
  ``domain_update_interval`` batches, that batch's per-domain correctness rewards enter a buffer of the last
  ``domain_buffer_size`` updates, decayed by the harmonic series (latest 1, then 1/2, 1/3, ...); per domain
  ``r_d = sum(decayed rewards) / count``, the target is ``target * H(buffer_size) / buffer_size``, the value
  ``v_d = max(0, target - r_d)`` and the weight ``w_d ∝ exp((v_d + eps) / tau)``. Domains start with equal weights
  (official "average" init). Defaults are the official script's (update every 8 steps, buffer 4, eps 0.1,
  tau 0.3, target 1.0). A domain absent from the buffer gets ``v_d = target`` (our choice).
* **RAPO curriculum pruning** (Fathom-DeepResearch, arXiv:2509.24107): prompts the policy has saturated (every
  rollout of its last ``prune_after`` groups correct) are removed from the pool. When fewer than a batch of
  prompts remain, pruned prompts are drawn again (uniformly).
* **RAPO per-prompt replay buffers on tool rollouts** (same paper; ``replay_buffer``, off by default; multi-turn tool
  runs only): each prompt keeps its latest successful tool episode (whole: completion ids with the tool-result tokens,
  TRL's tool mask and messages, behaviour log-probs of the model tokens), stored through the tool-episode seam
  (``ctx.store_tool_episodes``); a later group of that prompt in which every rollout failed gets it in slot 0
  (``ctx.replay_tool_episodes`` + ``ctx.replace_episode``: its turn structure kept, a fresh environment with its tool
  calls replayed, TRL's reward pass scores it), which restores the group's reward variance. It is trained as a group
  member (TRL's group advantage) with TRL's clipped ratio against its stored behaviour log-probs, exact for an
  off-policy episode. The paper states the rule in one sentence (inject the latest successful rollout into failed
  groups) and no training code is public: the slot, the failed-group test (no rollout above the success threshold)
  and the ratio against behaviour log-probs are reconstructed. Single-turn runs: the ``replay`` plugin (RAPO's
  settings by default).
* **RAPO reward-aware advantage scaling** (same paper; ``advantage_scaling``, off by default): at the advantage
  stage, the advantages of the "good" groups (rewards not all equal, so ``sigma_R > 0``) are multiplied by
  ``n_groups / n_good`` — the inverse of their frequency in the batch — so a batch where few groups carry signal
  keeps its gradient magnitude without DAPO-style re-sampling. Other groups are unchanged; a batch with no good
  group is unchanged. The paper describes the rule in words only (inverse of the good groups' share of the batch)
  and no training code is public, so the exact factor (count over the gathered batch, no cap) is reconstructed.

Sampling probability of prompt ``i`` in the unpruned pool: ``base_i = w_{d(i)} / |pool ∩ d(i)|`` (``1 / |pool|``
without domains) and ``q_i = (1 - lam) * base_i + lam * base_i * VPS_i / sum_j base_j VPS_j``; each chunk of
``generation_batch_size / G`` prompts is drawn without replacement from ``q``.

Mechanism: the ``trl_plugins_train_sampler`` hook replaces TRL's ``RepeatSampler`` with a sampler that keeps its
layout (each index G times in a row, each chunk ``num_iterations * steps_per_generation`` times, same length per
epoch, same sequence on every process). Chunk ``c`` is drawn with a generator seeded by ``(seed, c)``. Outcomes are
read at the reward stage from the **gathered** reward matrix (identical on every process) and matched to the
chunk's prompt indices. The dataloader draws ahead of training (TRL pulls a whole optimizer step of batches and
accelerate prefetches one more), so the outcome of chunk ``c`` is applied exactly when chunk ``c + feedback_delay``
is drawn (auto: the smallest delay the prefetch allows); this makes the draws a function of the seed and the
history alone, so every process draws the same and a resumed run draws what the unbroken run drew. The state
(per-prompt accuracy, streaks, pruned set, domain buffer, pending outcomes) is saved in every checkpoint.

A rollout is "correct" when its verifier column is above ``success_threshold`` (the first reward function that is
not a placeholder unless ``success_column`` names another; other reward columns never change the verdict). With ``variance_mix = 0``, no
``domain_column``, ``prune_solved = false``, ``advantage_scaling = false`` and ``replay_buffer = false`` the plugin
keeps TRL's own sampler, rollouts and advantages (vanilla GRPO). With ``replay_buffer`` it logs
``all_fail_group_fraction``, ``replayed_group_fraction`` and ``replay_buffer_prompts``. ``shuffle_dataset = False``
is ignored once the sampler is replaced (the draws are random by construction).

No official code was reachable: no official training code of MMR1's variance-aware sampling was found; compared
with the paper's abstract and summaries, the mix of variance and diversity, the priors, the history decay and the
pruning are reconstructed (``trl-plugins show adaptive_sampler``, docs/faithfulness.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.contexts import context_device
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import completion_text, stable_key
from trl_plugins.components.prompt_history import (
    HistoryRepeatSampler,
    chunk_generator,
    default_feedback_delay,
    refuse_iterable_dataset,
    refuse_unrestored_resume,
    warn_lagging_feedback,
)

from ._episode_replay import own_episode, splice_tool_rows, store_tool_rows
from ._rollout_buffer import RolloutBuffer

#: Annotation of a row that received a replayed episode (``replay_buffer``).
RAPO_REPLAYED = "rapo_replayed"


@dataclass
class AdaptiveSamplerOptions(SuccessOptions):
    variance_mix: float = option(
        0.5, min=0.0, max=1.0,
        help="lam: share of the sampling probability given by the variance score (MMR1 VAS mixes VPS-weighted and "
        "uniform draws); 0 = no variance weighting.",
        reconstructed=True,
    )
    ovs_weight: float = option(1.0, min=0.0, help="Weight of the outcome variance score 4p(1-p) in the VPS.")
    diversity_weight: float = option(
        0.0, min=0.0,
        help="Weight of the trajectory diversity score (distinct-completion fraction of the last group) in the VPS.",
        reconstructed=True,
    )
    prior_accuracy: float = option(
        0.5, min=0.0, max=1.0, help="Correctness rate assumed for prompts never drawn.", reconstructed=True
    )
    history_decay: float = option(
        0.5, min=0.0, max=1.0,
        help="Per-prompt accuracy is an EMA: p <- decay * p + (1 - decay) * group accuracy (0 = last group only).",
        reconstructed=True,
    )
    success_threshold: float = option(
        0.5, help="A rollout is correct when its verifier column (success_column) is above this value.",
        reconstructed=True,
    )
    prune_solved: bool = option(True, help="RAPO: drop prompts whose last prune_after groups were all correct.")
    prune_after: int = option(
        1, min=1, help="Consecutive all-correct groups before a prompt is pruned.", reconstructed=True
    )
    domain_column: str | None = option(
        None, help="Dataset column naming each prompt's domain (RuleReasoner domain weights); None = no domains."
    )
    domain_update_interval: int = option(8, min=1, help="Recompute the domain weights every this many batches.")
    domain_buffer_size: int = option(4, min=1, help="Updates kept in the domain reward buffer (harmonic decay).")
    domain_tau: float = option(0.3, min=0.0, min_exclusive=True, help="Temperature of the domain softmax.")
    domain_epsilon: float = option(0.1, min=0.0, help="Added to each domain value before the softmax.")
    domain_target: float = option(
        1.0, min=0.0, max=1.0, min_exclusive=True, help="Target reward per domain (official target_reward_base)."
    )
    advantage_scaling: bool = option(
        False,
        help="RAPO: multiply the advantages of groups with non-constant rewards by n_groups / n_good (inverse "
        "batch frequency of informative groups); false = TRL's advantages.",
        reconstructed=True,
    )
    replay_buffer: bool = option(
        False,
        help="RAPO per-prompt replay buffers (multi-turn tool rollouts): the latest successful tool episode of each "
        "prompt is kept (with its tool results and behaviour log-probs) and injected into slot 0 of a later group of "
        "that prompt in which every rollout failed, restoring the group's reward variance; it trains with TRL's "
        "clipped ratio against its stored behaviour log-probs. false = no replay (single-turn runs: the replay "
        "plugin).",
    )
    feedback_delay: int | None = option(
        None, min=1,
        help="Outcomes of chunk c are used from chunk c + feedback_delay on; None = smallest delay the dataloader's "
        "prefetching allows (gradient_accumulation_steps, workers and repeat count).",
    )

    @property
    def active(self) -> bool:
        return self.variance_mix > 0 or self.domain_column is not None or self.prune_solved


# ================================================================================================ pure functions
def rapo_advantage_scale(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, int, int]:
    """RAPO's reward-aware advantage scale per row.

    Args:
        rewards: (N,) combined rewards of the gathered batch, N = n_groups * G (NaN = no reward, ignored).
        num_generations: G.

    Returns:
        scale: (N,) ``n_groups / n_good`` on rows of good groups (non-NaN rewards not all equal), 1 elsewhere
            (all ones when no group is good); n_good; n_groups.
    """
    grouped = rewards.detach().float().view(-1, num_generations)
    n_groups = grouped.shape[0]
    finite = ~torch.isnan(grouped)
    hi = torch.where(finite, grouped, torch.full_like(grouped, -math.inf)).amax(dim=1)
    lo = torch.where(finite, grouped, torch.full_like(grouped, math.inf)).amin(dim=1)
    good = finite.sum(dim=1).ge(2) & (hi > lo)
    n_good = int(good.sum().item())
    factor = n_groups / n_good if n_good else 1.0
    scale = torch.where(good, torch.full_like(hi, factor), torch.ones_like(hi))
    return scale.repeat_interleave(num_generations), n_good, n_groups


def variance_scores(
    accuracy: torch.Tensor, diversity: torch.Tensor, prior: float, ovs_weight: float, diversity_weight: float
) -> torch.Tensor:
    """VPS per prompt (n,) in [0, 1]: weighted mean of ``4 p (1 - p)`` and the diversity score (NaN = unseen)."""
    p = torch.where(torch.isnan(accuracy), torch.full_like(accuracy, prior), accuracy)
    ovs = 4.0 * p * (1.0 - p)
    tds = torch.where(torch.isnan(diversity), torch.ones_like(diversity), diversity)
    total = ovs_weight + diversity_weight
    if total == 0:
        return torch.ones_like(p)
    return (ovs_weight * ovs + diversity_weight * tds) / total


def domain_weights_from_buffer(
    buffer: list[dict[str, list[float]]], domains: list[str], target_base: float, buffer_size: int,
    epsilon: float, tau: float,
) -> dict[str, float]:
    """RuleReasoner's domain weights from the reward buffer (oldest update first), harmonic decay.

    The latest update has decay 1, the one before 1/2, then 1/3, ...; ``r_d`` = sum of decayed rewards / their
    count; target = ``target_base * H(buffer_size) / buffer_size``; ``w_d ∝ exp((max(0, target - r_d) + eps) / tau)``.
    Domains with no reward in the buffer get the value ``target``.
    """
    target = target_base * sum(1.0 / i for i in range(1, buffer_size + 1)) / buffer_size
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for age, update in enumerate(reversed(buffer)):
        decay = 1.0 / (age + 1)
        for domain, rewards in update.items():
            sums[domain] = sums.get(domain, 0.0) + decay * sum(rewards)
            counts[domain] = counts.get(domain, 0) + len(rewards)
    values = {}
    for d in domains:
        values[d] = max(0.0, target - sums[d] / counts[d]) if counts.get(d) else target
    logits = torch.tensor([(values[d] + epsilon) / tau for d in domains], dtype=torch.float64)
    probs = torch.softmax(logits, dim=0).tolist()
    return dict(zip(domains, probs))


def sampling_probabilities(
    vps: torch.Tensor, pool: torch.Tensor, variance_mix: float,
    domain_ids: torch.Tensor | None = None, domain_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` (n,) over prompts: domain-weighted uniform base mixed with the VPS-weighted base (see module doc).

    Args:
        vps: (n,) variance scores. pool: (n,) bool, prompts that may be drawn.
        domain_ids: (n,) long domain index per prompt, with ``domain_weights`` (D,) summing to 1; None = uniform.
    """
    pool_f = pool.double()
    if domain_ids is None:
        base = pool_f / pool_f.sum().clamp(min=1.0)
    else:
        sizes = torch.zeros(domain_weights.numel(), dtype=torch.float64).index_add_(0, domain_ids, pool_f)
        present = sizes > 0
        w = torch.where(present, domain_weights.double(), torch.zeros_like(domain_weights.double()))
        w = w / w.sum().clamp(min=1e-300)
        base = pool_f * (w / sizes.clamp(min=1.0))[domain_ids]
    weighted = base * vps.double()
    if variance_mix > 0 and float(weighted.sum()) > 0:
        q = (1.0 - variance_mix) * base + variance_mix * weighted / weighted.sum()
    else:
        q = base
    return q / q.sum()


# ================================================================================================ sampler
class AdaptiveRepeatSampler(HistoryRepeatSampler):
    """TRL's ``RepeatSampler`` layout with prompts drawn by :class:`AdaptiveSamplerPlugin` (one chunk at a time)."""

    def __init__(self, plugin: AdaptiveSamplerPlugin, num_samples: int, mini_repeat_count: int, batch_size: int,
                 repeat_count: int):
        super().__init__(plugin.draw_chunk, num_samples, mini_repeat_count, batch_size, repeat_count)
        self.plugin = plugin


# ================================================================================================ plugin
class AdaptiveSamplerPlugin(Plugin):
    """Variance-aware (MMR1), domain-aware (RuleReasoner) and pruning (RAPO) prompt selection (sampling stage);
    RAPO advantage scaling (advantage stage, opt-in)."""

    name = "adaptive_sampler"
    image_inputs = True
    multi_turn = True
    version = "0.3.0"
    paper = (
        "MMR1: Enhancing Multimodal Reasoning with Variance-Aware Sampling and Open Resources (VAS), "
        "arXiv:2509.21268; RuleReasoner: Reinforced Rule-based Reasoning via Domain-aware Dynamic Sampling "
        "(DADS), arXiv:2506.08672; Fathom-DeepResearch: Unlocking Long Horizon Information Retrieval and "
        "Synthesis for SLMs (RAPO pruning, advantage scaling, replay buffers), arXiv:2509.24107"
    )
    summary = (
        "Draws prompts by outcome variance and domain need, prunes prompts the policy already solves, and can "
        "rescale advantages by the share of informative groups (RAPO)."
    )
    Options = AdaptiveSamplerOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official training code of MMR1's variance-aware sampling was found; compared with the paper's "
        "abstract and summaries: the mix of variance and diversity, the priors, the history decay and the pruning are "
        "reconstructed. RAPO (Fathom-DeepResearch): the public repository FractalAIResearchLabs/Fathom-DeepResearch "
        "@ cdc2010be8b9b7627f82e6492148d1dc9964e0b1 holds inference, evaluation and serving code only (no RAPO "
        "training code); pruning, advantage scaling and the replay buffers follow the paper's description.",
    )
    claim_metric = ("pruned_fraction", "prompts pruned")
    replaces = ("the training sampler (which prompts are drawn)",)
    reconstructed = (
        "how VPS weighting, domain weights and pruning combine into one probability (see the module docstring)",
        "TDS proxy: fraction of distinct completions in the prompt's last group (off by default)",
        "unseen prompts get p = prior_accuracy; per-prompt accuracy is an EMA (history_decay)",
        "outcomes apply with a fixed chunk delay (feedback_delay) so every process and a resumed run draw alike",
        "RAPO advantage scaling: good group = non-constant rewards; factor n_groups / n_good over the gathered "
        "batch, uncapped (the paper gives the rule in words only; no training code is public)",
        "RAPO replay buffers (replay_buffer): the latest success per prompt injected into slot 0 of an all-fail group "
        "(no rollout above success_threshold), trained with TRL's clipped ratio against its stored behaviour "
        "log-probs (the paper states the rule in one sentence; no training code is public)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._seed = 0
        self._delay = self.options.feedback_delay or 2
        self._dataset = None
        self._lag_warned = False
        self._restored = False  # set by load_state_dict: a resumed run must bring the sampler's state
        self.replay = RolloutBuffer()  # RAPO replay buffers: prompt key -> [the latest successful tool episode]
        self.reset_state(0, [])

    def required_columns(self) -> list[str]:
        return [self.options.domain_column] if self.options.domain_column else []

    def hook_enabled(self, hook: str) -> bool:
        if hook == "trl_plugins_after_generation":
            return self.options.replay_buffer
        return True

    # ------------------------------------------------------------------------------------------ state
    def reset_state(self, num_prompts: int, domains: list[str], domain_of: list[int] | None = None) -> None:
        """Fresh per-prompt state for ``num_prompts`` prompts (``domain_of`` = domain index of each prompt)."""
        self.accuracy = torch.full((num_prompts,), math.nan, dtype=torch.float64)
        self.diversity = torch.full((num_prompts,), math.nan, dtype=torch.float64)
        self.draws = torch.zeros(num_prompts, dtype=torch.long)
        self.streak = torch.zeros(num_prompts, dtype=torch.long)
        self.pruned = torch.zeros(num_prompts, dtype=torch.bool)
        self.domains = list(domains)
        self.domain_of = torch.tensor(domain_of or [0] * num_prompts, dtype=torch.long)
        self.domain_weights = {d: 1.0 / len(domains) for d in domains} if domains else {}
        self.domain_buffer: list[dict[str, list[float]]] = []
        self.pending: dict[int, dict] = {}
        self.chunks: dict[int, list[int]] = {}
        self.batches_seen = 0
        self.applied = 0  # outcomes applied to the statistics (= chunks 0 .. applied-1)

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {
            "accuracy": self.accuracy.clone(), "diversity": self.diversity.clone(), "draws": self.draws.clone(),
            "streak": self.streak.clone(), "pruned": self.pruned.clone(), "domains": list(self.domains),
            "domain_of": self.domain_of.clone(), "domain_weights": dict(self.domain_weights),
            "domain_buffer": [dict(u) for u in self.domain_buffer],
            "pending": {int(k): dict(v) for k, v in self.pending.items()},
            "chunks": {int(k): list(v) for k, v in self.chunks.items()},
            "batches_seen": self.batches_seen, "applied": self.applied, "replay": self.replay.state(),
        }

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        self.accuracy = state["accuracy"].clone()
        self.diversity = state["diversity"].clone()
        self.draws = state["draws"].clone()
        self.streak = state["streak"].clone()
        self.pruned = state["pruned"].clone()
        self.domains = list(state["domains"])
        self.domain_of = state["domain_of"].clone()
        self.domain_weights = dict(state["domain_weights"])
        self.domain_buffer = [dict(u) for u in state["domain_buffer"]]
        self.pending = {int(k): dict(v) for k, v in state["pending"].items()}
        self.chunks = {int(k): list(v) for k, v in state["chunks"].items()}
        self.batches_seen = int(state["batches_seen"])
        self.applied = int(state["applied"])
        self.replay = RolloutBuffer.from_state(state.get("replay", {}))  # absent in 0.2.0 checkpoints
        self._restored = True

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.options.replay_buffer and not getattr(trainer, "tools", None):
            raise PluginConfigError(
                "Option 'replay_buffer' of plugin 'adaptive_sampler' got true, which replays multi-turn tool episodes; "
                "allowed without tools (tools= or environment_factory=): false (single-turn replay buffers are the "
                "replay plugin's, RAPO's settings by default)."
            )
        if self.options.active:
            refuse_iterable_dataset(trainer, self.name)
        self._seed = int(args.seed)
        if self.options.feedback_delay is None:
            self._delay = default_feedback_delay(trainer, args)
        dataset = trainer.train_dataset
        if dataset is not None and self.options.active and len(self.accuracy) == 0:
            self._bind_dataset(dataset)

    def _bind_dataset(self, dataset: Any) -> None:
        self._dataset = dataset
        n = len(dataset)
        if len(self.accuracy) == n:
            return
        if self.options.domain_column:
            labels = [str(v) for v in dataset[self.options.domain_column]]
            domains = sorted(set(labels))
            index = {d: k for k, d in enumerate(domains)}
            self.reset_state(n, domains, [index[v] for v in labels])
        else:
            self.reset_state(n, [])

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        if not self.options.active:
            return None
        self._bind_dataset(dataset)
        if len(self.accuracy) != len(dataset):
            raise PluginError(
                f"adaptive_sampler: its state covers {len(self.accuracy)} prompts but the training dataset has "
                f"{len(dataset)} (a checkpoint from another dataset?)."
            )
        return AdaptiveRepeatSampler(
            self, len(dataset), mini_repeat_count=sampler.mini_repeat_count, batch_size=sampler.batch_size,
            repeat_count=sampler.repeat_count,
        )

    # ------------------------------------------------------------------------------------------ drawing
    def probabilities(self) -> torch.Tensor:
        """Current ``q`` (n,) over all prompts (pruned ones rejoin when the pool is smaller than needed)."""
        o = self.options
        vps = variance_scores(self.accuracy, self.diversity, o.prior_accuracy, o.ovs_weight, o.diversity_weight)
        pool = ~self.pruned if o.prune_solved else torch.ones_like(self.pruned)
        weights = None
        if self.domains:
            weights = torch.tensor([self.domain_weights[d] for d in self.domains], dtype=torch.float64)
        return sampling_probabilities(vps, pool, o.variance_mix, self.domain_of if self.domains else None, weights)

    def draw_chunk(self, chunk: int, size: int) -> list[int]:
        """Prompt indices of chunk ``chunk`` (``size`` distinct prompts), after applying outcomes due by then."""
        self._apply_due(chunk)
        q = self.probabilities()
        pool = int((q > 0).sum())
        if pool < size:  # too few unpruned prompts: the pruned ones rejoin, uniformly, for this chunk
            q = torch.where(q > 0, q, torch.full_like(q, float(q[q > 0].min()) if pool else 1.0))
            q = q / q.sum()
        indices = torch.multinomial(q, size, replacement=False, generator=chunk_generator(self._seed, chunk))
        drawn = indices.tolist()
        self.chunks[chunk] = drawn
        for old in [c for c in self.chunks if c < chunk - self._delay - 8]:
            del self.chunks[old]
        return drawn

    def _apply_due(self, chunk: int) -> None:
        due = chunk - self._delay
        if due >= 0 and self.batches_seen <= due and not self._lag_warned:
            warn_lagging_feedback(self.name, chunk, due)
            self._lag_warned = True
        for c in sorted(k for k in self.pending if k <= due):
            self._apply(self.pending.pop(c))
            self.applied = max(self.applied, c + 1)

    def _apply(self, outcome: dict) -> None:
        o = self.options
        for idx, acc, div in zip(outcome["indices"], outcome["accuracy"], outcome["diversity"]):
            old = float(self.accuracy[idx])
            self.accuracy[idx] = acc if math.isnan(old) else o.history_decay * old + (1 - o.history_decay) * acc
            if div is not None:
                self.diversity[idx] = div
            self.draws[idx] += 1
            self.streak[idx] = self.streak[idx] + 1 if acc >= 1.0 else 0
            if o.prune_solved and int(self.streak[idx]) >= o.prune_after:
                self.pruned[idx] = True
        if self.domains and outcome.get("update_domains"):
            self.domain_buffer.append(outcome["domain_rewards"])
            self.domain_buffer = self.domain_buffer[-o.domain_buffer_size:]
            self.domain_weights = domain_weights_from_buffer(
                self.domain_buffer, self.domains, o.domain_target, o.domain_buffer_size, o.domain_epsilon, o.domain_tau
            )

    # ------------------------------------------------------------------------------------------ outcomes
    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Read (never change) the gathered rewards: record the outcome of the chunk this batch was drawn from."""
        if not self.options.active or ctx.mode != "train":
            return
        k = self.batches_seen
        step = ctx.step
        if k == 0 and step > 0 and not self._restored:
            refuse_unrestored_resume(self.name, step)
        chunk = self.chunks.get(k)
        if chunk is None:
            return  # not drawn by this plugin's sampler (e.g. a custom loop); nothing to learn from
        self.record_outcome(ctx, k, chunk)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """RAPO advantage scaling: good groups' advantages times n_groups / n_good (training batches only)."""
        if not self.options.advantage_scaling or ctx.mode != "train":
            return
        scale, n_good, n_groups = rapo_advantage_scale(ctx.rewards, ctx.num_generations)
        adv = ctx.advantages
        scale = scale.to(device=adv.device, dtype=adv.dtype)
        ctx.advantages = adv * (scale.unsqueeze(-1) if adv.dim() == 2 else scale)
        ctx.log_metric("good_group_fraction", n_good / n_groups)
        ctx.log_metric("advantage_scale", n_groups / n_good if n_good else 1.0)

    # ------------------------------------------------------------------------------------------ RAPO replay
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """RAPO replay buffers (``replay_buffer``, tool episodes): store each prompt's latest success, inject it into a
        later all-fail group of the prompt. Decisions come from gathered flags (the same on every process)."""
        G, B = ctx.num_generations, len(ctx)
        success = ctx.success(range(B), rule=self.options.success_rule).cpu()
        local = torch.tensor([[int(success[i]), int(own_episode(ctx, i)), stable_key(ctx.prompts[i])]
                              for i in range(B)], dtype=torch.long).view(B, 3)
        flags = ctx.gather(local.to(context_device(ctx))).cpu()  # (N, 3): success, own episode, prompt key
        ok, keys = flags[:, 0].bool(), flags[:, 2].tolist()
        all_fail = ~ok.view(-1, G).any(dim=1)
        splices = {g * G: self.replay[keys[g * G]][-1] for g in torch.nonzero(all_fail).flatten().tolist()
                   if keys[g * G] in self.replay}
        latest = {keys[n]: n for n in torch.nonzero(ok & flags[:, 1].bool()).flatten().tolist()}
        if latest:  # every process calls the seam together (the decision is global)
            store_tool_rows(ctx, self.replay, sorted(latest.values()), keys, 1)
        replayed = splice_tool_rows(ctx, splices, "behaviour") if splices else []
        for i in replayed:
            ctx.annotations[i][RAPO_REPLAYED] = True
        ctx.log_metric("all_fail_group_fraction", float(all_fail.float().mean()) if all_fail.numel() else 0.0)
        ctx.log_metric("replayed_group_fraction", len(splices) / max(all_fail.numel(), 1))
        ctx.log_metric("replay_buffer_prompts", len(self.replay))

    def record_outcome(self, ctx: RewardContext, k: int, chunk: list[int]) -> None:
        o = self.options
        G = ctx.num_generations
        success = ctx.success(o.success_rule).cpu()  # (N,) on the verifier column only
        if success.numel() != len(chunk) * G:
            raise PluginError(
                f"adaptive_sampler: generation batch {k} has {success.numel()} rows but its chunk holds {len(chunk)} "
                f"prompts x {G} generations."
            )
        self._check_rows(ctx, chunk)
        correct = success.double().view(-1, G)
        accuracy = correct.mean(dim=1).tolist()
        diversity: list[float | None] = [None] * len(chunk)
        if o.diversity_weight > 0:
            texts = ctx.gather_object([completion_text(c) for c in ctx.local_completions])  # collective
            diversity = [
                (len(set(texts[j * G:(j + 1) * G])) - 1) / max(G - 1, 1) for j in range(len(chunk))
            ]
        outcome = {"indices": list(chunk), "accuracy": accuracy, "diversity": diversity}
        if self.domains:
            per_domain: dict[str, list[float]] = {}
            for j, idx in enumerate(chunk):
                domain = self.domains[int(self.domain_of[idx])]
                per_domain.setdefault(domain, []).extend(correct[j].tolist())
            outcome["domain_rewards"] = per_domain
            outcome["update_domains"] = (k + 1) % o.domain_update_interval == 0
        self.pending[k] = outcome
        self.batches_seen = k + 1
        n = max(len(self.pruned), 1)
        ctx.log_metric("pruned_fraction", float(self.pruned.sum()) / n)
        ctx.log_metric("batch_accuracy", sum(accuracy) / max(len(accuracy), 1))
        ctx.log_metric("batch_outcome_variance", sum(4 * a * (1 - a) for a in accuracy) / max(len(accuracy), 1))
        ctx.log_metric("seen_fraction", float((self.draws > 0).sum()) / n)
        for d, w in self.domain_weights.items():
            ctx.log_metric(f"domain_weight/{d}", w)

    def _check_rows(self, ctx: RewardContext, chunk: list[int]) -> None:
        """The local rows must be the chunk's prompts (decided on every process from gathered flags)."""
        if self._dataset is None:
            return
        G = ctx.num_generations
        start = ctx.process_slice.start
        flags = []
        for j, row in enumerate(ctx.local_rows):
            idx = chunk[(start + j) // G]
            flags.append(row.get("prompt") == self._dataset[idx].get("prompt"))
        if not all(ctx.gather_object(flags)):
            raise PluginError(
                "adaptive_sampler: the generation batch does not hold the prompts its sampler drew (another plugin "
                "or a custom dataloader changed the order, or train() was called again on the same trainer: build "
                "a new trainer for a new run)."
            )
