"""Teachers / correctors: who writes off-policy text for the policy.

Common interface (:class:`Teacher`), batched:

* ``continue_from(rows, prompts, prefixes, stop=None, max_tokens=None) -> list[str]``: continue an assistant turn
  that starts with ``prefix`` (the policy's verified prefix) after the conversation ``prompt``; returns only the
  continuation text. ``stop`` strings end it early (excluded from the result) -- e.g. the step separator to write a
  single corrected step.
* ``chat(conversations, max_tokens=None) -> list[str]``: one assistant answer per conversation (critiques, judge
  feedback).
* ``logprobs(prompt_ids, completion_ids) -> list[Tensor]``: the teacher's per-token log-probs of given completions
  (policy token ids; one (len(completion_ids[i]),) float32 CPU tensor per row), for dense teacher supervision.
  ``check_logprobs(policy_tokenizer)`` refuses, when the trainer is built, a teacher that cannot return them or does
  not share the policy's tokenizer (:mod:`trl_plugins.components.teacher_logprobs`).

Plugins configure a teacher with the option mixin :class:`TeacherOptions` (kind, model, endpoint, retries, device) and
build the shared instance with :func:`teacher_from_options`.

The continuation is plain text: callers re-tokenize it with the **policy** tokenizer (the tokens are off-policy
anyway).

Backends:

* :class:`EndpointTeacher` -- an OpenAI-compatible server (``vllm serve``). Continuation uses
  ``/v1/chat/completions`` with the prefix as a final assistant message and vLLM's chat parameters
  ``continue_final_message=true, add_generation_prompt=false`` (the answer holds only the new text).
* :class:`HFTeacher` -- a local Hugging Face causal LM loaded by name or path; the prefix is appended to the
  chat-templated conversation (generation prompt on), token for token.
* :class:`ReferenceTeacher` -- the dataset's reference solution (column ``solution``): the continuation of a prefix
  with ``k`` complete steps is the reference solution from its step ``k`` on. No model; cannot ``chat``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.api.options import option
from trl_plugins.components.client import (EndpointConfig, OpenAICompatibleClient, api_key_from_env, endpoint_options,
                                         local_model_loading)
from trl_plugins.components.steps import split_steps
from trl_plugins.components.teacher_logprobs import (
    ECHO_PARAMS,
    check_same_tokenizer,
    hf_completion_logprobs,
    parse_echo_logprobs,
    probe_endpoint,
)

__all__ = [
    "EndpointTeacher",
    "HFTeacher",
    "ReferenceTeacher",
    "Teacher",
    "TeacherOptions",
    "build_teacher",
    "clear_shared_teachers",
    "continuation_messages",
    "cut_at_stop",
    "shared_teacher",
    "teacher_from_options",
]


def continuation_messages(prompt: Any, prefix: str) -> list[dict]:
    """The conversation ``prompt`` (messages, or a user string) followed by the open assistant turn ``prefix``."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return messages + [{"role": "assistant", "content": prefix}]


def cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """``text`` up to (excluding) the earliest occurrence of any ``stop`` string."""
    if not stop:
        return text
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


