"""Faults of external components -- judge, PRM, teacher -- inside real training steps.

Every endpoint is a real HTTP server on loopback (``serve_openai_compatible``) whose handler misbehaves: down, slow,
trickling bytes, HTTP 429 / 500, invalid JSON, garbage answers. The contract: bounded retries
with exponential backoff, then an ``EndpointError`` naming the URL -- never a silent zero reward, never a hang. Every
test bounds its wall time. (``tests/components`` covers each client alone; here the faults travel through a plugin and
the trainer.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from trl_plugins.components import EndpointConfig, EndpointError, OpenAICompatibleClient, serve_openai_compatible
from trl_plugins.components.judge import rule_judge_handler
from trl_plugins.components.local_server import LoopbackHTTPServer, chat_response
from trl_plugins.components.prm import ProgrammaticPRM, clear_shared_prms, prm_handler
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

FAST = 0.01  # backoff of the clients in these tests (seconds)


@pytest.fixture(autouse=True)
def _fresh_components():
    yield
    clear_shared_prms()
    clear_shared_teachers()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@contextmanager
def trickling_server(seconds_per_byte: float = 0.1):
    """A server that answers 200 with a valid body, one byte at a time (never trips a per-read timeout)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps(chat_response("ok")).encode() + b" " * 40
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(seconds_per_byte)

        def log_message(self, *args):
            pass

    server = LoopbackHTTPServer(("127.0.0.1", 0), Handler)  # backlog for the judge's burst of connections
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


class Clock:
    def __enter__(self):
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.seconds = time.monotonic() - self.start


# ============================================================================================ the client's guarantees


def test_backoff_doubles_between_attempts_then_the_error_names_the_url():
    arrivals = []

    def overloaded(path, payload):
        arrivals.append(time.monotonic())
        return 503, {"error": "overloaded"}

    with serve_openai_compatible(overloaded) as url:
        client = OpenAICompatibleClient(EndpointConfig(base_url=url, max_retries=3, backoff=0.2, max_backoff=0.5))
        with Clock() as clock, pytest.raises(EndpointError) as err:
            client.chat([[{"role": "user", "content": "x"}]])
        client.close()
    assert f"{url}/chat/completions failed after 4 attempts" in str(err.value) and "HTTP 503" in str(err.value)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) == 3
    # delay k = min(0.2 * 2**k, 0.5) times a jitter in [0.5, 1]
    for gap, nominal in zip(gaps, (0.2, 0.4, 0.5)):
        assert 0.5 * nominal - 0.02 <= gap <= nominal + 1.0, gaps  # upper slack: a loaded machine
    assert clock.seconds < 5


def test_a_server_trickling_bytes_is_abandoned_within_the_bound():
    with trickling_server() as url:
        client = OpenAICompatibleClient(EndpointConfig(base_url=url, timeout=0.5, max_retries=1, backoff=FAST))
        with Clock() as clock, pytest.raises(EndpointError, match=rf"{url}/chat/completions failed after 2 attempts.*"
                                                                   r"TotalTimeout"):
            client.chat([[{"role": "user", "content": "x"}]])
        client.close()
    assert clock.seconds < 2 * (2 * 0.5) + 1.5  # attempts x total deadline + slack; unbounded before the fix


@pytest.mark.parametrize(
    "answer,message",
    [
        ((200, "<html>502 Bad Gateway</html>"), "answered with invalid JSON"),
        ({"choices": [{"message": {"role": "assistant", "content": None}}]}, "non-text choices\\[0\\].message.content"),
        ({"choices": []}, "without choices\\[0\\].message.content"),
    ],
)
def test_garbage_answers_are_errors_naming_the_url(answer, message):
    with serve_openai_compatible(lambda path, payload: answer) as url:
        client = OpenAICompatibleClient(EndpointConfig(base_url=url, backoff=FAST))
        with pytest.raises(EndpointError, match=rf"{url}/chat/completions.*{message}"):
            client.chat([[{"role": "user", "content": "x"}]])
        client.close()


