"""Answer extraction and answer clustering shared by the label-free and uncertainty plugins (EMPO, TTRL, SEED-GRPO).

A group's G completions are reduced to their final answers by an *extractor* (``text -> answer string or None``)
and clustered by **exact match after normalisation** (:func:`normalize_answer`). Built-in extractors:

* ``"task"`` (default): the integer on the first ``Answer: N`` line (the bundled arithmetic tasks' answer format,
  :func:`answer_line_value`; the tasks' own verifier reads it through this module);
* ``"boxed"``: the content of the last ``\\boxed{...}`` (nested braces allowed);
* ``"last_number"``: the last number in the text;
* ``"boxed_or_last_number"``: ``boxed``, else ``last_number`` (the usual math-RL convention).

Any other extractor is given as ``"package.module:function"`` (:func:`get_extractor`).

Clusters are numbered per group in order of first appearance; a completion without an answer gets cluster
``None`` (how it counts is each plugin's choice: its own singleton cluster, or no cluster at all).

:func:`batch_clusters` computes the clusters of the whole gathered batch once per reward stage and caches them on
the :class:`~trl_plugins.RewardContext`, so EMPO and SEED-GRPO stacked together extract and cluster once.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from trl_plugins.api.text import completion_text

Extractor = Callable[[str], "str | None"]

_NUMBER_RE = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")


#: The ``Answer: N`` answer line (the bundled tasks' format): a line starting with ``Answer:`` (any case) ...
ANSWER_PREFIX_RE = re.compile(r"^\s*answer\s*:", re.IGNORECASE)
#: ... that holds exactly one integer (an optional trailing period allowed).
ANSWER_LINE_RE = re.compile(r"^\s*answer\s*:\s*(-?\d+)\s*\.?\s*$", re.IGNORECASE)


def answer_line_value(text: str) -> int | None:
    """The integer on the first ``Answer:`` line of ``text`` (blank lines skipped, lines stripped), or None.

    None also when the first answer line does not hold a single integer (``"Answer: 7 or 8"``, ``"Answer:"``).
    """
    for line in text.splitlines():
        line = line.strip()
        if line and ANSWER_PREFIX_RE.match(line):
            match = ANSWER_LINE_RE.match(line)
            return int(match.group(1)) if match else None
    return None


def extract_task_answer(text: str) -> str | None:
    """The bundled tasks' answer: the integer on the first ``Answer: N`` line, as a string (or None)."""
    value = answer_line_value(text)
    return None if value is None else str(value)


def _boxed_at(text: str, start: int) -> str | None:
    r"""Content of the ``\boxed{...}`` starting at ``start`` (balanced braces), or None when it is not closed."""
    i = start + len("\\boxed")
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        depth, j = 0, i
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
            j += 1
    return None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        content = _boxed_at(text, start)
        if content is not None:
            return content
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_all_boxed(text: str) -> list[str]:
    r"""Contents of every closed ``\boxed{...}`` in ``text``, in order (balanced braces)."""
    out = []
    start = text.find("\\boxed")
    while start != -1:
        content = _boxed_at(text, start)
        if content is not None:
            out.append(content)
        start = text.find("\\boxed", start + 1)
    return out


def find_numbers(text: str) -> list[str]:
    """Every number in ``text``, in order (integers, decimals, thousands separators, simple fractions)."""
    return _NUMBER_RE.findall(text)


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (integers, decimals, thousands separators, simple fractions), or None."""
    found = find_numbers(text)
    return found[-1] if found else None


def extract_boxed_or_last_number(text: str) -> str | None:
    r"""``\boxed{...}`` if present, else the last number."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_last_number(text)


EXTRACTORS: dict[str, Extractor] = {
    "task": extract_task_answer,
    "boxed": extract_boxed,
    "last_number": extract_last_number,
    "boxed_or_last_number": extract_boxed_or_last_number,
}


def get_extractor(spec: str | Extractor) -> Extractor:
    """An extractor from a built-in name (:data:`EXTRACTORS`), a ``"module:function"`` path, or a callable."""
    if callable(spec):
        return spec
    if spec in EXTRACTORS:
        return EXTRACTORS[spec]
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            func = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"answer extractor {spec!r} cannot be imported: {exc}") from exc
        if not callable(func):
            raise ValueError(f"answer extractor {spec!r} is not callable")
        return func
    raise ValueError(
        f"unknown answer extractor {spec!r}; allowed: {', '.join(sorted(EXTRACTORS))} or 'package.module:function'"
    )


def normalize_answer(answer: str) -> str:
    """Canonical form for exact-match equivalence.

    Lower-cases, drops whitespace, surrounding ``$``, a trailing period and thousands separators in numbers, and
    writes numbers canonically (``"+5"``, ``"5.0"`` and ``"5"`` are equal; ``"0.50"`` equals ``".5"``).

    >>> normalize_answer(" 1,000. "), normalize_answer("$5.0$"), normalize_answer("Paris")
    ('1000', '5', 'paris')
    """
    s = "".join(answer.split()).strip("$").rstrip(".").lower()
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[len("\\text{") : -1]
    number = s.replace(",", "")
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", number):
        value = float(number)
        if math.isfinite(value):
            if value == int(value) and abs(value) < 1e15:
                return str(int(value))
            return repr(value)
    return s


