"""The bundled offline tool environment: a calculator and a search tool over a small local corpus.

Questions about fictional towns (:mod:`trl_plugins.tasks.tool_corpus`) whose answers need one to three tool calls:

=========  =====  =========================================================  ================================
kind       calls  question                                                   gold trace
=========  =====  =========================================================  ================================
lookup     1      What is the population of Brellin?                         search
scaled     2      What is three times the population of Brellin?             search, calculator
combined   3      What is the combined population of Brellin and Tavok?      search, search, calculator
=========  =====  =========================================================  ================================

Use it with TRL's ``tools=`` (the plain functions :func:`calculator` and :func:`search`) or ``environment_factory=``
(:class:`ToolEnvironment`, which also records each call and gives per-call rewards). Everything runs offline on CPU.

* :func:`make_tool_dataset` -- ``datasets.Dataset`` with ``prompt``, ``answer``, ``kind``, ``num_calls``,
  ``gold_calls`` (JSON list of ``{"name", "arguments"}``), ``entities`` (the places the question is about);
* :func:`tool_answer_reward` -- the exact verifier: the last assistant message's ``Answer: N`` line equals ``answer``;
* :func:`enable_tool_calling` -- gives the bundled tiny model's tokenizer, or a ChatML tokenizer such as
  ``builtin:smollm2``'s, a chat template that renders tool calls and results, and the response template TRL parses
  tool calls with (TRL requires both; neither model ships them).

In YAML (``trl-plugins train``)::

    dataset_name: builtin:tools
    reward_funcs: [tool_answer]
    environment_factory: trl_plugins.tasks.tools.ToolEnvironment     # or: tools: [trl_plugins.tasks.tools.search, ...]
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Sequence
from typing import Any

from trl_plugins.guards.tool_guard import ToolInputError
from trl_plugins.tasks.arithmetic import extract_answer
from trl_plugins.tasks.tool_corpus import FACTS, PLACES, Place

__all__ = [
    "CHATML_TOOL_TEMPLATE",
    "KINDS",
    "TINY_TOOL_TEMPLATE",
    "SYSTEM_PROMPT",
    "ToolEnvironment",
    "calculator",
    "enable_tool_calling",
    "final_answer_text",
    "gold_trace_script",
    "make_tool_dataset",
    "search",
    "tool_answer_reward",
]

KINDS = {"lookup": 1, "scaled": 2, "combined": 3}
SYSTEM_PROMPT = "Use the tools search and calculator. End with: Answer: N"

# ----------------------------------------------------------------------------------------------------- tools
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolInputError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ToolInputError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / // % and ()")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "4120*3".

    Returns:
        The value, as text (an integer when the value is whole).
    """
    if not isinstance(expression, str) or len(expression) > 200:
        raise ToolInputError("expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolInputError(f"expression does not parse: {exc.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def search_place(query: str) -> Place | None:
    """The corpus record that best matches ``query`` (name words count three times), None when nothing matches."""
    words = _words(query)
    best, best_score = None, 0
    for place in PLACES:
        score = 3 * len(words & _words(place.name)) + len(words & _words(place.text))
        if score > best_score:
            best, best_score = place, score
    return best


def search(query: str) -> str:
    """Search the encyclopedia of towns.

    Args:
        query: words to look for, e.g. the name of a town.

    Returns:
        The best matching document, or a message saying nothing matched.
    """
    if not isinstance(query, str) or not query.strip():
        raise ToolInputError("query must be a non-empty string")
    place = search_place(query)
    return place.text if place is not None else f"No document matches {query!r}."


class ToolEnvironment:
    """One rollout's environment for TRL's ``environment_factory``: the two tools, a call log and per-call rewards.

    Public methods other than ``reset`` are the tools TRL exposes to the model. After a rollout:

    * ``calls``: ``[{"name", "arguments", "result"}]`` in call order;
    * ``turn_rewards``: one float per tool call (the framework sums them per assistant turn, see
      :class:`~trl_plugins.api.turns.TurnStructure`): 1.0 when a search returned a document about a place the question
      asks about, or the calculator returned the answer; else 0.0.
    """

    def __init__(self):
        self.calls: list[dict] = []
        self.turn_rewards: list[float] = []
        self._entities: set[str] = set()
        self._answer: str | None = None

    def reset(self, **row: Any) -> None:
        self.calls = []
        self.turn_rewards = []
        self._entities = {e.lower() for e in row.get("entities") or []}
        self._answer = None if row.get("answer") is None else str(row["answer"])
        return None

    def _record(self, name: str, arguments: dict, result: str, reward: float) -> str:
        self.calls.append({"name": name, "arguments": arguments, "result": result})
        self.turn_rewards.append(reward)
        return result

    def search(self, query: str) -> str:
        """Search the encyclopedia of towns.

        Args:
            query: words to look for, e.g. the name of a town.

        Returns:
            The best matching document, or a message saying nothing matched.
        """
        result = search(query)
        place = search_place(query)
        hit = place is not None and place.name.lower() in self._entities
        return self._record("search", {"query": query}, result, float(hit))

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / // % and parentheses, e.g. "4120*3".

        Returns:
            The value, as text (an integer when the value is whole).
        """
        result = calculator(expression)
        return self._record("calculator", {"expression": expression}, result, float(result == self._answer))


# ----------------------------------------------------------------------------------------------------- data
def _question(kind: str, fact: str, places: Sequence[Place], factor: int) -> tuple[str, int, list[dict]]:
    """(question, answer, gold calls) of one question."""
    label = FACTS[fact]
    a = places[0]
    value_a = getattr(a, fact)
    if kind == "lookup":
        return f"What is the {label} of {a.name}?", value_a, [{"name": "search", "arguments": {"query": a.name}}]
    if kind == "scaled":
        word = {2: "twice", 3: "three times", 4: "four times"}[factor]
        calls = [{"name": "search", "arguments": {"query": a.name}},
                 {"name": "calculator", "arguments": {"expression": f"{value_a}*{factor}"}}]
        return f"What is {word} the {label} of {a.name}?", value_a * factor, calls
    b = places[1]
    value_b = getattr(b, fact)
    calls = [{"name": "search", "arguments": {"query": a.name}}, {"name": "search", "arguments": {"query": b.name}},
             {"name": "calculator", "arguments": {"expression": f"{value_a}+{value_b}"}}]
    return f"What is the combined {label} of {a.name} and {b.name}?", value_a + value_b, calls


def make_tool_dataset(n: int, kinds: Sequence[str] = tuple(KINDS), seed: int = 0, system_prompt: bool = True) -> Any:
    """A ``datasets.Dataset`` of ``n`` questions, kinds cycling through ``kinds`` (see the module docstring).

    Columns: ``prompt`` (conversational; a system message with :data:`SYSTEM_PROMPT` unless ``system_prompt`` is
    False), ``answer`` (``str`` of the integer), ``kind``, ``num_calls`` (length of the gold trace), ``gold_calls``
    (JSON), ``entities`` (place names). Deterministic given the arguments.
    """
    import datasets

    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty selection of {list(KINDS)}; got {list(kinds)!r}")
    rng = random.Random(seed)
    rows: dict[str, list] = {k: [] for k in ("prompt", "answer", "kind", "num_calls", "gold_calls", "entities")}
    for i in range(n):
        kind = kinds[i % len(kinds)]
        places = rng.sample(PLACES, 2)
        fact = rng.choice(sorted(FACTS))
        question, answer, calls = _question(kind, fact, places, rng.choice((2, 3, 4)))
        messages = [{"role": "user", "content": question}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        rows["prompt"].append(messages)
        rows["answer"].append(str(answer))
        rows["kind"].append(kind)
        rows["num_calls"].append(len(calls))
        rows["gold_calls"].append(json.dumps(calls))
        rows["entities"].append([p.name for p in places[: 1 if kind != "combined" else 2]])
    return datasets.Dataset.from_dict(rows)


def final_answer_text(completion: Any) -> str:
    """Content of the last assistant message of a (multi-turn) completion; the string itself for text completions."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


def tool_answer_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the last assistant message's ``Answer: N`` line equals the row's ``answer``, else 0.0."""
    return [float(extract_answer(final_answer_text(c)) == int(a)) for c, a in zip(completions, answer)]


def gold_trace_script(dataset: Any, shortcut_every: int = 2) -> Any:
    """A scripted policy for tests and demos, for :func:`trl_plugins.testing.script_generation`.

    Given the rendered prompt (with the earlier turns and tool results), it writes the next call of the question's
    gold trace, or ``Answer: N`` once every call has a result. Every ``shortcut_every``-th first-turn request (by its
    row index) instead answers at once, without tools, with a wrong number, so groups hold both outcomes.
    """
    traces = {row["prompt"][-1]["content"]: (json.loads(row["gold_calls"]), row["answer"]) for row in dataset}

    def script(prompt_text: str, row: int) -> str:
        question = next((q for q in traces if q in prompt_text), None)
        if question is None:
            return "Answer: 0"
        calls, answer = traces[question]
        done = prompt_text.count("<tool_response>")
        if done == 0 and shortcut_every and row % shortcut_every == shortcut_every - 1:
            return f"Answer: {int(answer) + 1}"
        if done < len(calls):
            return f"<tool_call>{json.dumps(calls[done])}</tool_call>"
        return f"Answer: {answer}"

    return script


# ----------------------------------------------------------------------------------------------------- templates
#: Tool-calling chat template for the bundled tiny model (same role markers as its plain template; tool results are
#: shown as a user turn wrapped in ``<tool_response>`` tags).
TINY_TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{%- endfor -%}<|end|>"
    "{%- elif message['role'] == 'tool' -%}<|user|><tool_response>{{ message['content'] }}</tool_response>"
    "{%- else -%}{{ raise_exception('unsupported role ' + message['role']) }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

#: Tool-calling ChatML template (``<|im_start|>role ... <|im_end|>``, tool calls as JSON in ``<tool_call>`` tags, the
#: tools' JSON schemas listed in the system message), for ChatML models such as SmolLM2.
CHATML_TOOL_TEMPLATE = (
    "{%- set ns = namespace(tools='') -%}"
    "{%- if tools -%}{%- set ns.tools = '\\n\\nYou can call these tools; write each call as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:' -%}"
    "{%- for tool in tools -%}{%- set ns.tools = ns.tools + '\\n' + (tool | tojson) -%}{%- endfor -%}{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_start|>system\nYou are a helpful assistant.{{ ns.tools }}<|im_end|>\n{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_start|>system\n{{ message['content'] }}{{ ns.tools }}<|im_end|>\n"
    "{% elif message['role'] == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['role'] == 'assistant' -%}<|im_start|>assistant\n{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<tool_call>\n{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "\n</tool_call>{%- endfor -%}<|im_end|>\n"
    "{% else -%}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}"
)


def _response_template(anchor: str, end_pattern: str) -> dict:
    """transformers' response template: content up to the first ``<tool_call>``, then JSON tool calls."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": anchor,
        "fields": {
            "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": end_pattern, "content": "text"},
        },
    }


