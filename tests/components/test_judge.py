"""Rubric judges (trl_plugins.components.judge): prompt, lenient parsing, endpoint / HF / rule backends, failures."""

import socket

import pytest

from trl_plugins.components import EndpointConfig, EndpointError, chat_response, serve_openai_compatible
from trl_plugins.components.judge import (
    EndpointJudge,
    HFJudge,
    JudgeRequest,
    RuleJudge,
    build_judge_prompt,
    parse_verdict,
    rule_judge_handler,
)
from trl_plugins.api.errors import PluginError
from trl_plugins.tasks.arithmetic import Problem, make_rubrics, rubric_score, rubric_verdict

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14
CONVERSATION = [{"role": "system", "content": "SECRET SCAFFOLD"}, {"role": "user", "content": PROBLEM.question}]
COMPLETIONS = [
    PROBLEM.solution,  # fully correct
    "3+4=7\n7*2=15\nAnswer: 15",  # wrong second step and answer
    "Answer: 14",  # right answer, no steps
    "gibberish",
]


def _requests():
    items = make_rubrics(PROBLEM)
    row = {"problem": PROBLEM.to_json()}
    return [JudgeRequest(CONVERSATION, c, it, row) for c in COMPLETIONS for it in items], items


def _fast(url, **kw):
    return EndpointConfig(base_url=url, timeout=5.0, max_retries=kw.pop("max_retries", 1), backoff=0.01, **kw)


def test_parse_verdict_is_lenient():
    assert parse_verdict('```json\n{"explanation": "ok", "criteria_met": true}\n```') is True
    assert parse_verdict('<think>{"criteria_met": true}</think> {"explanation": "x", "criteria_met": false}') is False
    assert parse_verdict('Sure! {"explanation": "has } brace", "criteria_met": "true"} done') is True
    assert parse_verdict('{"explanation": "bad json", criteria_met: false,}') is False  # regex fallback
    assert parse_verdict("criteria_met = yes") is True
    assert parse_verdict('{"explanation": "no field"}') is None
    assert parse_verdict("I think it is met.") is None
    assert parse_verdict(None) is None


def test_prompt_has_the_original_turns_the_completion_and_the_signed_item():
    items = make_rubrics(PROBLEM)
    prompt = build_judge_prompt(CONVERSATION, "MY REPLY", items[-3])  # the -6 penalty item
    assert "SECRET SCAFFOLD" not in prompt and "system:" not in prompt
    assert f"user: {PROBLEM.question}" in prompt
    assert "assistant: MY REPLY" in prompt
    assert "[-6] States an incorrect final answer" in prompt
    assert "criteria_met" in prompt and "undesirable" in prompt
    assert "[+5] States the correct final answer 14" in build_judge_prompt(CONVERSATION, "r", items[-1])


def test_rule_judge_matches_rubric_verdict():
    requests, items = _requests()
    verdicts = RuleJudge().grade(requests)
    expected = [rubric_verdict(it, PROBLEM, c) for c in COMPLETIONS for it in items]
    assert verdicts == expected
    n = len(items)
    assert rubric_score(items, verdicts[:n]) == 1.0  # the reference solution meets every positive item
    assert rubric_score(items, verdicts[n : 2 * n]) < 0  # wrong answer: penalty met
    with pytest.raises(PluginError, match="'problem'"):
        RuleJudge().grade([JudgeRequest(CONVERSATION, "x", items[0], {})])


def test_endpoint_judge_over_http_grades_like_the_rule_judge_one_call_per_item():
    requests, items = _requests()
    seen = []
    with serve_openai_compatible(rule_judge_handler(seen)) as url:
        judge = EndpointJudge(_fast(url, max_concurrency=4), {"temperature": 0.7})
        verdicts = judge.grade(requests)
        assert verdicts == RuleJudge().grade(requests)
        assert len(seen) == len(requests) == len(COMPLETIONS) * len(items)  # one request per (completion, item)
        assert all("SECRET SCAFFOLD" not in p for p in seen)
        # parsed verdicts are cached: grading again sends nothing
        assert judge.grade(requests[:3]) == verdicts[:3] and len(seen) == len(requests)
        judge.close()


