"""SPO — Segment Policy Optimization, chain form (arXiv:2505.23564): Monte-Carlo segment advantages.

Between GRPO's one advantage per rollout and PPO's critic per token, SPO credits *segments*: it cuts each rollout at
low-probability tokens, estimates the value of every segment boundary by Monte-Carlo continuations of that prefix
from the policy itself (no critic), and gives each segment's tokens ``V(end) - V(start)``. Facts from the official
code (AIFrameResearch/SPO @ b9fc6a2, ``src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py``
(``MC``), ``src/treetune/trainers/ppo_trainer.py`` (``PPO``), ``src/treetune/trainers/utils.py`` (``U``),
``configs/polIter_qwen05b_spo_chain_gsm8k.jsonnet`` and ``configs/trainers/ppo_MATH.jsonnet``):

1. Cut points (MC:926-929): ``p_t`` the policy's probability of sampled token ``t``; the tokens with
   ``p_t < 0.9`` are candidates, each one's cut point is ``t - 1`` (the boundary just before it), and every
   ``cutpoint_interval``-th candidate is kept (``[::interval]``, interval 5 by default, MC:30). A cut point
   ``c`` is the prefix ``completion[:c + 1]``; ``c = -1`` is the prompt alone.
2. Values (MC:505-536, 985-999; gsm8k chain config: 4 samples, Qwen-1.5B MATH: 9): ``V(c)`` is the mean reward of
   ``mc_samples`` continuations of ``prompt + completion[:c + 1]`` sampled from the current policy; the last token's
   value is the rollout's own reward.
3. Advantages (MC:394-439): walking the tokens, at each token that carries a value the advantage is ``V - V_prev``
   (0 for the first one unless the prompt itself was a cut point, ``c = -1``); every token takes the advantage of
   the next valued token at or after it, i.e. a segment ``(c_{k-1}, c_k]`` gets ``V(c_k) - V(c_{k-1})``; tokens
   with ``p_t > 0.9`` get 0. A rollout without any cut point gets 0 everywhere.
4. Training (ppo_MATH.jsonnet:64, 139; PPO:820-826, 1057-1059; U:266-291): advantages are whitened over the batch's
   tokens with ``p_t < 0.9`` (mean and unbiased variance, ``(A - mean) / sqrt(var + 1e-8)``) and only those tokens
   enter the loss.

Mapping onto TRL: the sampling stage (``trl_plugins_after_generation``) takes ``p_t`` from a no-grad teacher-forced
forward of the current policy (``ctx.policy_logprobs``, temperature applied as TRL applies it), finds the cut points
and asks the branching seam (``ctx.continue_prefixes``: HF generate, collective, counted in the rollout budget; one
call per batch on every process) for ``mc_samples`` continuations of each, up to ``max_completion_length``; the
continuations are scored by TRL's reward functions (``ctx.score``). The advantage stage builds the token advantages
(N, T) from the rollouts' rewards (TRL's combined reward), whitens them over the low-probability tokens of the
batch and sets 0 on the others: they carry no policy gradient (the official code leaves them out of the loss; here
they still count in TRL's loss normaliser, a documented difference). Cost: ``mc_samples`` continuations per cut
point (``max_cutpoints`` caps the cut points per rollout: our option, off by default as in the official code).

Neutral setting: ``weight=0`` generates nothing and keeps TRL's advantages (vanilla GRPO); ``weight`` (ours) mixes
``(1 - w) A_TRL + w A_SPO``, 1 being the official method.

Not yet: SPO's tree form (SPO-tree: segment trees whose leaves form the group), which needs trees as groups
(issue 32, item 2); truncated continuations are scored by the reward functions as TRL scores truncated rollouts
(the official code gives unfinished responses its penalty, 0.0 in the released configs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginOptions,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate

#: Annotation keys: the cut points with their values, the low-probability token positions, the completion length.
CUTS_KEY = "spo_cuts"
LOW_KEY = "spo_low"
LENGTH_KEY = "spo_len"


@dataclass
class SpoOptions(PluginOptions):
    prob_threshold: float = option(
        0.9, min=0.0, max=1.0, min_exclusive=True,
        help="Tokens sampled with probability below this are cut-point candidates and the only tokens trained "
        "(official: 0.9).",
    )
    cutpoint_interval: int = option(5, min=1, help="Keep every k-th candidate cut point (official default: 5).")
    mc_samples: int = option(
        4, min=1, help="Monte-Carlo continuations per cut point that estimate its value (official gsm8k chain: 4).",
    )
    max_cutpoints: int | None = option(
        None, min=1, help="Cut points per rollout at most, the earliest kept (ours; None: all, as official).",
    )
    whiten: bool = option(
        True, help="Whiten the advantages over the batch's low-probability tokens (official ppo_MATH: true).",
    )
    weight: float = option(
        1.0, min=0.0, max=1.0,
        help="A = (1 - weight) A_TRL + weight A_SPO (ours); 1: SPO as published, 0: vanilla TRL (nothing generated).",
    )


def cut_points(probs: torch.Tensor, threshold: float, interval: int, limit: int | None = None) -> list[int]:
    """Official cut points of one rollout: ``t - 1`` for every token ``t`` with ``probs[t] < threshold``, every
    ``interval``-th kept, the first ``limit`` of those (all when None). ``-1`` stands for the prompt alone.

    Args:
        probs: (T,) probability of each sampled completion token under the policy.
    """
    candidates = (torch.nonzero(probs < threshold).flatten() - 1).tolist()[::interval]
    return candidates if limit is None else candidates[:limit]


def segment_advantages(length: int, cuts: list[int], values: list[float], reward: float,
                       low: torch.Tensor) -> torch.Tensor:
    """(length,) SPO-chain token advantages of one rollout: segment ``(c_{k-1}, c_k]`` gets ``V(c_k) - V(c_{k-1})``,
    the last segment ``reward - V(c_last)``, the first one 0 unless ``cuts[0] == -1`` (the prompt's value is then its
    start); tokens outside ``low`` ((length,) bool) get 0, and so does every token of a rollout without cut points.
    """
    adv = torch.zeros(length)
    if not cuts or length == 0:
        return adv
    token_values: list[float | None] = [None] * length
    token_values[-1] = reward
    base = None
    if cuts[0] == -1:
        base, cuts, values = values[0], cuts[1:], values[1:]
    for c, v in zip(cuts, values):
        token_values[c] = v
    at: dict[int, float] = {}  # advantage at each valued token: its value minus the previous one
    for t, v in enumerate(token_values):
        if v is not None:
            at[t] = 0.0 if base is None else v - base
            base = v
    current = 0.0
    for t in range(length - 1, -1, -1):  # a token takes the advantage of the next valued token at or after it
        current = at.get(t, current)
        adv[t] = current
    return adv * low[:length].float()


def whiten_over(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(adv - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance over ``mask`` (bool, same shape);
    unchanged when fewer than two tokens are in the mask."""
    valid = adv[mask]
    if valid.numel() < 2:
        return adv
    return (adv - valid.mean()) * torch.rsqrt(valid.var(unbiased=True) + 1e-8)


