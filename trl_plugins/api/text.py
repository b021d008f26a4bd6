"""The plain text of a TRL completion, and stable keys of JSON-able values, for reward functions, extractors and
plugins (standard library only).

TRL hands reward functions and plugins completions in the dataset's format: a string (standard datasets) or a list
of messages whose last one is the assistant's answer (conversational datasets).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["check_template", "completion_text", "stable_key"]


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


def check_template(plugin: str, option: str, template: Any, fields: tuple[str, ...],
                   required: tuple[str, ...] | None = None) -> None:
    """Refuse a ``str.format`` template option at construction instead of a raw ``KeyError`` / ``IndexError`` /
    ``ValueError`` mid-run, or a template that silently leaves out what it must carry.

    ``fields``: the ``{names}`` the plugin fills in; ``required`` (default: all of them) must each appear. Refused
    (a :class:`~trl_plugins.api.errors.PluginConfigError` naming plugin, option, value and the allowed fields): text
    that is not a template (unbalanced braces), a field the plugin does not fill (``{questoin}``), a positional ``{}``,
    attribute or index access (``{answer.upper}``, ``{answer[0]}``), a nested field in a format spec, and a missing
    required field.
    """
    import string

    from trl_plugins.api.errors import PluginConfigError

    required = fields if required is None else required
    allowed = ", ".join("{" + f + "}" for f in fields)

    def refuse(problem: str) -> None:
        raise PluginConfigError(
            f"Option {option!r} of plugin {plugin!r} got {template!r:.120}; {problem}. Allowed fields: {allowed} "
            "(write {{ and }} for literal braces)."
        )

    if not isinstance(template, str):
        refuse("allowed: text")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        refuse(f"it is not a valid template ({exc})")
    seen = set()
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit():
            refuse("a positional field {} is filled by nothing")
        if name not in fields:
            base = name.split(".", 1)[0].split("[", 1)[0]
            if base in fields:
                refuse(f"the field {{{name}}} reads an attribute or item of {{{base}}}; only plain fields are filled")
            refuse(f"it has the field {{{name}}}, which the plugin does not fill")
        if spec and "{" in spec:
            refuse(f"the format spec of {{{name}}} holds a nested field")
        seen.add(name)
    missing = [f for f in required if f not in seen]
    if missing:
        refuse(f"it must contain {', '.join('{' + f + '}' for f in missing)}")


def last_user_text(prompt: Any) -> str:
    """The text of a prompt's last user message (conversational), or the prompt itself (a string)."""
    if isinstance(prompt, str):
        return prompt
    return str([m for m in prompt if m.get("role") == "user"][-1]["content"])


def with_last_user_text(prompt: Any, text: str) -> Any:
    """``prompt`` with its last user message's text replaced by ``text`` (a new list; a string prompt becomes
    ``text``); the other messages are kept as they are."""
    if isinstance(prompt, str):
        return text
    messages = [dict(m) for m in prompt]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
    messages[last]["content"] = text
    return messages
