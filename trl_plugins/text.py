"""The plain text of a TRL completion, and stable keys of JSON-able values, for reward functions, extractors and
plugins (standard library only).

TRL hands reward functions and plugins completions in the dataset's format: a string (standard datasets) or a list
of messages whose last one is the assistant's answer (conversational datasets).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["completion_text", "stable_key"]


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


def stable_key(value: Any) -> int:
    """A signed 64-bit key of a JSON-able value (a prompt, a column's value, a tool call), the same on every process
    and in every run (unlike Python's ``hash``): the first 8 bytes of the SHA-1 of its key-sorted JSON."""
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "little", signed=True)