class SpoPlugin(Plugin):
    """Monte-Carlo values at low-probability cut points; segment advantages V(end) - V(start) (SPO-chain)."""

    name = "spo"
    version = "0.1.0"
    paper = "Segment Policy Optimization: Improved Credit Assignment in Reinforcement Learning for LLMs (SPO), " \
        "arXiv:2505.23564"
    summary = "Cuts rollouts at low-probability tokens; Monte-Carlo values of the cuts give segment advantages."
    Options = SpoOptions
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = (
        "its Monte-Carlo continuations run through the branching seam, which samples single-turn text without running "
        "tools, so they would not continue the same multi-turn episode."
    )
    official = OfficialSource(
        "AIFrameResearch/SPO", "b9fc6a2", verdict="faithful",
        files=(
            "src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py",
            "src/treetune/trainers/ppo_trainer.py",
            "src/treetune/trainers/utils.py",
            "configs/polIter_qwen05b_spo_chain_gsm8k.jsonnet",
            "configs/trainers/ppo_MATH.jsonnet",
        ),
        note="Chain form only (the tree form is not yet here). High-probability tokens get advantage 0 (the official "
        "code leaves them out of the loss, so they still count in TRL's normaliser); continuations are scored by "
        "TRL's reward functions, truncated ones included; p_t from TRL's temperature-scaled log-probs.",
        variants=("weight", "max_cutpoints"),
    )
    claim_metric = ("cutpoints", "cut points per rollout (segments - 1)")
    reconstructed = (
        "weight (mix with TRL's advantages) and max_cutpoints are our options",
        "high-probability tokens get advantage 0 rather than leaving the loss",
    )

    def hook_enabled(self, hook: str) -> bool:
        return self.options.weight > 0

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(f"spo cannot run with use_vllm=True or continuous batching: {VLLM_BRANCHING}")

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        logps = ctx.policy_logprobs(ctx.prompt_ids, ctx.completion_ids)  # collective: every process, every batch
        limit = ctx.run.max_completion_length
        plan, prompts, prefixes, room = [], [], [], []
        for i, lp in enumerate(logps):
            probs = lp.float().exp()
            cuts = [c for c in cut_points(probs, o.prob_threshold, o.cutpoint_interval, o.max_cutpoints)
                    if c + 1 < limit]
            plan.append(cuts)
            ctx.annotations[i][LOW_KEY] = torch.nonzero(probs < o.prob_threshold).flatten().tolist()
            ctx.annotations[i][LENGTH_KEY] = len(ctx.completion_ids[i])
            for c in cuts:
                prompts += [list(ctx.prompt_ids[i])] * o.mc_samples
                prefixes += [list(ctx.completion_ids[i][: c + 1])] * o.mc_samples
                room += [limit - (c + 1)] * o.mc_samples
        # one call on every process, with no request too: generation and the forward are collectives
        continuations = ctx.continue_prefixes(prompts, prefixes, room)
        rows = [i for i, cuts in enumerate(plan) for _ in range(len(cuts) * o.mc_samples)]
        texts = [ctx.decode(c.completion_ids, i) for c, i in zip(continuations, rows)]
        scores = ctx.score(rows, texts).float() if rows else torch.zeros(0)
        k = 0
        for i, cuts in enumerate(plan):
            values = []
            for _ in cuts:
                values.append(float(scores[k : k + o.mc_samples].mean()))
                k += o.mc_samples
            ctx.annotations[i][CUTS_KEY] = [[c, v] for c, v in zip(cuts, values)]
        ctx.log_metric("extra_rollouts", len(prefixes))
        ctx.log_metric("cutpoints", sum(len(c) for c in plan) / max(len(plan), 1))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.mode != "train":
            return
        mask = ctx.completion_mask().bool().cpu()  # (N, T_max)
        N, width = mask.shape
        spo = torch.zeros(N, width)
        low = torch.zeros(N, width, dtype=torch.bool)
        has = torch.zeros(N, dtype=torch.bool)
        rewards = ctx.rewards.float().cpu().nan_to_num(0.0)
        for n, note in enumerate(ctx.annotations):
            if CUTS_KEY not in note or note[LENGTH_KEY] > width:
                continue  # e.g. a row of a refill round: it keeps TRL's advantage
            length = note[LENGTH_KEY]
            row_low = torch.zeros(length, dtype=torch.bool)
            row_low[[t for t in note[LOW_KEY] if t < length]] = True
            cuts = [int(c) for c, _ in note[CUTS_KEY]]
            values = [float(v) for _, v in note[CUTS_KEY]]
            spo[n, :length] = segment_advantages(length, cuts, values, float(rewards[n]), row_low)
            low[n, :length] = row_low
            has[n] = True
        trained = low & mask & has.unsqueeze(1)
        if o.whiten:
            spo = whiten_over(spo, trained) * trained.float()
        base = ctx.advantages.float().cpu()
        if base.dim() == 1:
            base = base.unsqueeze(1).expand(-1, width)
        base = base[:, :width]
        mixed = torch.where(has.unsqueeze(1), (1 - o.weight) * base + o.weight * spo[:, : base.size(1)], base)
        ctx.advantages = mixed.to(ctx.advantages.device, ctx.advantages.dtype)
        ctx.log_metric("trained_token_fraction", float(trained.sum()) / max(float((mask & has.unsqueeze(1)).sum()), 1))
        ctx.log_metric("segment_advantage_abs_mean",
                       float(spo[trained].abs().mean()) if trained.any() else 0.0)
        ctx.log_metric("rows_without_cutpoints",
                       float(sum(1 for note in ctx.annotations if CUTS_KEY in note and not note[CUTS_KEY])))
