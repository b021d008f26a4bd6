"""ETTRL — test-time RL with an entropy mechanism (arXiv:2508.11356): TTRL's majority vote, EAR and ETMR.

Test-time RL on unlabeled prompts (TTRL, arXiv:2504.16084): the G rollouts of a prompt vote, and a rollout whose
extracted answer is the majority answer gets reward 1, else 0 (the column ``ettrl``; the vote is
:func:`trl_plugins.api.answers.majority_votes` over :func:`~trl_plugins.api.answers.batch_clusters`, the same vote
as ``empo``'s ``mode="majority_vote"``). ETTRL adds two entropy mechanisms:

* **EAR** (entropy-based advantage reshaping, advantage stage). ``H_i`` is rollout ``i``'s response entropy, the mean
  over its completion (loss) tokens of the policy's next-token entropy; ``H_bar`` the mean of ``H`` over the rollout's
  group. The advantage is scaled by ``Y_i = 1 + (H_bar - H_i) / H_bar``: confident (low-entropy) rollouts keep more
  of their advantage, uncertain ones less, which damps the large advantages that a few lucky rollouts get from a
  wrong early majority (``advantage="reshape"``, the paper's Adv-Res). The paper's simpler ablation Adv-Clip clips
  the advantages to ``[-clip_beta, clip_beta]`` (``advantage="clip"``, beta 2).
* **ETMR** (entropy-fork tree majority rollout, sampling stage). The group of G rollouts is grown as trees: each tree
  starts from one fully sampled rollout (its root); the ``fork_points`` (N) tokens of the root with the highest
  policy entropy are its forks, and from each fork ``branches`` (B) new rollouts continue the root's prefix. A tree
  holds ``L = 1 + B N`` rollouts, so G = M L gives M trees (the paper: M = 12, N = 2, B = 2, 60 rollouts against
  TTRL's 64). Every leaf votes and is trained like an ordinary rollout; the shared prefixes are what cut the rollout
  tokens (about 60% of independent sampling in the paper).

Mapping onto TRL. The branch rows (index in group ``k`` with ``k % L != 0``) are deferred at the prompt stage
(``PromptContext.defer``), so TRL samples the M roots only; the after-generation hook takes the roots' entropies
(``ctx.policy_entropies``, one no-grad forward), gathers the roots and their forks across processes (a group may
straddle processes), and fills each branch row with a continuation of its root's prefix through the branching seam
(``ctx.continue_prefixes``: HF generate, one collective call per step, counted in the rollout budget). A group size
that is not a multiple of L ends with a partial tree (its first rows). EAR takes the response entropies from the
advantage stage's policy statistics (``AdvantageContext.policy_stats().mean_entropy``: one no-grad forward of the
generation batch, shared with the other plugins that read it; training batches only).

Reconstructed (no official code was found; the paper and public summaries of it were read):

* the fork's branch resamples the fork token itself: its prefix is the root's tokens *before* the high-entropy
  token (``fork_tokens="sample"``); ``fork_tokens="distinct"`` (ours) instead forces the B branches of a fork onto
  the B most likely tokens there other than the root's own (the branching seam's ``fork_prefixes``);
* forks are the N highest-entropy positions of the root, distinct; a root shorter than N tokens reuses its forks
  in turn;
* EAR's mean ``H_bar`` is taken over the rollout's group; ``H_bar = 0`` leaves the advantages unchanged;
* the partial last tree when G is not a multiple of L;
* every leaf is trained (TTRL votes over 64 and trains on 32; whether ETTRL trains on a subset of its 60 leaves is
  not stated).

Neutral setting: ``vote=False, advantage="none", fork_points=0`` leaves the run vanilla TRL (no hook runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    PromptContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import batch_clusters, get_extractor, majority_votes
from trl_plugins.api.collectives import context_device, gather_id_lists
from trl_plugins.api.reasons import CORRECTNESS_PICK_ONE, IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate
from trl_plugins.api.success import placeholder_column

COLUMN = "ettrl"
#: Annotation keys of a branch row: its tree's root (index in group) and its fork position in the root.
ROOT_KEY = "ettrl_root"
FORK_KEY = "ettrl_fork"


@dataclass
class EttrlOptions(PluginOptions):
    vote: bool = option(
        True, help="Reward column 'ettrl' = TTRL majority vote over the group (label-free). False: keep the run's own "
        "reward functions (EAR / ETMR on labelled data).",
    )
    extractor: str = option(
        "task",
        help="Answer extractor of the vote: task, boxed, last_number, boxed_or_last_number, or 'package.module:function'.",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the ettrl column.")
    advantage: Literal["reshape", "clip", "none"] = option(
        "reshape", help="EAR: 'reshape' scales A_i by 1 + (H_bar - H_i) / H_bar (Adv-Res, the paper's method); 'clip' "
        "clips A to [-clip_beta, clip_beta] (Adv-Clip ablation); 'none': TRL's advantages.",
    )
    clip_beta: float = option(2.0, min=0.0, min_exclusive=True, help="Adv-Clip bound beta (paper: 2).")
    fork_points: int = option(
        2, min=0, help="ETMR: N forks per tree at the root's highest-entropy tokens (paper: 2). 0: no trees, every "
        "rollout sampled independently (TTRL).",
    )
    branches: int = option(2, min=1, help="ETMR: B new rollouts from each fork (paper: 2).")
    fork_tokens: Literal["sample", "distinct"] = option(
        "sample", help="ETMR: a branch resamples the fork token ('sample', reconstructed) or the B branches of a fork "
        "start with the B most likely tokens there other than the root's ('distinct', ours).", reconstructed=True,
    )

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'ettrl': {exc}.") from exc

    @property
    def tree_size(self) -> int:
        """L = 1 + B N rollouts per tree (1 without ETMR)."""
        return 1 + self.branches * self.fork_points


def ear_scale(entropies: torch.Tensor, group_size: int) -> torch.Tensor:
    """EAR's per-rollout scale ``Y_i = 1 + (H_bar - H_i) / H_bar``, ``H_bar`` the mean over the rollout's group.

    Args:
        entropies: (N,) response entropies (mean token entropy of each rollout), groups of ``group_size`` contiguous.
    Returns:
        (N,) scales; 1 in a group whose mean entropy is 0 (or not finite).
    """
    H = entropies.float().view(-1, group_size)
    mean = H.mean(dim=1, keepdim=True)
    ok = torch.isfinite(mean) & (mean > 0)
    scale = torch.where(ok, 1 + (mean - H) / torch.where(ok, mean, torch.ones_like(mean)), torch.ones_like(H))
    return scale.view(-1)


def reshape_advantages(advantages: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Y_i A_i`` for (N,) or (N, T) advantages and (N,) scales."""
    shape = (-1,) + (1,) * (advantages.dim() - 1)
    return advantages * scale.to(advantages.device, advantages.dtype).view(shape)


