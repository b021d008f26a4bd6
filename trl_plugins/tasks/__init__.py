"""Built-in synthetic tasks: the chained-arithmetic task family and the tiny offline model.

``trl_plugins.tasks.arithmetic`` (verifier, PRM, feedback, rubrics, hints, datasets) imports nothing
heavy; the names from ``trl_plugins.tasks.tiny`` (torch / transformers) are loaded on first access.
"""

from __future__ import annotations

from typing import Any

from trl_plugins.tasks import arithmetic as _arithmetic
from trl_plugins.tasks.arithmetic import *  # noqa: F403 -- exactly the names of arithmetic.__all__

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

__all__ = [*_arithmetic.__all__, *_TINY_NAMES]


def __getattr__(name: str) -> Any:
    if name in _TINY_NAMES:
        from trl_plugins.tasks import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
