"""IGPO — Information Gain-based Policy Optimization (arXiv:2510.14967), with an A2TGPO mode (arXiv:2605.06200).

A turn-level intrinsic reward for multi-turn tool agents (TRL ``tools`` / ``environment_factory``): how much each
interaction turn raised the policy's own probability of the ground-truth answer. Facts from the paper:

1. Belief after turn t: ``P_t = exp( (1/L) sum_j log pi(a_j | q, o_<=t, a_<j) )`` -- the length-normalised probability
   of the L answer tokens, teacher-forced after the prompt q and the interaction history up to turn t (``P_0``: after
   the prompt alone). Computed here with no gradient, from the current policy, at the advantage stage.
2. Information gain of turn t (every turn but the last): ``r_t = P_t - P_{t-1}``.
3. The last (answer) turn's reward is the outcome reward.
4. IGPO: the turn rewards of a group (the G rollouts of a prompt, all their turns) are normalised together, and each
   turn's advantage is the discounted sum of the normalised rewards from that turn to the end; every token of an
   assistant turn gets its turn's advantage (tool-result tokens are masked out of the loss by TRL).

A2TGPO (``mode="a2tgpo"``; facts from its abstract, and for (iii) from a published description of its released code,
github.com/CuSO4-Chen/A-TGPO, which could not be read here): (i) information gains are normalised within each
(prompt, turn index) group, so a turn is compared only with turns at the same depth; (ii) the accumulated advantage
is divided by the square root of the number of accumulated terms; (iii) adaptive turn-level clipping: turn t's PPO
clip range is multiplied by ``c_t = 1 + beta (2 sigmoid(g_t) - 1)`` (``clip_beta`` = beta, 0.3), ``g_t`` its
turn-group-normalised information gain -- wider for informative turns, narrower for uninformative ones, within
``(1 - beta, 1 + beta)`` times TRL's ``epsilon_low`` / ``epsilon_high``. The factors ride with their rows to the loss
stage, where every token of an assistant turn takes its turn's factor (``LossContext.scale_clip_range`` from the
``trl_plugins_loss_advantages`` hook, before the surrogate is built); ``clip_beta=0`` keeps TRL's range.

Reconstructed (options, flagged): the text the answer is probed with (``answer_template``), the discount
(``gamma``, 1.0), that in A2TGPO mode the outcome rewards are normalised per group like GRPO's, that the answer turn
(which has no information gain) keeps TRL's clip range (``c = 1``), ``clip_beta`` (0.3, from the description of the
code, not the paper), and the epsilon and unbiased standard deviation (TRL's). Rows without tool calls have one turn:
their advantage is the group-normalised outcome, i.e. GRPO's -- with no tool call in a group, IGPO equals GRPO (and
``ig_weight=0`` leaves TRL's advantages).

Official code checked against: ``GuoqingWang1/IGPO@bff163b`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show igpo``, docs/faithfulness.md).
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
    PluginOptions,
    hookimpl,
    option,
)
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES
from trl_plugins.api.text import check_template
from trl_plugins.api.turns import accumulate_turn_rewards as accumulate
from trl_plugins.api.turns import expand_turn_values
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE

EPS = 1e-4  # TRL's epsilon in the group normalisation
#: Extra carrying A2TGPO's per-turn clip factors (N, U) from the advantage stage to the loss stage.
CLIP_FACTORS_EXTRA = "igpo_clip_factors"


@dataclass
class IgpoOptions(PluginOptions):
    mode: Literal["igpo", "a2tgpo"] = option(
        "igpo", help="'igpo': normalise every turn reward of a group together (IGPO); 'a2tgpo': normalise information "
        "gains per (prompt, turn index), divide accumulated advantages by sqrt(#terms) and scale each turn's clip "
        "range by its normalised gain (A2TGPO)."
    )
    clip_beta: float = option(
        0.3, min=0.0, max=1.0, reconstructed=True,
        help="A2TGPO only: turn clip range = TRL's times 1 + clip_beta (2 sigmoid(g) - 1), g the turn's normalised "
        "information gain (0: TRL's clip range on every turn). 0.3 is the value reported for the official code "
        "(not stated in the paper's abstract). Needs a clipped loss_type.",
    )
    answer_column: str = option("answer", help="Dataset column holding the ground-truth answer.")
    answer_template: str = option(
        "Answer: {answer}", reconstructed=True,
        help="Text whose token probabilities are the belief P_t ({answer} is replaced by the ground truth); the "
        "official code probes the answer inside its prompt format's answer tags.",
    )
    gamma: float = option(1.0, min=0.0, max=1.0, reconstructed=True, help="Discount of the turn-reward accumulation.")
    ig_weight: float = option(
        1.0, min=0.0, help="Scale of the information-gain rewards (0: the plugin leaves TRL's advantages unchanged)."
    )
    outcome: Literal["combined", "verifier"] = option(
        "combined", help="Outcome reward of the answer turn: the run's combined reward, or the verifier column."
    )
    scale: bool = option(True, help="Divide by the group standard deviation (TRL's scale_rewards='group').")

    def validate(self) -> None:
        check_template("igpo", "answer_template", self.answer_template, ("answer",))  # else P_t probes a constant


def normalise(values: torch.Tensor, keys: torch.Tensor, scale: bool) -> torch.Tensor:
    """Normalise the non-NaN entries of ``values`` within each key: ``(x - mean) / (std + EPS)`` (unbiased std, 1.0
    for a key with one entry). ``values``, ``keys``: same shape; NaN stays NaN."""
    out = torch.full_like(values, math.nan)
    valid = ~torch.isnan(values)
    for key in torch.unique(keys[valid]):
        sel = valid & (keys == key)
        x = values[sel]
        centred = x - x.mean()
        if scale:
            std = x.std() if x.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + EPS)
        out[sel] = centred
    return out


def turn_reward_matrix(info_gain: torch.Tensor, outcome: torch.Tensor, num_turns: torch.Tensor) -> torch.Tensor:
    """(N, U) turn rewards: information gains on turns ``0 .. U_n - 2``, the outcome on turn ``U_n - 1``, NaN after.

    Args:
        info_gain: (N, U) information gain of each turn (only entries before the last turn are read).
        outcome: (N,) outcome rewards. num_turns: (N,) U_n >= 1.
    """
    N, U = info_gain.shape
    cols = torch.arange(U).expand(N, U)
    last = (num_turns - 1).clamp(min=0).unsqueeze(1)
    rewards = torch.where(cols < last, info_gain, torch.full_like(info_gain, math.nan))
    return torch.where(cols == last, outcome.unsqueeze(1).expand(N, U), rewards)


def clip_factors(normalised_gains: torch.Tensor, beta: float) -> torch.Tensor:
    """A2TGPO's per-turn clip factors ``c = 1 + beta (2 sigmoid(g) - 1)`` (N, U) from the turn-group-normalised
    information gains ``g`` (N, U); 1 where ``g`` is NaN (the answer turn, padding)."""
    factors = 1 + beta * (2 * torch.sigmoid(normalised_gains) - 1)
    return torch.where(torch.isnan(normalised_gains), torch.ones_like(factors), factors)


class IgpoPlugin(Plugin):
    claim_metric = ('info_gain_mean', 'information gain per turn')
    name = "igpo"
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = True
    version = "0.1.0"
    paper = (
        "Information Gain-based Policy Optimization: A Simple and Effective Approach for Multi-Turn LLM Agents, "
        "arXiv:2510.14967; A2TGPO: Agentic Turn-Group Policy Optimization with Adaptive Turn-level Clipping, "
        "arXiv:2605.06200"
    )
    summary = "Turn-level information-gain rewards for tool agents: the rise of the policy's probability of the answer."
    Options = IgpoOptions
    official = OfficialSource(
        "GuoqingWang1/IGPO", "bff163b", verdict="faithful",
        note="The Feb-2026 update read in the fork debajoycs98/IGPO@8660196; the A2TGPO mode is reconstructed (no code "
        "reachable).",
    )
    replaces = ("the advantages (turn-level, expanded to tokens)",)
    reconstructed = (
        "answer_template: the text the answer is probed with",
        "gamma = 1.0 (discount of the accumulation)",
        "a2tgpo: outcome rewards normalised per group like GRPO's",
        "a2tgpo: clip_beta = 0.3 (from a description of the official code); the answer turn keeps TRL's clip range",
    )

    def clips_turns(self) -> bool:
        """Whether the adaptive turn-level clipping of A2TGPO is on."""
        return self.options.mode == "a2tgpo" and self.options.clip_beta > 0

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.clips_turns() and args.loss_type not in CLIPPED_LOSS_TYPES:
            raise IncompatiblePluginsError(
                f"igpo: mode='a2tgpo' with clip_beta={self.options.clip_beta} scales PPO's clip range per turn, but "
                f"loss_type={args.loss_type!r} has no clip range; use one of {', '.join(CLIPPED_LOSS_TYPES)} or set "
                "clip_beta=0."
            )

    def required_columns(self) -> list[str]:
        return [self.options.answer_column]

    def beliefs(self, ctx: AdvantageContext) -> list[list[float]]:
        """Per local row, ``P_0 .. P_{U-1}``: the belief before each assistant turn (after the earlier turns and their
        tool results). One batched no-grad forward over every probe of this process (``ctx.policy_logprobs``)."""
        probes_prompt, probes_answer, owners = [], [], []
        tokenizer = ctx.tokenizer
        for i, turns in enumerate(ctx.local_turns):
            if turns.num_turns < 2:
                continue
            answer = self.options.answer_template.format(answer=ctx.local_rows[i][self.options.answer_column])
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            completion = ctx.local_completion_ids[i, : len(turns.tool_mask)].tolist()
            for start, _ in turns.assistant_spans:
                probes_prompt.append(list(ctx.local_prompt_ids[i]) + completion[:start])
                probes_answer.append(answer_ids)
                owners.append(i)
        beliefs: list[list[float]] = [[] for _ in ctx.local_turns]
        # called on every process, with no probes too: the policy forward is a collective under FSDP / ZeRO-3
        logps = ctx.policy_logprobs(probes_prompt, probes_answer)
        for i, lp in zip(owners, logps):
            beliefs[i].append(float(lp.float().mean().exp()))
        return beliefs

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if ctx.turn_ids is None or self.options.ig_weight == 0:
            return  # single-turn rollouts: IGPO is GRPO
        B = len(ctx.local_turns)
        beliefs = self.beliefs(ctx)
        width = max([len(b) for b in beliefs] + [1])
        local_ig = torch.full((B, width), math.nan)
        for i, p in enumerate(beliefs):
            for u in range(len(p) - 1):
                local_ig[i, u] = self.options.ig_weight * (p[u + 1] - p[u])
        info_gain = ctx.gather_padded(local_ig.to(ctx.device), dim=1, pad_value=math.nan).cpu()
        num_turns = ctx.gather(torch.tensor([t.num_turns for t in ctx.local_turns], device=ctx.device)).cpu()
        outcome = (ctx.rewards if self.options.outcome == "combined" else ctx.verifier()).float().cpu()
        U = max(int(num_turns.max().item()), 1, info_gain.size(1))
        info_gain = torch.cat([info_gain, torch.full((info_gain.size(0), U - info_gain.size(1)), math.nan)], dim=1)
        rewards = turn_reward_matrix(info_gain, outcome.nan_to_num(0.0), num_turns.clamp(min=1))
        groups = ctx.group_ids.cpu().unsqueeze(1).expand_as(rewards)
        if self.options.mode == "igpo":
            normalised = normalise(rewards, groups, self.options.scale)
        else:  # A2TGPO: gains per (prompt, turn index); outcomes per prompt
            cols = torch.arange(U).expand_as(rewards)
            is_last = cols == (num_turns.clamp(min=1) - 1).unsqueeze(1)
            gains = torch.where(is_last, torch.full_like(rewards, math.nan), rewards)
            outcomes = torch.where(is_last, rewards, torch.full_like(rewards, math.nan))
            normalised_gains = normalise(gains, groups * U + cols, self.options.scale)
            normalised = torch.where(is_last, normalise(outcomes, groups, self.options.scale), normalised_gains)
            if self.clips_turns():
                factors = clip_factors(normalised_gains, self.options.clip_beta)
                ctx.extras[CLIP_FACTORS_EXTRA] = factors.to(ctx.advantages.device)
                has_gain = ~torch.isnan(normalised_gains)
                ctx.log_metric("clip_factor_mean", float(factors[has_gain].mean()) if has_gain.any() else 1.0)
        advantages = accumulate(normalised, self.options.gamma, sqrt_terms=self.options.mode == "a2tgpo")
        ctx.turn_rewards = rewards.to(ctx.advantages.device)
        ctx.advantages = ctx.expand_turns(advantages.nan_to_num(0.0).to(ctx.advantages.device))
        gains = info_gain[~torch.isnan(info_gain)]
        ctx.log_metric("info_gain_mean", float(gains.mean()) if gains.numel() else 0.0)
        ctx.log_metric("turns_mean", float(num_turns.float().mean()))

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx: LossContext):
        """A2TGPO: each token of assistant turn u takes the clip factor of turn u (tool results, padding: 1)."""
        factors = ctx.extras.get(CLIP_FACTORS_EXTRA)
        if factors is None or ctx.turn_ids is None:
            return
        ctx.scale_clip_range(expand_turn_values(factors.to(ctx.per_token_logps.device), ctx.turn_ids, fill=1.0))
