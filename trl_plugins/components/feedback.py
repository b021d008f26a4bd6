"""Verifier feedback: a task's rule-based verifier says, in words, what is wrong with a solution.

Plugins that turn a failed attempt into guidance (FBOS-RL's feedback-augmented prompts, R3L's reflection reports)
ask a *feedback oracle* named in :data:`VERIFIER_FEEDBACK` -- ``fn(problem, text)`` with ``problem`` the row's problem
column as stored -- and get a :class:`VerifierFeedback`. ``"arithmetic"`` is the bundled tasks' verifier
(:func:`trl_plugins.tasks.arithmetic.verifier_feedback`, loaded on first use: the first wrong step, what it should
be, a missing or wrong final answer); a task registers its own with ``VERIFIER_FEEDBACK.register``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trl_plugins.api.errors import PluginError
from trl_plugins.api.registry import Registry

__all__ = ["VERIFIER_FEEDBACK", "VerifierFeedback", "feedback_oracle"]


@dataclass(frozen=True)
class VerifierFeedback:
    """What a verifier says about one solution.

    Attributes:
        message: the natural-language feedback (e.g. ``"Step 2 is wrong: 7*2 is 14, not 15."``; ``"Correct."``).
        correct: whether the solution is correct.
        first_error: 0-based index of the first wrong step (one step per non-empty line), None when no step is wrong.
    """

    message: str
    correct: bool
    first_error: int | None = None


#: Feedback oracles by name, ``fn(problem, text) -> VerifierFeedback`` (or a mapping with its fields).
VERIFIER_FEEDBACK: Registry[Callable[[Any, str], Any]] = Registry(
    "verifier feedback oracle", {"arithmetic": "trl_plugins.tasks.arithmetic:verifier_feedback"},
    contract="fn(problem, text: str) -> VerifierFeedback or {'message', 'correct', 'first_error'}",
)


def feedback_oracle(name: str | Callable[[Any, str], Any]) -> Callable[[Any, str], VerifierFeedback]:
    """The oracle named ``name`` (see :data:`VERIFIER_FEEDBACK`), answering :class:`VerifierFeedback`."""
    oracle = VERIFIER_FEEDBACK.get(name)

    def ask(problem: Any, text: str) -> VerifierFeedback:
        answer = oracle(problem, text)
        if isinstance(answer, VerifierFeedback):
            return answer
        if isinstance(answer, Mapping) and "message" in answer and "correct" in answer:
            first = answer.get("first_error")
            return VerifierFeedback(str(answer["message"]), bool(answer["correct"]),
                                    None if first is None else int(first))
        raise PluginError(
            f"The verifier feedback oracle {name!r} answered {answer!r}; expected a VerifierFeedback or a mapping with "
            "'message', 'correct' and 'first_error'."
        )

    return ask
