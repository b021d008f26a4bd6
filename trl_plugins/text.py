"""The plain text of a TRL completion, for reward functions, extractors and plugins (imports nothing).

TRL hands reward functions and plugins completions in the dataset's format: a string (standard datasets) or a list
of messages whose last one is the assistant's answer (conversational datasets).
"""

from __future__ import annotations

from typing import Any

__all__ = ["completion_text"]


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: the string itself, or the content of the last message of a message list.

    >>> completion_text("Answer: 4"), completion_text([{"role": "assistant", "content": "Answer: 4"}])
    ('Answer: 4', 'Answer: 4')
    """
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content", "")
    return content if isinstance(content, str) else ""
