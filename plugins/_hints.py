"""Shared pieces of the hint plugins (``hint_scaffold``, ``seele``): how a hint joins a prompt, and the key of a
problem in a plugin's per-problem memory."""

from __future__ import annotations

import copy
from typing import Any

from trl_plugins.api import PluginConfigError

#: The hint sentence of GHPO (and SEELE's hint in the prompt): the hint is the beginning of the answer.
DEFAULT_TEMPLATE = "{question}\n\nThe following text is the beginning of the answer, which you can refer to:\n{hint}"


def hinted_prompt(prompt: Any, hint: str, template: str) -> Any:
    """The prompt with ``hint`` joined to its last user message (conversational) or to the text."""
    if isinstance(prompt, str):
        return template.format(question=prompt, hint=hint)
    messages = copy.deepcopy(prompt)
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = template.format(question=message["content"], hint=hint)
            return messages
    raise PluginConfigError("the prompt has no user message to attach the hint to.")


def question_key(prompt: Any) -> str:
    """The key of a problem in a plugin's per-problem memory (SEELE's hinting rates, Scaf-GRPO's teacher tiers): its prompt text."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
