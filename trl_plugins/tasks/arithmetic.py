"""Chained integer arithmetic: the embedded, step-structured, verifiable task family.

A problem is an expression such as ``3+4*2-5`` that is evaluated **left to right** (no operator
precedence), one operation per line. The reference solution of ``3+4*2-5`` is::

    3+4=7
    7*2=14
    14-5=9
    Answer: 9

Everything the methods need is derived from the :class:`Problem` itself, without a model:

* :func:`verify` / :func:`accuracy_reward` -- exact verifier on the ``Answer: N`` line;
* :func:`step_scores` / :func:`first_error_step` -- a programmatic process reward model (PRM);
* :func:`feedback` -- natural-language verifier feedback that reveals at most the fix of the first
  wrong step;
* :func:`make_rubrics` / :func:`rubric_verdict` -- HealthBench-style rubric items and a rule-based
  judge for them;
* :func:`hint` -- a prefix of the reference solution;
* :data:`LEVELS` -- difficulty levels.

Step and line conventions (shared by every function here):

* a *step* is a non-empty line (:func:`split_steps`); blank lines are ignored;
* a step line has the form ``a op b=c`` with ``op`` one of ``+ - *`` (spaces allowed);
* the answer line has the form ``Answer: N`` (case-insensitive, optional trailing period);
* the first answer line ends the solution: :func:`extract_answer` reads it, and any line after it
  is an error for the PRM.

Difficulty levels (see :data:`LEVELS`); every intermediate value stays in ``0..99``:

=====  =====  ===========================  ====================
level  steps  ``+``/``-`` operand range     ``*`` operand range
=====  =====  ===========================  ====================
0      1      1..9                         2..9
1      2      1..9                         2..9
2      3      1..9                         2..9
3      4      1..20                        2..9
4      5      1..20                        2..9
5      6      1..30                        2..9
=====  =====  ===========================  ====================
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_plugins.api.answers import ANSWER_LINE_RE as _ANSWER_RE
from trl_plugins.api.answers import ANSWER_PREFIX_RE as _ANSWER_PREFIX_RE
from trl_plugins.api.answers import answer_line_value
from trl_plugins.api.text import completion_text  # re-exported: the bundled reward functions read it

__all__ = [
    "LEVELS",
    "OPERATORS",
    "LevelSpec",
    "Problem",
    "Step",
    "accuracy_reward",
    "apply_op",
    "completion_text",
    "extract_answer",
    "feedback",
    "first_error_step",
    "hint",
    "in_split",
    "FORMAT_INSTRUCTIONS",
    "make_dataset",
    "make_problem",
    "make_rubrics",
    "parse_step",
    "prm_step_scores",
    "row_from_question",
    "rubric_oracle",
    "rubric_score",
    "rubric_verdict",
    "split_steps",
    "step_scores",
    "verifier_feedback",
    "verify",
]

OPERATORS: tuple[str, ...] = ("+", "-", "*")
"""The operators a problem can use."""

Step = tuple[int, str, int, int]
"""One reference step ``(lhs, op, rhs, result)``, e.g. ``(3, "+", 4, 7)``."""


@dataclass(frozen=True)
class LevelSpec:
    """Generation parameters of one difficulty level.

    Attributes:
        num_steps: number of operations (the solution has ``num_steps + 1`` lines).
        max_operand: largest right-hand operand of ``+`` and ``-`` (and largest first operand).
        max_multiplier: largest right-hand operand of ``*`` (the smallest is 2).
        max_value: every intermediate value, and the answer, lies in ``0..max_value``.
    """

    num_steps: int
    max_operand: int
    max_multiplier: int = 9
    max_value: int = 99


LEVELS: dict[int, LevelSpec] = {
    0: LevelSpec(num_steps=1, max_operand=9),
    1: LevelSpec(num_steps=2, max_operand=9),
    2: LevelSpec(num_steps=3, max_operand=9),
    3: LevelSpec(num_steps=4, max_operand=20),
    4: LevelSpec(num_steps=5, max_operand=20),
    5: LevelSpec(num_steps=6, max_operand=30),
}
"""Difficulty levels 0..5 (see the module docstring)."""


def apply_op(lhs: int, op: str, rhs: int) -> int:
    """Return ``lhs op rhs`` for ``op`` in :data:`OPERATORS`; raise ``ValueError`` otherwise."""
    if op == "+":
        return lhs + rhs
    if op == "-":
        return lhs - rhs
    if op == "*":
        return lhs * rhs
    raise ValueError(f"unknown operator {op!r}; allowed: {', '.join(OPERATORS)}")


def _format_step(lhs: int, op: str, rhs: int, result: int) -> str:
    return f"{lhs}{op}{rhs}={result}"


@dataclass
class Problem:
    """One chained-arithmetic problem and its reference solution.

    Attributes:
        operands: the ``k + 1`` numbers of the expression, in order.
        operators: the ``k`` operators, in order.
        steps: the ``k`` reference steps ``(lhs, op, rhs, result)``, evaluated left to right.
        answer: the value of the expression (the result of the last step).
        level: the difficulty level it was drawn from (0 for hand-made problems, as for one-operation ones).
    """

    operands: list[int]
    operators: list[str]
    steps: list[Step] = field(default_factory=list)
    answer: int = 0
    level: int = 0

    @classmethod
    def from_expression(cls, operands: Sequence[int], operators: Sequence[str], level: int = 0) -> Problem:
        """Build a problem from its operands and operators, computing the steps and the answer."""
        if len(operands) != len(operators) + 1 or not operators:
            raise ValueError(
                f"need k >= 1 operators and k + 1 operands, got {len(operators)} operators and {len(operands)} operands"
            )
        value = int(operands[0])
        steps: list[Step] = []
        for op, rhs in zip(operators, operands[1:]):
            result = apply_op(value, op, int(rhs))
            steps.append((value, op, int(rhs), result))
            value = result
        return cls(list(map(int, operands)), list(operators), steps, value, level)

    @property
    def expression(self) -> str:
        """The expression without spaces, e.g. ``"3+4*2-5"``."""
        parts = [str(self.operands[0])]
        for op, rhs in zip(self.operators, self.operands[1:]):
            parts.append(f"{op}{rhs}")
        return "".join(parts)

    @property
    def question(self) -> str:
        """The user-facing question, e.g. ``"Compute 3+4*2-5 step by step (left to right)."``."""
        return f"Compute {self.expression} step by step (left to right)."

    @property
    def step_lines(self) -> list[str]:
        """The reference step lines, e.g. ``["3+4=7", "7*2=14", "14-5=9"]``."""
        return [_format_step(*s) for s in self.steps]

    @property
    def solution_lines(self) -> list[str]:
        """The reference solution lines: the step lines then ``"Answer: N"``."""
        return [*self.step_lines, f"Answer: {self.answer}"]

    @property
    def solution(self) -> str:
        """The reference solution: newline-separated steps and a final ``Answer: N`` line."""
        return "\n".join(self.solution_lines)

    def to_json(self) -> str:
        """Serialise to a JSON string that :meth:`from_json` reloads."""
        return json.dumps(
            {
                "operands": self.operands,
                "operators": self.operators,
                "steps": [list(s) for s in self.steps],
                "answer": self.answer,
                "level": self.level,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Problem:
        """Reload a problem written by :meth:`to_json`."""
        d = json.loads(text)
        steps = [(int(a), str(op), int(b), int(c)) for a, op, b, c in d["steps"]]
        return cls(list(d["operands"]), list(d["operators"]), steps, int(d["answer"]), int(d["level"]))


# --------------------------------------------------------------------------------------------- generation


def _choose_step(rng: random.Random, value: int, spec: LevelSpec) -> tuple[str, int]:
    """Draw an operator and a right operand keeping the result in ``0..spec.max_value``."""
    choices: list[tuple[str, int, int]] = []  # (op, low, high) of feasible right operands
    if value + 1 <= spec.max_value:
        choices.append(("+", 1, min(spec.max_operand, spec.max_value - value)))
    if value >= 1:
        choices.append(("-", 1, min(spec.max_operand, value)))
    if value >= 1 and 2 * value <= spec.max_value:
        choices.append(("*", 2, min(spec.max_multiplier, spec.max_value // value)))
    op, low, high = rng.choice(choices)
    return op, rng.randint(low, high)


def make_problem(rng: random.Random, level: int) -> Problem:
    """Draw one problem of difficulty ``level`` (a key of :data:`LEVELS`) using ``rng``.

    Operators are drawn uniformly among those that keep the running value in ``0..max_value``.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; allowed: {sorted(LEVELS)}")
    spec = LEVELS[level]
    value = rng.randint(1, spec.max_operand)
    operands, operators = [value], []
    for _ in range(spec.num_steps):
        op, rhs = _choose_step(rng, value, spec)
        operators.append(op)
        operands.append(rhs)
        value = apply_op(value, op, rhs)
    return Problem.from_expression(operands, operators, level=level)


