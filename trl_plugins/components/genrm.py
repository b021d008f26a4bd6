"""Generative reward models (GenRMs): an LLM writes a critique and a verdict; k sampled verdicts are parsed and voted.

Three protocols, each a :class:`GenRMTemplate` (system + user text with named fields, and the regex that finds the
verdict in an answer):

* **pointwise** (``fields = question, response``): the judge writes principles, a critique and a score in a range
  (DeepSeek-GRM / SPCT style); the verdict is a number in ``[low, high]``.
* **pairwise** (``fields = question, response_a, response_b``): the judge compares two responses and names the better
  one, or a signed strength; the verdict is mapped by ``labels`` to a number, **positive when response B is better**
  (Think-RM's convention). :meth:`GenerativeRewardModel.compare` turns it into ``pref(first over second)`` and, with
  ``swap=True``, asks again with the two responses exchanged and averages both orders (position-bias control).
* **step** (``fields = question, history, step``; ``step=True``): a process judge reads the question, the steps
  before and one step, and gives that step a verdict from ``labels`` (e.g. the ternary
  :data:`TERNARY_STEP_TEMPLATE`: ``1`` correct, ``0.5`` minor / correctable error, ``0`` fatal error);
  :meth:`GenerativeRewardModel.judge_steps` asks one request per step (all steps of a batch in one call).

:class:`GenerativeRewardModel` samples ``k`` answers per request (a fresh sample each: no response cache), parses
each, re-asks the unparsable ones up to ``parse_retries`` times, optionally keeps the ``meta_keep`` samples a meta
judge rates highest (DeepSeek-GRM's meta-RM guided voting; the hook is :data:`MetaFilter`), and aggregates:

* ``"vote"``: the **sum** of the k verdicts (SPCT's voting; its range is k times the score range). Samples that did
  not parse count as the mean of the parsed ones, so the sum keeps its scale;
* ``"mean"``: the mean of the parsed verdicts;
* ``"majority"``: the most frequent verdict (ties: the mean of the tied values).

**Unparsable verdicts** are never a silent zero: every request result says how many of its samples parsed, a row
with none is NaN (the caller decides what a row without a verdict means -- the built-in plugins give it its group's
mean, a neutral advantage) and is logged with its text, :attr:`GenerativeRewardModel.stats` counts them, and when the
share of unparsable samples of one call exceeds ``max_unparsable`` the call raises :class:`GenRMParseError` naming
the judge, the row and the text.

**Cache**: final verdicts per (template, rendered prompt -- i.e. question and completion(s) --, k, aggregation) are
kept (LRU), so a refill round or a retried step never pays for the same judgement twice. Rows without a verdict are
not cached.

Backends (:class:`GenRMBackend`: ``ask(conversations) -> texts``, batched):

* :class:`EndpointGenRMBackend`: an OpenAI-compatible ``/v1/chat/completions`` server (``vllm serve``) through
  :class:`~trl_plugins.components.client.OpenAICompatibleClient` (async, bounded concurrency, timeouts, retries with
  backoff on 429/5xx/connection errors; a dead server is an :class:`EndpointError` naming the URL).
* :class:`HFGenRMBackend`: a local Hugging Face causal LM, loaded and run by
  :class:`~trl_plugins.components.teacher.HFTeacher` (whole on every process, also under ZeRO-3 / FSDP; ``generate``
  local to the process, never synced), so it has the teacher's engine rules.
* :class:`ScriptedGenRMBackend`: a Python function ``messages -> text``; :func:`scripted_genrm` answers in the
  templates' formats from a task's verifier (:data:`~trl_plugins.components.feedback.VERIFIER_FEEDBACK`, the question
  rebuilt by :data:`~trl_plugins.components.local_server.QUESTION_ROWS`), for CPU tests and the offline demo;
  :func:`genrm_handler` serves any backend on :func:`~trl_plugins.components.local_server.serve_openai_compatible`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import string
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.api.options import option
from trl_plugins.components.client import EndpointConfig, EndpointError, OpenAICompatibleClient, endpoint_options

__all__ = [
    "AGGREGATIONS",
    "EndpointGenRMBackend",
    "GenRMBackend",
    "GenRMOptions",
    "GenRMParseError",
    "GenRMResult",
    "GenRMTemplate",
    "GenerativeRewardModel",
    "HFGenRMBackend",
    "MetaFilter",
    "STEP_FIELDS",
    "TERNARY_STEP_TEMPLATE",
    "ScriptedGenRMBackend",
    "aggregate_verdicts",
    "clear_shared_genrm_backends",
    "genrm_from_options",
    "genrm_handler",
    "neutral_fill",
    "meta_judge_filter",
    "pointwise_column",
    "scripted_genrm",
]

logger = logging.getLogger(__name__)

AGGREGATIONS = ("vote", "mean", "majority")
POINTWISE_FIELDS = ("question", "response")
PAIRWISE_FIELDS = ("question", "response_a", "response_b")
STEP_FIELDS = ("question", "history", "step")


class GenRMParseError(EndpointError):
    """Too many verdicts of a generative reward model could not be parsed (the message names judge, row and text)."""


# ============================================================================================= templates
@dataclass(frozen=True)
class GenRMTemplate:
    """A judge prompt and how to read its verdict.

    Attributes:
        name: identifies the template in cache keys and errors.
        system: the system message (may be empty: no system message is sent).
        user: the user message, a ``str.format`` text with exactly the fields of the protocol: ``{question}`` and
            ``{response}`` (pointwise), ``{question}``, ``{response_a}``, ``{response_b}`` (pairwise) or
            ``{question}``, ``{history}``, ``{step}`` (step).
        verdict_regex: finds the verdict; its first group is the verdict text. The **last** match counts (a judge that
            restates the format before answering is read at its answer).
        low, high: pointwise: the score range (a number outside it is unparsable).
        labels: pairwise: verdict text -> value, positive when response B is better (e.g. ``{"A": -1, "B": 1}``);
            step: verdict text -> value of the step (e.g. ``{"1": 1.0, "0.5": 0.5, "0": 0.0}``). A verdict text
            that is not a key but is a number equal to a numeric key's number (``"1.0"`` for ``"1"``) reads as it.
        step: the step protocol (labels required).
    """

    name: str
    system: str
    user: str
    verdict_regex: str
    low: float = 1.0
    high: float = 10.0
    labels: Mapping[str, float] | None = None
    step: bool = False

    def __post_init__(self):
        try:
            fields = tuple(sorted({f for _, f, _, _ in string.Formatter().parse(self.user) if f}))
        except ValueError as exc:
            raise PluginConfigError(f"GenRM template {self.name!r}: its user text is not a template ({exc}).") from exc
        expected = {"pointwise": POINTWISE_FIELDS, "pairwise": PAIRWISE_FIELDS, "step": STEP_FIELDS}[self.protocol]
        if fields != tuple(sorted(expected)):
            raise PluginConfigError(
                f"GenRM template {self.name!r}: its user text has the fields {list(fields)}; a "
                f"{self.protocol} template needs exactly {list(expected)}."
            )
        try:
            pattern = re.compile(self.verdict_regex, re.DOTALL)
        except re.error as exc:
            raise PluginConfigError(f"GenRM template {self.name!r}: verdict_regex is not a regex ({exc}).") from exc
        if pattern.groups < 1:
            raise PluginConfigError(f"GenRM template {self.name!r}: verdict_regex needs a group holding the verdict.")
        if self.labels is None and not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise PluginConfigError(f"GenRM template {self.name!r}: score range [{self.low}, {self.high}] is empty.")
        if self.labels is not None and not self.labels or self.step and self.labels is None:
            raise PluginConfigError(f"GenRM template {self.name!r}: a {self.protocol} template needs verdict labels.")

    @property
    def protocol(self) -> str:
        return "step" if self.step else ("pairwise" if self.labels is not None else "pointwise")

    def messages(self, **fields: str) -> list[dict]:
        """The chat messages of one request (fields as in :attr:`user`)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        return out + [{"role": "user", "content": self.user.format(**fields)}]

    def parse(self, text: str | None) -> float | None:
        """The verdict of one answer (pointwise: the score; pairwise: the label's value), None when it has none.
        ``<think>...</think>`` blocks are skipped."""
        if not isinstance(text, str):
            return None
        body = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL | re.IGNORECASE)
        matches = re.findall(self.verdict_regex, body, flags=re.DOTALL)
        if not matches:
            return None
        raw = matches[-1][0] if isinstance(matches[-1], tuple) else matches[-1]
        raw = raw.strip()
        if self.labels is not None:
            return _label_value(self.labels, raw)
        try:
            value = float(raw)
        except ValueError:
            return None
        return value if self.low <= value <= self.high and math.isfinite(value) else None


