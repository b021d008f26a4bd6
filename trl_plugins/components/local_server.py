"""A real OpenAI-compatible HTTP server on loopback, answering from a Python callable.

Used by the tests and the offline demos: the judge / PRM / teacher clients talk HTTP to it exactly as they
would to ``vllm serve``. It binds 127.0.0.1 only, on a free port, and stops when the context exits.

The handler gets ``(path, payload)`` (e.g. ``("/v1/chat/completions", {...})``) and returns either a JSON-able
body (status 200) or ``(status, body)``; raising :class:`Delay` first sleeps (to test timeouts).

A local PRM or judge server sees only the question, but a programmatic oracle grades from the dataset row:
:data:`QUESTION_ROWS` names the functions ``question -> row`` that rebuild it (``"arithmetic"``: the bundled tasks'
:func:`~trl_plugins.tasks.arithmetic.row_from_question`, loaded on first use; raise ``ValueError`` for a text holding
no question of the task).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trl_plugins.api.registry import Registry

Handler = Callable[[str, dict], Any]

#: ``question text -> dataset row`` for the local test / demo servers, by task name (see the module docstring).
QUESTION_ROWS: Registry[Callable[[str], dict]] = Registry(
    "question -> row rebuilder", {"arithmetic": "trl_plugins.tasks.arithmetic:row_from_question"},
    contract="fn(question: str) -> dict, ValueError when the text holds no question of the task",
)


class LoopbackHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server with a listen backlog that holds a client's whole burst of connections.

    The standard library's backlog is 5: a client opening more connections at once (a judge runs 16 by default)
    has the extra SYNs dropped while the accept loop is busy, and the kernel retries them only after one second --
    which a client with a short timeout reports as a connect timeout, not as whatever the server really did.
    """

    request_queue_size = 256
    daemon_threads = True


def chat_response(text: str) -> dict:
    """The body of a chat completion whose assistant message is ``text``."""
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


@contextmanager
def serve_openai_compatible(handler: Handler, delay: float = 0.0) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1 (free port) in a thread; yields the base URL ``http://127.0.0.1:PORT/v1``."""
    calls: list[tuple[str, dict]] = []

    class RequestHandler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server naming
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            try:
                payload = json.loads(raw or b"{}")
            except ValueError:
                payload = {}
            calls.append((self.path, payload))
            if delay:
                time.sleep(delay)
            try:
                result = handler(self.path, payload)
            except Exception as exc:  # a broken handler is a 500, as a real server would answer
                result = (500, {"error": f"{type(exc).__name__}: {exc}"})
            status, body = result if isinstance(result, tuple) else (200, result)
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting (its timeout); it reports that itself

        def log_message(self, *args):  # keep test output clean
            pass

    server = LoopbackHTTPServer(("127.0.0.1", 0), RequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        serve_openai_compatible.calls = calls  # type: ignore[attr-defined]
        yield url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
