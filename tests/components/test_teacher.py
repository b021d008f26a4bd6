"""Teachers / correctors (trl_plugins.components.teacher): reference solutions, an OpenAI-compatible endpoint on a
real loopback server, and a local HF model loaded by path."""

import pytest

from trl_plugins.components.client import EndpointConfig, EndpointError
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.teacher import (
    EndpointTeacher,
    HFTeacher,
    ReferenceTeacher,
    build_teacher,
    continuation_messages,
    cut_at_stop,
    shared_teacher,
)
from trl_plugins.api.errors import PluginConfigError
from trl_plugins.tasks.arithmetic import Problem
from trl_plugins.tasks.tiny import build_and_save

PROBLEM = Problem.from_expression([3, 4, 2, 5], ["+", "*", "-"])  # 3+4=7 / 7*2=14 / 14-5=9 / Answer: 9
ROW = {"prompt": [{"role": "user", "content": PROBLEM.question}], "solution": PROBLEM.solution}
PROMPT = ROW["prompt"]


def test_cut_at_stop():
    assert cut_at_stop("a\nb\nc", ["\n"]) == "a"
    assert cut_at_stop("abc", ["x", "c", "b"]) == "a"
    assert cut_at_stop("abc", None) == "abc" and cut_at_stop("abc", [""]) == "abc"


def test_reference_teacher_continues_from_the_prefix_step_count():
    t = ReferenceTeacher(separator="\n")
    rows, prompts = [ROW] * 5, [PROMPT] * 5
    prefixes = ["", "3+4=7\n", "3+4=7", "3+4=7\n7*2=14\n", "3+4=7\n7*2=14\n14-5=9\nAnswer: 9\n"]
    assert t.continue_from(rows, prompts, prefixes) == [
        PROBLEM.solution,
        "7*2=14\n14-5=9\nAnswer: 9",
        "\n7*2=14\n14-5=9\nAnswer: 9",  # a separator first when the prefix lacks one
        "14-5=9\nAnswer: 9",
        "",
    ]
    assert t.continue_from(rows[:2], prompts[:2], prefixes[:2], stop=["\n"]) == ["3+4=7", "7*2=14"]  # one step
    with pytest.raises(PluginConfigError, match="'solution'"):
        t.continue_from([{"prompt": PROMPT}], [PROMPT], [""])
    with pytest.raises(PluginConfigError, match="cannot answer"):
        t.chat([[{"role": "user", "content": "hi"}]])


def test_endpoint_teacher_continuation_and_chat_over_loopback():
    seen = []

    def handler(path, payload):
        seen.append(payload)
        messages = payload["messages"]
        if payload.get("continue_final_message"):
            assert payload["add_generation_prompt"] is False and messages[-1]["role"] == "assistant"
            prefix = messages[-1]["content"]
            rest = ReferenceTeacher(separator="\n").continue_from([ROW], [messages[:-1]], [prefix])[0]
            return chat_response(rest)  # a server ignoring `stop`: the client still cuts there
        return chat_response("critique: " + messages[-1]["content"])

    with serve_openai_compatible(handler) as url:
        t = EndpointTeacher(EndpointConfig(base_url=url, model="teacher", max_retries=0), max_tokens=77)
        out = t.continue_from([ROW, ROW], [PROMPT, PROMPT], ["3+4=7\n", "3+4=7\n7*2=14\n"])
        one = t.continue_from([ROW], [PROMPT], ["3+4=7\n"], stop=["\n"], max_tokens=5)
        answers = t.chat([[{"role": "user", "content": "x"}]])
        t.close()
    assert out == ["7*2=14\n14-5=9\nAnswer: 9", "14-5=9\nAnswer: 9"]
    assert one == ["7*2=14"] and answers == ["critique: x"]
    first_two = seen[:2]  # sent concurrently: their arrival order is not fixed
    assert all(p["model"] == "teacher" and p["max_tokens"] == 77 and p["temperature"] == 0.0 for p in first_two)
    assert continuation_messages(PROMPT, "3+4=7\n") in [p["messages"] for p in first_two]
    assert continuation_messages(PROMPT, "3+4=7\n7*2=14\n") in [p["messages"] for p in first_two]
    assert seen[2]["stop"] == ["\n"] and seen[2]["max_tokens"] == 5
    assert "continue_final_message" not in seen[3]


def test_endpoint_teacher_dead_server_names_the_url():
    t = build_teacher("endpoint", base_url="http://127.0.0.1:9/v1")
    t.client.config.max_retries = 0
    with pytest.raises(EndpointError, match=r"http://127\.0\.0\.1:9/v1/chat/completions"):
        t.continue_from([ROW], [PROMPT], ["3+4=7\n"])
    with pytest.raises(PluginConfigError, match="base URL"):
        build_teacher("endpoint")


def test_hf_teacher_loaded_by_path(tmp_path):
    path = build_and_save(tmp_path / "teacher", hidden_size=16, num_layers=1, num_heads=2)
    t = HFTeacher(str(path), max_tokens=6)
    captured = []
    original = t.model.generate

    def generate(**kwargs):
        captured.append(kwargs["input_ids"].clone())
        return original(**kwargs)

    t.model.generate = generate
    out = t.continue_from([ROW, ROW], ["Q?", PROMPT], ["3+4=7\n", ""])
    assert len(out) == 2 and all(isinstance(x, str) for x in out)
    tok = t.tokenizer
    expected = tok.apply_chat_template([{"role": "user", "content": "Q?"}], add_generation_prompt=True,
                                       tokenize=False) + "3+4=7\n"
    row0 = captured[0][0][captured[0][0] != tok.pad_token_id].tolist()  # left-padded batch
    assert row0 == tok(expected, add_special_tokens=False)["input_ids"]  # prefix appended token for token
    assert t.continue_from([ROW], ["Q?"], ["3+4=7\n"]) == out[:1]  # greedy: deterministic
    assert len(t.chat([[{"role": "user", "content": "hi"}]])) == 1
    assert shared_teacher("reference", separator="\n") is shared_teacher("reference", separator="\n")


def test_a_local_teacher_that_cannot_be_loaded_is_one_error_naming_the_model(tmp_path):
    from trl_plugins.components.teacher import build_teacher

    with pytest.raises(EndpointError, match=r"Could not load the teacher model '.*no-such-teacher'"):
        build_teacher("hf", model=str(tmp_path / "no-such-teacher"))