def _label_value(labels: Mapping[str, float], raw: str) -> float | None:
    """The value of verdict text ``raw``: its label, else the label whose key is the same number (None if neither)."""
    if raw in labels:
        return float(labels[raw])
    try:
        number = float(raw)
    except ValueError:
        return None
    for key, value in labels.items():
        try:
            if float(key) == number:
                return float(value)
        except ValueError:
            continue
    return None


#: DataPRM's reflection-aware ternary step verdict (arXiv:2604.24198; our wording of the official judge prompt,
#: zjunlp/DataMind@4b49ef0 ``dataprm/evaluate/prompt.py:1-41``): ``1`` correct and useful, ``0.5`` generally correct
#: with a minor error the later steps can easily fix, ``0`` a fatal error; the last ``<score>...</score>`` counts, and
#: a score outside {1, 0.5, 0} is unparsable (``run_eval.py:81-98``). The official judge also runs code against the
#: environment before it answers; here it reads the steps (and their tool results) only.
TERNARY_STEP_TEMPLATE = GenRMTemplate(
    name="data_prm/ternary_step",
    system="You are a careful expert verifier of multi-step solutions (analysis, code, tool calls and the results "
    "they returned). Check whether the designated step is correct and reasonable, then score it: 1 if the step is "
    "correct and helps solve the problem; 0.5 if it is generally correct but omits a detail or has a minor error that "
    "later steps can easily fix without harming the overall solution; 0 if it has a fatal error or a severe omission "
    "that leads to wrong or misleading results. Judge correctness, not formatting. Reason first, then give the score "
    "inside <score></score> (one of 1, 0.5, 0) and a one-sentence reason inside <summary></summary>.",
    user="[Question]\n{question}\n[End of Question]\n\n[History]\n{history}\n[End of History]\n\n"
    "[Step]\n{step}\n[End of Step]",
    verdict_regex=r"<score>\s*([^<]*?)\s*</score>",
    labels={"1": 1.0, "0.5": 0.5, "0": 0.0},
    step=True,
)


