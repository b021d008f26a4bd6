"""Process reward models (PRMs): one score in [0, 1] per reasoning step of a completion.

Common interface (:class:`ProcessRewardModel`), batched over rows:

* ``steps(completion) -> list[StepSpan]``: how this PRM splits a completion into steps (with character spans, so a
  step boundary can be mapped back to a token of the completion);
* ``score_steps(rows, completions) -> list[list[float]]``: one list of step scores per completion;
* ``score_step_lists(rows, step_lists) -> list[list[float]]``: the same for steps split by the caller;
* ``first_error(rows, completions, threshold) -> list[int | None]``: 0-based index of the first step scored below
  ``threshold`` (None when every step reaches it).

``rows`` are dataset rows (the question is the last user message of ``row["prompt"]``; the programmatic PRM also
reads the task's problem column) or plain question strings; ``completions`` are strings or TRL's
assistant-message lists.

Backends:

* :class:`HFProcessRewardModel` -- a Hugging Face PRM loaded by name or path, **Qwen2.5-Math-PRM convention**: the
  conversation is (system prompt, user = question, assistant = the steps each followed by the step token
  ``<extra_0>``), rendered with the PRM's chat template; the step score is the probability of the positive class
  (label 1 of a two-label head) read at the positions of the step token. Models with a token-classification
  architecture load through ``AutoModelForTokenClassification``; models shipping their own class through ``auto_map``
  (Qwen2.5-Math-PRM-7B's ``Qwen2ForProcessRewardModel``) through ``AutoModel`` with ``trust_remote_code=True``.
* :class:`EndpointPRM` -- an OpenAI-compatible server, two documented JSON protocols:

  - ``protocol="pooling"`` (vLLM's pooling API, ``vllm serve Qwen/Qwen2.5-Math-PRM-7B --runner pooling``): ``POST
    {server root}/pooling`` with ``{"model", "messages"}`` (the same conversation as above); the answer's
    ``data[0].data`` holds one entry per step token, ``[p_negative, p_positive]`` (or a bare score);
  - ``protocol="chat"`` (an LLM used as a step verifier): ``POST /v1/chat/completions``; the user message gives the
    question and the steps as a JSON list, and asks for the JSON object ``{"step_scores": [s_1, ..., s_K]}``
    with one number in [0, 1] per step; the first such object in the answer is used.

  A dead server, a non-JSON answer or a wrong number of scores raises
  :class:`~trl_plugins.components.client.EndpointError` naming the URL -- never a silent default score.
* :class:`ProgrammaticPRM` -- a task's exact step verifier ``fn(problem, steps) -> scores``, named in
  :data:`STEP_VERIFIERS` (``"arithmetic"``: the bundled tasks', :func:`trl_plugins.tasks.arithmetic.prm_step_scores`,
  loaded on first use; one step per line).
* :class:`FunctionPRM` -- any callable ``fn(row, steps) -> scores`` (your own verifier).

:func:`shared_prm` builds a PRM once per configuration and hands the same instance to every plugin that asks for
it (SCOPE locating errors and Posterior-GRPO rewarding successes share one model). :func:`prm_handler` serves any
local PRM over both endpoint protocols, for tests and offline demos.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from trl_plugins.api.text import completion_text
from trl_plugins.api.errors import PluginConfigError
from trl_plugins.api.options import option
from trl_plugins.api.registry import Registry
from trl_plugins.components.client import (
    EndpointConfig,
    EndpointError,
    OpenAICompatibleClient,
    api_key_from_env,
    endpoint_options,
    local_model_loading,
)
from trl_plugins.components.local_server import QUESTION_ROWS
from trl_plugins.components.steps import StepSpan, first_error, question_text, split_steps

__all__ = [
    "QWEN_PRM_SYSTEM",
    "STEP_TOKEN",
    "STEP_VERIFIERS",
    "EndpointPRM",
    "FunctionPRM",
    "PRMOptions",
    "HFProcessRewardModel",
    "ProcessRewardModel",
    "ProgrammaticPRM",
    "arithmetic_row",
    "build_prm",
    "clear_shared_prms",
    "prm_conversation",
    "prm_from_options",
    "prm_handler",
    "shared_prm",
]

#: System prompt of Qwen2.5-Math-PRM's documented usage.
QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
#: Step token of the Qwen2.5-Math-PRM convention (appended after every step).
STEP_TOKEN = "<extra_0>"

#: Step verifiers of :class:`ProgrammaticPRM` by name, ``fn(problem, steps) -> one score in [0, 1] per step``
#: (``problem``: the row's problem column as stored). A task registers its own with ``STEP_VERIFIERS.register``.
STEP_VERIFIERS: Registry[Callable[[Any, list[str]], Sequence[float]]] = Registry(
    "programmatic PRM step verifier", {"arithmetic": "trl_plugins.tasks.arithmetic:prm_step_scores"},
    contract="fn(problem, steps: list[str]) -> list[float], one score per step",
)

CHAT_PRM_INSTRUCTIONS = (
    "You are a careful verifier of step-by-step solutions. Judge each step below on its own: is it correct "
    "given the question and the steps before it? Answer with only a JSON object of the form "
    '{"step_scores": [s_1, ..., s_K]} holding one number in [0, 1] per step (1 = certainly correct), in order.'
)


def _question(row: Any) -> str:
    if isinstance(row, str):
        return row
    return question_text(row["prompt"])


def prm_conversation(question: str, steps: Sequence[str], step_token: str = STEP_TOKEN,
                     system_prompt: str | None = QWEN_PRM_SYSTEM) -> list[dict]:
    """The PRM conversation of the Qwen2.5-Math-PRM convention: steps each followed by ``step_token``."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    messages.append({"role": "assistant", "content": "".join(s + step_token for s in steps)})
    return messages


