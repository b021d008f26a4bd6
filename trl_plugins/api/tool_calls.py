"""Tool calls as data: gold traces read from a dataset column, call arguments and values in comparable form.

Shared by the plugins that compare a rollout's tool calls with gold calls (``funrl``'s exact match, ``matchtir``'s
bipartite matching). Predicted calls come from TRL's parsed messages (see
:class:`~trl_plugins.api.turns.TurnStructure`'s ``tool_calls``: ``[{"name", "arguments"}]`` per assistant turn); gold
calls from a dataset column holding a JSON list (or a list) of ``{"name": ..., "arguments": {...}}`` -- the bundled tool
environment's ``gold_calls`` (:func:`trl_plugins.tasks.tools.make_tool_dataset`). ``"parameters"`` is accepted for
``"arguments"``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["call_arguments", "call_key", "normalise_value", "parse_gold_calls"]


def call_arguments(arguments: Any) -> dict:
    """A call's arguments as a dict: a dict as is, a JSON object string parsed; anything else (None, a string that
    is not a JSON object) gives ``{}``."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def normalise_value(value: Any) -> Any:
    """A hashable, comparable form of an argument value: numbers by value (``3 == 3.0``), strings stripped,
    lists as tuples, dicts as sorted (key, value) pairs; booleans and None as they are."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (list, tuple)):
        return tuple(normalise_value(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), normalise_value(v)) for k, v in value.items()))
    return repr(value)


def call_key(name: Any, arguments: Any) -> tuple:
    """A hashable, normalised form of one call: (name, sorted (parameter, value) pairs)."""
    return (str(name).strip(), normalise_value(dict(call_arguments(arguments))))


def parse_gold_calls(value: Any) -> list[dict]:
    """The gold calls of one dataset row, ``[{"name": str, "arguments": dict}]`` in trace order.

    ``value``: a JSON string or a list of ``{"name", "arguments"}`` (or ``"parameters"``) dicts; None or an empty
    string is an empty trace. Raises ValueError naming the bad value otherwise.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    calls = json.loads(value) if isinstance(value, str) else value
    if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ValueError(f"gold calls must be a (JSON) list of {{'name', 'arguments'}} objects; got {value!r}")
    return [{"name": str(c["name"]), "arguments": call_arguments(c.get("arguments", c.get("parameters")))}
            for c in calls]


GOLD_CALLS_ALLOWED = ("a JSON list (or a list) of {'name', 'arguments'} objects in trace order, or None / an empty "
                      "string for a row without calls")


def gold_calls_ok(value: Any) -> bool:
    """Whether :func:`parse_gold_calls` reads ``value`` (for the construction check of a gold-calls column)."""
    try:
        parse_gold_calls(value)
    except Exception:  # noqa: BLE001 - malformed JSON, wrong shapes, arguments that are no mapping ...
        return False
    return True
