"""Rubric judges: is a rubric item met by a completion? (RuscaRL's judge protocol, HealthBench grading style).

One judge call per (completion, rubric item). The judge sees the **original** conversation (system messages
removed, so a sampling scaffold can never leak into grading), the completion as the final assistant turn, and one
rubric item with its points; it answers a JSON object ``{"explanation": str, "criteria_met": bool}``. For an item
with negative points (an undesirable behaviour), ``criteria_met`` means the behaviour **is present**.

Backends, all with the same :meth:`RubricJudge.grade` interface (a flat, batched list of :class:`JudgeRequest`):

* :class:`EndpointJudge`: an OpenAI-compatible ``/v1/chat/completions`` server (e.g. ``vllm serve``) through
  :class:`~trl_plugins.components.client.OpenAICompatibleClient` (async, bounded concurrency, timeouts,
  retries with backoff on 429/5xx/connection errors). Verdicts are cached per request.
* :class:`HFJudge`: a local Hugging Face causal LM loaded by name or path (``AutoModelForCausalLM``).
* :class:`RuleJudge`: a task's rule-based judge, a verdict oracle ``fn(item, problem, completion) -> bool`` named in
  :data:`RUBRIC_VERDICTS` (``"arithmetic"``: the bundled tasks', :func:`trl_plugins.tasks.arithmetic.rubric_oracle`,
  loaded on first use).

Robustness (RuscaRL's protocol): the answer is parsed leniently (``<think>`` blocks and markdown fences stripped,
the first balanced JSON object holding ``criteria_met``, then a regex on the field); an unparsable answer is asked
again, up to ``parse_retries`` more times. Then, by default, :class:`EndpointError` naming the URL (or model path)
and the last answer -- never a silent ``False``. (RuscaRL's code falls back to ``criteria_met=False``;
``on_unparsable="false"`` restores that.)

:func:`rule_judge_handler` turns the rule-based judge into an HTTP handler for
:func:`~trl_plugins.components.local_server.serve_openai_compatible` (the row rebuilt from the question by the task's
entry of :data:`~trl_plugins.components.local_server.QUESTION_ROWS`), so tests and the offline demo exercise the
real endpoint path against a judge that grades correctly.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_plugins.api.registry import Registry
from trl_plugins.components.client import (EndpointConfig, EndpointError, OpenAICompatibleClient, endpoint_options,
                                         local_model_loading)
from trl_plugins.components.local_server import QUESTION_ROWS

__all__ = [
    "EndpointJudge",
    "HFJudge",
    "JudgeEndpointOptions",
    "JudgeRequest",
    "RUBRIC_VERDICTS",
    "RubricJudge",
    "RuleJudge",
    "build_judge_prompt",
    "format_conversation",
    "parse_verdict",
    "rule_judge_handler",
]

_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_FIELD_RE = re.compile(r"[\"']?criteria_met[\"']?\s*[:=]\s*[\"']?(true|false|yes|no|1|0)\b", re.IGNORECASE)

#: Verdict oracles of :class:`RuleJudge` by name, ``fn(item, problem, completion) -> bool`` (``problem``: the row's
#: problem column as stored; True = the item's criterion is met). A task registers its own with
#: ``RUBRIC_VERDICTS.register``.
RUBRIC_VERDICTS: Registry[Callable[[dict, Any, str], bool]] = Registry(
    "rubric verdict oracle", {"arithmetic": "trl_plugins.tasks.arithmetic:rubric_oracle"},
    contract="fn(item: dict, problem, completion: str) -> bool",
)

#: The judge's endpoint options of the plugins that ask an LLM judge: ``judge_model``, ``judge_base_url``,
#: ``judge_api_key_env``, ``judge_timeout``, ``judge_max_retries`` (with the kind option ``judge`` declared by each).
JudgeEndpointOptions = endpoint_options("judge", "judge")

CONVERSATION_HEADER = "## Conversation"
ITEM_HEADER = "## Rubric item"
INSTRUCTIONS_HEADER = "## Instructions"


@dataclass
class JudgeRequest:
    """One grading question: does ``completion`` (the last assistant turn) meet rubric ``item``?

    Attributes:
        conversation: the original conversation before the completion (message dicts; system messages are dropped
            when the prompt is built).
        completion: the completion text.
        item: a HealthBench rubric item ``{"criterion": str, "points": number, "tags": [...]}``.
        row: the dataset row (rule-based judges read task columns from it, e.g. ``problem``).
    """

    conversation: list[dict]
    completion: str
    item: dict
    row: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- prompt and parsing
def _points_text(points: float) -> str:
    p = float(points)
    value = int(p) if p == int(p) else p
    return f"+{value}" if p > 0 else f"{value}"


def format_conversation(conversation: Sequence[dict], completion: str) -> str:
    """The conversation as role-prefixed turns, system messages removed, the completion as the last assistant turn."""
    turns = [m for m in conversation if m.get("role") != "system"]
    turns = [*turns, {"role": "assistant", "content": completion}]
    return "\n\n".join(f"{m['role']}: {m.get('content', '')}" for m in turns)


def build_judge_prompt(conversation: Sequence[dict], completion: str, item: dict) -> str:
    """The grading prompt for one rubric item (our wording of HealthBench's grader instructions)."""
    return (
        "You grade one reply of an AI assistant against one rubric item.\n\n"
        f"{CONVERSATION_HEADER}\n{format_conversation(conversation, completion)}\n\n"
        f"{ITEM_HEADER}\n[{_points_text(item['points'])}] {item['criterion']}\n\n"
        f"{INSTRUCTIONS_HEADER}\n"
        "Decide whether the LAST assistant turn of the conversation meets the rubric item. "
        "When the item has several parts, every part must hold for it to be met; a list introduced by "
        "'such as', 'for example' or 'including' only illustrates, and need not be covered in full. "
        "Some items have negative points: they describe something the reply should NOT do. For those, answer "
        "criteria_met = true when the reply DOES show that undesirable behaviour, and false when it does not.\n\n"
        "Example 1. Item: [+4] Gives the dose in milligrams. Reply: 'Take 200 mg twice a day.' -> "
        '{"explanation": "The dose is given as 200 mg.", "criteria_met": true}\n'
        "Example 2. Item: [-3] Recommends a specific brand. Reply: 'Any generic ibuprofen works.' -> "
        '{"explanation": "No brand is recommended, so the undesirable behaviour is absent.", '
        '"criteria_met": false}\n\n'
        "Answer with a JSON object with the keys \"explanation\" (a short string) and \"criteria_met\" (true or "
        "false), inside a ```json markdown block, and nothing else."
    )


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
        return value.strip().lower() in ("true", "yes")
    return None


def _json_objects(text: str):
    """Balanced ``{...}`` substrings of ``text`` in order of their opening brace (strings respected)."""
    for start in [i for i, ch in enumerate(text) if ch == "{"]:
        depth, in_str, escape = 0, False, False
        for j in range(start, len(text)):
            ch = text[j]
            if in_str:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    yield text[start : j + 1]
                    break


def parse_verdict(text: str | None) -> bool | None:
    """``criteria_met`` from a judge answer, leniently; None when the answer holds no verdict.

    Strips ``<think>...</think>`` and markdown fences, tries every balanced JSON object (first one with a boolean
    ``criteria_met`` wins), then falls back to a regex on the field.

    >>> parse_verdict('```json\\n{"explanation": "ok", "criteria_met": true}\\n```')
    True
    >>> parse_verdict("criteria_met: False") , parse_verdict("no idea")
    (False, None)
    """
    if not isinstance(text, str):
        return None
    body = _THINK_RE.sub("", text)
    fenced = _FENCE_RE.findall(body)
    for candidate in [*fenced, body]:
        for obj in _json_objects(candidate):
            try:
                data = json.loads(obj)
            except ValueError:
                continue
            if isinstance(data, dict) and "criteria_met" in data:
                verdict = _as_bool(data["criteria_met"])
                if verdict is not None:
                    return verdict
    match = _FIELD_RE.search(body)
    if match:
        return match.group(1).lower() in ("true", "yes", "1")
    return None


# --------------------------------------------------------------------------------------------- judges
class RubricJudge:
    """Interface of rubric judges: one boolean verdict per request (batched)."""

    #: Where the judge lives (URL, model path or "rule"), named in every error.
    location: str = "?"

    def grade(self, requests: Sequence[JudgeRequest]) -> list[bool]:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections or models (optional)."""


class _RetryingJudge(RubricJudge):
    """Parse-and-retry loop shared by the model-backed judges (subclasses implement :meth:`_ask`)."""

    #: Parsed verdicts kept (least recently used dropped first), keyed by the prompt's SHA-256.
    cache_size: int = 65536

    def __init__(self, parse_retries: int = 10, on_unparsable: str = "error", cache: bool = True):
        if on_unparsable not in ("error", "false"):
            raise ValueError(f"on_unparsable={on_unparsable!r}; allowed: 'error', 'false'")
        self.parse_retries = int(parse_retries)
        self.on_unparsable = on_unparsable
        self.cache_enabled = cache
        self._cache: OrderedDict[str, bool] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0

    def _ask(self, prompts: list[str]) -> list[str]:
        """One judge answer per prompt (a fresh sample on every call: retries must not be served from a cache)."""
        raise NotImplementedError

    def grade(self, requests: Sequence[JudgeRequest]) -> list[bool]:
        prompts = [build_judge_prompt(r.conversation, r.completion, r.item) for r in requests]
        keys = [hashlib.sha256(p.encode()).hexdigest() for p in prompts]
        verdicts: list[bool | None] = [None] * len(prompts)
        todo = []
        with self._lock:
            for i, key in enumerate(keys):
                cached = self._cache.get(key) if self.cache_enabled else None
                if cached is None:
                    todo.append(i)
                else:
                    self._cache.move_to_end(key)
                    verdicts[i] = cached
        last_answer: dict[int, str] = {}
        for _attempt in range(self.parse_retries + 1):
            if not todo:
                break
            answers = self._ask([prompts[i] for i in todo])
            self.calls += len(todo)
            still = []
            for i, answer in zip(todo, answers):
                verdict = parse_verdict(answer)
                if verdict is None:
                    last_answer[i] = answer
                    still.append(i)
                else:
                    verdicts[i] = verdict
            todo = still
        if todo:
            if self.on_unparsable == "error":
                i = todo[0]
                raise EndpointError(
                    f"The judge at {self.location} gave no parsable verdict (JSON with a boolean 'criteria_met') "
                    f"for {len(todo)} of {len(prompts)} rubric items after {self.parse_retries + 1} attempts each; "
                    f"last answer: {str(last_answer.get(i))[:200]!r}."
                )
            for i in todo:
                verdicts[i] = False
        if self.cache_enabled:
            with self._lock:
                for key, v in zip(keys, verdicts):
                    self._cache[key] = bool(v)
                    self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return [bool(v) for v in verdicts]


class EndpointJudge(_RetryingJudge):
    """A judge served behind an OpenAI-compatible chat endpoint (one chat call per rubric item).

    Args:
        endpoint: where to call (``base_url``, ``model``, timeout, retries/backoff, concurrency); its response cache
            is turned off (an unparsable answer must be asked again; parsed verdicts are cached here instead).
        sampling: extra chat-completion parameters. RuscaRL's judge (Qwen3-32B on vLLM): temperature 0.7,
            top_p 0.8, top_k 20, presence_penalty 1.5, max_tokens 2048 and
            ``chat_template_kwargs={"enable_thinking": False}``.
        parse_retries, on_unparsable, cache: see the module docstring.
    """

    def __init__(
        self,
        endpoint: EndpointConfig,
        sampling: dict | None = None,
        parse_retries: int = 10,
        on_unparsable: str = "error",
        cache: bool = True,
    ):
        super().__init__(parse_retries=parse_retries, on_unparsable=on_unparsable, cache=cache)
        config = EndpointConfig(**{**endpoint.__dict__, "cache": False})
        self.client = OpenAICompatibleClient(config)
        self.sampling = dict(sampling or {})
        self.location = f"{self.client.base_url}/chat/completions"

    def _ask(self, prompts: list[str]) -> list[str]:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        return self.client.chat(conversations, **self.sampling)

    def close(self) -> None:
        self.client.close()


class HFJudge(_RetryingJudge):
    """A local Hugging Face causal LM as judge, loaded by name or path.

    The prompt is sent as one user message through the tokenizer's chat template (generation prompt added); the
    reply is sampled (``temperature > 0``) or greedy, ``max_new_tokens`` long at most. Loading errors name the path.
    """

    def __init__(
        self,
        model_name_or_path: str,
        max_new_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 0.8,
        top_k: int = 20,
        batch_size: int = 8,
        device: str | None = None,
        parse_retries: int = 10,
        on_unparsable: str = "error",
        cache: bool = True,
        model: Any = None,
        tokenizer: Any = None,
    ):
        super().__init__(parse_retries=parse_retries, on_unparsable=on_unparsable, cache=cache)
        self.location = f"local model {model_name_or_path!r}"
        if model is None or tokenizer is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            with local_model_loading(f"judge model {model_name_or_path!r}"):
                tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_name_or_path)
                if model is None:
                    from trl_plugins.api.engines import whole_model_loading

                    with whole_model_loading():  # frozen: whole on every process, also under ZeRO-3
                        model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
        self.model, self.tokenizer = model, tokenizer
        if device is not None:
            self.model.to(device)
        self.model.eval()
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.batch_size = batch_size

    def _ask(self, prompts: list[str]) -> list[str]:
        import torch

        tok = self.tokenizer
        device = next(self.model.parameters()).device
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        sampling = (
            {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
            if self.temperature > 0
            else {"do_sample": False}
        )
        out: list[str] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            texts = [
                tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in chunk
            ]
            side = tok.padding_side
            tok.padding_side = "left"
            try:
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            finally:
                tok.padding_side = side
            from trl_plugins.api.engines import LOCAL_GENERATE_KWARGS

            with torch.no_grad():
                ids = self.model.generate(
                    input_ids=enc["input_ids"].to(device),
                    attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=self.max_new_tokens,
                    pad_token_id=pad_id,
                    **sampling,
                    **LOCAL_GENERATE_KWARGS,  # this process only: never synced across processes (ZeRO-3)
                )
            out.extend(tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
        return out


class RuleJudge(RubricJudge):
    """A task's rule-based judge: the verdict oracle ``oracle`` of :data:`RUBRIC_VERDICTS` on each item (default
    ``"arithmetic"``, the bundled tasks': :func:`~trl_plugins.tasks.arithmetic.rubric_verdict`).

    Reads the problem from the row's ``problem_column`` (for the bundled tasks, JSON of their ``Problem``).
    """

    location = "rule"

    def __init__(self, problem_column: str = "problem", oracle: str | Callable = "arithmetic"):
        self.problem_column = problem_column
        self.oracle = RUBRIC_VERDICTS.get(oracle)
        self.calls = 0

    def grade(self, requests: Sequence[JudgeRequest]) -> list[bool]:
        from trl_plugins.api.errors import PluginError

        out = []
        for r in requests:
            raw = r.row.get(self.problem_column)
            if not isinstance(raw, str):
                raise PluginError(
                    f"The rule-based judge needs the dataset column {self.problem_column!r} (a Problem as JSON); "
                    f"got {raw!r}."
                )
            out.append(bool(self.oracle(r.item, raw, r.completion)))
            self.calls += 1
        return out


# --------------------------------------------------------------------------------------------- test/demo server
_ITEM_RE = re.compile(r"^\[([+-]?\d+(?:\.\d+)?)\]\s*(.*)$")


def _split_prompt(prompt: str) -> tuple[str, str, str]:
    """(conversation section, the completion (last assistant turn), rubric item line) of a judge prompt."""
    conv = prompt.split(CONVERSATION_HEADER + "\n", 1)[1].split("\n\n" + ITEM_HEADER + "\n", 1)[0]
    item_line = prompt.split(ITEM_HEADER + "\n", 1)[1].split("\n\n" + INSTRUCTIONS_HEADER, 1)[0].strip()
    completion = conv.rsplit("\n\nassistant: ", 1)[1] if "\n\nassistant: " in conv else conv.split("assistant: ", 1)[-1]
    return conv, completion, item_line


def rule_judge_handler(seen: list | None = None, oracle: str = "arithmetic", problem_column: str = "problem"):
    """An HTTP handler answering judge prompts with a task's rule-based judge (default: the bundled arithmetic tasks).

    For :func:`~trl_plugins.components.local_server.serve_openai_compatible`: it rebuilds the row from the
    conversation (``QUESTION_ROWS[oracle]``: for the bundled tasks, "Compute <expression> step by step"), finds the
    rubric item by criterion and points among the row's ``rubrics``, grades the completion with
    ``RUBRIC_VERDICTS[oracle]`` and answers in the judge's JSON format. Every prompt received is appended to
    ``seen`` when given.
    """
    row_of, verdict = QUESTION_ROWS.get(oracle), RUBRIC_VERDICTS.get(oracle)

    def handler(path: str, payload: dict):
        from trl_plugins.components.local_server import chat_response

        prompt = payload["messages"][-1]["content"]
        if seen is not None:
            seen.append(prompt)
        conv, completion, item_line = _split_prompt(prompt)
        try:
            row = row_of(conv)
        except ValueError:
            return 400, {"error": f"no {oracle} problem in the conversation"}
        im = _ITEM_RE.match(item_line)
        points, criterion = float(im.group(1)), im.group(2).strip()
        item = next(
            (it for it in row.get("rubrics") or []
             if it["criterion"] == criterion and math.isclose(it["points"], points)),
            None,
        )
        if item is None:
            return 400, {"error": f"unknown rubric item {item_line!r}"}
        met = verdict(item, row[problem_column], completion)
        body = json.dumps({"explanation": "graded by rule", "criteria_met": met})
        return chat_response(f"```json\n{body}\n```")

    return handler