def in_split(problem: Problem, split: str | None, test_fraction: float = 0.1) -> bool:
    """Whether ``problem`` belongs to ``split``: ``"train"``, ``"test"`` or ``None`` (both).

    The split is a stable hash of the expression, so train and test problems never overlap, whatever
    the seeds used to draw them.
    """
    if split is None:
        return True
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; allowed: 'train', 'test', None")
    is_test = zlib.crc32(problem.expression.encode()) % 1000 < int(test_fraction * 1000)
    return is_test == (split == "test")


def make_rubrics(problem: Problem) -> list[dict[str, Any]]:
    """HealthBench-style rubric items ``{"criterion", "points", "tags"}`` for ``problem``.

    Order (compatible with RuscaRL's ``math_linear`` reveal rule): the process item, one item per
    intermediate step, the penalty item, the format item (second to last) and the final-answer item
    (last). Every item carries a ``kind:...`` tag that :func:`rubric_verdict` dispatches on, plus
    ``verifier:rule``.
    """
    items: list[dict[str, Any]] = [
        {
            "criterion": "Shows each intermediate step of the left-to-right evaluation",
            "points": 3.0,
            "tags": ["kind:all_steps", "axis:completeness", "verifier:rule"],
        }
    ]
    for i, line in enumerate(problem.step_lines, start=1):
        items.append(
            {
                "criterion": f"Includes the intermediate step {line}",
                "points": 1.0,
                "tags": ["kind:step", f"step:{i}", f"parameters:{line}", "axis:accuracy", "verifier:rule"],
            }
        )
    items.append(
        {
            "criterion": "States an incorrect final answer",
            "points": -6.0,
            "tags": ["kind:wrong_answer", f"parameters:{problem.answer}", "axis:accuracy", "verifier:rule"],
        }
    )
    items.append(
        {
            "criterion": "Each step is on its own line (a op b=c), followed by a final line 'Answer: N'",
            "points": 2.0,
            "tags": ["kind:format", "axis:communication_quality", "verifier:rule"],
        }
    )
    items.append(
        {
            "criterion": f"States the correct final answer {problem.answer}",
            "points": 5.0,
            "tags": ["kind:final_answer", f"parameters:{problem.answer}", "axis:accuracy", "verifier:rule"],
        }
    )
    return items


