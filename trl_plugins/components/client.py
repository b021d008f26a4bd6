"""An OpenAI-compatible HTTP client for judges, PRMs and teachers (e.g. ``vllm serve``).

Async, batched, bounded in concurrency, retried with exponential backoff on 429 / 5xx / connection errors and
timeouts, with an in-memory response cache. It fails loudly: once retries are exhausted it raises
:class:`EndpointError` naming the URL and the last status or exception — never a silent default value.

Synchronous callers (reward functions, sampling plugins) use :meth:`OpenAICompatibleClient.run`, which runs
a batch of coroutines on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import sys
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.api.options import PluginOptions, option

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class EndpointError(PluginError, RuntimeError):
    """An external component (judge, PRM, teacher) could not be reached or answered garbage.

    Its message names the URL with any credentials redacted (``https://***@host/v1?api_key=***``, as every
    :class:`~trl_plugins.api.errors.PluginError`)."""


@contextlib.contextmanager
def local_model_loading(what: str):
    """Around loading a local component model: transformers' ``OSError`` / ``ValueError`` (a hub name without network,
    a missing folder) becomes one :class:`EndpointError` starting "Could not load the {what}"; the project's own
    refusals (:class:`PluginError`) pass as they are."""
    try:
        yield
    except PluginError:
        raise
    except (OSError, ValueError) as exc:
        raise EndpointError(f"Could not load the {what}: {exc}") from exc


def api_key_from_env(env: str | None) -> str | None:
    """The API key held by the environment variable ``env`` (an ``*_api_key_env`` option), or None when no variable
    is named. A named variable that is not set is refused here, at construction, rather than sending requests without
    a key and failing at the first step with an authorisation error."""
    if env is None:
        return None
    if env not in os.environ:
        raise PluginConfigError(f"The API key environment variable {env!r} is not set.")
    return os.environ[env]


@dataclass
class EndpointConfig:
    """Where and how to call an OpenAI-compatible server.

    Attributes:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name sent in every request.
        api_key: sent as a bearer token when set.
        timeout: seconds per request phase (connect, each read, write); a request still not fully answered after
            ``2 * timeout`` (e.g. a server trickling bytes) is abandoned too. Either counts as a failed attempt.
        max_retries: retries after the first attempt (so ``max_retries + 1`` attempts at most).
        backoff: first retry delay in seconds; doubles each retry (with jitter), capped at ``max_backoff``.
        max_concurrency: requests in flight at once.
        cache: keep responses of identical requests in memory.
    """

    base_url: str
    model: str = "default"
    api_key: str | None = None
    timeout: float = 60.0
    max_retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_concurrency: int = 16
    cache: bool = True

    def __post_init__(self):
        check_base_url(self.base_url)


# ============================================================================================= plugin options
@dataclasses.dataclass
class EndpointOptions(PluginOptions):
    """Base of the endpoint option groups :func:`endpoint_options` makes: the helpers below read a group by its
    prefix, so an option dataclass may hold several groups (SCOPE: a PRM and a teacher)."""

    def endpoint_kwargs(self, prefix: str) -> dict[str, Any]:
        """``model``, ``base_url``, ``api_key_env``, ``timeout``, ``max_retries`` of group ``prefix`` (the keyword
        arguments of :func:`~trl_plugins.components.teacher.shared_teacher` and
        :func:`~trl_plugins.components.prm.build_prm`)."""
        return {key: getattr(self, f"{prefix}_{key}") for key in ENDPOINT_FIELDS}

    def endpoint_config(self, prefix: str, **extra: Any) -> EndpointConfig:
        """The :class:`EndpointConfig` of group ``prefix`` (its API key read from the environment now); ``extra`` sets
        other fields (e.g. ``max_concurrency``)."""
        o = self.endpoint_kwargs(prefix)
        return EndpointConfig(base_url=o["base_url"], model=o["model"], api_key=api_key_from_env(o["api_key_env"]),
                              timeout=o["timeout"], max_retries=o["max_retries"], **extra)

    def require_base_url(self, prefix: str, plugin: str, *, active: bool = True, when: str = "",
                         otherwise: str = "") -> None:
        """Refuse group ``prefix`` used as an endpoint (its kind option, named ``prefix``, is ``'endpoint'``) without
        ``<prefix>_base_url``. ``active``: whether the plugin uses the group with these options; ``when`` names that
        condition in the message (e.g. ``"scorer='judge'"``); ``otherwise`` the alternatives (e.g. ``"judge='hf'"``)."""
        if active and getattr(self, prefix, "endpoint") == "endpoint" and not getattr(self, f"{prefix}_base_url"):
            condition = f"{when} and {prefix}='endpoint'" if when else f"{prefix}='endpoint'"
            raise PluginConfigError(
                f"Plugin {plugin!r} with {condition} needs {prefix}_base_url (an OpenAI-compatible server such as "
                f"`vllm serve`, e.g. http://127.0.0.1:8000/v1){'; or set ' + otherwise if otherwise else ''}."
            )


#: The options of an endpoint group, without the prefix.
ENDPOINT_FIELDS = ("model", "base_url", "api_key_env", "timeout", "max_retries")


def endpoint_options(
    prefix: str,
    label: str,
    *,
    model: str = "default",
    model_help: str | None = None,
    model_reconstructed: bool = False,
    timeout: float = 120.0,
    max_retries: int = 4,
) -> type[EndpointOptions]:
    """The option group of one external model (teacher, critic, judge, PRM): ``<prefix>_model``,
    ``<prefix>_base_url``, ``<prefix>_api_key_env``, ``<prefix>_timeout`` and ``<prefix>_max_retries``, declared here
    once for every plugin. An option dataclass derives from the group (and declares the kind option named ``prefix``
    itself, ``Literal["endpoint", "hf", ...]``: its choices differ per plugin); :class:`EndpointOptions` has the
    helpers. ``label`` names the model in the help texts; the keyword arguments are the group's defaults."""
    cap = label[:1].upper() + label[1:]
    fields = [
        (f"{prefix}_model", str, option(
            model, reconstructed=model_reconstructed,
            help=model_help or f"{cap}: served model name (endpoint) or model name/path (hf).")),
        (f"{prefix}_base_url", str | None, option(
            None, help=f"{cap} endpoint ({prefix}='endpoint'), e.g. http://127.0.0.1:8000/v1.")),
        (f"{prefix}_api_key_env", str | None, option(
            None, help=f"Environment variable holding the {label} endpoint's API key.")),
        (f"{prefix}_timeout", float, option(
            timeout, min=0.0, min_exclusive=True, help=f"Seconds per {label} endpoint request before it counts as "
            "failed.")),
        (f"{prefix}_max_retries", int, option(
            max_retries, min=0,
            help=f"Retries (with backoff on 429/5xx/connection errors) of a failed {label} endpoint request.")),
    ]
    name = "".join(part.capitalize() for part in prefix.split("_")) + "EndpointOptions"
    cls = dataclasses.make_dataclass(name, fields, bases=(EndpointOptions,))
    cls.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    cls.__doc__ = f"The endpoint options of the {label} (``{prefix}_*``, see :func:`endpoint_options`)."
    return cls