def test_unparsable_answers_are_asked_again_then_parsed():
    answers = {}

    def flaky(path, payload):
        prompt = payload["messages"][-1]["content"]
        answers[prompt] = answers.get(prompt, 0) + 1
        if answers[prompt] < 3:
            return chat_response("Let me think about it...")
        return chat_response('{"explanation": "fine", "criteria_met": true}')

    requests, _ = _requests()
    with serve_openai_compatible(flaky) as url:
        judge = EndpointJudge(_fast(url), parse_retries=3)
        assert judge.grade(requests[:2]) == [True, True]
        assert sorted(answers.values()) == [3, 3]  # retries reach the server (no cached garbage)
        judge.close()


def test_garbled_judge_is_an_error_naming_the_url_never_a_silent_zero():
    calls = []

    def garbled(path, payload):
        calls.append(path)
        return chat_response("yes, probably")

    requests, _ = _requests()
    with serve_openai_compatible(garbled) as url:
        judge = EndpointJudge(_fast(url), parse_retries=2)
        with pytest.raises(EndpointError, match=rf"{url}/chat/completions.*no parsable verdict.*3 attempts"):
            judge.grade(requests[:1])
        assert len(calls) == 3
        lenient = EndpointJudge(_fast(url), parse_retries=0, on_unparsable="false")
        assert lenient.grade(requests[:2]) == [False, False]  # RuscaRL's code path, only when asked for
        judge.close()
        lenient.close()


def test_dead_judge_is_an_error_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    judge = EndpointJudge(_fast(url, max_retries=1))
    with pytest.raises(EndpointError, match=rf"127.0.0.1:{port}/v1/chat/completions failed after 2 attempts"):
        judge.grade(_requests()[0][:1])
    judge.close()


def test_server_error_is_retried_then_reported():
    with serve_openai_compatible(lambda path, payload: (503, {"error": "overloaded"})) as url:
        judge = EndpointJudge(_fast(url, max_retries=2))
        with pytest.raises(EndpointError, match=r"failed after 3 attempts.*HTTP 503"):
            judge.grade(_requests()[0][:1])
        judge.close()


def test_hf_judge_loads_by_path_and_fails_loudly_on_garbage(tmp_path):
    from trl_plugins.tasks.tiny import build_and_save

    path = str(build_and_save(tmp_path / "judge"))
    judge = HFJudge(path, max_new_tokens=8, parse_retries=1, temperature=1.0)
    requests, _ = _requests()
    with pytest.raises(EndpointError, match=r"local model '.*judge'.*no parsable verdict.*2 attempts"):
        judge.grade(requests[:2])  # an untrained model cannot answer in JSON
    assert judge.calls == 4
    texts = judge._ask(["hello"])  # it really generates with the loaded model
    assert len(texts) == 1 and isinstance(texts[0], str)
    judge._ask = lambda prompts: ['{"criteria_met": false}'] * len(prompts)
    assert judge.grade(requests[:2]) == [False, False]
    with pytest.raises(EndpointError, match="could not load the judge model|Could not load the judge model"):
        HFJudge(str(tmp_path / "missing"))


def test_verdict_cache_is_bounded_lru():
    class Scripted(EndpointJudge.__mro__[1]):  # the shared parse-and-retry judge, answering without a server
        location = "scripted"

        def __init__(self):
            super().__init__(parse_retries=0)
            self.asked = []

        def _ask(self, prompts):
            self.asked.extend(prompts)
            return ['{"criteria_met": true}'] * len(prompts)

    judge = Scripted()
    judge.cache_size = 2
    requests, _ = _requests()
    assert judge.grade(requests[:3]) == [True] * 3
    assert len(judge._cache) == 2 and len(judge.asked) == 3
    judge.grade(requests[1:3])  # the two most recent are cached
    assert len(judge.asked) == 3
    judge.grade(requests[:1])  # the oldest was dropped
    assert len(judge.asked) == 4
