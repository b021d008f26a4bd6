"""PEAR — Phase Entropy Aware Reward for efficient reasoning (arXiv:2510.08026).

What the paper states: the thinking phase of a response (before the ``</think>`` marker) has higher token entropy than
the final-answer phase, and entropy correlates with length; PEAR's reward penalises entropy in the thinking phase while
allowing moderate entropy in the answer phase, computed from the (old-policy) per-token entropies of each response.

Here the mean token entropy of the thinking phase (before ``marker``) is penalised, the answer phase's less or not at
all: ``bonus = -(alpha H_think + answer_alpha H_answer)`` for correct responses, in the plugin's own reward column
(named after the plugin; TRL's weights and aggregation apply), from one no-grad forward of the current (pre-update)
policy at the reward stage. The exact combination was not available to us (no copy of the official code here), so
this form and its defaults are a documented reconstruction (``answer_alpha`` < ``alpha``: the answer phase is
penalised less, by default not at all). ``alpha = answer_alpha = 0`` is the neutral setting (an all-zero column, no
forward). Correctness: :mod:`trl_plugins_builtin._length`.

No official code was reachable, so the method is reconstructed from its paper: the phase
split and the phase weights are reconstructed from the abstract (``trl-plugins show pear``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import OfficialSource, Plugin, RewardContext, hookimpl, option
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE

from ._length import CorrectnessOptions, check_reward_columns, correct_rows, local_completion_ids
from ._phases import phase_boundary


@dataclass
class PearOptions(CorrectnessOptions):
    alpha: float = option(
        0.1, min=0.0, help="Weight of the thinking phase's mean token entropy in the (negative) bonus.",
        reconstructed=True,
    )
    answer_alpha: float = option(
        0.0, min=0.0, help="Weight of the answer phase's mean token entropy (smaller: moderate answer-phase entropy is "
        "tolerated; 0: not penalised).", reconstructed=True,
    )
    marker: str = option(
        "</think>", help="Text that ends the thinking phase (no marker: the whole completion is thinking).",
    )
    only_correct: bool = option(True, help="Pay the entropy bonus to correct responses only.", reconstructed=True)


def phase_entropies(entropies: torch.Tensor, boundary: int) -> tuple[float, float]:
    """(mean entropy of the thinking phase, of the answer phase) of one completion's (L,) token entropies; an empty
    phase has mean 0."""
    think, answer = entropies[:boundary], entropies[boundary:]
    return (float(think.mean()) if think.numel() else 0.0, float(answer.mean()) if answer.numel() else 0.0)


def pear_bonus(think: torch.Tensor, answer: torch.Tensor, correct: torch.Tensor, alpha: float, alpha_answer: float,
               only_correct: bool = True) -> torch.Tensor:
    """(N,) reward bonus ``-(alpha H_think + alpha_answer H_answer)``, 0 on incorrect rows when ``only_correct``."""
    bonus = -(alpha * think + alpha_answer * answer)
    return torch.where(correct, bonus, torch.zeros_like(bonus)) if only_correct else bonus


class PearPlugin(Plugin):
    """PEAR's phase-entropy bonus in the plugin's own reward column (reward stage)."""

    name = "pear"
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    version = "0.1.0"
    paper = "PEAR: Phase Entropy Aware Reward for Efficient Reasoning, arXiv:2510.08026"
    summary = "Penalises the thinking phase's token entropy (reconstructed formula), tolerating the answer phase's."
    Options = PearOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found: the phase split and the phase weights are reconstructed from the abstract.",
    )
    claim_metric = ("think_entropy", "thinking-phase entropy")
    reconstructed = (
        "the bonus -(alpha H_think + answer_alpha H_answer) on correct responses and its defaults (the paper's exact "
        "formula was not available)",
    )

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(self.name)]  # the bonus needs the policy's entropies: the reward transform fills it

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        check_reward_columns(self.name, trainer, self.options, own=self.name)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Fill the plugin's column with the phase-entropy bonus (one no-grad forward over the local rows)."""
        o = self.options
        ids = local_completion_ids(ctx, self.name)
        if o.alpha == 0 and o.answer_alpha == 0:  # neutral: an all-zero column, no forward
            return
        tokenizer = ctx.tokenizer

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=False)

        local = [phase_entropies(h.float().cpu(), phase_boundary(row, decode, o.marker))
                 for h, row in zip(ctx.policy_entropies(), ids)]
        gathered = ctx.gather_object(local)
        device = ctx.rewards_per_func.device
        think = torch.tensor([t for t, _ in gathered], device=device)
        answer = torch.tensor([a for _, a in gathered], device=device)
        bonus = pear_bonus(think, answer, correct_rows(ctx, o).to(device), o.alpha, o.answer_alpha, o.only_correct)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(self.name)] = bonus.to(rewards.dtype)
        ctx.rewards_per_func = rewards
        ctx.log_metric("think_entropy", think.mean().item())
        ctx.log_metric("answer_entropy", answer.mean().item())
        ctx.log_metric("bonus", bonus.mean().item())