FORMAT_INSTRUCTIONS: dict[str, str] = {
    "lines": "Write one operation per line, like 3+4=7, then a last line 'Answer: N'.",
    "example": "Show each operation on its own line, then give the result on a last line that starts with "
               "'Answer:'. For example, for 3+4*2 you write:\n3+4=7\n7*2=14\nAnswer: 14",
    "answer_only": "Reply with a single line of the form 'Answer: N'.",
}
"""Texts that ``make_dataset(..., instruction=name)`` appends to each question: the answer format spelled out for a
pretrained chat model (``builtin:smollm2``), which has never seen this task. The tiny model learns the format from its
warm start and gets the bare question."""


def make_dataset(
    n: int,
    levels: Iterable[int] = (1, 2),
    seed: int = 0,
    split: str | None = None,
    instruction: str | None = None,
) -> Any:
    """A ``datasets.Dataset`` of ``n`` problems, levels cycling through ``levels``.

    Columns: ``prompt`` (``[{"role": "user", "content": question}]``), ``answer`` (``str`` of the
    integer), ``solution`` (reference solution text), ``level`` (``int``), ``rubrics`` (see
    :func:`make_rubrics`) and ``problem`` (JSON for :meth:`Problem.from_json`).

    ``split="train"``/``"test"`` keeps only problems of that hash split (:func:`in_split`), so a
    training set and a held-out set never share a problem. ``instruction`` (a key of
    :data:`FORMAT_INSTRUCTIONS`) appends that format instruction to every question, for pretrained chat models. The
    result is a function of the arguments.
    """
    import datasets  # deferred: importing datasets is slow and not needed by the rest of the module

    if instruction is not None and instruction not in FORMAT_INSTRUCTIONS:
        raise ValueError(f"unknown instruction {instruction!r}; allowed: {sorted(FORMAT_INSTRUCTIONS)} or None")
    levels = tuple(levels)
    if not levels:
        raise ValueError("levels must name at least one level")
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; allowed: {sorted(LEVELS)}")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {k: [] for k in ("prompt", "answer", "solution", "level", "rubrics", "problem")}
    i = 0
    while len(rows["answer"]) < n:
        level = levels[i % len(levels)]
        problem = make_problem(rng, level)
        if not in_split(problem, split):
            continue
        i += 1
        question = problem.question if instruction is None else f"{problem.question} {FORMAT_INSTRUCTIONS[instruction]}"
        rows["prompt"].append([{"role": "user", "content": question}])
        rows["answer"].append(str(problem.answer))
        rows["solution"].append(problem.solution)
        rows["level"].append(level)
        rows["rubrics"].append(make_rubrics(problem))
        rows["problem"].append(problem.to_json())
    return datasets.Dataset.from_dict(rows)