def enable_tool_calling(tokenizer: Any) -> Any:
    """Give ``tokenizer`` a tool-calling chat template and TRL's response template (in place; returned).

    Recognises the bundled tiny model's template and ChatML templates (``<|im_start|>``, e.g. ``builtin:smollm2``).
    A tokenizer whose template already renders tool calls and that has a response template is left unchanged.
    """
    from trl.chat_template_utils import supports_tool_calling

    from trl_plugins.tasks.tiny import CHAT_TEMPLATE

    template = getattr(tokenizer, "chat_template", None) or ""
    if supports_tool_calling(tokenizer) and getattr(tokenizer, "response_template", None) is not None:
        return tokenizer
    if template in (CHAT_TEMPLATE, TINY_TOOL_TEMPLATE):
        tokenizer.chat_template = TINY_TOOL_TEMPLATE
        tokenizer.response_template = _response_template("<|assistant|>", r"<\|end\|>")
    elif "<|im_start|>" in template:
        tokenizer.chat_template = CHATML_TOOL_TEMPLATE
        tokenizer.response_template = _response_template("<|im_start|>assistant\n", r"<\|im_end\|>\s*")
    else:
        raise ValueError(
            "enable_tool_calling knows the bundled tiny model's chat template and ChatML templates (<|im_start|>); "
            "this tokenizer has neither. Give it a chat template that renders tool calls and set its "
            "response_template (see transformers' chat response parsing docs)."
        )
    return tokenizer