class Teacher:
    """Base class of teachers (see the module docstring)."""

    def continue_from(self, rows: Sequence[Any], prompts: Sequence[Any], prefixes: Sequence[str], *,
                      stop: Sequence[str] | None = None, max_tokens: int | None = None) -> list[str]:
        raise NotImplementedError

    def chat(self, conversations: Sequence[list[dict]], *, max_tokens: int | None = None) -> list[str]:
        raise PluginConfigError(f"{type(self).__name__} cannot answer free-form chat requests (critiques, feedback).")

    def logprobs(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list:
        """Per-token log-probs of ``completion_ids[i]`` after ``prompt_ids[i]`` (policy token ids) under the teacher:
        one (len(completion_ids[i]),) float32 CPU tensor per row."""
        raise PluginConfigError(self._no_logprobs())

    def check_logprobs(self, policy_tokenizer: Any, probe: bool = True) -> None:
        """Refuse a teacher that cannot score the policy's tokens (``PluginConfigError``; an endpoint that does not
        answer: ``EndpointError`` naming its URL); called at construction. ``probe=False`` skips network requests."""
        raise PluginConfigError(self._no_logprobs())

    def _no_logprobs(self) -> str:
        return (f"{type(self).__name__} cannot return per-token log-probs (it has no model); use a local model "
                "(teacher 'hf') or an OpenAI-compatible endpoint serving the policy's tokenizer ('endpoint').")

    def close(self) -> None:
        """Release resources."""


# ============================================================================================= endpoint
class EndpointTeacher(Teacher):
    """A teacher LLM behind an OpenAI-compatible server.

    Args:
        config: server URL, served model name, retries, concurrency (see :class:`EndpointConfig`).
        temperature: sampling temperature of the teacher.
        max_tokens: default length limit of an answer.
        extra_params: extra JSON fields sent with every request (e.g. ``{"top_p": 0.95}``).
    """

    def __init__(self, config: EndpointConfig, *, temperature: float = 0.0, max_tokens: int = 1024,
                 extra_params: Mapping[str, Any] | None = None):
        self.config = config
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_params = dict(extra_params or {})
        self.client = OpenAICompatibleClient(config)
        self._scoring: OpenAICompatibleClient | None = None

    def continue_from(self, rows, prompts, prefixes, *, stop=None, max_tokens=None):
        if not prefixes:
            return []
        params = {
            "continue_final_message": True,
            "add_generation_prompt": False,
            "temperature": self.temperature,
            "max_tokens": max_tokens or self.max_tokens,
            **self.extra_params,
        }
        if stop:
            params["stop"] = list(stop)
        conversations = [continuation_messages(p, x) for p, x in zip(prompts, prefixes)]
        return [cut_at_stop(text, stop) for text in self.client.chat(conversations, **params)]

    def chat(self, conversations, *, max_tokens=None):
        if not conversations:
            return []
        params = {"temperature": self.temperature, "max_tokens": max_tokens or self.max_tokens, **self.extra_params}
        return self.client.chat([list(c) for c in conversations], **params)

    def logprobs(self, prompt_ids, completion_ids):
        """Prompt log-probs of ``prompt + completion`` through ``/v1/completions`` (echo protocol, one request per
        row, concurrent); the completion positions are kept."""
        import torch

        if self._scoring is None:  # no response cache: scored completions rarely repeat, and the cache never shrinks
            self._scoring = OpenAICompatibleClient(EndpointConfig(**{**self.config.__dict__, "cache": False}))
        rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        todo = [j for j, c in enumerate(completion_ids) if len(c)]
        choices = self._scoring.completions([rows[j] for j in todo], **ECHO_PARAMS) if todo else []
        out = [torch.zeros(0) for _ in rows]
        url = f"{self.client.base_url}/completions"
        for j, choice in zip(todo, choices):
            out[j] = torch.tensor(parse_echo_logprobs(choice, rows[j], len(prompt_ids[j]), url), dtype=torch.float32)
        return out

    def check_logprobs(self, policy_tokenizer, probe: bool = True):
        """With ``probe``: one echo request (:func:`~trl_plugins.components.teacher_logprobs.probe_endpoint`)."""
        if probe:
            probe_endpoint(self.client, policy_tokenizer)

    def close(self) -> None:
        self.client.close()
        if self._scoring is not None:
            self._scoring.close()


# ============================================================================================= Hugging Face
class HFTeacher(Teacher):
    """A local causal LM teacher, loaded by name or path (or given as ``model`` + ``tokenizer``).

    Generation is greedy at ``temperature=0`` and plain sampling otherwise; prompts are left-padded in batches.
    """

    def __init__(self, model_name_or_path: str | None = None, *, model: Any = None, tokenizer: Any = None,
                 device: str | None = None, temperature: float = 0.0, max_tokens: int = 256, batch_size: int = 8,
                 role: str = "teacher model"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = model_name_or_path or getattr(getattr(model, "config", None), "_name_or_path", "model")
        with local_model_loading(f"{role} {model_name_or_path!r}"):
            self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_name_or_path)
            if model is None:
                from trl_plugins.api.engines import whole_model_loading

                with whole_model_loading():  # frozen: whole on every process, also under ZeRO-3
                    model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
        self.model = model
        if device is not None:
            self.model.to(device)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise PluginConfigError(f"Teacher {self.name!r}: its tokenizer has no chat template.")

    def _prompt_ids(self, conversation: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)
        return list(out["input_ids"])

    def continue_from(self, rows, prompts, prefixes, *, stop=None, max_tokens=None):
        requests = []
        for prompt, prefix in zip(prompts, prefixes):
            messages = continuation_messages(prompt, prefix)[:-1]
            ids = self._prompt_ids(messages) + list(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])
            requests.append(ids)
        return [cut_at_stop(t, stop) for t in self._generate(requests, max_tokens or self.max_tokens)]

    def chat(self, conversations, *, max_tokens=None):
        return self._generate([self._prompt_ids(list(c)) for c in conversations], max_tokens or self.max_tokens)

    def logprobs(self, prompt_ids, completion_ids):
        """One no-grad forward per batch (:func:`~trl_plugins.components.teacher_logprobs.hf_completion_logprobs`)."""
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return hf_completion_logprobs(self.model, prompt_ids, completion_ids, pad, self.batch_size)

    def check_logprobs(self, policy_tokenizer, probe: bool = True):
        check_same_tokenizer(self.tokenizer, policy_tokenizer, f"model {self.name!r}")

    def _generate(self, requests: list[list[int]], max_tokens: int) -> list[str]:
        import torch

        from trl_plugins.api.engines import LOCAL_GENERATE_KWARGS  # this process only: never synced across processes

        if not requests:
            return []
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        device = next(self.model.parameters()).device
        texts: list[str] = []
        was_training = self.model.training
        self.model.eval()
        sampling = {"do_sample": False} if self.temperature <= 0 else {
            "do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            width = max(len(r) for r in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros_like(input_ids)
            for j, ids in enumerate(chunk):
                input_ids[j, width - len(ids):] = torch.tensor(ids)
                attention[j, width - len(ids):] = 1
            with torch.no_grad():
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                          max_new_tokens=max_tokens, pad_token_id=pad,
                                          eos_token_id=tok.eos_token_id, **sampling, **LOCAL_GENERATE_KWARGS)
            texts.extend(tok.batch_decode(out[:, width:], skip_special_tokens=True))
        self.model.train(was_training)
        return texts


