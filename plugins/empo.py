"""EMPO — Entropy Minimized Policy Optimization (arXiv:2504.05812), with a TTRL majority-vote mode (arXiv:2504.16084).

Label-free RL: no reference answer is needed. The G completions of a prompt are clustered by meaning — for math,
by their final answers (extracted, then compared by normalised exact match, :mod:`trl_plugins.api.answers`) — and

* ``mode="semantic_cluster"`` (EMPO): each completion is rewarded with the empirical probability of its cluster,
  ``r_i = |C(i)| / G``. Maximising it minimises the semantic entropy of the group's answers (the model is pushed
  toward its most consistent answer); a completion without an answer gets 0;
* ``mode="majority_vote"`` (TTRL): ``r_i = 1`` if the completion's answer is the majority answer of the prompt's
  vote pool, else 0 (ties go to the answer that appears first; no answer at all gives 0).

TTRL's vote pool. By default (``vote_pool`` unset) the majority is taken over the G rollouts that are trained on.
TTRL's official recipe votes over more rollouts than it trains on: 64 votes per prompt
(``n_votes_per_prompt``), of which the first 32 (``n_samples_per_prompt``) are kept for training. ``vote_pool=P``
(> G) reproduces that split: in the sampling stage the plugin asks the generation service for ``P - G`` more
completions of each prompt, under the same prompt and sampling settings; they only vote (never trained, never
rewarded). The G trained rollouts are among the P voters, as in TTRL, whose trained samples are a prefix of its
i.i.d. votes. The extra completions count in the generation budget (``plugin_generation_budget``) and in the logged
extra rollouts. TTRL's setting: ``num_generations=32``, ``vote_pool=64``. Evaluation batches (no sampling stage) vote
over their own rollouts.

The reward is the column ``empo`` (TRL's reward weights apply). Reward functions see only this process's rows,
so the column is filled by a reward transform with the whole groups in view (answers gathered across processes).

Entropy thresholding (EMPO's filter of prompts whose semantic entropy is too low or too high) is available with
``entropy_low`` / ``entropy_high``: groups outside ``(low, high)`` get zero advantages. It is off by default: the
thresholds are reconstructed (EMPO's verl recipe filters prompts by confidence bounds of the largest cluster). Watch
for the "model collapse step" of label-free RL ("How Far Can Unsupervised RLVR Scale LLM Training?"): consistency
rewards sharpen the initial distribution and can rise then fall; log accuracy separately.

Stacks with ``seed_grpo`` (same answer clustering, computed once per batch).

Official code checked against: ``QingyangZhang/EMPO@c5eccd4`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show empo``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import (
    batch_clusters,
    cluster_answers,
    cluster_fractions,
    get_extractor,
    majority_votes,
    semantic_entropy,
)
from trl_plugins.api.reasons import CORRECTNESS_PICK_ONE
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE

COLUMN = "empo"


@dataclass
class EmpoOptions(PluginOptions):
    mode: Literal["semantic_cluster", "majority_vote"] = option(
        "semantic_cluster", help="EMPO cluster-probability reward, or TTRL majority-vote reward."
    )
    extractor: str = option(
        "task",
        help="Answer extractor: task, boxed, last_number, boxed_or_last_number, or 'package.module:function'.",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the empo column.")
    vote_pool: int | None = option(
        None, min=1,
        help="mode='majority_vote': answers voted on per prompt. None: the G trained rollouts. P > G: P - G extra "
        "completions per prompt from the generation service vote too (counted in the generation budget, never "
        "trained). Official TTRL: 64 votes, 32 trained (num_generations=32, vote_pool=64); None here is a "
        "cheaper deviation.",
    )
    entropy_low: float | None = option(
        None, min=0.0, help="Zero the advantages of groups whose semantic entropy is <= this.", reconstructed=True
    )
    entropy_high: float | None = option(
        None, min=0.0, help="Zero the advantages of groups whose semantic entropy is >= this.", reconstructed=True
    )
    entropy_estimator: Literal["plugin", "mc"] = option(
        "plugin", help="Entropy used by the thresholds: -sum p log p ('plugin') or SEED-GRPO's -(1/K) sum log p.",
        reconstructed=True,
    )

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'empo': {exc}.") from exc
        if self.vote_pool is not None and self.mode != "majority_vote":
            raise PluginConfigError(
                f"Option 'vote_pool' of plugin 'empo' got {self.vote_pool!r} with mode={self.mode!r}; the vote pool "
                "belongs to mode='majority_vote' (TTRL): set that mode, or leave vote_pool unset."
            )


def empo_rewards(cluster_ids: list[list[int | None]], mode: str) -> list[float]:
    """Flat (N,) rewards from per-group cluster ids (EMPO fractions or TTRL majority votes)."""
    out: list[float] = []
    for ids in cluster_ids:
        out.extend(cluster_fractions(ids) if mode == "semantic_cluster" else majority_votes(ids))
    return out


def pooled_majority_votes(answers: list[str | None], extra_votes: list[list[str | None]], group_size: int) -> list[float]:
    """TTRL rewards with a larger vote pool: per group, the majority over its G answers followed by its extra votes.

    Args:
        answers: the N trained rollouts' answers (groups of ``group_size`` contiguous; None = no answer).
        extra_votes: one list of extra answers per group (N / G lists, possibly empty).
    Returns:
        (N,) rewards: 1.0 where a trained rollout's answer is its group's pooled majority answer, else 0.0
        (ties to the answer seen first, trained rollouts first; a pool without any answer gives zeros).
    """
    G = group_size
    out: list[float] = []
    for g, extra in enumerate(extra_votes):
        ids = cluster_answers(list(answers[g * G:(g + 1) * G]) + list(extra))
        out.extend(majority_votes(ids)[:G])
    return out


class EmpoPlugin(Plugin):
    """Label-free semantic-cluster (EMPO) or majority-vote (TTRL) reward (reward stage, optional advantage filter)."""

    name = "empo"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Right Question is Already Half the Answer: Fully Unsupervised LLM Reasoning Incentivization (EMPO), "
        "arXiv:2504.05812; TTRL: Test-Time Reinforcement Learning, arXiv:2504.16084"
    )
    summary = "Label-free reward: probability of the completion's answer cluster in its group, or majority vote."
    Options = EmpoOptions
    official = OfficialSource(
        "QingyangZhang/EMPO", "c5eccd4", verdict="faithful",
        files=("trl/src/open_r1/rewards.py",),
        note="TTRL mode checked against PRIME-RL/TTRL@c46b671 (ttrl_utils.py); answers are compared by normalised "
        "exact match, not math-verify equivalence.",
        variants=("vote_pool",),
    )
    claim_metric = ("answered_fraction", "completions with an answer")
    replaces = ("the correctness reward (a label-free reward column)",)
    conflicts_with = ("rlpr",)
    conflict_reason = CORRECTNESS_PICK_ONE
    reconstructed = (
        "answer equivalence = normalised exact match of extracted answers (EMPO clusters math answers by "
        "math-verify equivalence, free-form ones with a model)",
        "completions without an answer get reward 0 and form no cluster",
        "entropy_low/entropy_high thresholds off by default",
        "TTRL vote pool: the G trained rollouts by default; TTRL votes over 64 and trains on 32 (vote_pool)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._entropies: torch.Tensor | None = None
        self._extra_votes: dict[int, list[str | None]] | None = None  # global group id -> extra answers

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: the default vote (over the G trained rollouts) works; a vote pool samples its extra votes
        through the generation service, without the image."""
        o = self.options
        if o.mode == "majority_vote" and o.vote_pool is not None:
            return f"with vote_pool={o.vote_pool}, {IMAGES_GENERATION_SERVICE}"
        return None

    def pooled(self, num_generations: int) -> bool:
        """Whether extra votes are generated (TTRL mode with a vote pool larger than G)."""
        o = self.options
        return o.mode == "majority_vote" and o.vote_pool is not None and o.vote_pool > num_generations

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        G = args.num_generations
        if self.options.vote_pool is not None and not self.pooled(G):
            warnings.warn(
                f"empo: vote_pool={self.options.vote_pool} <= num_generations={G}: no extra votes, the majority is "
                "taken over the G trained rollouts.", stacklevel=2,
            )

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Extra votes (TTRL's vote pool): ``vote_pool - G`` completions per prompt, asked by the process holding the
        group's first row (one collective service call on every process)."""
        G = ctx.num_generations
        self._extra_votes = None
        if not self.pooled(G):
            return
        extra = self.options.vote_pool - G
        heads = [i for i in range(len(ctx)) if ctx.index_in_group[i] == 0]
        completions = ctx.service.generate(prompts=[ctx.prompts[i] for i in heads for _ in range(extra)])
        extractor = get_extractor(self.options.extractor)
        self._extra_votes = {
            ctx.group_ids[i]: [extractor(c.text) for c in completions[k * extra:(k + 1) * extra]]
            for k, i in enumerate(heads)
        }
        ctx.log_metric("extra_votes", float(len(completions)))

    def multi_turn_refusal(self) -> str | None:
        if self.options.vote_pool is not None:
            return ("its extra votes (vote_pool) are sampled by the generation service as single-turn text without "
                    "running tools; leave vote_pool unset to vote over the G tool rollouts.")
        return None

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # the reward needs whole groups: the reward transform fills the column in
        return [placeholder_column("empo", self.options.reward_weight)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        answers, cluster_ids = batch_clusters(ctx, o.extractor)
        extra, self._extra_votes = self._extra_votes, None
        if extra is not None:  # TTRL's vote pool: the extra votes of every group, gathered (collective)
            first = ctx.process_slice.start
            G = ctx.num_generations
            local = [extra.get((first + j) // G) if (first + j) % G == 0 else None for j in range(len(ctx.local_rows))]
            gathered = ctx.gather_object(local)
            pools = [gathered[g * G] or [] for g in range(len(answers) // G)]
            rewards = pooled_majority_votes(answers, pools, G)
            ctx.log_metric("vote_pool_size", float(G + sum(len(p) for p in pools) / max(len(pools), 1)))
        else:
            rewards = empo_rewards(cluster_ids, o.mode)
        values = torch.tensor(rewards, dtype=ctx.rewards_per_func.dtype, device=ctx.rewards_per_func.device)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values
        ctx.rewards_per_func = rewards
        entropies = [semantic_entropy(ids, o.entropy_estimator, unanswered="ignore") for ids in cluster_ids]
        self._entropies = torch.tensor(entropies, dtype=torch.float32)
        ctx.log_metric("semantic_entropy", float(self._entropies.mean()))
        ctx.log_metric("answered_fraction", sum(a is not None for a in answers) / max(len(answers), 1))
        ctx.log_metric("reward", float(values.mean()))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.entropy_low is None and o.entropy_high is None:
            return
        H = self._entropies
        if H is None or H.numel() * ctx.num_generations != ctx.advantages.size(0):
            return
        keep = torch.ones_like(H, dtype=torch.bool)
        if o.entropy_low is not None:
            keep &= H > o.entropy_low
        if o.entropy_high is not None:
            keep &= H < o.entropy_high
        rows = keep.repeat_interleave(ctx.num_generations).to(ctx.advantages.device)
        shape = (-1,) + (1,) * (ctx.advantages.dim() - 1)
        ctx.advantages = ctx.advantages * rows.view(shape).to(ctx.advantages.dtype)
        ctx.log_metric("kept_group_fraction", float(keep.float().mean()))
