"""Built-in synthetic tasks: the chained-arithmetic task family and the tiny offline model.

``trl_plugins.tasks.arithmetic`` (verifier, PRM, feedback, rubrics, hints, datasets) imports nothing
heavy; the names from ``trl_plugins.tasks.tiny`` (torch / transformers) are loaded on first access.
"""

from __future__ import annotations

from typing import Any

from .arithmetic import (
    LEVELS,
    OPERATORS,
    LevelSpec,
    Problem,
    Step,
    accuracy_reward,
    apply_op,
    completion_text,
    extract_answer,
    feedback,
    first_error_step,
    hint,
    in_split,
    make_dataset,
    make_problem,
    make_rubrics,
    parse_step,
    rubric_score,
    rubric_verdict,
    split_steps,
    step_scores,
    verify,
)

_TINY_NAMES = (
    "CHAT_TEMPLATE",
    "INFORMAL_ENDINGS",
    "DemoSettings",
    "build_and_save",
    "build_tiny_model",
    "build_tokenizer",
    "demo_model",
    "evaluate_accuracy",
    "generate_completions",
    "sft_loss",
    "warm_start",
)

__all__ = [
    "LEVELS",
    "OPERATORS",
    "LevelSpec",
    "Problem",
    "Step",
    "accuracy_reward",
    "apply_op",
    "completion_text",
    "extract_answer",
    "feedback",
    "first_error_step",
    "hint",
    "in_split",
    "make_dataset",
    "make_problem",
    "make_rubrics",
    "parse_step",
    "rubric_score",
    "rubric_verdict",
    "split_steps",
    "step_scores",
    "verify",
    *_TINY_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _TINY_NAMES:
        from . import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
