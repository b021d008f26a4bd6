"""The OpenAI-compatible client against a real HTTP server on loopback."""

import pytest

from trl_plugins.components import (
    EndpointConfig,
    EndpointError,
    OpenAICompatibleClient,
    chat_response,
    serve_openai_compatible,
)


def client(url, **kw):
    kw.setdefault("backoff", 0.01)
    return OpenAICompatibleClient(EndpointConfig(base_url=url, model="m", **kw))


def test_chat_batch_in_order():
    def handler(path, payload):
        assert path == "/v1/chat/completions" and payload["model"] == "m"
        return chat_response(payload["messages"][-1]["content"].upper())

    with serve_openai_compatible(handler) as url:
        c = client(url)
        assert c.chat([[{"role": "user", "content": w}] for w in ["a", "b", "c"]]) == ["A", "B", "C"]
        c.close()


def test_retries_on_429_and_500_then_succeeds():
    answers = iter([(429, {"error": "slow down"}), (500, {"error": "boom"}), chat_response("ok")])
    with serve_openai_compatible(lambda path, payload: next(answers)) as url:
        c = client(url)
        assert c.chat([[{"role": "user", "content": "x"}]]) == ["ok"]
        assert c.requests_sent == 3
        c.close()


def test_dead_endpoint_is_an_error_naming_the_url():
    with serve_openai_compatible(lambda p, q: chat_response("x")) as url:
        pass  # server stopped: the port is closed now
    c = client(url, max_retries=1, timeout=2)
    with pytest.raises(EndpointError, match=rf"{url}/chat/completions failed after 2 attempts"):
        c.chat([[{"role": "user", "content": "x"}]])
    c.close()


def test_garbage_answer_is_an_error():
    with serve_openai_compatible(lambda p, q: {"unexpected": True}) as url:
        c = client(url)
        with pytest.raises(EndpointError, match="without choices"):
            c.chat([[{"role": "user", "content": "x"}]])
        c.close()


def test_client_error_is_not_retried():
    with serve_openai_compatible(lambda p, q: (400, {"error": "bad request"})) as url:
        c = client(url)
        with pytest.raises(EndpointError, match="refused the request \\(HTTP 400"):
            c.chat([[{"role": "user", "content": "x"}]])
        assert c.requests_sent == 1
        c.close()


def test_cache_avoids_repeated_requests():
    with serve_openai_compatible(lambda p, q: chat_response("same")) as url:
        c = client(url)
        c.chat([[{"role": "user", "content": "x"}]])
        c.chat([[{"role": "user", "content": "x"}]])
        assert c.requests_sent == 1
        c.close()


def test_timeout_is_retried_then_reported():
    # read deadline 0.5 s after the request is written, whole-request deadline 1.0 s after it starts: the read timeout
    # comes first unless connecting and writing on loopback took over half a second
    with serve_openai_compatible(lambda p, q: chat_response("late"), delay=2.0) as url:
        c = client(url, timeout=0.5, max_retries=1)
        with pytest.raises(EndpointError, match="ReadTimeout"):
            c.chat([[{"role": "user", "content": "x"}]])
        c.close()


def test_api_key_from_env_reads_the_named_variable_and_refuses_an_unset_one(monkeypatch):
    from trl_plugins.components.client import api_key_from_env
    from trl_plugins.api.errors import PluginConfigError

    assert api_key_from_env(None) is None
    monkeypatch.setenv("TRLP_TEST_KEY", "sk-123")
    assert api_key_from_env("TRLP_TEST_KEY") == "sk-123"
    monkeypatch.delenv("TRLP_TEST_KEY")
    with pytest.raises(PluginConfigError, match="'TRLP_TEST_KEY' is not set"):
        api_key_from_env("TRLP_TEST_KEY")