# ------------------------------------------------------------------------------------------- verification

_STEP_RE = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")


def split_steps(text: str) -> list[str]:
    """The non-empty lines of ``text``, stripped: the steps a PRM scores."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def _is_answer_line(line: str) -> bool:
    return bool(_ANSWER_PREFIX_RE.match(line))


def extract_answer(text: str) -> int | None:
    """The integer on the first ``Answer: N`` line of ``text``, or ``None``.

    ``None`` when there is no answer line or the first one does not hold a single integer
    (``"Answer: 7 or 8"``, ``"Answer:"``).
    """
    return answer_line_value(text)


def verify(text: str, answer: int | str) -> bool:
    """Exact verifier: the first ``Answer:`` line of ``text`` states ``answer``."""
    got = extract_answer(text)
    return got is not None and got == int(answer)


def accuracy_reward(completions: Sequence[Any], answer: Sequence[int | str], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 for each completion whose final answer is correct, else 0.0.

    Args:
        completions: ``B`` completions, each a string or a list of ``{"role", "content"}`` messages.
        answer: ``B`` ground-truth answers (the dataset's ``answer`` column).
        **kwargs: the other dataset columns (ignored).

    Returns:
        ``B`` floats in ``{0.0, 1.0}``.
    """
    return [1.0 if verify(completion_text(c), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def _not_an_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    try:
        int(str(value).strip())
    except ValueError:
        return True
    return False


def _check_answer_column(dataset: Any) -> None:
    """Construction-time check of ``accuracy_reward``'s ``answer`` column (the trainer calls ``check_dataset``)."""
    from trl_plugins.api.data_checks import check_column_filled

    check_column_filled("accuracy_reward", dataset, "answer", "the verifier compares the completion's integer final "
                        "answer with it", blank=_not_an_integer, blank_means="not an integer")


accuracy_reward.check_dataset = _check_answer_column


def parse_step(line: str) -> Step | None:
    """Parse ``"a op b=c"`` into ``(a, op, b, c)``; ``None`` if the line is not of that form."""
    m = _STEP_RE.match(line)
    if not m:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))


def _step_is_correct(problem: Problem, index: int, line: str) -> bool:
    if index >= len(problem.steps):
        return False
    return parse_step(line) == problem.steps[index]


def step_scores(problem: Problem, text: str) -> list[float]:
    """Programmatic PRM: one score in ``{0.0, 1.0}`` per step (non-empty line) of ``text``.

    Lines before the first ``Answer:`` line are compared position by position with the reference
    steps: line ``i`` scores 1.0 iff it parses as ``a op b=c`` with ``a`` the correct running value,
    ``op b`` the ``i``-th operation of the expression and ``c`` correct. Extra step lines score 0.0.
    The answer line scores 1.0 iff it states the correct answer **and** all the steps came before it
    (an answer given after too few steps scores 0.0). Lines after the answer line score 0.0.

    Returns:
        a list of ``len(split_steps(text))`` floats.
    """
    scores: list[float] = []
    answered = False
    for i, line in enumerate(split_steps(text)):
        if answered:
            scores.append(0.0)
        elif _is_answer_line(line):
            answered = True
            m = _ANSWER_RE.match(line)
            ok = m is not None and int(m.group(1)) == problem.answer and i == len(problem.steps)
            scores.append(1.0 if ok else 0.0)
        else:
            scores.append(1.0 if _step_is_correct(problem, i, line) else 0.0)
    return scores


def first_error_step(problem: Problem, text: str) -> int | None:
    """0-based index of the first step scored 0.0 by :func:`step_scores`, or ``None``.

    ``None`` means every present step is correct; it does not mean the solution is complete (use
    :func:`verify` for that).
    """
    for i, score in enumerate(step_scores(problem, text)):
        if score == 0.0:
            return i
    return None