def test_connection_dropped_without_an_answer_is_retried_then_reported():
    calls = []

    class Dropper(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            calls.append(1)
            self.connection.close()  # no status line at all

        def log_message(self, *args):
            pass

    server = LoopbackHTTPServer(("127.0.0.1", 0), Dropper)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        client = OpenAICompatibleClient(EndpointConfig(base_url=url, max_retries=2, backoff=FAST, timeout=5))
        # a FIN reads as RemoteProtocolError, a reset (the handler closed with unread data) as ReadError
        with pytest.raises(EndpointError, match=rf"{url}/chat/completions failed after 3 attempts.*"
                                                r"(RemoteProtocolError|ReadError)"):
            client.chat([[{"role": "user", "content": "x"}]])
        client.close()
    finally:
        server.shutdown()
        server.server_close()
    assert len(calls) == 3


# ================================================================================ judge (ruscarl) in training


def _ruscarl_trainer(url: str, tmp_path, **judge_options):
    options = {"judge": "endpoint", "judge_base_url": url, "scaffold": False, "judge_max_retries": 2,
               "judge_timeout": 5.0, "judge_parse_retries": 1, **judge_options}
    trainer = make_tiny_trainer(
        plugins=["ruscarl"], plugin_config={"ruscarl": options}, reward_funcs=[digit_fraction_reward],
        output_dir=str(tmp_path), max_steps=1, log_level="error", max_completion_length=8,
    )
    trainer.plugin_stack.by_name["ruscarl"].judge.client.config.backoff = FAST
    return trainer


def _half_correct_backend(trainer):
    """Generation stand-in: even rows answer with the reference solution (rubric items met), odd rows with junk."""
    import re

    from trl_plugins.tasks.arithmetic import Problem

    tok = trainer.processing_class

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for j, ids in enumerate(prompt_ids):
            expression = re.search(r"Compute ([0-9+\-*]+) step", tok.decode(list(ids), skip_special_tokens=True))
            tokens = re.findall(r"\d+|[+\-*]", expression.group(1))
            solution = Problem.from_expression([int(t) for t in tokens[0::2]], tokens[1::2]).solution
            text = solution if j % 2 == 0 else "no idea"
            out.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return out, None

    return single_turn


def test_judge_recovering_from_429_and_500_gives_the_true_rubric_reward(tmp_path):
    """Each rubric item is refused twice (429, then 500) before it is graded: the reward is the rule judge's,
    never a zero from a request that failed."""
    grade = rule_judge_handler()
    refusals: dict[str, int] = {}

    def flaky(path, payload):
        key = payload["messages"][-1]["content"]
        refusals[key] = refusals.get(key, 0) + 1
        if refusals[key] == 1:
            return 429, {"error": "rate limited"}
        if refusals[key] == 2:
            return 500, {"error": "boom"}
        return grade(path, payload)

    with serve_openai_compatible(flaky) as url:
        trainer = _ruscarl_trainer(url, tmp_path)
        trainer._generate_single_turn = _half_correct_backend(trainer)
        seen = {}
        original = trainer._calculate_rewards

        def rewards(inputs, prompts, completions, completion_ids_list):
            out = original(inputs, prompts, completions, completion_ids_list)
            seen.update(inputs=inputs, completions=completions, rewards=out.detach().clone())
            return out

        trainer._calculate_rewards = rewards
        trainer.train()
    assert refusals and all(n >= 3 for n in refusals.values())  # identical requests share one counter
    column = trainer.reward_func_names.index("ruscarl_rubric")
    plugin = trainer.plugin_stack.by_name["ruscarl"]
    from trl_plugins.components.judge import RuleJudge

    plugin.judge = RuleJudge()  # the same grading without HTTP
    rows = seen["inputs"]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    expected = plugin.score([r["prompt"] for r in rows], seen["completions"], columns)
    torch.testing.assert_close(seen["rewards"][:, column], torch.tensor(expected))
    assert any(v != 0 for v in expected), "the rubric reward must not be all zeros for this check to mean anything"


@pytest.mark.parametrize(
    "fault",
    ["down", "http_500", "slow", "trickle", "garbage_verdict", "invalid_json"],
)
def test_judge_fault_stops_training_with_an_error_naming_the_url(fault, tmp_path):
    handlers = {
        "http_500": lambda path, payload: (500, {"error": "internal"}),
        "garbage_verdict": lambda path, payload: chat_response("I think it is fine, probably."),
        "invalid_json": lambda path, payload: (200, "not json"),
    }
    expected = {
        "down": r"failed after 3 attempts .*ConnectError",
        "http_500": r"failed after 3 attempts .*HTTP 500",
        "slow": r"failed after 3 attempts .*(ReadTimeout|TotalTimeout)",
        "trickle": r"failed after 3 attempts .*TotalTimeout",
        "garbage_verdict": r"no parsable verdict",
        "invalid_json": r"invalid JSON",
    }[fault]

    @contextmanager
    def endpoint():
        if fault == "down":
            yield _dead_url()
        elif fault == "slow":
            with serve_openai_compatible(rule_judge_handler(), delay=1.5) as url:
                yield url
        elif fault == "trickle":
            with trickling_server(0.05) as url:
                yield url
        else:
            with serve_openai_compatible(handlers[fault]) as url:
                yield url

    with endpoint() as url:
        trainer = _ruscarl_trainer(url, tmp_path, judge_timeout=0.4)
        with Clock() as clock, pytest.raises(EndpointError) as err:
            trainer.train()
    message = str(err.value)
    assert f"{url}/chat/completions" in message, message
    assert __import__("re").search(expected, message), message
    assert trainer.state.global_step == 0, "no optimizer step may run on rewards that were never computed"
    # bounded: 3 attempts x (2 x judge_timeout total deadline) + backoff, plus one tiny training step
    assert clock.seconds < 30, clock.seconds


# ============================================================================================ PRM and teacher (scope)


def _scope_trainer(tmp_path, **options):
    base = {"mode": "teacher_suffix", "teacher": "reference", "prm": "programmatic", "scope_groups": "all",
            "min_prefix_steps": 0, "accept": "any", "threshold": 0.5}
    trainer = make_tiny_trainer(
        plugins=["scope"], plugin_config={"scope": {**base, **options}}, reward_funcs=[digit_fraction_reward],
        dataset=tiny_dataset(4), output_dir=str(tmp_path), max_steps=1, log_level="error", max_completion_length=8,
    )
    plugin = trainer.plugin_stack.by_name["scope"]
    for component in (plugin.prm, plugin.teacher):
        for name in ("client", "_root_client"):
            if hasattr(component, name):
                getattr(component, name).config.backoff = FAST
                getattr(component, name).config.timeout = 1.0
    return trainer


@pytest.mark.parametrize("fault", ["down", "wrong_step_count", "http_429_forever"])
def test_prm_endpoint_fault_is_an_error_naming_the_url(fault, tmp_path):
    def handler(path, payload):
        if fault == "http_429_forever":
            return 429, {"error": "slow down"}
        return {"object": "list", "data": [{"data": [[0.2, 0.8]] * 7}]}  # never the right number of steps

    @contextmanager
    def endpoint():
        if fault == "down":
            yield _dead_url()
        else:
            with serve_openai_compatible(handler) as url:
                yield url

    with endpoint() as url:
        trainer = _scope_trainer(tmp_path, prm="endpoint", prm_base_url=url)
        with Clock() as clock, pytest.raises(EndpointError) as err:
            trainer.train()
    root = url[: -len("/v1")]
    assert f"{root}/pooling" in str(err.value), str(err.value)
    assert clock.seconds < 30


def test_prm_endpoint_that_recovers_scores_like_the_local_prm(tmp_path):
    local = ProgrammaticPRM()
    served = prm_handler(local)
    calls = {"n": 0}

    def flaky(path, payload):
        calls["n"] += 1
        return (503, {"error": "warming up"}) if calls["n"] <= 2 else served(path, payload)

    with serve_openai_compatible(flaky) as url:
        trainer = _scope_trainer(tmp_path, prm="endpoint", prm_base_url=url, step_separator="\n")
        trainer.train()
    assert calls["n"] > 2 and trainer.state.global_step == 1


@pytest.mark.parametrize("fault", ["down", "null_content"])
def test_teacher_endpoint_fault_is_an_error_naming_the_url(fault, tmp_path):
    @contextmanager
    def endpoint():
        if fault == "down":
            yield _dead_url()
        else:
            answer = {"choices": [{"message": {"role": "assistant", "content": None}}]}
            with serve_openai_compatible(lambda path, payload: answer) as url:
                yield url

    with endpoint() as url:
        trainer = _scope_trainer(tmp_path, teacher="endpoint", teacher_base_url=url)
        with Clock() as clock, pytest.raises(EndpointError) as err:
            trainer.train()
    assert f"{url}/chat/completions" in str(err.value), str(err.value)
    assert clock.seconds < 30