class ProcessRewardModel:
    """Base class: subclasses implement :meth:`_score_step_lists` (batched) and set :attr:`separator`."""

    #: step separator of :meth:`steps` (Qwen2.5-Math-PRM: blank lines)
    separator: str = "\n\n"

    def steps(self, completion: Any) -> list[StepSpan]:
        """The steps of a completion (string or assistant-message list) as this PRM sees them."""
        return split_steps(completion_text(completion), self.separator)

    def score_steps(self, rows: Sequence[Any], completions: Sequence[Any]) -> list[list[float]]:
        """One score in [0, 1] per step of each completion (batched; ``len(rows) == len(completions)``)."""
        if len(rows) != len(completions):
            raise ValueError(f"score_steps: {len(rows)} rows for {len(completions)} completions.")
        return self.score_step_lists(rows, [[s.text for s in self.steps(c)] for c in completions])

    def score_step_lists(self, rows: Sequence[Any], step_lists: Sequence[Sequence[str]]) -> list[list[float]]:
        """One score in [0, 1] per given step (steps already split by the caller, e.g. a whole response as one step,
        as ReasonFlux-PRM's RL code does); an empty step list gets no scores."""
        if len(rows) != len(step_lists):
            raise ValueError(f"score_step_lists: {len(rows)} rows for {len(step_lists)} step lists.")
        step_lists = [list(steps) for steps in step_lists]
        scored = [j for j, steps in enumerate(step_lists) if steps]
        out: list[list[float]] = [[] for _ in step_lists]
        if scored:
            values = self._score_step_lists(
                [_question(rows[j]) for j in scored], [step_lists[j] for j in scored], [rows[j] for j in scored]
            )
            for j, scores in zip(scored, values):
                if len(scores) != len(step_lists[j]):
                    raise EndpointError(
                        f"{self.describe()} returned {len(scores)} step scores for a completion with "
                        f"{len(step_lists[j])} steps."
                    )
                out[j] = [float(s) for s in scores]
        return out

    def first_error(self, rows: Sequence[Any], completions: Sequence[Any], threshold: float = 0.5) -> list[int | None]:
        """0-based index of each completion's first step scored below ``threshold`` (None: no such step)."""
        return [first_error(scores, threshold) for scores in self.score_steps(rows, completions)]

    def _score_step_lists(
        self, questions: list[str], step_lists: list[list[str]], rows: list[Any]
    ) -> list[list[float]]:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__

    def close(self) -> None:
        """Release resources (HTTP loop threads)."""