# ============================================================================================= reference
class ReferenceTeacher(Teacher):
    """The dataset's reference solution as the corrector.

    A prefix with ``k`` complete steps (split with ``separator``) is continued by the reference solution's steps
    ``k, k+1, ...`` joined by ``separator`` (a separator is put first when the prefix does not end with one). With
    ``stop``, only the text before the first stop string -- with ``stop=[separator]``, exactly the reference step ``k``.
    """

    def __init__(self, solution_column: str = "solution", separator: str = "\n\n"):
        self.solution_column = solution_column
        self.separator = separator

    def continue_from(self, rows, prompts, prefixes, *, stop=None, max_tokens=None):
        out = []
        for row, prefix in zip(rows, prefixes):
            solution = row.get(self.solution_column) if isinstance(row, Mapping) else None
            if not isinstance(solution, str) or not solution.strip():
                raise PluginConfigError(
                    f"ReferenceTeacher: the row has no reference solution in column {self.solution_column!r}."
                )
            reference = [s.text for s in split_steps(solution, self.separator)]
            done = len(split_steps(prefix, self.separator))
            body = cut_at_stop(self.separator.join(reference[done:]), stop)
            lead = self.separator if prefix.strip() and body and not prefix.endswith(self.separator) else ""
            out.append(lead + body)
        return out


# ============================================================================================= factory
_SHARED: dict[tuple, Teacher] = {}