def cluster_answers(answers: Sequence[str | None]) -> list[int | None]:
    """Cluster ids of one group's answers by normalised exact match (numbered by first appearance).

    >>> cluster_answers(["7", "07", None, "8", "7.0"])
    [0, 0, None, 1, 0]
    """
    ids: dict[str, int] = {}
    out: list[int | None] = []
    for a in answers:
        if a is None:
            out.append(None)
            continue
        key = normalize_answer(a)
        out.append(ids.setdefault(key, len(ids)))
    return out


def cluster_sizes(cluster_ids: Sequence[int | None], unanswered: str = "singleton") -> list[int]:
    """Sizes of the clusters of one group.

    ``unanswered``: ``"singleton"`` (each completion without an answer is a cluster of its own), ``"cluster"`` (all
    of them form one cluster) or ``"ignore"`` (they belong to no cluster).
    """
    counts: dict[int, int] = {}
    for c in cluster_ids:
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
    sizes = [counts[k] for k in sorted(counts)]
    missing = sum(c is None for c in cluster_ids)
    if missing:
        if unanswered == "singleton":
            sizes += [1] * missing
        elif unanswered == "cluster":
            sizes.append(missing)
        elif unanswered != "ignore":
            raise ValueError(f"unanswered={unanswered!r}; allowed: 'singleton', 'cluster', 'ignore'")
    return sizes


def cluster_fractions(cluster_ids: Sequence[int | None]) -> list[float]:
    """EMPO reward of each completion: the fraction of the group (G rows) in its answer cluster (0 without answer).

    >>> cluster_fractions([0, 0, 1, None])
    [0.5, 0.5, 0.25, 0.0]
    """
    G = len(cluster_ids)
    counts: dict[int, int] = {}
    for c in cluster_ids:
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
    return [0.0 if c is None else counts[c] / G for c in cluster_ids]


def majority_votes(cluster_ids: Sequence[int | None]) -> list[float]:
    """TTRL reward: 1.0 where the completion's answer is the group's majority answer, else 0.0.

    Ties go to the cluster that appears first in the group; a group without any answer gets all zeros.

    >>> majority_votes([1, 0, 1, 0, None])
    [0.0, 1.0, 0.0, 1.0, 0.0]
    """
    counts: dict[int, int] = {}
    for c in cluster_ids:
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
    if not counts:
        return [0.0] * len(cluster_ids)
    best = max(counts.values())
    majority = min(k for k, v in counts.items() if v == best)  # ids are in order of first appearance
    return [1.0 if c == majority else 0.0 for c in cluster_ids]


def semantic_entropy(cluster_ids: Sequence[int | None], estimator: str = "mc", unanswered: str = "singleton") -> float:
    """Semantic entropy of one group from its clusters, with frequency cluster probabilities ``p_k = |C_k| / n``.

    ``estimator="mc"``: ``-(1/K) sum_k log p_k`` (SEED-GRPO's Monte-Carlo form over the K clusters);
    ``estimator="plugin"``: ``-sum_k p_k log p_k`` (the Shannon entropy of the cluster distribution).
    ``n`` is the number of completions counted (all G unless ``unanswered="ignore"``). Both are 0 when all answers
    agree and ``log G`` when all G differ (:func:`max_semantic_entropy`). An empty count gives 0.
    """
    sizes = cluster_sizes(cluster_ids, unanswered)
    n = sum(sizes)
    if n == 0:
        return 0.0
    probs = [s / n for s in sizes]
    if estimator == "mc":
        return -sum(math.log(p) for p in probs) / len(probs)
    if estimator == "plugin":
        return -sum(p * math.log(p) for p in probs)
    raise ValueError(f"estimator={estimator!r}; allowed: 'mc', 'plugin'")


def max_semantic_entropy(group_size: int) -> float:
    """``log G``: the semantic entropy of a group whose G answers all differ (both estimators)."""
    return math.log(group_size) if group_size > 1 else 0.0


def group_cluster_ids(answers: Sequence[str | None], group_size: int) -> list[list[int | None]]:
    """Split a flat, group-contiguous list of N answers into N/G groups and cluster each one."""
    if len(answers) % group_size:
        raise ValueError(f"{len(answers)} answers are not whole groups of {group_size}")
    return [cluster_answers(answers[g : g + group_size]) for g in range(0, len(answers), group_size)]


def batch_clusters(ctx: Any, extractor: str | Extractor = "task") -> tuple[list[str | None], list[list[int | None]]]:
    """Answers (N,) and per-group cluster ids of the **global** batch at the reward stage (collective, cached).

    Gathers the local completions' answers with ``ctx.gather_object`` (every process must call it) and caches the
    result in ``ctx.shared`` per extractor, so several plugins in one stack extract and cluster once.
    """
    key = extractor if isinstance(extractor, str) else f"{getattr(extractor, '__module__', '')}:{extractor!r}"
    cache = ctx.shared.setdefault("answer_clusters", {})
    if key not in cache:
        func = get_extractor(extractor)
        local = [func(completion_text(c)) for c in ctx.local_completions]
        answers = list(ctx.gather_object(local))
        cache[key] = (answers, group_cluster_ids(answers, ctx.num_generations))
    return cache[key]