# ============================================================================================= programmatic
class ProgrammaticPRM(ProcessRewardModel):
    """A task's exact step verifier, named in :data:`STEP_VERIFIERS` (default ``"arithmetic"``, the bundled tasks':
    step ``i`` scores 1.0 iff it is the exact ``i``-th reference step). Reads the row's ``problem_column`` and hands
    it to the verifier with the completion's steps, one per line."""

    separator = "\n"

    def __init__(self, problem_column: str = "problem", verifier: str | Callable = "arithmetic"):
        self.problem_column = problem_column
        self.verifier_name = verifier if isinstance(verifier, str) else getattr(verifier, "__name__", "custom")
        self.verifier = STEP_VERIFIERS.get(verifier)

    def _score_step_lists(self, questions, step_lists, rows):
        out = []
        for row, steps in zip(rows, step_lists):
            raw = row.get(self.problem_column) if isinstance(row, Mapping) else None
            if not raw:
                raise PluginConfigError(
                    f"ProgrammaticPRM needs the dataset column {self.problem_column!r} (the problem its step verifier "
                    f"{self.verifier_name!r} reads); the row has "
                    f"{sorted(row) if isinstance(row, Mapping) else type(row).__name__}."
                )
            out.append(list(self.verifier(raw, list(steps))))
        return out


class FunctionPRM(ProcessRewardModel):
    """A PRM from a callable ``fn(row, steps) -> list[float]`` (one score per step)."""

    def __init__(self, fn: Callable[[Any, list[str]], Sequence[float]], separator: str = "\n\n"):
        self.fn = fn
        self.separator = separator

    def _score_step_lists(self, questions, step_lists, rows):
        return [list(self.fn(row, steps)) for row, steps in zip(rows, step_lists)]