def build_teacher(
    kind: str,
    *,
    model: str = "default",
    base_url: str | None = None,
    api_key_env: str | None = None,
    device: str | None = None,
    temperature: float = 0.0,
    max_tokens: int = 1024,
    solution_column: str = "solution",
    separator: str = "\n\n",
    timeout: float = 120.0,
    max_retries: int = 4,
) -> Teacher:
    """Build a teacher from plugin options: ``"endpoint"`` (``base_url``, ``model`` = served name), ``"hf"``
    (``model`` = name or path) or ``"reference"`` (``solution_column``, ``separator``). ``timeout`` (seconds per
    request) and ``max_retries`` (retries with backoff on 429/5xx/connection errors) apply to endpoints."""
    if kind == "reference":
        return ReferenceTeacher(solution_column, separator)
    if kind == "hf":
        return HFTeacher(model, device=device, temperature=temperature, max_tokens=max_tokens)
    if kind == "endpoint":
        if not base_url:
            raise PluginConfigError(
                "A teacher endpoint needs a base URL (e.g. http://host:8000/v1); or use a local model ('hf') or the "
                "dataset's reference solutions ('reference')."
            )
        config = EndpointConfig(base_url=base_url, model=model, api_key=api_key_from_env(api_key_env), timeout=timeout,
                                max_retries=max_retries)
        return EndpointTeacher(config, temperature=temperature, max_tokens=max_tokens)
    raise PluginConfigError(f"Unknown teacher kind {kind!r}; allowed: 'endpoint', 'hf', 'reference'.")


def shared_teacher(kind: str, **kwargs: Any) -> Teacher:
    """:func:`build_teacher`, built once per distinct configuration (one local model in memory)."""
    key = (kind, tuple(sorted(kwargs.items())))
    if key not in _SHARED:
        _SHARED[key] = build_teacher(kind, **kwargs)
    return _SHARED[key]


def clear_shared_teachers() -> None:
    for teacher in _SHARED.values():
        teacher.close()
    _SHARED.clear()


# ============================================================================================= plugin options
#: ``teacher_model``, ``teacher_base_url``, ``teacher_api_key_env``, ``teacher_timeout``, ``teacher_max_retries``.
TeacherEndpointOptions = endpoint_options("teacher", "teacher")


@dataclass
class TeacherOptions(TeacherEndpointOptions):
    """The teacher options of plugins that use a teacher model (generation, hints, log-probs); their option
    dataclasses derive from this one, set ``plugin_name`` and call ``super().validate()`` from their own checks."""

    plugin_name: ClassVar[str] = "?"

    teacher: Literal["hf", "endpoint"] = option(
        "hf", help="Teacher: a local Hugging Face model by name/path (teacher_model), or an OpenAI-compatible server "
        "(teacher_base_url; log-probs through the completions API's echo protocol, as `vllm serve` answers it).",
    )
    teacher_device: str | None = option(None, help="Device of a local (hf) teacher (None: the run's device).")
    teacher_temperature: float = option(0.0, min=0.0, help="Sampling temperature of the teacher's generations.")
    teacher_max_tokens: int = option(256, min=1, help="Longest teacher generation (hint, demonstration) in tokens.")
    teacher_probe: bool = option(
        True, help="Plugins reading teacher log-probs: at construction, send one echo request to a teacher endpoint "
        "to check that it returns log-probs and tokenizes like the policy (False: skip; a server started later then "
        "fails at its first request instead).",
    )

    def validate(self) -> None:
        self.require_base_url("teacher", self.plugin_name, otherwise="teacher='hf' with teacher_model")
        if self.teacher == "hf" and self.teacher_model == "default":
            raise PluginConfigError(
                f"Plugin {self.plugin_name!r} with teacher='hf' needs teacher_model (a model name or path whose "
                "tokenizer is the policy's)."
            )


def teacher_from_options(o: TeacherOptions, device: Any = None) -> Any:
    """The shared teacher (:func:`~trl_plugins.components.teacher.shared_teacher`) described by :class:`TeacherOptions`;
    ``device`` places a local teacher when ``teacher_device`` is None (the run's device)."""
    kwargs: dict[str, Any] = dict(model=o.teacher_model, temperature=o.teacher_temperature,
                                  max_tokens=o.teacher_max_tokens)
    if o.teacher == "hf":
        where = o.teacher_device if o.teacher_device is not None else device
        kwargs["device"] = None if where is None else str(where)
    else:
        kwargs.update(o.endpoint_kwargs("teacher"))
    return shared_teacher(o.teacher, **kwargs)
