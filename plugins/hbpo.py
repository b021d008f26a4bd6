"""HBPO — Hierarchical Budget Policy Optimization (arXiv:2507.15844).

Each group of ``G`` rollouts is split into ``k = len(budgets)`` equal sub-groups (rows ``j * G/k .. (j+1) * G/k - 1``
get budget ``b_j``); each row is sampled **and trained** under its prompt with the budget sentence (``prompt``,
official "I will answer the question with {budget} tokens") -- sampling stage. The correctness column of a correct
response of ``n`` tokens becomes the budget-aware reward (official ``min(f1, f2)``, or the paper's piecewise ``f1`` /
``f2``), 0 for a wrong one, -1 for one without ``</think>`` or an extractable answer (official) -- reward stage; the advantages are the hierarchical ones, ``(R - mean) / (std + 1e-6)`` over
the group plus ``w (mean of the sub-group's R - f2(b))`` (official ``w = 2``, the paper's equation ``w = 1``), in place
of TRL's (``scale_rewards`` does not apply) -- advantage stage. Evaluation batches keep their prompts, rewards and
advantages (the paper evaluates without budget sentences).

Stacking (declared on the class, checked when the stack is built): HBPO recomputes the advantages from scratch
(``overwrites``), and it is refused with the refill plugins (``conflicts_with_hooks``: a refill plugin regenerates
rejected groups from the original prompts, without the budget sentences). ``intra_weight=0`` leaves GRPO's
group-normalised advantage (std + 1e-6) of the budget rewards; the budget sentences and the budget reward are what
HBPO is, so it has no setting equal to vanilla GRPO (disable the plugin for that). Correctness:
:mod:`trl_plugins_builtin._length`.

Facts from the paper (Sec. 3, Algorithm 1) and the official code (ZJU-REAL/HBPO @5c8991d: the hierarchical vLLM
rollout, ``rllm/rewards/math_reward.py`` and ``compute_grpo_outcome_advantage`` in ``verl/trainer/ppo/core_algos.py``;
restated, not copied):

* **Budget sub-groups.** The ``G`` rollouts of a prompt are split into ``k`` equal sub-groups; sub-group ``i`` is
  sampled with a budget sentence for ``b_i`` (paper: 16 rollouts, ``B = {512, 1024, 2048, 2560}``). The official
  rollout appends ``"<think> I will answer the question with {b} tokens"`` to the prompt token ids, after the chat
  template's assistant header; the paper writes the sentence as "I will answer the question within n tokens" after
  the reasoning tag. The sentence is part of the prompt (not trained on).
* **Budget-aware reward** of a correct response of ``n <= L_max`` tokens under budget ``b``, with
  ``f1(n, b) = beta cos(pi n / (2 L_max)) - alpha |n - b|`` and ``f2(b) = beta cos(pi b / (2 L_max))``: the paper's
  piecewise rule is ``f1`` for ``n > b`` and ``f2`` for ``n <= b``; the official code pays ``min(f1, f2)`` for every
  ``n`` (the two differ for short answers, where ``alpha |n - b|`` exceeds the cosine gap). Wrong answers get 0.
* **Format error.** The official reward gives ``-1`` (``format_error_reward`` / ``unk_error_reward``) to a response
  without ``</think>`` or without an extractable (``\\boxed{}``) answer in the text after it, whether or not the answer
  would grade as correct (ZJU-REAL/HBPO@5c8991d ``rllm/rewards/math_reward.py:52, 62``,
  ``rllm/rewards/reward_types.py:24``): the default here (``format_reward: -1``, ``think_end``, ``answer_extractor``);
  ``format_reward: null`` turns the check off (only the correctness column decides: 0 for every incorrect response,
  the plugin's behaviour before 2026-11-27, for models without reasoning tags).
  Official constants: ``beta = 4``, ``L_max = 4096`` (the response length), ``alpha = 1 / L_max``.
* **Hierarchical advantage** of response ``j`` of sub-group ``i``: ``A_inter = (R_ij - mean(R)) / (std(R) + 1e-6)``
  over the whole group (unbiased std) plus ``A_intra_i = mean_j(R_ij) - f2(b_i)``. The paper adds ``A_intra`` once;
  the official code adds it twice (a repeated line), i.e. weight 2.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import get_extractor
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS
from trl_plugins.api.success import verifier_column
from trl_plugins.api.text import completion_text

from ._length import CorrectnessOptions, check_reward_columns, correct_rows, local_completion_ids

#: The paper's budgets (tokens).
PAPER_BUDGETS = (512, 1024, 2048, 2560)
#: The official rollout's budget sentence (appended after the reasoning tag); ``{budget}`` is replaced.
OFFICIAL_BUDGET_PROMPT = "I will answer the question with {budget} tokens"


@dataclass
class HbpoOptions(CorrectnessOptions):
    budgets: list[int] = option(
        default_factory=lambda: list(PAPER_BUDGETS),
        help="Token budgets of the sub-groups (paper: 512, 1024, 2048, 2560); num_generations must be a multiple of "
        "their number (equal sub-groups).",
    )
    prompt: str = option(
        OFFICIAL_BUDGET_PROMPT,
        help="Budget sentence ({budget} is replaced), appended to a text prompt after a space or to the last user "
        "message of a conversational prompt after a blank line [reconstructed for conversational prompts: the "
        "official rollout prefills it after '<think>' in the assistant turn]. Official wording 'with {budget} "
        "tokens'; the paper writes 'within {budget} tokens'.",
    )
    reward: Literal["official_min", "paper_piecewise"] = option(
        "official_min",
        help="Reward of a correct answer. official_min: min(f1, f2) (official code); paper_piecewise: f1 beyond the "
        "budget, f2 within it (the paper's equation).",
    )
    beta: float = option(4.0, min=0.0, help="Reward scale beta of the cosine terms (official: 4).")
    alpha: float | None = option(
        None, min=0.0, help="Deviation penalty alpha per token beyond/away from the budget (default / official: "
        "1 / max_length).",
    )
    max_length: int | None = option(
        None, min=1, help="L_max of the cosine terms (default: max_completion_length; official: the 4096-token "
        "response length).",
    )
    format_reward: float | None = option(
        -1.0,
        help="Reward of a response without think_end or without an extractable answer after it, correct or not "
        "(official: -1, ZJU-REAL/HBPO@5c8991d math_reward.py:52, 62); null: no format check (0 for every incorrect "
        "response, e.g. for models without reasoning tags).",
    )
    think_end: str | None = option(
        "</think>",
        help="Tag that ends the reasoning (official: '</think>'); the answer is looked for in the text between its "
        "first and second occurrence (official split(...)[1]). null: no tag needed, the whole completion is searched.",
    )
    answer_extractor: str | None = option(
        "boxed",
        help="Extractor of the final answer for the format check (trl_plugins.api.answers: boxed, last_number, "
        "boxed_or_last_number, task, or 'package.module:function'; official: the last \\boxed{}); null: no answer "
        "check.",
    )
    intra_weight: float = option(
        2.0, min=0.0,
        help="Weight of the intra-sub-group advantage mean_i(R) - f2(b_i). Official code: 2 (the term is added twice); "
        "the paper's equation: 1; 0 leaves the inter-sub-group (group-normalised) advantage only.",
    )

    def validate(self) -> None:
        if not self.budgets or any(int(b) < 1 for b in self.budgets):
            raise PluginConfigError(
                f"Option 'budgets' of plugin 'hbpo' got {self.budgets!r}; allowed: a non-empty list of positive token "
                "counts."
            )
        if "{budget}" not in self.prompt:
            raise PluginConfigError(
                f"Option 'prompt' of plugin 'hbpo' got {self.prompt!r}; it must contain the placeholder '{{budget}}'."
            )
        if self.answer_extractor is not None:
            try:
                get_extractor(self.answer_extractor)
            except ValueError as exc:
                raise PluginConfigError(f"Option 'answer_extractor' of plugin 'hbpo': {exc}") from exc


def budget_slots(index_in_group: torch.Tensor, group_size: int, num_budgets: int) -> torch.Tensor:
    """(N,) long: the budget sub-group of each row, ``index_in_group // (G / k)`` (equal, contiguous sub-groups)."""
    return torch.div(index_in_group.long(), group_size // num_budgets, rounding_mode="floor")


def with_budget_sentence(prompt, sentence: str):
    """``prompt`` with the budget ``sentence`` appended: to the text after one space for a text prompt (the official
    rollout's place when the prompt ends with the assistant header or the reasoning tag); for a conversational prompt,
    after a blank line at the end of the last user message (a chat template renders the generation prompt itself, so
    an assistant prefill cannot be expressed there)."""
    if isinstance(prompt, str):
        return f"{prompt} {sentence}"
    messages = [dict(m) for m in prompt]
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            m["content"] = f"{m['content']}\n\n{sentence}"
            return messages
    raise ValueError("HBPO: a conversational prompt without a text user message cannot carry the budget sentence.")


def budget_baseline(budgets: torch.Tensor, max_length: int, beta: float) -> torch.Tensor:
    """``f2(b) = beta cos(pi b / (2 L_max))`` per row (N,)."""
    return beta * torch.cos(math.pi * budgets.float() / (2 * max_length))


def budget_rewards(lengths: torch.Tensor, budgets: torch.Tensor, correct: torch.Tensor, max_length: int, beta: float,
                   alpha: float, form: str = "official_min") -> torch.Tensor:
    """HBPO's reward per row (N,).

    Args:
        lengths: (N,) completion tokens ``n``. budgets: (N,) the row's budget ``b``. correct: (N,) bool.
        form: ``"official_min"`` -- ``min(f1, f2)``; ``"paper_piecewise"`` -- ``f1`` if ``n > b`` else ``f2``.
    Returns:
        (N,) float: the budget reward for correct rows with ``n <= max_length``, else 0.
    """
    n = lengths.float()
    f1 = beta * torch.cos(math.pi * n / (2 * max_length)) - alpha * (n - budgets.float()).abs()
    f2 = budget_baseline(budgets, max_length, beta)
    shaped = torch.minimum(f1, f2) if form == "official_min" else torch.where(n > budgets.float(), f1, f2)
    return torch.where(correct & (lengths <= max_length), shaped, torch.zeros_like(shaped))


def well_formed(text: str, think_end: str | None, extractor) -> bool:
    """Official format check: ``think_end`` occurs in ``text`` and ``extractor`` finds an answer in the text after its
    first occurrence (up to the second, as ``text.split(think_end)[1]``); ``think_end=None`` searches the whole text,
    ``extractor=None`` only asks for the tag."""
    if think_end is not None:
        if think_end not in text:
            return False
        text = text.split(think_end)[1]
    return extractor is None or extractor(text) is not None


def hierarchical_advantages(rewards: torch.Tensor, slots: torch.Tensor, budgets: torch.Tensor, group_size: int,
                            max_length: int, beta: float, intra_weight: float, eps: float = 1e-6) -> torch.Tensor:
    """HBPO's advantage per row (N,): ``(R - mean_g) / (std_g + eps) + intra_weight (mean_{g,i}(R) - f2(b_i))``.

    Args:
        rewards: (N,) combined rewards, groups of ``group_size`` contiguous (NaN counts as 0).
        slots: (N,) budget sub-group of each row. budgets: (N,) the row's budget ``b``.
    """
    R = torch.nan_to_num(rewards.float(), nan=0.0).view(-1, group_size)
    inter = (R - R.mean(dim=1, keepdim=True)) / (R.std(dim=1, keepdim=True) + eps)
    s = slots.view(-1, group_size)
    same = (s.unsqueeze(2) == s.unsqueeze(1)).float()  # (groups, G, G): rows of one budget sub-group
    sub_mean = (same * R.unsqueeze(1)).sum(dim=2) / same.sum(dim=2)
    intra = sub_mean - budget_baseline(budgets, max_length, beta).view(-1, group_size)
    return (inter + intra_weight * intra).view(-1)


REFILL_REASON = (
    "a refill plugin regenerates rejected groups from the original prompts, without HBPO's budget sentences, while "
    "their rewards and advantages would still follow the budgets"
)


class HbpoPlugin(Plugin):
    """HBPO: budget sub-groups sampled with per-row budget sentences, the budget-aware reward and the hierarchical
    advantage (sampling, reward and advantage stages)."""

    name = "hbpo"
    image_inputs = (
        "it writes its budget instruction into the user message's text, and image prompts carry that message as "
        "image and text parts."
    )
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.2.0"
    paper = "Hierarchical Budget Policy Optimization for Adaptive Reasoning (HBPO), arXiv:2507.15844"
    summary = "Budget sub-groups sampled with budget sentences, budget-aware rewards, hierarchical advantages."
    Options = HbpoOptions
    official = OfficialSource(
        "ZJU-REAL/HBPO", "5c8991d", verdict="faithful",
        files=("rllm/rewards/math_reward.py", "rllm/rewards/reward_types.py"),
        variants=("format_reward",),
        non_official_defaults={
            "max_length": "the 4096-token response length; here max_completion_length",
        },
    )
    claim_metric = ("within_budget_fraction", "responses within their budget")
    replaces = (
        "the correctness column's value (by the budget-aware reward) and the advantages (hierarchical)",
    )
    overwrites = ("advantages",)
    conflicts_with_hooks = {"trl_plugins_reject_groups": REFILL_REASON}
    reconstructed = (
        "the budget sentence of a conversational prompt ends the last user message (official: assistant prefill after "
        "'<think>', which TRL's chat templating cannot express)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.max_len = 1

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        self.max_len = int(trainer.max_completion_length)
        check_reward_columns(self.name, trainer, o)
        if max(o.budgets) > (o.max_length or self.max_len):
            warnings.warn(
                f"{self.name} (HBPO): budgets {o.budgets} exceed L_max={o.max_length or self.max_len} (max_length, "
                "default max_completion_length); the paper's budgets (up to 2560) assume a 4096-token response length. "
                "Set budgets for this run's length.",
                stacklevel=2,
            )
        if args.num_generations % len(o.budgets):
            raise PluginConfigError(
                f"{self.name} (HBPO): num_generations={args.num_generations} is not a multiple of the {len(o.budgets)} "
                f"budgets {o.budgets}; HBPO splits each group into equal budget sub-groups."
            )

    def _row_budgets(self, index_in_group, G: int) -> torch.Tensor:
        """(N,) long budget of each row (its sub-group's) from its index in the group."""
        budgets = torch.tensor([int(b) for b in self.options.budgets], dtype=torch.long)
        index = torch.as_tensor(index_in_group, dtype=torch.long).cpu()
        return budgets[budget_slots(index, G, len(budgets))]

    def _constants(self) -> tuple[int, float]:
        """(L_max, alpha) of the budget reward."""
        L = self.options.max_length or self.max_len
        return L, self.options.alpha if self.options.alpha is not None else 1.0 / L

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        budgets = self._row_budgets(ctx.index_in_group, ctx.num_generations).tolist()
        for i, b in enumerate(budgets):
            prompt = with_budget_sentence(ctx.prompts[i], self.options.prompt.format(budget=b))
            ctx.generation_prompts[i] = ctx.training_prompts[i] = prompt
            ctx.annotations[i]["hbpo_budget"] = b

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Write the budget-aware reward into the correctness column (training batches; NaN stays NaN)."""
        ids = local_completion_ids(ctx, self.name)
        if ctx.mode != "train":
            return
        o = self.options
        device = ctx.rewards_per_func.device
        extractor = None if o.answer_extractor is None else get_extractor(o.answer_extractor)
        local = [(len(row), o.format_reward is None or well_formed(completion_text(c), o.think_end, extractor))
                 for row, c in zip(ids, ctx.local_completions)]
        gathered = ctx.gather_object(local)
        lengths = torch.tensor([n for n, _ in gathered], device=device)
        ok = torch.tensor([f for _, f in gathered], dtype=torch.bool, device=device)
        budgets = self._row_budgets(ctx.index_in_group, ctx.num_generations).to(device)
        L, alpha = self._constants()
        reward = budget_rewards(lengths, budgets, correct_rows(ctx, o).to(device), L, o.beta, alpha, o.reward)
        if o.format_reward is not None:
            reward = torch.where(ok, reward, torch.full_like(reward, o.format_reward))
            ctx.log_metric("format_error_fraction", (~ok).float().mean().item())
        K = ctx.rewards_per_func.shape[1]
        flags = ctx.run.placeholder_columns if len(ctx.run.placeholder_columns) == K else ()
        col = verifier_column(ctx.reward_func_names, flags, o.correctness_column)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, col] = torch.where(torch.isnan(rewards[:, col]), rewards[:, col], reward.to(rewards.dtype))
        ctx.rewards_per_func = rewards
        ctx.log_metric("mean_length", lengths.float().mean().item())
        ctx.log_metric("within_budget_fraction", (lengths <= budgets).float().mean().item())
        ctx.log_metric("budget_reward", reward.mean().item())

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        if ctx.mode != "train":
            return
        o, G = self.options, ctx.num_generations
        budgets = self._row_budgets(ctx.index_in_group, G)
        slots = budget_slots(torch.as_tensor(ctx.index_in_group).cpu(), G, len(o.budgets))
        L, _ = self._constants()
        adv = hierarchical_advantages(ctx.rewards.cpu(), slots, budgets, G, L, o.beta, o.intra_weight)
        ctx.advantages = adv.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
        ctx.log_metric("hbpo_advantage_mean", adv.mean().item())