# ============================================================================================= Hugging Face
class HFProcessRewardModel(ProcessRewardModel):
    """A Hugging Face PRM (Qwen2.5-Math-PRM convention, see the module docstring), loaded by name or path.

    Args:
        model_name_or_path: hub name or local path (ignored when ``model`` and ``tokenizer`` are given).
        model, tokenizer: an already loaded model (logits (B, T, C) per token) and its tokenizer.
        device: where the PRM runs (default: CPU, or the model's device); keep it off the training GPU if you can.
        separator: step separator of the policy's completions.
        step_token: the token appended after each step; must be a single token of the PRM's vocabulary.
        system_prompt: system message of the PRM conversation (None: no system message).
        positive_index: the positive class of the head (scores are ``softmax(logits)[..., positive_index]``; a
            one-logit head gives ``sigmoid``).
        batch_size: conversations per forward.
        trust_remote_code: allow the model's own code (needed by Qwen2.5-Math-PRM-7B).
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        device: str | None = None,
        torch_dtype: Any = None,
        separator: str = "\n\n",
        step_token: str = STEP_TOKEN,
        system_prompt: str | None = QWEN_PRM_SYSTEM,
        positive_index: int = 1,
        batch_size: int = 8,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoTokenizer

        self.name = model_name_or_path or getattr(getattr(model, "config", None), "_name_or_path", "model")
        with local_model_loading(f"process reward model {model_name_or_path!r} (plugin option prm_model; a hub name "
                                 "or a local folder)"):
            self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
                model_name_or_path, trust_remote_code=trust_remote_code
            )
            self.model = model if model is not None else load_prm_model(
                model_name_or_path, trust_remote_code=trust_remote_code, torch_dtype=torch_dtype
            )
        if device is not None:
            self.model.to(device)
        self.model.eval()
        self.separator = separator
        self.step_token = step_token
        self.system_prompt = system_prompt
        self.positive_index = positive_index
        self.batch_size = batch_size
        ids = self.tokenizer(step_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise PluginConfigError(
                f"PRM {self.name!r}: the step token {step_token!r} is {len(ids)} tokens in its tokenizer; it must be a "
                "single token (add it as a special token)."
            )
        self.step_token_id = ids[0]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise PluginConfigError(f"PRM {self.name!r}: its tokenizer has no chat template.")

    def describe(self) -> str:
        return f"HF PRM {self.name!r}"

    def encode(self, question: str, steps: Sequence[str]) -> list[int]:
        """Token ids of the PRM conversation (chat template applied, no generation prompt)."""
        for s in steps:
            if self.step_token in s:
                raise PluginConfigError(f"PRM {self.name!r}: a step contains the step token {self.step_token!r}.")
        text = self.tokenizer.apply_chat_template(
            prm_conversation(question, steps, self.step_token, self.system_prompt), tokenize=False,
            add_generation_prompt=False,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _score_step_lists(self, questions, step_lists, rows):
        import torch

        encoded = [self.encode(q, steps) for q, steps in zip(questions, step_lists)]
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        out: list[list[float]] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, ids in enumerate(chunk):  # right padding: positions of real tokens do not move
                input_ids[j, : len(ids)] = torch.tensor(ids)
                attention[j, : len(ids)] = 1
            with torch.inference_mode():
                output = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device))
            logits = output.logits if hasattr(output, "logits") else output[0]
            logits = logits.float()
            for j, ids in enumerate(chunk):
                positions = (input_ids[j, : len(ids)] == self.step_token_id).nonzero().flatten().to(logits.device)
                step_logits = logits[j, positions]
                if step_logits.size(-1) == 1:
                    probs = torch.sigmoid(step_logits[:, 0])
                else:
                    probs = torch.softmax(step_logits, dim=-1)[:, self.positive_index]
                out.append(probs.cpu().tolist())
        return out


def load_prm_model(name_or_path: str, *, trust_remote_code: bool = False, torch_dtype: Any = None):
    """Load a PRM by name or path: a ``*ForTokenClassification`` architecture through
    ``AutoModelForTokenClassification``; a model shipping its own class (``auto_map``, e.g. Qwen2.5-Math-PRM-7B's
    ``Qwen2ForProcessRewardModel``) through ``AutoModel`` with ``trust_remote_code``. Anything else is refused (a
    plain causal LM would silently get a randomly initialised head)."""
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

    from trl_plugins.api.engines import whole_model_loading

    with whole_model_loading():  # frozen: whole on every process, also under ZeRO-3 (never partitioned)
        return _load_prm_model(name_or_path, AutoConfig, AutoModel, AutoModelForTokenClassification,
                               trust_remote_code=trust_remote_code, torch_dtype=torch_dtype)


def _load_prm_model(name_or_path, AutoConfig, AutoModel, AutoModelForTokenClassification, *,
                    trust_remote_code: bool, torch_dtype: Any):
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    auto_map = getattr(config, "auto_map", None) or {}
    kwargs = {"trust_remote_code": trust_remote_code}
    if torch_dtype is not None:
        kwargs["torch_dtype"] = torch_dtype
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return AutoModelForTokenClassification.from_pretrained(name_or_path, **kwargs)
    if "AutoModel" in auto_map:
        if not trust_remote_code:
            raise PluginConfigError(
                f"PRM {name_or_path!r} ships its own model class ({auto_map['AutoModel']}); loading it runs that code. "
                "Set trust_remote_code (plugin option prm_trust_remote_code: true) if you trust it."
            )
        return AutoModel.from_pretrained(name_or_path, **kwargs)
    raise PluginConfigError(
        f"PRM {name_or_path!r} has architectures {architectures or '(none)'}: expected a *ForTokenClassification model "
        "or a model with its own PRM class in auto_map (Qwen2.5-Math-PRM convention)."
    )


# ============================================================================================= endpoint
def _server_root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class EndpointPRM(ProcessRewardModel):
    """A PRM behind an OpenAI-compatible server (protocols ``"pooling"`` and ``"chat"``, see the module docstring)."""

    def __init__(
        self,
        config: EndpointConfig,
        *,
        protocol: str = "pooling",
        separator: str = "\n\n",
        step_token: str = STEP_TOKEN,
        system_prompt: str | None = QWEN_PRM_SYSTEM,
        positive_index: int = 1,
        pooling_path: str = "/pooling",
    ):
        if protocol not in ("pooling", "chat"):
            raise PluginConfigError(f"EndpointPRM: protocol {protocol!r}; allowed: 'pooling', 'chat'.")
        self.config = config
        self.protocol = protocol
        self.separator = separator
        self.step_token = step_token
        self.system_prompt = system_prompt
        self.positive_index = positive_index
        self.pooling_path = pooling_path
        self.client = OpenAICompatibleClient(config)
        root = EndpointConfig(**{**config.__dict__, "base_url": _server_root(config.base_url)})
        self._root_client = OpenAICompatibleClient(root)

    def describe(self) -> str:
        return f"PRM endpoint {self.config.base_url}"

    def _score_step_lists(self, questions, step_lists, rows):
        if self.protocol == "pooling":
            return self._pooling(questions, step_lists)
        return self._chat(questions, step_lists)

    def _pooling(self, questions, step_lists):
        client = self._root_client
        url = f"{client.base_url}/{self.pooling_path.lstrip('/')}"

        def make(question, steps):
            async def call(http):
                payload = {
                    "model": self.config.model,
                    "messages": prm_conversation(question, steps, self.step_token, self.system_prompt),
                }
                body = await client.post_json(http, self.pooling_path, payload)
                return _parse_pooling(body, len(steps), self.positive_index, url)

            return call

        return client.run([make(q, s) for q, s in zip(questions, step_lists)])

    def _chat(self, questions, step_lists):
        conversations = [
            [{"role": "system", "content": CHAT_PRM_INSTRUCTIONS},
             {"role": "user", "content": chat_prm_prompt(q, steps)}]
            for q, steps in zip(questions, step_lists)
        ]
        answers = self.client.chat(conversations, temperature=0.0)
        url = f"{self.client.base_url}/chat/completions"
        return [_parse_chat_scores(a, len(s), url) for a, s in zip(answers, step_lists)]

    def close(self) -> None:
        self.client.close()
        self._root_client.close()


def chat_prm_prompt(question: str, steps: Sequence[str]) -> str:
    """User message of the ``chat`` protocol: the question, then the steps as a JSON list."""
    return f"## Question\n{question}\n\n## Steps (JSON list, in order)\n{json.dumps(list(steps))}"


def _score_value(entry: Any, positive_index: int) -> float:
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return float(entry)
    if isinstance(entry, list) and entry and all(isinstance(x, (int, float)) for x in entry):
        return float(entry[positive_index]) if len(entry) > 1 else float(entry[0])
    raise ValueError(f"unexpected step entry {entry!r}")


def _parse_pooling(body: Any, n_steps: int, positive_index: int, url: str) -> list[float]:
    try:
        data = body["data"][0]["data"]
        scores = [_score_value(entry, positive_index) for entry in data]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EndpointError(
            f"{url} answered without per-step scores in data[0].data: {json.dumps(body)[:200]}"
        ) from exc
    if len(scores) != n_steps:
        raise EndpointError(f"{url} returned {len(scores)} step scores for {n_steps} steps.")
    return scores


_SCORES_RE = re.compile(r"\{[^{}]*\"step_scores\"[^{}]*\}", re.DOTALL)


def _parse_chat_scores(text: str, n_steps: int, url: str) -> list[float]:
    for match in _SCORES_RE.finditer(text or ""):
        try:
            values = json.loads(match.group(0))["step_scores"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            if len(values) != n_steps:
                raise EndpointError(f"{url} returned {len(values)} step scores for {n_steps} steps: {text[:200]!r}")
            return [min(max(float(v), 0.0), 1.0) for v in values]
    raise EndpointError(f"{url} answered without a JSON object {{\"step_scores\": [...]}}: {(text or '')[:200]!r}")


# ============================================================================================= factory
_SHARED: dict[tuple, ProcessRewardModel] = {}


def build_prm(
    kind: str,
    *,
    model: str = "Qwen/Qwen2.5-Math-PRM-7B",
    base_url: str | None = None,
    protocol: str = "pooling",
    api_key_env: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    separator: str | None = None,
    problem_column: str = "problem",
    verifier: str = "arithmetic",
    timeout: float = 60.0,
    max_retries: int = 4,
) -> ProcessRewardModel:
    """Build a PRM from plugin options.

    Args:
        kind: ``"hf"`` (``model`` = name or path), ``"endpoint"`` (``base_url`` + ``model`` = served name,
            ``protocol``), or ``"programmatic"`` (the step verifier named ``verifier`` in :data:`STEP_VERIFIERS`,
            reading the column ``problem_column``).
        separator: step separator (default: ``"\\n\\n"`` for hf/endpoint, one line for programmatic).
        api_key_env: name of an environment variable holding the endpoint's API key.
        timeout, max_retries: per-request timeout in seconds and retries with backoff (endpoint only; see
            :class:`~trl_plugins.components.client.EndpointConfig`).
    """
    if kind == "programmatic":
        prm = ProgrammaticPRM(problem_column, verifier)
        if separator is not None and separator != "\n":
            raise PluginConfigError("The programmatic PRM scores one step per line; its separator is '\\n'.")
        return prm
    sep = "\n\n" if separator is None else separator
    if kind == "hf":
        return HFProcessRewardModel(model, device=device, separator=sep, trust_remote_code=trust_remote_code)
    if kind == "endpoint":
        if not base_url:
            raise PluginConfigError("A PRM endpoint needs a base URL (option prm_base_url, e.g. http://host:8000/v1).")
        config = EndpointConfig(base_url=base_url, model=model, api_key=api_key_from_env(api_key_env), timeout=timeout,
                                max_retries=max_retries)
        return EndpointPRM(config, protocol=protocol, separator=sep)
    raise PluginConfigError(f"Unknown PRM kind {kind!r}; allowed: 'hf', 'endpoint', 'programmatic'.")




def shared_prm(kind: str, **kwargs: Any) -> ProcessRewardModel:
    """:func:`build_prm`, built once per distinct configuration: plugins asking for the same PRM share one instance
    (one model in memory, one HTTP client)."""
    key = (kind, tuple(sorted(kwargs.items())))
    if key not in _SHARED:
        _SHARED[key] = build_prm(kind, **kwargs)
    return _SHARED[key]


#: ``prm_model``, ``prm_base_url``, ``prm_api_key_env``, ``prm_timeout``, ``prm_max_retries``.
PRMEndpointOptions = endpoint_options("prm", "PRM", model="Qwen/Qwen2.5-Math-PRM-7B", model_reconstructed=True,
                                      model_help="PRM name/path, or served name.", timeout=60.0)


@dataclass
class PRMOptions(PRMEndpointOptions):
    """The PRM options shared by the plugins that score steps (scope, posterior_grpo); their option dataclasses
    derive from this one, set ``plugin_name`` and call ``super().validate()`` from their own checks."""

    plugin_name: ClassVar[str] = "?"

    prm: Literal["hf", "endpoint", "programmatic"] = option(
        "hf", reconstructed=True,
        help="PRM: an HF model by name/path (Qwen2.5-Math-PRM convention), an endpoint, or a task's programmatic "
        "step verifier (prm_verifier).",
    )
    prm_verifier: str = option(
        "arithmetic",
        help="prm='programmatic': the step verifier by name (components.prm.STEP_VERIFIERS; 'arithmetic' = the bundled "
        "tasks', reading their 'problem' column) or 'package.module:function' (fn(problem, steps) -> scores).",
    )
    prm_protocol: Literal["pooling", "chat"] = option("pooling", help="PRM endpoint protocol (see components.prm).")
    prm_device: str | None = option(None, help="Device of an HF PRM (None: CPU).")
    prm_trust_remote_code: bool = option(False, help="Allow an HF PRM's own model code (Qwen2.5-Math-PRM-7B needs it).")

    def validate(self) -> None:
        self.require_base_url("prm", self.plugin_name, otherwise="prm='hf' or 'programmatic'")
        if self.prm == "programmatic":
            STEP_VERIFIERS.check(self.prm_verifier, f"Option 'prm_verifier' of plugin {self.plugin_name!r}: ")


def prm_from_options(o: PRMOptions) -> ProcessRewardModel:
    """The shared PRM described by plugin options named ``prm`` (kind), ``prm_verifier``, ``prm_model``,
    ``prm_base_url``, ``prm_protocol``, ``prm_api_key_env``, ``prm_timeout``, ``prm_max_retries``, ``prm_device``,
    ``prm_trust_remote_code``, ``step_separator`` and ``problem_column`` -- plugins with equal PRM options get the
    same instance (SCOPE and Posterior-GRPO)."""
    kwargs: dict[str, Any] = {"separator": o.step_separator}
    if o.prm == "programmatic":
        kwargs.update(problem_column=o.problem_column, verifier=o.prm_verifier)
    elif o.prm == "hf":
        kwargs.update(model=o.prm_model, device=o.prm_device, trust_remote_code=o.prm_trust_remote_code)
    else:
        kwargs.update(o.endpoint_kwargs("prm"), protocol=o.prm_protocol)
    return shared_prm(o.prm, **kwargs)


def clear_shared_prms() -> None:
    """Forget the shared PRMs (closing their clients)."""
    for prm in _SHARED.values():
        prm.close()
    _SHARED.clear()


# ============================================================================================= test / demo server
def arithmetic_row(question: str) -> dict:
    """A dataset row (``prompt``, ``problem`` and the other columns) rebuilt from a bundled arithmetic question, e.g.
    ``"Compute 3+4*2 step by step (left to right)."`` -- lets a PRM server grade with :class:`ProgrammaticPRM` from
    the question alone (``QUESTION_ROWS["arithmetic"]`` of :mod:`~trl_plugins.components.local_server`)."""
    return QUESTION_ROWS.get("arithmetic")(question)


def prm_handler(prm: ProcessRewardModel, row_of: Callable[[str], Any] = arithmetic_row,
                step_token: str = STEP_TOKEN, seen: list | None = None):
    """An HTTP handler for :func:`~trl_plugins.components.local_server.serve_openai_compatible` that serves ``prm``
    over both :class:`EndpointPRM` protocols (``/pooling`` and ``/v1/chat/completions``). ``row_of(question)`` rebuilds
    the row the local PRM needs; ``seen`` collects ``(path, question, steps)`` of every request."""
    from trl_plugins.components.local_server import chat_response

    def handler(path: str, payload: dict):
        if path.rstrip("/").endswith("/pooling"):
            messages = payload["messages"]
            question = next(m["content"] for m in messages if m["role"] == "user")
            body = next(m["content"] for m in messages if m["role"] == "assistant")
            steps = body.split(step_token)
            if steps and steps[-1] == "":
                steps = steps[:-1]
            scores = prm._score_step_lists([question], [steps], [row_of(question)])[0]
            if seen is not None:
                seen.append((path, question, steps))
            return {"object": "list", "data": [{"index": 0, "object": "pooling",
                                                "data": [[1.0 - s, s] for s in scores]}]}
        if path.rstrip("/").endswith("/chat/completions"):
            user = payload["messages"][-1]["content"]
            question = user.split("## Question\n", 1)[1].split("\n\n## Steps", 1)[0]
            steps = json.loads(user.split("(JSON list, in order)\n", 1)[1])
            scores = prm._score_step_lists([question], [steps], [row_of(question)])[0]
            if seen is not None:
                seen.append((path, question, steps))
            return chat_response("Scores:\n```json\n" + json.dumps({"step_scores": scores}) + "\n```")
        return 404, {"error": f"unknown route {path}"}

    return handler