def feedback(problem: Problem, text: str) -> str:
    """Natural-language verifier feedback on ``text`` for ``problem``.

    Describes the first wrong step only (what it should be), e.g. ``"Step 2 is wrong: 7*2 is 14, not
    15."``; ``"The final answer is missing."`` when all steps are right but no answer line follows;
    ``"Correct."`` when the solution is fully correct. It never reveals more than the fix of the
    first wrong step (in particular never the final answer unless that is the first wrong step).
    """
    lines = split_steps(text)
    if not lines:
        return "The solution is empty. Write one step per line, then 'Answer: N'."
    k = first_error_step(problem, text)
    if k is None:
        if any(_is_answer_line(line) for line in lines):
            return "Correct."
        if len(lines) < len(problem.steps):
            nxt = len(lines)
            lhs, op, rhs, _ = problem.steps[nxt]
            return f"The solution stops early: step {nxt + 1} should compute {lhs}{op}{rhs}."
        return "The final answer is missing."
    line, n = lines[k], k + 1
    if _is_answer_line(line):
        if k < len(problem.steps):
            lhs, op, rhs, _ = problem.steps[k]
            return f"Step {n} gives the answer too early: the next step should compute {lhs}{op}{rhs}."
        if k > len(problem.steps) or any(_is_answer_line(x) for x in lines[:k]):
            return f"Step {n} is superfluous: the solution should end after the answer line."
        m = _ANSWER_RE.match(line)
        if m is None:
            return f"Step {n} is malformed: the last line should be 'Answer: N' with N an integer."
        return f"The final answer is wrong: it should be {problem.answer}, not {int(m.group(1))}."
    if any(_is_answer_line(x) for x in lines[:k]):
        return f"Step {n} is superfluous: the solution should end after the answer line."
    if k >= len(problem.steps):
        if parse_step(line) is None:
            return f"Step {n} is malformed: after the last operation, write the final line as 'Answer: N'."
        return f"Step {n} is superfluous: all {len(problem.steps)} operations are done; write 'Answer: N' next."
    lhs, op, rhs, result = problem.steps[k]
    parsed = parse_step(line)
    if parsed is None:
        return f"Step {n} is malformed: it should have the form a op b=c, here {lhs}{op}{rhs}={result}."
    a, o, b, c = parsed
    if a != lhs:
        return f"Step {n} is wrong: it should start from the running value {lhs}, not {a}."
    if (o, b) != (op, rhs):
        return f"Step {n} is wrong: the next operation is {op}{rhs}, not {o}{b}."
    return f"Step {n} is wrong: {lhs}{op}{rhs} is {result}, not {c}."


# ------------------------------------------------------------------------------------------------ rubrics


def _kind(item: dict[str, Any]) -> str:
    for tag in item.get("tags", []):
        if isinstance(tag, str) and tag.startswith("kind:"):
            return tag[len("kind:") :]
    raise ValueError(f"rubric item has no 'kind:...' tag, so the rule-based judge cannot grade it: {item!r}")


def _is_well_formatted(lines: list[str]) -> bool:
    if not lines or not _ANSWER_RE.match(lines[-1]):
        return False
    body = lines[:-1]
    return bool(body) and all(parse_step(x) is not None for x in body)


def rubric_verdict(item: dict[str, Any], problem: Problem, text: str) -> bool:
    """Rule-based judge for an item of :func:`make_rubrics`: is the criterion met by ``text``?

    As in HealthBench, for a negative-points item ``True`` means the undesirable behaviour is present.
    Dispatches on the item's ``kind:`` tag: ``all_steps`` (all reference steps appear, correct and in
    order, before the answer line), ``step`` (the tagged reference step appears on some line),
    ``wrong_answer`` (an answer is stated and it is wrong), ``format`` (one ``a op b=c`` per line and
    a final ``Answer: N`` line) and ``final_answer`` (:func:`verify`).
    """
    kind = _kind(item)
    lines = split_steps(text)
    if kind == "final_answer":
        return verify(text, problem.answer)
    if kind == "wrong_answer":
        got = extract_answer(text)
        return got is not None and got != problem.answer
    if kind == "all_steps":
        scores = step_scores(problem, text)
        n = len(problem.steps)
        return len(scores) >= n and all(s == 1.0 for s in scores[:n])
    if kind == "step":
        index = next(int(t[5:]) for t in item["tags"] if t.startswith("step:")) - 1
        return any(parse_step(line) == problem.steps[index] for line in lines)
    if kind == "format":
        return _is_well_formatted(lines)
    raise ValueError(
        f"unknown rubric kind {kind!r} in {item!r}; allowed: all_steps, step, wrong_answer, format, final_answer"
    )