def tree_slot(index_in_group: int, tree_size: int, branches: int) -> tuple[int, int | None]:
    """``(root, fork)`` of a row: the index in group of its tree's root, and which of the root's forks it branches
    from (None for the root itself). Rows ``m L .. m L + L - 1`` form tree ``m``; after the root come the B branches
    of fork 0, then of fork 1, ..."""
    root = index_in_group - index_in_group % tree_size
    j = index_in_group - root
    return root, None if j == 0 else (j - 1) // branches


def fork_positions(entropies: torch.Tensor, count: int) -> list[int]:
    """The ``count`` completion positions with the highest entropy (distinct, highest first); a completion shorter than
    ``count`` tokens reuses its positions in turn, an empty one forks at 0.

    Args:
        entropies: (T,) entropy of the policy's distribution of each completion token.
    """
    if count == 0:
        return []
    if entropies.numel() == 0:
        return [0] * count
    top = torch.topk(entropies.float(), min(count, entropies.numel())).indices.tolist()
    return [int(top[n % len(top)]) for n in range(count)]


class EttrlPlugin(Plugin):
    """TTRL majority vote with entropy-based advantage reshaping (EAR) and entropy-fork tree rollouts (ETMR)."""

    name = "ettrl"
    version = "0.1.0"
    paper = (
        "ETTRL: Balancing Exploration and Exploitation in LLM Test-Time Reinforcement Learning Via Entropy Mechanism, "
        "arXiv:2508.11356"
    )
    summary = "Test-time RL: majority-vote reward, entropy-scaled advantages, rollout trees forked at high-entropy tokens."
    Options = EttrlOptions
    image_inputs = True
    multi_turn = True
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found (searched the code and issue indexes for ETTRL / ETMR / arXiv 2508.11356); "
        "rebuilt from the paper: the vote is TTRL's (as empo's majority_vote mode), EAR's Adv-Res and Adv-Clip "
        "formulas and ETMR's M trees of 1 + B N rollouts forked at the N highest-entropy tokens follow the paper; "
        "where the fork's prefix ends, the group over which H_bar is averaged and the partial last tree are ours.",
        variants=("fork_tokens", "vote"),
    )
    claim_metric = ("rollout_token_fraction", "generated tokens / tokens of the trained rollouts (ETMR's saving)")
    conflicts_with = ("empo", "rlpr")
    conflict_reason = CORRECTNESS_PICK_ONE
    replaces = ("the correctness reward (a label-free majority-vote column), when vote=True",)
    reconstructed = (
        "a branch's prefix is the root's tokens before the fork token (the branch resamples it)",
        "forks: the N highest-entropy positions of the root, reused in turn when the root is shorter",
        "EAR's H_bar: the mean response entropy of the rollout's group",
        "a group size that is not a multiple of 1 + B N ends with a partial tree",
        "fork_tokens='distinct' (forced distinct top tokens at a fork) is ours",
        "every leaf of the trees is trained (no vote-only subset as in TTRL's 64 votes / 32 trained)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending = False  # the prompt stage deferred the branch rows of this step

    # ----------------------------------------------------------------------------------------- checks
    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook in ("trl_plugins_reward_functions", "trl_plugins_transform_rewards"):
            return o.vote
        if hook == "trl_plugins_transform_advantages":
            return o.advantage != "none"
        if hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation"):
            return o.fork_points > 0
        return True

    def image_inputs_refusal(self) -> str | None:
        if self.options.fork_points > 0:
            return f"with fork_points={self.options.fork_points} (ETMR), {IMAGES_GENERATION_SERVICE}"
        return None

    def multi_turn_refusal(self) -> str | None:
        if self.options.fork_points > 0:
            return ("ETMR's branches continue through the branching seam, which samples single-turn text without "
                    "running tools; set fork_points=0 for tool rollouts.")
        return None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.fork_points == 0:
            return
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"ettrl with fork_points={o.fork_points} (ETMR) cannot run with use_vllm=True or continuous "
                f"batching: {VLLM_BRANCHING} Or set fork_points=0 (independent rollouts).")
        G = args.num_generations
        if o.tree_size > G:
            raise PluginConfigError(
                f"Options of plugin 'ettrl': a tree of 1 + branches * fork_points = 1 + {o.branches} * {o.fork_points} "
                f"= {o.tree_size} rollouts does not fit in a group of num_generations={G}; allowed: num_generations "
                f">= {o.tree_size} (the paper: 60 = 12 trees of 5), or fewer fork_points / branches, or "
                "fork_points=0.")

    # ----------------------------------------------------------------------------------------- ETMR
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer every branch row: TRL samples the tree roots only."""
        L = self.options.tree_size
        ctx.defer_slots(lambda k: k % L != 0)
        self._pending = True  # on every process, whatever its rows: the next hook's collectives run everywhere

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Fork each root at its highest-entropy tokens and fill the branch rows (collective: one forward, three
        gathers and one branching call on every process)."""
        if not self._pending:  # e.g. a refill round: its rows were sampled independently
            return
        self._pending = False
        o, G, L, B = self.options, ctx.num_generations, self.options.tree_size, len(ctx)
        roots = [i for i in range(B) if ctx.index_in_group[i] % L == 0]
        entropies = ctx.policy_entropies(roots)  # collective
        local_forks = torch.full((B, o.fork_points), -1, dtype=torch.long)
        for i, h in zip(roots, entropies):
            local_forks[i] = torch.tensor(fork_positions(h, o.fork_points), dtype=torch.long)
        forks = ctx.gather(local_forks.to(context_device(ctx))).cpu()
        is_root = set(roots)
        root_ids = gather_id_lists(ctx, [ctx.completion_ids[i] if i in is_root else [] for i in range(B)])
        branch_rows, prompts, prefixes, room, planned = [], [], [], [], []
        limit = ctx.run.max_completion_length
        for i in range(B):
            root, fork = tree_slot(ctx.index_in_group[i], L, o.branches)
            if fork is None:
                continue
            g = ctx.group_ids[i] * G + root
            t = min(int(forks[g, fork]), max(len(root_ids[g]) - 1, 0), limit - 1)
            branch_rows.append(i)
            prompts.append(list(ctx.prompt_ids[i]))
            prefixes.append(root_ids[g][:t])
            room.append(limit - t)
            planned.append((root, t, (ctx.index_in_group[i] - root - 1) % o.branches, root_ids[g]))
        if o.fork_tokens == "distinct":
            firsts = [plan[3][plan[1]] if plan[1] < len(plan[3]) else None for plan in planned]
            continuations = ctx.fork_prefixes(prompts, prefixes, [p[2] for p in planned], room, exclude=firsts)
        else:
            continuations = ctx.continue_prefixes(prompts, prefixes, room)  # collective, even with no request
        new_tokens = 0
        for i, c, (root, t, _, _) in zip(branch_rows, continuations, planned):
            lps = None if ctx.sampling_logprobs is None else [float("nan")] * t + list(c.logprobs)
            ctx.replace_row(i, c.completion_ids, logprobs=lps)
            ctx.annotations[i].update({ROOT_KEY: root, FORK_KEY: t})
            new_tokens += len(c.completion_ids) - t
        root_tokens = sum(len(ctx.completion_ids[i]) for i in roots)
        trained = root_tokens + sum(len(ctx.completion_ids[i]) for i in branch_rows)
        ctx.log_metric("rollout_token_fraction", (root_tokens + new_tokens) / max(trained, 1))
        ctx.log_metric("branch_rollouts", float(len(branch_rows)))
        if branch_rows:
            ctx.log_metric("fork_position", sum(p[1] for p in planned) / len(planned))

    # ----------------------------------------------------------------------------------------- vote
    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN, self.options.reward_weight)]  # the vote needs whole groups

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        answers, cluster_ids = batch_clusters(ctx, self.options.extractor)  # collective, shared with empo / seed_grpo
        votes = [v for ids in cluster_ids for v in majority_votes(ids)]
        values = torch.tensor(votes, dtype=ctx.rewards_per_func.dtype, device=ctx.rewards_per_func.device)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values
        ctx.rewards_per_func = rewards
        ctx.log_metric("majority_fraction", float(values.mean()))
        ctx.log_metric("answered_fraction", sum(a is not None for a in answers) / max(len(answers), 1))

    # ----------------------------------------------------------------------------------------- EAR
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.advantage == "clip":
            clipped = ctx.advantages.clamp(-o.clip_beta, o.clip_beta)
            ctx.log_metric("clipped_fraction", float((clipped != ctx.advantages).float().mean()))
            ctx.advantages = clipped
            return
        if ctx.mode != "train":
            return  # evaluation batches: TRL's advantages (no forward)
        H = ctx.policy_stats().mean_entropy.float().cpu()  # (N,) collective, cached for the other plugins
        scale = ear_scale(H, ctx.num_generations)
        ctx.log_metric("response_entropy", float(H.mean()))
        ctx.advantages = reshape_advantages(ctx.advantages, scale)
        ctx.log_metric("ear_scale_min", float(scale.min()))
        ctx.log_metric("ear_scale_max", float(scale.max()))
