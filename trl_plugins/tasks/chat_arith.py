"""Chat arithmetic: one-operation questions a small pretrained chat model can start on.

The chained-arithmetic task (:mod:`trl_plugins.tasks.arithmetic`) asks for an ``Answer: N`` line that a pretrained
chat model such as SmolLM2-135M-Instruct never writes, so GRPO has no signal there. This task asks in plain chat::

    What is 23 + 17? Reply with only the number.

and accepts any short reply that states the right number (:func:`verify_reply`): ``"40"``, ``"The answer is 40."``
and ``"23 + 17 = 40"`` are correct; ``"41"``, ``"40 or 41"`` and a reply whose first words hold no number are not.

Problems are drawn deterministically from a seed (:func:`make_chat_dataset`); train and held-out problems never
share an expression (a stable hash of the expression, :func:`trl_plugins.tasks.arithmetic.in_split`). Rows carry what
the guidance methods read: ``solution`` (the reference reply ``"23 + 17 = 40"``: GHPO / Scaf-GRPO hint prefixes,
LUFFY demonstrations, SCOPE's reference suffix) and ``problem`` (the one-step :class:`~.arithmetic.Problem` JSON that
the programmatic PRM scores).

Operations (:data:`CHAT_OPS`): ``+`` with both operands in ``1..max_operand``; ``-`` with ``b <= a`` (the answer is
never negative); ``*`` with ``a`` in ``2..max_multiplicand`` and ``b`` in ``2..9``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from trl_plugins.api.text import completion_text
from trl_plugins.tasks.arithmetic import Problem, in_split

__all__ = [
    "CHAT_INSTRUCTION",
    "CHAT_OPS",
    "chat_accuracy_reward",
    "chat_question",
    "make_chat_dataset",
    "reply_numbers",
    "verify_reply",
]

CHAT_OPS: tuple[str, ...] = ("+", "-", "*")
"""The operations a chat question can use."""

CHAT_INSTRUCTION = "Reply with only the number."
"""The format instruction after every question."""

DEFAULT_WINDOW = 8
"""Words of the reply read by the verifier (the number must come early)."""

_NUMBER_RE = re.compile(r"(?<!\d)-?\d+")  # "23-17" is 23 and 17, "-5" is -5


def chat_question(a: int, op: str, b: int, instruction: str = CHAT_INSTRUCTION) -> str:
    """``"What is a op b? <instruction>"``."""
    if op not in CHAT_OPS:
        raise ValueError(f"unknown operation {op!r}; allowed: {', '.join(CHAT_OPS)}")
    return f"What is {a} {op} {b}? {instruction}".strip()


def _draw(rng: random.Random, op: str, max_operand: int, max_multiplicand: int) -> tuple[int, int]:
    if op == "+":
        return rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "-":
        a = rng.randint(2, max_operand)
        return a, rng.randint(1, a)
    return rng.randint(2, max_multiplicand), rng.randint(2, 9)


def make_chat_dataset(
    n: int,
    seed: int = 0,
    split: str | None = None,
    ops: Iterable[str] = ("+", "-"),
    max_operand: int = 40,
    max_multiplicand: int = 12,
    instruction: str = CHAT_INSTRUCTION,
) -> Any:
    """A ``datasets.Dataset`` of ``n`` chat questions, operations cycling through ``ops``.

    Columns: ``prompt`` (``[{"role": "user", "content": question}]``), ``answer`` (``str`` of the integer),
    ``solution`` (the reference reply ``"a op b = c"``), ``problem`` (:class:`~.arithmetic.Problem` JSON, one step)
    and ``op``. ``split="train"`` / ``"test"`` keeps only problems of that hash split, so the two never share a
    problem. Problems repeat when ``n`` exceeds the distinct ones of the split. The result is a function of the
    arguments.
    """
    import datasets  # deferred: importing datasets is slow

    ops = tuple(ops)
    if not ops:
        raise ValueError("ops must name at least one operation")
    for op in ops:
        if op not in CHAT_OPS:
            raise ValueError(f"unknown operation {op!r}; allowed: {', '.join(CHAT_OPS)}")
    if max_operand < 2 or max_multiplicand < 2:
        raise ValueError(f"max_operand and max_multiplicand must be >= 2, got {max_operand} and {max_multiplicand}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {k: [] for k in ("prompt", "answer", "solution", "problem", "op")}
    i = tries = 0
    while len(rows["answer"]) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"could not draw {n} problems of split {split!r} with ops {ops}")
        op = ops[i % len(ops)]
        a, b = _draw(rng, op, max_operand, max_multiplicand)
        problem = Problem.from_expression([a, b], [op])
        if not in_split(problem, split):
            continue
        i += 1
        rows["prompt"].append([{"role": "user", "content": chat_question(a, op, b, instruction)}])
        rows["answer"].append(str(problem.answer))
        rows["solution"].append(f"{a} {op} {b} = {problem.answer}")
        rows["problem"].append(problem.to_json())
        rows["op"].append(op)
    return datasets.Dataset.from_dict(rows)


def reply_numbers(text: str, window: int = DEFAULT_WINDOW) -> list[int]:
    """The integers in the first ``window`` whitespace-separated words of ``text``, in order."""
    head = " ".join(text.split()[:window])
    return [int(m) for m in _NUMBER_RE.findall(head.replace(",", ""))]


def verify_reply(text: str, answer: int | str, operands: Sequence[int] = (), window: int = DEFAULT_WINDOW) -> bool:
    """Lenient verifier: the right number is among the first ``window`` words, and every other number there is an
    operand of the question (restating ``"23 + 17 = 40"`` is fine; hedging ``"40 or 41"`` is not)."""
    numbers = reply_numbers(text, window)
    allowed = {int(answer), *map(int, operands)}
    return int(answer) in numbers and all(x in allowed for x in numbers)


def _operands(problem: Any) -> list[int]:
    if not problem:
        return []
    return Problem.from_json(problem).operands if isinstance(problem, str) else list(problem.operands)


def chat_accuracy_reward(
    completions: Sequence[Any], answer: Sequence[int | str], problem: Sequence[Any] | None = None, **kwargs: Any
) -> list[float]:
    """TRL reward function: 1.0 per completion that :func:`verify_reply` accepts, else 0.0.

    Args:
        completions: ``B`` completions, strings or lists of ``{"role", "content"}`` messages.
        answer: ``B`` ground-truth answers (the ``answer`` column).
        problem: ``B`` problem JSONs (the ``problem`` column: the operands a reply may restate); without it a reply
            may hold no number but the answer.
        **kwargs: the other dataset columns (ignored).
    """
    problems = list(problem) if problem is not None else [None] * len(answer)
    return [1.0 if verify_reply(completion_text(c), a, _operands(p)) else 0.0
            for c, a, p in zip(completions, answer, problems, strict=True)]