def rubric_score(items: Sequence[dict[str, Any]], verdicts: Sequence[bool]) -> float:
    """HealthBench score ``sum(met points) / sum(positive points)`` (0.0 without positive items).

    Not clipped: it is at most 1 and can be negative when penalty items are met.
    """
    total = sum(float(it["points"]) for it in items if float(it["points"]) > 0)
    if total == 0:
        return 0.0
    return sum(float(it["points"]) for it, v in zip(items, verdicts, strict=True) if v) / total


# -------------------------------------------------------------------------------------------------- hints


def hint(problem: Problem, fraction: float) -> str:
    """The first ``fraction`` of the reference solution, by lines (newline-joined).

    ``floor(fraction * L)`` of the ``L`` solution lines, but at least one when ``fraction > 0`` and
    at most ``L - 1`` when ``fraction < 1``: the answer line is only included when ``fraction == 1``.
    ``fraction == 0`` gives ``""``.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    lines = problem.solution_lines
    if fraction == 0.0:
        return ""
    k = max(1, math.floor(fraction * len(lines)))
    if fraction < 1.0:
        k = min(k, len(lines) - 1)  # the answer line only with the whole solution
    return "\n".join(lines[:k])


# ---------------------------------------------------------------------------------- oracles by name (the framework)
# The framework's components reach these through their registries, under the name "arithmetic" (the tables of
# components.prm.STEP_VERIFIERS, components.judge.RUBRIC_VERDICTS, components.feedback.VERIFIER_FEEDBACK and
# components.local_server.QUESTION_ROWS); a config value names them (``prm_verifier: arithmetic``). Each takes the
# row's problem column as stored (:meth:`Problem.to_json`) or a :class:`Problem`.

_QUESTION_RE = re.compile(r"Compute\s+([0-9+\-*]+)\s+step by step")


def _as_problem(problem: Problem | str) -> Problem:
    return problem if isinstance(problem, Problem) else Problem.from_json(problem)


def prm_step_scores(problem: Problem | str, steps: Sequence[str]) -> list[float]:
    """Step verifier of the programmatic PRM: one score per given step (the verifier contract of
    ``components.prm.STEP_VERIFIERS``). The steps are joined one per line and scored line by line with
    :func:`step_scores`; a given step that spans several lines (e.g. a whole response scored as one step, as
    ``reasonflux_prm`` does) scores the minimum over its lines -- 1.0 iff every line of it is right -- and a step
    with no non-empty line scores 0.0."""
    line_scores = step_scores(_as_problem(problem), "\n".join(steps))
    out, start = [], 0
    for step in steps:
        n = len(split_steps(step))
        out.append(min(line_scores[start : start + n]) if n else 0.0)
        start += n
    return out


def rubric_oracle(item: dict[str, Any], problem: Problem | str, text: str) -> bool:
    """Rubric verdict of the rule-based judge: :func:`rubric_verdict`."""
    return rubric_verdict(item, _as_problem(problem), text)


def verifier_feedback(problem: Problem | str, text: str) -> dict[str, Any]:
    """Verifier feedback on a solution: ``{"message": feedback(...), "correct": verify(...), "first_error":
    first_error_step(...)}``."""
    p = _as_problem(problem)
    return {"message": feedback(p, text), "correct": verify(text, p.answer), "first_error": first_error_step(p, text)}


def row_from_question(question: str) -> dict[str, Any]:
    """A dataset row rebuilt from a text holding a bundled question (e.g. ``"Compute 3+4*2 step by step (left to
    right)."``): ``prompt`` (that text as the user message), ``answer``, ``solution``, ``rubrics`` and ``problem``,
    as :func:`make_dataset` writes them. Lets a local PRM or judge server grade from the question alone; raises
    ``ValueError`` when the text holds no bundled question."""
    match = _QUESTION_RE.search(question)
    if match is None:
        raise ValueError(f"not a bundled arithmetic question: {question!r}")
    tokens = re.findall(r"\d+|[+\-*]", match.group(1))
    problem = Problem.from_expression([int(t) for t in tokens[0::2]], tokens[1::2])
    return {"prompt": [{"role": "user", "content": question}], "answer": str(problem.answer),
            "solution": problem.solution, "rubrics": make_rubrics(problem), "problem": problem.to_json()}