# ============================================================================================= aggregation
def aggregate_verdicts(values: Sequence[float | None], how: str) -> float:
    """One verdict from k sampled ones (None = unparsable): ``vote`` (sum, unparsed samples counted as the parsed
    mean), ``mean`` or ``majority`` (see the module docstring); NaN when none parsed."""
    if how not in AGGREGATIONS:
        raise PluginConfigError(f"GenRM aggregation {how!r}; allowed: {', '.join(map(repr, AGGREGATIONS))}.")
    parsed = [float(v) for v in values if v is not None]
    if not parsed:
        return math.nan
    mean = sum(parsed) / len(parsed)
    if how == "vote":
        return mean * len(values)
    if how == "mean":
        return mean
    counts = Counter(parsed)
    top = max(counts.values())
    tied = [v for v, c in counts.items() if c == top]
    return sum(tied) / len(tied)


#: A meta judge's hook: ``fn(messages, texts) -> one score per sampled answer`` (higher = more trustworthy); the
#: ``meta_keep`` best-rated parsed samples are kept before aggregating (DeepSeek-GRM's meta-RM guided voting).
MetaFilter = Callable[[list[dict], list[str]], Sequence[float]]


@dataclass
class GenRMResult:
    """The verdicts of one batch of requests.

    Attributes:
        values: (R,) aggregated verdict per request; NaN where no sample parsed.
        samples: R lists of the k parsed verdicts (None where unparsable; after the meta filter, None where dropped).
        texts: R lists of the k judge answers (empty lists for cached rows).
        cached: (R,) whether the row came from the cache.
    """

    values: list[float]
    samples: list[list[float | None]]
    texts: list[list[str]] = field(default_factory=list)
    cached: list[bool] = field(default_factory=list)

    @property
    def unparsable_rows(self) -> list[int]:
        return [i for i, v in enumerate(self.values) if math.isnan(v)]


