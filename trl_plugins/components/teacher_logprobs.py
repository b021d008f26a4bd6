"""Teacher log-probs: per-token log-probabilities of given completions under a teacher model.

The policy's completion tokens are scored by the teacher **token for token**, so the teacher must use the policy's
tokenizer; a mismatch is refused when the trainer is built (:func:`check_same_tokenizer`, :func:`probe_endpoint`).

Backends (methods of the teachers in :mod:`trl_plugins.components.teacher`, ``teacher.logprobs(prompt_ids,
completion_ids)``):

* a local Hugging Face causal LM (:class:`~trl_plugins.components.teacher.HFTeacher`): one no-grad forward over
  ``prompt + completion`` in TRL's layout (prompts left-padded, completions right-padded), log-softmax of the raw
  logits (temperature 1), the completion tokens gathered (:func:`hf_completion_logprobs`);
* an OpenAI-compatible endpoint (:class:`~trl_plugins.components.teacher.EndpointTeacher`) through the completions
  API's prompt log-probs, as ``vllm serve`` answers them: ``POST /v1/completions`` with the token ids as ``prompt``,
  ``echo=true``, ``logprobs=1``, ``max_tokens=0`` (:data:`ECHO_PARAMS`); the answer's
  ``choices[0].logprobs.token_logprobs`` holds one log-prob per prompt token (the first is null), of which the
  completion positions are kept (:func:`parse_echo_logprobs`; vLLM's ``choices[0].prompt_logprobs`` is read too).
  Failures are retried with backoff by the HTTP client, then an ``EndpointError`` names the URL.

:func:`teacher_logprob_handler` answers that protocol from a local model on the loopback test server
(:func:`~trl_plugins.components.local_server.serve_openai_compatible`), so the endpoint path is tested against the
same numbers as the local one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.api.model_utils import prompt_completion_batch
from trl_plugins.components.client import EndpointError

__all__ = [
    "PROBE_TEXT",
    "check_same_tokenizer",
    "ECHO_PARAMS",
    "hf_completion_logprobs",
    "parse_echo_logprobs",
    "probe_endpoint",
    "teacher_logprob_handler",
]

#: Text whose tokenization the endpoint probe compares between teacher and policy (ASCII: every tokenizer's tokens
#: of it decode to themselves).
PROBE_TEXT = "Compute 12+34*5 step by step. The answer is 182."
_TOKEN_ID_RE = re.compile(r"^token_id:(\d+)$")


# ============================================================================================= tokenizer check
def check_same_tokenizer(teacher_tokenizer: Any, policy_tokenizer: Any, teacher: str) -> None:
    """Refuse a teacher whose tokenizer differs from the policy's (its log-probs would score other tokens).

    Compares the vocabularies (token -> id, added tokens included) and the EOS id; the error names the first
    difference. ``teacher`` names the teacher in the message (its path or URL).
    """
    teacher_vocab, policy_vocab = teacher_tokenizer.get_vocab(), policy_tokenizer.get_vocab()
    reason = None
    if len(teacher_vocab) != len(policy_vocab):
        reason = f"vocabulary sizes differ ({len(teacher_vocab)} teacher tokens, {len(policy_vocab)} policy tokens)"
    else:
        for token, index in sorted(policy_vocab.items(), key=lambda kv: kv[1]):
            if teacher_vocab.get(token) != index:
                reason = (f"token {token!r} has id {index} for the policy but "
                          f"{teacher_vocab.get(token)!r} for the teacher")
                break
    if reason is None and teacher_tokenizer.eos_token_id != policy_tokenizer.eos_token_id:
        reason = (f"the EOS ids differ ({teacher_tokenizer.eos_token_id} teacher, "
                  f"{policy_tokenizer.eos_token_id} policy)")
    if reason:
        raise PluginConfigError(
            f"The teacher {teacher} does not share the policy's tokenizer: {reason}. Teacher log-probs are taken "
            "token for token on the policy's completions, so the teacher must use the same tokenizer (e.g. a larger "
            "model of the same family)."
        )


# ============================================================================================= local model
def hf_completion_logprobs(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int = 8,
) -> list[torch.Tensor]:
    """No-grad log pi_teacher(completion_ids[i][t] | prompt, completion[:t]) for every row (raw logits, temperature 1).

    Rows are batched in TRL's layout (:func:`~trl_plugins.api.model_utils.prompt_completion_batch`). Returns one
    (len(completion_ids[i]),) float32 CPU tensor per row (an empty completion gives an empty tensor).
    """
    out: list[torch.Tensor] = []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(completion_ids), batch_size):
            prompts = [list(p) or [pad_id] for p in prompt_ids[start:start + batch_size]]
            completions = [list(c) for c in completion_ids[start:start + batch_size]]
            input_ids, attention_mask, c_len = prompt_completion_batch(
                prompts, [c or [pad_id] for c in completions], pad_id, device)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # padding never shifts a row's positions
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            p_len = input_ids.size(1) - c_len
            logps = torch.log_softmax(logits[:, p_len - 1:-1].float(), dim=-1)  # position j predicts token P + j
            labels = input_ids[:, p_len:]
            token_logps = logps.gather(-1, labels.unsqueeze(-1)).squeeze(-1).cpu()
            out.extend(token_logps[j, :len(c)].clone() for j, c in enumerate(completions))
    finally:
        model.train(was_training)
    return out


# ============================================================================================= endpoint protocol
#: Parameters of a ``/v1/completions`` request for prompt log-probs (vLLM's echo protocol): the prompt (token ids or
#: text) is echoed with one log-prob per token and nothing is generated. ``return_tokens_as_token_ids`` (a vLLM
#: extension, ignored elsewhere) makes the echoed tokens ``"token_id:N"``, so the alignment with the ids sent is checked.
ECHO_PARAMS: dict[str, Any] = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 1.0,
                               "return_tokens_as_token_ids": True}


def _echoed_token_ids(choice: dict) -> list[int] | None:
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if not isinstance(tokens, list):
        return None
    ids = [_TOKEN_ID_RE.match(t) if isinstance(t, str) else None for t in tokens]
    return [int(m.group(1)) for m in ids] if all(ids) else None


def parse_echo_logprobs(choice: dict, token_ids: Sequence[int], n_prompt: int, url: str) -> list[float]:
    """The log-probs of ``token_ids[n_prompt:]`` from one ``choices[i]`` of an echo answer.

    Reads ``logprobs.token_logprobs`` (OpenAI's field; one entry per prompt token, the first null; a server that
    still generated a token adds entries after them) or else vLLM's ``prompt_logprobs`` (one ``{token_id: {logprob}}``
    dict per prompt token). Raises ``EndpointError`` naming ``url`` when neither holds a finite log-prob for every
    completion token, or when the echoed token ids differ from the ids sent.
    """
    n_total = len(token_ids)
    echoed = _echoed_token_ids(choice)
    if echoed is not None and echoed[:n_total] != list(token_ids):
        raise EndpointError(f"{url} echoed other tokens than the ids sent (first 8: {echoed[:8]} vs "
                            f"{list(token_ids)[:8]}); is it serving the policy's tokenizer?")
    values: list[Any] | None = None
    token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if isinstance(token_logprobs, list) and len(token_logprobs) >= n_total:
        values = token_logprobs[n_prompt:n_total]
    elif isinstance(choice.get("prompt_logprobs"), list) and len(choice["prompt_logprobs"]) >= n_total:
        values = []
        for entry, token in zip(choice["prompt_logprobs"][n_prompt:n_total], token_ids[n_prompt:]):
            item = entry.get(str(token)) if isinstance(entry, dict) else None
            values.append(item.get("logprob") if isinstance(item, dict) else item)
    if values is None:
        raise EndpointError(
            f"{url} answered without prompt log-probs for the {n_total} tokens sent (expected "
            "choices[0].logprobs.token_logprobs with echo=true, as `vllm serve` returns them): "
            f"{str(choice)[:200]}"
        )
    bad = [j for j, v in enumerate(values)
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > 1e-6]
    if bad:
        raise EndpointError(f"{url} answered an invalid log-prob {values[bad[0]]!r} for completion token {bad[0]} "
                            "(allowed: a finite number <= 0).")
    return [float(v) for v in values]


def probe_endpoint(client: Any, policy_tokenizer: Any) -> None:
    """Check at construction that an endpoint returns prompt log-probs and tokenizes like the policy.

    Sends :data:`PROBE_TEXT` as text with the echo protocol; the echoed tokens (ids with vLLM's
    ``return_tokens_as_token_ids``, else their strings) must end with the policy's tokens of the text (a BOS the
    server adds is allowed). Raises ``EndpointError`` (server down, no log-probs) or ``PluginConfigError``
    (tokenizer mismatch), both naming the URL.
    """
    url = f"{client.base_url}/completions"
    choice = client.completions([PROBE_TEXT], **ECHO_PARAMS)[0]
    expected = list(policy_tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    echoed_ids = _echoed_token_ids(choice)
    tokens = (choice.get("logprobs") or {}).get("tokens")
    token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(token_logprobs, list) and not isinstance(choice.get("prompt_logprobs"), list):
        raise EndpointError(
            f"{url} cannot return teacher log-probs: its answer to an echo request (echo=true, logprobs=1, "
            f"max_tokens=0) holds no choices[0].logprobs.token_logprobs: {str(choice)[:200]}. Serve the teacher "
            "with `vllm serve`, or use a local teacher."
        )
    if echoed_ids is not None:
        got, want = echoed_ids, expected
    elif isinstance(tokens, list):
        got, want = tokens, [policy_tokenizer.decode([i]) for i in expected]
    else:
        return  # the server does not echo tokens: nothing to compare
    n = len(want)
    if len(got) - n not in (0, 1) or got[len(got) - n:] != want:
        raise PluginConfigError(
            f"The teacher endpoint {url} tokenizes {PROBE_TEXT!r} differently from the policy (teacher: "
            f"{got[:12]}..., policy: {want[:12]}...). Teacher log-probs are taken token for token on the policy's "
            "completions, so the teacher must use the policy's tokenizer."
        )


def teacher_logprob_handler(teacher: Any, chat_text: str | None = None, seen: list | None = None):
    """An HTTP handler answering the echo protocol from a local :class:`~trl_plugins.components.teacher.HFTeacher`.

    For :func:`~trl_plugins.components.local_server.serve_openai_compatible`: ``/v1/completions`` with
    ``echo=true`` and ``max_tokens=0`` answers ``choices[0].logprobs`` (``tokens`` as ``"token_id:N"`` when asked
    with ``return_tokens_as_token_ids``, else as text; ``token_logprobs`` with a null first entry), computed by the
    teacher's model; a text prompt is tokenized without special tokens. ``/v1/chat/completions`` answers
    ``chat_text`` when given (e.g. a hint), else 404. Every request payload is appended to ``seen`` when given.
    """
    from trl_plugins.components.local_server import chat_response

    tok = teacher.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def handler(path: str, payload: dict):
        if seen is not None:
            seen.append(payload)
        if path.endswith("/chat/completions"):
            return chat_response(chat_text) if chat_text is not None else (404, {"error": "no chat here"})
        if not payload.get("echo") or payload.get("max_tokens") != 0:
            return 400, {"error": "this test server only answers echo requests with max_tokens=0"}
        prompt = payload["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else list(tok(prompt, add_special_tokens=False)["input_ids"])
        logps = hf_completion_logprobs(teacher.model, [ids[:1]], [ids[1:]], pad)[0].tolist() if len(ids) > 1 else []
        as_ids = bool(payload.get("return_tokens_as_token_ids"))
        tokens = [f"token_id:{i}" if as_ids else tok.decode([i]) for i in ids]
        return {"object": "text_completion", "choices": [{"index": 0, "text": "", "logprobs": {
            "tokens": tokens, "token_logprobs": [None, *logps], "top_logprobs": None, "text_offset": None}}]}

    return handler
