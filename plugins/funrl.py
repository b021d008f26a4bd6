"""FunRL — function-call RL with AST-verified rewards ("Exploring Superior Function Calls via Reinforcement Learning",
arXiv:2508.05118).

A strict, binary function-call reward: 1.0 when the completion's function calls match the gold calls exactly --
the same functions with the same arguments (names and values) -- and 0.0 otherwise (also when the calls do not
parse). Facts from the paper: the reward is binary and strict; calls are verified structurally, through their
abstract syntax tree (function name, parameter names, parameter values), not by string comparison.

Where the calls come from: the tool calls TRL parsed from every assistant turn of a multi-turn completion (TRL
``tools`` / ``environment_factory``); for a completion without structured calls, the text of its last assistant
message parsed as Python call expressions with :mod:`ast` (``search(query="Pell")``, or a list of them, BFCL's
format). Gold calls: a dataset column holding a JSON list of ``{"name": ..., "arguments": {...}}`` (the bundled tool
environment's ``gold_calls``).

Reconstructed (options, flagged): multiple calls compared as a multiset (``order="unordered"``; the paper's
parallel-call categories are order-free), values compared after normalisation (numbers by value, strings stripped).
Not implemented here: the paper's entropy-based exploration bonus (EGPO in later versions of the paper) and its
data-filtering pipeline. ``reward_weight = 0`` is the neutral setting (the column adds nothing to TRL's sum).
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from trl_plugins import Plugin, PluginOptions, hookimpl, option
from trl_plugins.tool_calls import call_key, parse_gold_calls


@dataclass
class FunrlOptions(PluginOptions):
    gold_column: str = option("gold_calls", help="Dataset column with the gold calls (JSON list of {name, arguments}).")
    order: Literal["unordered", "ordered"] = option(
        "unordered", reconstructed=True, help="Compare several calls as a multiset, or in order."
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL weight of the funrl column (0: the neutral setting).")


def parse_text_calls(text: str) -> list[tuple] | None:
    """Calls written as Python expressions (``f(a=1)`` or ``[f(a=1), g(b="x")]``), via :mod:`ast`; None when the text
    is not a call expression (positional arguments, attribute access and non-literal values do not verify)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(call_key(node.func.id, arguments))
    return calls


def completion_calls(completion: Any) -> list[tuple] | None:
    """The calls of a completion: TRL's parsed tool calls of every assistant turn, else the last assistant text."""
    if isinstance(completion, list):
        structured = [
            call_key((c.get("function") or c).get("name"), (c.get("function") or c).get("arguments") or {})
            for message in completion if isinstance(message, dict) and message.get("role") == "assistant"
            for c in message.get("tool_calls") or []
        ]
        if structured:
            return structured
        texts = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        text = texts[-1] if texts and isinstance(texts[-1], str) else ""
    else:
        text = str(completion)
    return parse_text_calls(text)


def calls_match(predicted: list[tuple] | None, gold: list[tuple], ordered: bool) -> bool:
    if predicted is None:
        return False
    return predicted == gold if ordered else Counter(predicted) == Counter(gold)


def gold_calls(value: Any) -> list[tuple]:
    return [call_key(c["name"], c["arguments"]) for c in parse_gold_calls(value)]


class FunrlPlugin(Plugin):
    name = "funrl"
    multi_turn = True
    version = "0.1.0"
    paper = "Exploring Superior Function Calls via Reinforcement Learning (FunRL), arXiv:2508.05118"
    summary = "Strict binary function-call reward: calls verified against gold calls by their syntax tree."
    Options = FunrlOptions
    reconstructed = ("several calls compared as a multiset", "values normalised (numbers by value, strings stripped)")

    def required_columns(self) -> list[str]:
        return [self.options.gold_column]

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        column, ordered = self.options.gold_column, self.options.order == "ordered"

        def funrl(completions, **kwargs):
            golds = kwargs[column]
            return [float(calls_match(completion_calls(c), gold_calls(g), ordered)) for c, g in zip(completions, golds)]

        funrl.reward_weight = self.options.reward_weight
        return [funrl]
