"""RLSP — Reinforcement Learning via Self-Play (arXiv:2502.06773): an exploration reward decoupled from the outcome.

The paper trains with an outcome verifier and, separately, an exploration reward that pays for taking more
intermediate steps; the two are balanced so that the exploration signal cannot be hacked into wrong answers. Facts
from the official reward server (``GuanghaoYe/Emergence-of-Thinking@a36ba6c``,
``openrlhf/cli/orm_server_efficient.py``: ``extract_answer_and_reasoning``, lines 80-91; ``_compute_single_reward``,
lines 109-123):

1. The reasoning is the text of the response before its first ``\\boxed{...}`` answer (the whole response when
   there is none); its length ``L`` is counted as ``len(reasoning) / 4`` (characters over four, a token estimate).
2. Exploration reward: ``r_explore = -c / L`` with ``c`` the ``length_penalty`` -- a penalty that shrinks as the
   reasoning grows, never positive, so it can only rank equally-correct answers and never lift a wrong one above a
   right one by more than ``c / L``. The README's runs use ``c = 0`` (Figure 5(a), outcome only) and ``c = 1000``
   (Figure 5(b) and the Qwen2.5-32B run); the script's own default is 20.
3. Outcome: the verifier's 0/1, or ``-0.5`` when the response has no boxed answer at all (a format penalty).
4. Total: ``outcome + r_explore``.

Here the exploration reward is its own reward column ``rlsp`` (TRL's reward weights apply: ``reward_weight``
balances it against the verifier, 1.0 as in the official sum), so the outcome column stays untouched (decoupled, and
``multi_objective_aggregation="normalize_then_sum"`` can normalise the two separately). The column holds
``r_explore + (missing_answer_reward if no answer)``: with a verifier that gives 0 to an unanswered response, the sum
is the official ``-0.5 + r_explore``. ``length_penalty = 0`` and ``missing_answer_reward = 0`` is the neutral setting
(an all-zero column: vanilla TRL).

Not included: the official server's optional GPT-4o-mini "thinking effort" grade (``use_gpt``: total
``0.8 * r + 0.2 * grade``), which needs a numeric-score judge the project's rubric judges do not provide.
Reconstructed: ``L`` is floored at one token (the official code divides by zero on an empty reasoning and then falls
back to a reward of 0 for the whole response).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginOptions,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import completion_text
from ._regex import compile_option

COLUMN = "rlsp"
#: the official answer pattern: the outermost ``\boxed{...}`` with one level of nested braces
BOXED = r"\\boxed{([^{}]*(?:{[^{}]*}[^{}]*)*)}"


@dataclass
class RlspOptions(PluginOptions):
    length_penalty: float = option(
        1000.0, min=0.0,
        help="c of the exploration reward -c / L (L: reasoning characters / chars_per_token). Official runs: 1000 "
        "(Figure 5(b), Qwen2.5-32B); 0 turns the exploration reward off.",
    )
    missing_answer_reward: float = option(
        -0.5, max=0.0,
        help="Added when the response has no answer (answer_pattern never matches); official: the outcome becomes "
        "-0.5. 0 turns the format penalty off.",
    )
    answer_pattern: str = option(
        BOXED, help="Regular expression of the final answer; the reasoning is the text before its first match (the "
        "whole response when it never matches). Official: the \\boxed{...} answer.",
    )
    chars_per_token: float = option(
        4.0, min=0.0, min_exclusive=True, help="Characters per token of the length estimate (official: 4)."
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL reward weight of the rlsp column (official: 1, a plain sum).")

    def validate(self) -> None:
        compile_option("rlsp", "answer_pattern", self.answer_pattern)


def reasoning_length(text: str, pattern: re.Pattern, chars_per_token: float) -> tuple[float, bool]:
    """(L, answered): the reasoning's length in estimated tokens (characters before the first answer match, or the whole
    text, over ``chars_per_token``; floored at 1) and whether the answer pattern matched."""
    match = pattern.search(text)
    reasoning = text if match is None else text[:match.start()]
    return max(len(reasoning) / chars_per_token, 1.0), match is not None


def exploration_reward(lengths: list[float], answered: list[bool], length_penalty: float,
                       missing_answer_reward: float) -> list[float]:
    """(N,) RLSP column: ``-c / L``, plus ``missing_answer_reward`` where no answer was found."""
    return [-length_penalty / n + (0.0 if ok else missing_answer_reward) for n, ok in zip(lengths, answered)]


class RlspPlugin(Plugin):
    """RLSP's length exploration reward (and missing-answer penalty) in its own column, beside the verifier (reward)."""

    name = "rlsp"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = "On the Emergence of Thinking in LLMs I: Searching for the Right Intuition (RLSP), arXiv:2502.06773"
    summary = "Decoupled exploration reward -c/L (longer reasoning, smaller penalty) beside the outcome verifier."
    Options = RlspOptions
    official = OfficialSource(
        "GuanghaoYe/Emergence-of-Thinking", "a36ba6c", verdict="faithful",
        files=("openrlhf/cli/orm_server_efficient.py",),
        note="The exploration reward is a separate column (the official server adds it to the outcome); the optional "
        "GPT thinking-effort grade (use_gpt) is not included; L floored at one token.",
    )
    claim_metric = ("reasoning_tokens", "estimated reasoning tokens")
    reconstructed = ("L floored at one token (the official code's division by zero on an empty reasoning)",)

    def __init__(self, options=None):
        super().__init__(options)
        self._pattern = re.compile(self.options.answer_pattern)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # filled by the reward transform, which also logs the lengths (a placeholder is never the verifier column)
        return [placeholder_column(COLUMN, self.options.reward_weight)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        local = [reasoning_length(completion_text(c), self._pattern, o.chars_per_token) for c in ctx.local_completions]
        measured = ctx.gather_object(local)  # collective: (N,) (L, answered)
        lengths, answered = [n for n, _ in measured], [ok for _, ok in measured]
        values = exploration_reward(lengths, answered, o.length_penalty, o.missing_answer_reward)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = torch.tensor(values, dtype=rewards.dtype,
                                                                       device=rewards.device)
        ctx.rewards_per_func = rewards
        ctx.log_metric("reasoning_tokens", sum(lengths) / max(len(lengths), 1))
        ctx.log_metric("answered_fraction", sum(answered) / max(len(answered), 1))
        ctx.log_metric("exploration_reward", sum(values) / max(len(values), 1))