def neutral_fill(values: Any, group_size: int) -> tuple[Any, Any]:
    """Rows without a verdict (NaN) take the mean of their group's verdicts -- the group mean is unchanged, so the
    row's group-relative advantage is 0 -- or 0.0 when no row of the group has one.

    Args:
        values: (N,) float tensor, groups of ``group_size`` contiguous rows.
    Returns:
        (N,) filled values and the (N,) bool mask of the rows that had no verdict.
    """
    import torch

    missing = torch.isnan(values)
    groups = values.view(-1, group_size)
    means = torch.nan_to_num(groups.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(groups).reshape(-1)
    return torch.where(missing, means, values), missing


def pointwise_column(ctx: Any, grm: GenerativeRewardModel, plugin: str, column: str) -> Any:
    """Fill the reward column ``column`` with a pointwise GenRM's verdicts (the reward stage of the plugins that pay
    one, e.g. deepseek_grm and libra_rm). Collective: every process judges its own rows (question from the prompt,
    response from the completion text), the (N,) verdicts are gathered -- a judge failing on one process stops every
    process, naming ``plugin`` -- and rows without a verdict take their group's mean (:func:`neutral_fill`; metric
    ``unparsable_fraction``, the share of such rows).

    Args:
        ctx: the :class:`~trl_plugins.api.RewardContext` (its ``rewards_per_func`` (N, F) is replaced).
    Returns:
        (N,) float32 tensor of the verdicts before filling (NaN where none parsed).
    """
    import torch

    from trl_plugins.api.collectives import gather_objects_together
    from trl_plugins.api.text import completion_text
    from trl_plugins.components.steps import question_text

    def local() -> list[float]:
        questions = [question_text(p) for p in ctx.local_prompts]
        return grm.score(questions, [completion_text(c) for c in ctx.local_completions]).values

    scores = torch.tensor(gather_objects_together(ctx, plugin, local), dtype=torch.float32)
    values, missing = neutral_fill(scores, ctx.num_generations)
    ctx.log_metric("unparsable_fraction", missing.float().mean().item())
    matrix = ctx.rewards_per_func.clone()
    matrix[:, ctx.reward_func_names.index(column)] = values.to(matrix)
    ctx.rewards_per_func = matrix
    return scores


# ============================================================================================= backends
class GenRMBackend:
    """Where verdicts come from: ``ask(conversations) -> one fresh sampled answer per conversation``."""

    #: Named in every error (URL, model path or "scripted").
    location: str = "?"

    def ask(self, conversations: Sequence[list[dict]]) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections or models (optional)."""


class EndpointGenRMBackend(GenRMBackend):
    """An OpenAI-compatible chat endpoint; ``sampling`` holds extra request fields (``temperature``, ``max_tokens``,
    ...). The client's response cache is off: k identical requests must be k samples."""

    def __init__(self, endpoint: EndpointConfig, sampling: Mapping[str, Any] | None = None):
        self.client = OpenAICompatibleClient(EndpointConfig(**{**endpoint.__dict__, "cache": False}))
        self.sampling = dict(sampling or {})
        self.location = f"{self.client.base_url}/chat/completions"

    def ask(self, conversations):
        return self.client.chat([list(c) for c in conversations], **self.sampling) if conversations else []

    def close(self) -> None:
        self.client.close()


class HFGenRMBackend(GenRMBackend):
    """A local causal LM as the judge, run by :class:`~trl_plugins.components.teacher.HFTeacher` (its loading,
    batching and process-local generation). Pass ``teacher`` to share an already loaded one."""

    def __init__(self, model_name_or_path: str | None = None, *, teacher: Any = None, temperature: float = 1.0,
                 max_tokens: int = 512, device: str | None = None, batch_size: int = 8):
        from trl_plugins.components.teacher import HFTeacher

        if teacher is None:
            teacher = HFTeacher(model_name_or_path, device=device, temperature=temperature, max_tokens=max_tokens,
                                batch_size=batch_size, role="generative reward model")
        self.teacher = teacher
        self.location = f"local model {teacher.name!r}"

    def ask(self, conversations):
        return self.teacher.chat([list(c) for c in conversations]) if conversations else []


class ScriptedGenRMBackend(GenRMBackend):
    """``fn(messages) -> answer text`` (deterministic judges for tests and demos)."""

    location = "scripted"

    def __init__(self, fn: Callable[[list[dict]], str]):
        self.fn = fn

    def ask(self, conversations):
        return [self.fn(list(c)) for c in conversations]


# ============================================================================================= the model
class GenerativeRewardModel:
    """Sampled, parsed, voted and cached verdicts of a judge LLM (see the module docstring).

    Args:
        backend: where answers come from.
        template: prompt and verdict format (its protocol decides :meth:`score` vs :meth:`compare`).
        k: sampled verdicts per request (>= 1).
        aggregate: ``"vote"``, ``"mean"`` or ``"majority"``.
        parse_retries: extra asks for each unparsable sample.
        max_unparsable: largest share of unparsable samples in one call before :class:`GenRMParseError`
            (in [0, 1]; 1 never raises, rows without a verdict are still NaN and logged).
        meta_filter, meta_keep: keep the ``meta_keep`` parsed samples the meta filter rates highest (both or neither).
        cache_size: verdicts kept (LRU); 0 turns the cache off.
        name: names the judge in logs and errors (e.g. the plugin).
    """

    def __init__(self, backend: GenRMBackend, template: GenRMTemplate, *, k: int = 1, aggregate: str = "vote",
                 parse_retries: int = 0, max_unparsable: float = 0.5, meta_filter: MetaFilter | None = None,
                 meta_keep: int | None = None, cache_size: int = 65536, name: str = "genrm"):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise PluginConfigError(f"GenRM {name!r}: k={k!r}; it must be an integer >= 1 (sampled verdicts).")
        if aggregate not in AGGREGATIONS:
            raise PluginConfigError(
                f"GenRM {name!r}: aggregate={aggregate!r}; allowed: {', '.join(map(repr, AGGREGATIONS))}.")
        if not 0.0 <= float(max_unparsable) <= 1.0:
            raise PluginConfigError(f"GenRM {name!r}: max_unparsable={max_unparsable!r}; allowed: a share in [0, 1].")
        if parse_retries < 0:
            raise PluginConfigError(f"GenRM {name!r}: parse_retries={parse_retries!r}; it must be >= 0.")
        if (meta_filter is None) != (meta_keep is None):
            raise PluginConfigError(f"GenRM {name!r}: meta_filter and meta_keep go together (both or neither).")
        if meta_keep is not None and not 1 <= meta_keep <= k:
            raise PluginConfigError(f"GenRM {name!r}: meta_keep={meta_keep!r}; allowed: 1 to k={k}.")
        self.backend, self.template, self.k, self.aggregate = backend, template, k, aggregate
        self.parse_retries, self.max_unparsable = int(parse_retries), float(max_unparsable)
        self.meta_filter, self.meta_keep = meta_filter, meta_keep
        self.cache_size, self.name = int(cache_size), name
        self._cache: OrderedDict[str, tuple[float, list]] = OrderedDict()
        self._lock = threading.Lock()
        #: cumulative counts: requests, samples asked (retries included), unparsable samples (after retries),
        #: rows without a verdict, cache hits
        self.stats = Counter()

    # ------------------------------------------------------------------------------------------ public API
    def score(self, questions: Sequence[str], responses: Sequence[str]) -> GenRMResult:
        """Pointwise: one aggregated score per (question, response)."""
        self._need("pointwise")
        return self._judge([self.template.messages(question=q, response=r) for q, r in zip(questions, responses,
                                                                                            strict=True)])

    def judge_steps(self, questions: Sequence[str], histories: Sequence[str], steps: Sequence[str]) -> GenRMResult:
        """Step protocol: one aggregated verdict per (question, history of the steps before, step)."""
        self._need("step")
        return self._judge([self.template.messages(question=q, history=h, step=s)
                            for q, h, s in zip(questions, histories, steps, strict=True)])

    def compare(self, questions: Sequence[str], first: Sequence[str], second: Sequence[str], *,
                swap: bool = False) -> GenRMResult:
        """Pairwise: ``pref(first over second)`` per request -- the template's value negated (it is positive when
        its response B, here ``second``, is better). With ``swap``, also asked with ``second`` as A and the two
        orders' verdicts averaged (a row is NaN when either order has none). ``samples`` hold the first order's."""
        self._need("pairwise")
        rows = list(zip(questions, first, second, strict=True))
        ab = self._judge([self.template.messages(question=q, response_a=a, response_b=b) for q, a, b in rows])
        values = [-v for v in ab.values]
        if swap:
            ba = self._judge([self.template.messages(question=q, response_a=b, response_b=a) for q, a, b in rows])
            values = [(x + y) / 2 for x, y in zip(values, ba.values)]
        return GenRMResult(values, ab.samples, ab.texts, ab.cached)

    def close(self) -> None:
        self.backend.close()

    # ------------------------------------------------------------------------------------------ internals
    def _need(self, protocol: str) -> None:
        if self.template.protocol != protocol:
            raise PluginConfigError(
                f"GenRM {self.name!r}: template {self.template.name!r} is {self.template.protocol}; this call needs a "
                f"{protocol} template.")

    def _key(self, messages: list[dict]) -> str:
        t = self.template
        text = repr((t.name, t.system, t.user, t.verdict_regex, t.low, t.high, sorted((t.labels or {}).items()),
                     t.step, self.k, self.aggregate, self.meta_keep, messages))
        return hashlib.sha256(text.encode()).hexdigest()

    def _judge(self, requests: list[list[dict]]) -> GenRMResult:
        n = len(requests)
        values, samples = [math.nan] * n, [[] for _ in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        cached = [False] * n
        keys = [self._key(m) for m in requests]
        todo = []
        with self._lock:
            for i, key in enumerate(keys):
                hit = self._cache.get(key) if self.cache_size else None
                if hit is None:
                    todo.append(i)
                else:
                    self._cache.move_to_end(key)
                    values[i], samples[i], cached[i] = hit[0], list(hit[1]), True
        self.stats["requests"] += n
        self.stats["cache_hits"] += n - len(todo)
        if not todo:
            return GenRMResult(values, samples, texts, cached)
        slots = [(i, s) for i in todo for s in range(self.k)]  # one sample each
        verdicts: dict[tuple[int, int], float | None] = {}
        answers: dict[tuple[int, int], str] = {}
        pending = slots
        for _attempt in range(self.parse_retries + 1):
            if not pending:
                break
            got = self.backend.ask([requests[i] for i, _ in pending])
            if len(got) != len(pending):
                raise EndpointError(f"The generative reward model at {self.backend.location} returned {len(got)} "
                                    f"answers for {len(pending)} requests.")
            self.stats["samples"] += len(pending)
            still = []
            for slot, text in zip(pending, got):
                answers[slot], verdicts[slot] = text, self.template.parse(text)
                if verdicts[slot] is None:
                    still.append(slot)
            pending = still
        self.stats["unparsable_samples"] += len(pending)
        for i in todo:
            row_texts = [answers[(i, s)] for s in range(self.k)]
            row = [verdicts[(i, s)] for s in range(self.k)]
            if self.meta_filter is not None:
                row = self._meta(requests[i], row_texts, row)
            texts[i], samples[i] = row_texts, row
            values[i] = aggregate_verdicts(row, self.aggregate)
        missing = [i for i in todo if math.isnan(values[i])]
        self.stats["unparsable_rows"] += len(missing)
        if pending:
            i, s = pending[0]
            where = f"row {i} (sample {s + 1} of {self.k})"
            share = len(pending) / len(slots)
            message = (f"The generative reward model {self.name!r} at {self.backend.location} gave no parsable verdict "
                       f"({self.template.name}: {self.template.verdict_regex!r}) for {len(pending)} of {len(slots)} "
                       f"samples after {self.parse_retries + 1} attempts each ({len(missing)} rows without any); "
                       f"first: {where}, text {answers[(i, s)][:300]!r}")
            if share > self.max_unparsable:
                raise GenRMParseError(f"{message}. That is more than max_unparsable={self.max_unparsable:g}.")
            logger.warning("%s.", message)
        if self.cache_size:
            with self._lock:
                for i in todo:
                    if not math.isnan(values[i]):
                        self._cache[keys[i]] = (values[i], list(samples[i]))
                        self._cache.move_to_end(keys[i])
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GenRMResult(values, samples, texts, cached)

    def _meta(self, messages: list[dict], texts: list[str], row: list[float | None]) -> list[float | None]:
        """Keep the ``meta_keep`` parsed samples the meta filter rates highest (stable order on ties)."""
        rating = list(self.meta_filter(messages, texts))
        if len(rating) != len(texts):
            raise EndpointError(f"GenRM {self.name!r}: the meta filter rated {len(rating)} of {len(texts)} samples.")
        parsed = [s for s, v in enumerate(row) if v is not None]
        keep = set(sorted(parsed, key=lambda s: -float(rating[s]))[: self.meta_keep])
        return [v if s in keep else None for s, v in enumerate(row)] if keep else row


def meta_judge_filter(meta: GenerativeRewardModel) -> MetaFilter:
    """A :data:`MetaFilter` asking a pointwise GenRM to rate each sampled answer: its question is the original
    request's user message, its response the sampled judgement (a meta-RM that reads the critique). The filter's
    ``judge`` attribute is ``meta`` (its :attr:`~GenerativeRewardModel.stats` count the meta ratings)."""

    def rate(messages: list[dict], texts: list[str]) -> list[float]:
        question = messages[-1]["content"]
        values = meta.score([question] * len(texts), list(texts)).values
        return [-math.inf if math.isnan(v) else v for v in values]

    rate.judge = meta
    return rate


# ============================================================================================= scripted judge
_SECTION_RE = {
    "question": re.compile(r"\[Question\]\n(.*?)\n\[End of Question\]", re.DOTALL),
    "response": re.compile(r"\[Response\]\n(.*?)\n\[End of Response\]", re.DOTALL),
    "response_a": re.compile(r"\[Response A\]\n(.*?)\n\[End of Response A\]", re.DOTALL),
    "response_b": re.compile(r"\[Response B\]\n(.*?)\n\[End of Response B\]", re.DOTALL),
    "judgement": re.compile(r"\[Judgement\]\n(.*?)\n\[End of Judgement\]", re.DOTALL),
    "history": re.compile(r"\[History\]\n(.*?)\n?\[End of History\]", re.DOTALL),
    "step": re.compile(r"\[Step\]\n(.*?)\n\[End of Step\]", re.DOTALL),
}
#: lines of a step request that are framing, not solution text (paragraph tags, the final-step note)
_FRAMING_RE = re.compile(r"^\s*(\[/?Paragraph_\d+\]|Note: This is the final step\.)\s*$")
_BOXED_RE = re.compile(r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}")
#: a pointwise request asking for a binary correctness verdict, ``\boxed{1}`` (correct) or ``\boxed{0}``
_BINARY_ASK_RE = re.compile(r"\\boxed\{1\}.*\\boxed\{0\}", re.DOTALL)


def scripted_genrm(oracle: str | Callable = "arithmetic", *, high: float = 10.0, low: float = 1.0) -> Callable:
    """``messages -> answer`` grading with a task's verifier, in the built-in templates' formats (sections
    ``[Question]`` / ``[Response]`` or ``[Response A]`` / ``[Response B]``): pointwise, ``high`` for a correct
    response, else a whole score between ``low`` and the middle by how many steps precede its first error, ending in
    ``\\boxed{score}``; pairwise, ``<answer>A</answer>`` or ``B`` for the better one (correct first, then the later
    first error; a tie names A, a position bias that a swap exposes) -- or, when the prompt asks for the signed
    scale "from -3 to 3", ``<answer>+-2</answer>`` (0 is not on the scale: a tie answers -1, A slightly better);
    when a pointwise prompt asks for a binary correctness verdict (it names ``\\boxed{1}`` and then ``\\boxed{0}``,
    libra_rm's format), ``\\boxed{1}`` for a correct response and ``\\boxed{0}`` otherwise;
    a meta-RM request (a ``[Judgement]`` section holding a pointwise judgement of a request) is rated ``high`` when
    the judgement's last ``\\boxed{}`` score equals the verifier's, else ``low``; a step request (``[History]`` and
    ``[Step]``, the :data:`TERNARY_STEP_TEMPLATE` format) is ``<score>1</score>`` when no step up to this one is wrong,
    ``<score>0</score>`` when the first wrong step lies in this one, ``<score>0.5</score>`` when an earlier step is
    wrong (this one builds on a correctable error) -- lines are steps, paragraph tags are skipped. The question is rebuilt into a row
    by ``QUESTION_ROWS[oracle]`` and graded by ``VERIFIER_FEEDBACK[oracle]``; a request without these sections is a
    ``ValueError``."""
    from trl_plugins.components.feedback import feedback_oracle
    from trl_plugins.components.local_server import QUESTION_ROWS

    row_of, grade = QUESTION_ROWS.get(oracle), feedback_oracle(oracle)

    def quality(row: dict, text: str) -> float:
        verdict = grade(row["problem"], text)
        if verdict.correct:
            return high
        steps = len([line for line in text.splitlines() if line.strip()]) or 1
        done = steps if verdict.first_error is None else verdict.first_error
        return float(round(low + (high - low) / 2 * min(done / steps, 1.0)))  # whole scores, as judges write them

    def step_verdict(row: dict, history: str, step: str) -> str:
        def lines(text: str) -> list[str]:
            return [ln for ln in text.splitlines() if ln.strip() and not _FRAMING_RE.match(ln)]

        before = lines(history)
        first = grade(row["problem"], "\n".join(before + lines(step))).first_error
        return "1" if first is None else ("0" if first >= len(before) else "0.5")

    def answer(messages: list[dict]) -> str:
        text = "\n".join(str(m.get("content", "")) for m in messages)
        parts = {name: m.group(1) for name, rx in _SECTION_RE.items() if (m := rx.search(text))}
        if "question" not in parts or not ({"response", "response_a", "step"} & set(parts)):
            raise ValueError("scripted_genrm: the request has no [Question] and [Response] (or [Step]) sections.")
        row = row_of(parts["question"])
        if "step" in parts:
            return f"Checked with the task's verifier.\n<score>{step_verdict(row, parts.get('history', ''), parts['step'])}</score>"
        if "judgement" in parts:
            said = _BOXED_RE.findall(parts["judgement"])
            right = bool(said) and float(said[-1]) == quality(row, parts["response"])
            return f"The judgement {'matches' if right else 'contradicts'} the verifier. \\boxed{{{high if right else low:g}}}"
        if "response" in parts and _BINARY_ASK_RE.search(text.replace(parts["response"], "")):
            verdict = grade(row["problem"], parts["response"]).correct
            return f"Checked against the task's verifier.\nJudgement: \\boxed{{{int(verdict)}}}"
        if "response" in parts:
            score = quality(row, parts["response"])
            return (f"Principles: the final answer must be exact; every step must be right.\n"
                    f"Critique: graded by the task's verifier.\nScore: \\boxed{{{score:g}}}")
        a, b = quality(row, parts["response_a"]), quality(row, parts["response_b"])
        if "from -3 to 3" in text:
            return f"Compared by the task's verifier.\n<answer>{2 if b > a else (-2 if a > b else -1)}</answer>"
        return f"Compared by the task's verifier.\n<answer>{'B' if b > a else 'A'}</answer>"

    return answer


def genrm_handler(backend: GenRMBackend, seen: list | None = None) -> Callable[[str, dict], Any]:
    """An HTTP handler answering chat requests with ``backend`` (one answer per request), for
    :func:`~trl_plugins.components.local_server.serve_openai_compatible`; requests are appended to ``seen``."""
    from trl_plugins.components.local_server import chat_response

    def handler(path: str, payload: dict):
        if seen is not None:
            seen.append(payload)
        return chat_response(backend.ask([payload["messages"]])[0])

    return handler


# ============================================================================================= plugin options
_SHARED: dict[tuple, GenRMBackend] = {}

#: ``genrm_model``, ``genrm_base_url``, ``genrm_api_key_env``, ``genrm_timeout``, ``genrm_max_retries``.
GenRMEndpointOptions = endpoint_options("genrm", "generative reward model")


@dataclass
class GenRMOptions(GenRMEndpointOptions):
    """The generative-RM options of the plugins that ask one (deepseek_grm, libra_rm, think_rm, ...); their option
    dataclasses derive from this one, set ``plugin_name``, may redeclare a field with their paper's default, and call
    ``super().validate()`` from their own checks."""

    plugin_name: ClassVar[str] = "?"

    genrm: Literal["endpoint", "hf", "scripted"] = option(
        "endpoint", help="Generative RM: an OpenAI-compatible server (genrm_base_url, e.g. `vllm serve`), a local "
        "Hugging Face model (genrm_model, loaded whole on every process like a teacher), or a task's scripted judge "
        "(genrm_oracle; tests and demos).",
    )
    genrm_oracle: str = option(
        "arithmetic", help="genrm='scripted': the task whose verifier answers (components.feedback.VERIFIER_FEEDBACK "
        "and components.local_server.QUESTION_ROWS; 'arithmetic' = the bundled tasks).",
    )
    genrm_temperature: float = option(1.0, min=0.0, help="Sampling temperature of the judge's answers.")
    genrm_max_tokens: int = option(1024, min=1, help="Longest judge answer in tokens.")
    genrm_device: str | None = option(None, help="Device of a local (hf) judge (None: the run's device).")
    genrm_max_concurrency: int = option(16, min=1, help="Endpoint requests in flight at once.")
    genrm_parse_retries: int = option(0, min=0, help="Extra asks for each sampled verdict that did not parse.")
    genrm_max_unparsable: float = option(
        0.5, min=0.0, max=1.0, reconstructed=True,
        help="Largest share of unparsable sampled verdicts in one reward batch; above it the step fails with an "
        "error naming the judge, the row and the text. Rows without any verdict get their group's mean (a neutral "
        "advantage), and are counted (metric unparsable_fraction) and logged.",
    )

    def validate(self) -> None:
        self.require_base_url("genrm", self.plugin_name, otherwise="genrm='hf' with genrm_model, or 'scripted'")
        if self.genrm == "hf" and self.genrm_model == "default":
            raise PluginConfigError(
                f"Plugin {self.plugin_name!r} with genrm='hf' needs genrm_model (a model name or path).")
        if self.genrm == "scripted":
            from trl_plugins.components.local_server import QUESTION_ROWS

            QUESTION_ROWS.check(self.genrm_oracle, f"Option 'genrm_oracle' of plugin {self.plugin_name!r}: ")


def _build_backend(kind: str, **kw: Any) -> GenRMBackend:
    if kind == "scripted":
        return ScriptedGenRMBackend(scripted_genrm(kw["oracle"]))
    if kind == "hf":
        return HFGenRMBackend(kw["model"], temperature=kw["temperature"], max_tokens=kw["max_tokens"],
                              device=kw["device"])
    from trl_plugins.components.client import api_key_from_env

    config = EndpointConfig(base_url=kw["base_url"], model=kw["model"], api_key=api_key_from_env(kw["api_key_env"]),
                            timeout=kw["timeout"], max_retries=kw["max_retries"], max_concurrency=kw["concurrency"])
    return EndpointGenRMBackend(config, {"temperature": kw["temperature"], "max_tokens": kw["max_tokens"]})


def genrm_from_options(o: GenRMOptions, template: GenRMTemplate, *, k: int, aggregate: str, device: Any = None,
                       meta_template: GenRMTemplate | None = None, meta_keep: int | None = None) -> GenerativeRewardModel:
    """A :class:`GenerativeRewardModel` for a plugin's options. The backend is shared by every plugin with the same
    judge options (one local model in memory, one HTTP client); ``device`` places a local judge when
    ``genrm_device`` is None. With ``meta_template``, the same backend rates each sampled judgement with it
    (:func:`meta_judge_filter`) and the ``meta_keep`` best are voted."""
    kw: dict[str, Any] = dict(model=o.genrm_model, temperature=o.genrm_temperature, max_tokens=o.genrm_max_tokens)
    if o.genrm == "scripted":
        kw = dict(oracle=o.genrm_oracle)
    elif o.genrm == "hf":
        where = o.genrm_device if o.genrm_device is not None else device
        kw["device"] = None if where is None else str(where)
    else:
        kw.update(o.endpoint_kwargs("genrm"), concurrency=o.genrm_max_concurrency)
    key = (o.genrm, tuple(sorted(kw.items())))
    if key not in _SHARED:
        _SHARED[key] = _build_backend(o.genrm, **kw)
    backend = _SHARED[key]
    common = dict(parse_retries=o.genrm_parse_retries, max_unparsable=o.genrm_max_unparsable)
    meta = None
    if meta_template is not None:
        meta = meta_judge_filter(GenerativeRewardModel(backend, meta_template, k=1, aggregate="mean",
                                                       name=f"{o.plugin_name} meta-RM", **common))
    return GenerativeRewardModel(backend, template, k=k, aggregate=aggregate, meta_filter=meta,
                                 meta_keep=meta_keep if meta is not None else None, name=o.plugin_name, **common)


def clear_shared_genrm_backends() -> None:
    """Forget the shared judge backends (closing their clients)."""
    for backend in _SHARED.values():
        backend.close()
    _SHARED.clear()