def check_base_url(url: Any) -> None:
    """Refuse a malformed endpoint URL when the client is made (at trainer construction), not at the first request."""
    from urllib.parse import urlsplit

    from trl_plugins.api.errors import PluginConfigError

    problem = None
    if not isinstance(url, str) or not url.strip():
        problem = "it is empty" if isinstance(url, str) else f"it is a {type(url).__name__}, not text"
    else:
        try:
            parts = urlsplit(url.strip())
            parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0..65535
        except ValueError as exc:
            problem = str(exc)
        else:
            if parts.scheme not in ("http", "https"):
                problem = f"the scheme is {parts.scheme!r}, not 'http' or 'https'" if parts.scheme else "it has no scheme"
            elif not parts.hostname:
                problem = "it has no host"
    if problem:
        raise PluginConfigError(
            f"Endpoint URL {url!r} is malformed ({problem}); expected e.g. http://127.0.0.1:8000/v1."
        )


class OpenAICompatibleClient:
    """Chat / completions calls against an OpenAI-compatible endpoint (see the module docstring)."""

    def __init__(self, config: EndpointConfig):
        self.config = config
        self._cache: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.requests_sent = 0

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def base_url(self) -> str:
        return self.config.base_url.rstrip("/")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="trl-plugins-http")
                self._thread.start()
        return self._loop

    def run(self, coroutines: Sequence[Awaitable[Any]]) -> list[Any]:
        """Run coroutines concurrently (bounded by ``max_concurrency``) and return their results in order."""

        async def gather():
            semaphore = asyncio.Semaphore(self.config.max_concurrency)
            async with httpx.AsyncClient(timeout=self.config.timeout, headers=self._headers()) as http:

                async def bounded(coro_factory):
                    async with semaphore:
                        return await coro_factory(http)

                return await asyncio.gather(*(bounded(c) for c in coroutines))

        future = asyncio.run_coroutine_threadsafe(gather(), self._ensure_loop())
        return future.result()

    async def post_json(self, http: httpx.AsyncClient, path: str, payload: dict) -> dict:
        """POST ``payload`` to ``base_url + path`` with retries/backoff; returns the decoded JSON body."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        key = hashlib.sha256((url + json.dumps(payload, sort_keys=True)).encode()).hexdigest()
        if self.config.cache and key in self._cache:
            return self._cache[key]
        last = "no attempt"
        for attempt in range(self.config.max_retries + 1):
            try:
                self.requests_sent += 1
                # httpx's timeouts are per phase (a server trickling bytes never trips them): bound the whole request
                response = await asyncio.wait_for(http.post(url, json=payload), timeout=2 * self.config.timeout)
                if response.status_code == 200:
                    try:
                        body = response.json()
                    except ValueError as exc:
                        raise EndpointError(f"{url} answered with invalid JSON: {response.text[:200]!r}") from exc
                    if self.config.cache:
                        self._cache[key] = body
                    return body
                last = f"HTTP {response.status_code}: {response.text[:200]!r}"
                if response.status_code not in RETRY_STATUS:
                    raise EndpointError(f"{url} refused the request ({last}).")
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except asyncio.TimeoutError:
                last = f"TotalTimeout: no complete answer within {2 * self.config.timeout:g}s"
            if attempt < self.config.max_retries:
                delay = min(self.config.backoff * 2**attempt, self.config.max_backoff)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
        raise EndpointError(
            f"{url} failed after {self.config.max_retries + 1} attempts (last error: {last}). "
            "Check that the server is running and reachable."
        )

    # ------------------------------------------------------------------------------------------ API
    def chat(self, conversations: Sequence[list[dict]], **params: Any) -> list[str]:
        """One chat completion per conversation (list of messages); returns the assistant texts in order."""

        def make(messages):
            async def call(http):
                body = await self.post_json(
                    http, "chat/completions", {"model": self.config.model, "messages": messages, **params}
                )
                try:
                    content = body["choices"][0]["message"]["content"]
                except (KeyError, IndexError, TypeError) as exc:
                    raise EndpointError(
                        f"{self.base_url}/chat/completions answered without choices[0].message.content: "
                        f"{json.dumps(body)[:200]}"
                    ) from exc
                if not isinstance(content, str):  # e.g. null: everything went to reasoning_content or a tool call
                    raise EndpointError(
                        f"{self.base_url}/chat/completions answered with a non-text choices[0].message.content "
                        f"({content!r}): {json.dumps(body)[:200]}"
                    )
                return content

            return call

        return self.run([make(m) for m in conversations])

    def completions(self, prompts: Sequence[str], **params: Any) -> list[dict]:
        """One text completion per prompt; returns each ``choices[0]`` dict (text, logprobs, ...)."""

        def make(prompt):
            async def call(http):
                body = await self.post_json(http, "completions", {"model": self.config.model, "prompt": prompt, **params})
                try:
                    return body["choices"][0]
                except (KeyError, IndexError, TypeError) as exc:
                    raise EndpointError(
                        f"{self.base_url}/completions answered without choices[0]: {json.dumps(body)[:200]}"
                    ) from exc

            return call

        return self.run([make(p) for p in prompts])

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop = None
