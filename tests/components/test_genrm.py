"""Generative reward models (trl_plugins.components.genrm): templates, parsing, aggregation, cache, meta filter,
unparsable accounting, and the endpoint / HF / scripted backends (endpoint on loopback)."""

import logging
import math

import pytest

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.components import EndpointConfig, EndpointError, chat_response, serve_openai_compatible
from trl_plugins.components.genrm import (
    EndpointGenRMBackend,
    GenerativeRewardModel,
    GenRMParseError,
    GenRMTemplate,
    HFGenRMBackend,
    ScriptedGenRMBackend,
    aggregate_verdicts,
    genrm_handler,
    meta_judge_filter,
    scripted_genrm,
)
from trl_plugins.tasks.arithmetic import Problem

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14
RIGHT, WRONG = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15"

POINTWISE = GenRMTemplate(
    "test-pointwise", "Judge.", "[Question]\n{question}\n[End of Question]\n\n[Response]\n{response}\n"
    "[End of Response]", r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*\}", low=1, high=10)
PAIRWISE = GenRMTemplate(
    "test-pairwise", "", "[Question]\n{question}\n[End of Question]\n\n[Response A]\n{response_a}\n"
    "[End of Response A]\n\n[Response B]\n{response_b}\n[End of Response B]", r"<answer>\s*(A|B)\s*</answer>",
    labels={"A": -1.0, "B": 1.0})


class Counting(ScriptedGenRMBackend):
    """A scripted backend that records every conversation it is asked."""

    def __init__(self, fn):
        super().__init__(fn)
        self.asked = []

    def ask(self, conversations):
        self.asked.extend(conversations)
        return super().ask(conversations)


def _fast(url, **kw):
    return EndpointConfig(base_url=url, timeout=5.0, max_retries=kw.pop("max_retries", 1), backoff=0.01, **kw)


# ------------------------------------------------------------------------------------------------ templates
def test_template_parses_the_last_verdict_in_range_and_skips_think_blocks():
    assert POINTWISE.parse("Principles ... Score: \\boxed{7}") == 7.0
    assert POINTWISE.parse("format is \\boxed{3}; my answer: \\boxed{ 9 }") == 9.0  # the last one counts
    assert POINTWISE.parse("<think>\\boxed{2}</think> no verdict") is None
    assert POINTWISE.parse("\\boxed{11}") is None and POINTWISE.parse("\\boxed{0}") is None  # out of [1, 10]
    assert POINTWISE.parse("no score") is None and POINTWISE.parse(None) is None
    assert PAIRWISE.parse("B is better. <answer>B</answer>") == 1.0
    assert PAIRWISE.parse("<answer>A</answer>") == -1.0 and PAIRWISE.parse("<answer>C</answer>") is None
    assert POINTWISE.protocol == "pointwise" and PAIRWISE.protocol == "pairwise"
    messages = PAIRWISE.messages(question="q", response_a="x", response_b="y")
    assert len(messages) == 1 and "[Response A]\nx\n" in messages[0]["content"]  # empty system: not sent


@pytest.mark.parametrize("kwargs, match", [
    (dict(user="{question} only"), r"fields \['question'\].*exactly \['question', 'response'\]"),
    (dict(user="{question} {response} {extra}"), "exactly"),
    (dict(verdict_regex=r"\\boxed\{\d+\}"), "needs a group"),
    (dict(verdict_regex=r"(unclosed"), "not a regex"),
    (dict(low=5, high=5), r"score range \[5, 5\] is empty"),
    (dict(labels={}, user="{question} {response_a} {response_b}"), "needs verdict labels"),
    (dict(labels={"A": -1}), r"pairwise template needs exactly"),
    (dict(user="{question} {response"), "is not a template"),
])
def test_bad_templates_are_refused(kwargs, match):
    base = dict(name="bad", system="", user="{question} {response}", verdict_regex=r"(\d+)")
    with pytest.raises(PluginConfigError, match=match):
        GenRMTemplate(**{**base, **kwargs})


# ------------------------------------------------------------------------------------------------ aggregation
def test_aggregations():
    assert aggregate_verdicts([7, 9, 8], "vote") == 24  # SPCT: the sum
    assert aggregate_verdicts([7, None, 9], "vote") == 24  # the unparsed sample counts as the parsed mean
    assert aggregate_verdicts([7, None, 9], "mean") == 8
    assert aggregate_verdicts([1, 1, -1], "majority") == 1
    assert aggregate_verdicts([1, -1], "majority") == 0  # a tie: the mean of the tied values
    assert math.isnan(aggregate_verdicts([None, None], "vote"))
    with pytest.raises(PluginConfigError, match="'median'"):
        aggregate_verdicts([1], "median")


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=0), r"k=0; it must be an integer >= 1"),
    (dict(k=2.0), r"k=2.0"),
    (dict(aggregate="sum"), r"aggregate='sum'; allowed: 'vote', 'mean', 'majority'"),
    (dict(max_unparsable=1.5), r"max_unparsable=1.5"),
    (dict(parse_retries=-1), "parse_retries"),
    (dict(meta_keep=2), "both or neither"),
    (dict(k=2, meta_keep=3, meta_filter=lambda m, t: [0] * len(t)), r"meta_keep=3; allowed: 1 to k=2"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(PluginConfigError, match=match):
        GenerativeRewardModel(ScriptedGenRMBackend(lambda m: ""), POINTWISE, name="judge-x", **kwargs)


# ------------------------------------------------------------------------------------------------ scripted judge
def test_scripted_judge_grades_with_the_verifier_and_votes_k_samples():
    backend = Counting(scripted_genrm("arithmetic"))
    rm = GenerativeRewardModel(backend, POINTWISE, k=3, aggregate="vote")
    out = rm.score([PROBLEM.question] * 3, [RIGHT, WRONG, "gibberish"])
    assert out.values[0] == 30.0  # 3 samples of 10
    assert 3.0 <= out.values[1] < out.values[0] and out.values[2] < out.values[0]
    assert out.samples[0] == [10.0, 10.0, 10.0] and len(backend.asked) == 9
    assert "\\boxed{10}" in out.texts[0][0]


def test_cache_keyed_by_prompt_and_completion_never_pays_twice():
    backend = Counting(scripted_genrm("arithmetic"))
    rm = GenerativeRewardModel(backend, POINTWISE, k=2)
    first = rm.score([PROBLEM.question, PROBLEM.question], [RIGHT, WRONG])
    assert len(backend.asked) == 4
    again = rm.score([PROBLEM.question, PROBLEM.question, PROBLEM.question], [WRONG, RIGHT, "Answer: 14"])
    assert len(backend.asked) == 6  # only the new completion was asked (a refill round)
    assert again.values[:2] == [first.values[1], first.values[0]] and again.cached == [True, True, False]
    assert rm.stats["cache_hits"] == 2
    uncached = GenerativeRewardModel(Counting(scripted_genrm()), POINTWISE, k=2, cache_size=0)
    uncached.score([PROBLEM.question], [RIGHT])
    uncached.score([PROBLEM.question], [RIGHT])
    assert len(uncached.backend.asked) == 4


def test_pairwise_compare_sign_and_position_swap():
    rm = GenerativeRewardModel(ScriptedGenRMBackend(scripted_genrm()), PAIRWISE, k=1, aggregate="mean")
    q = [PROBLEM.question] * 3
    plain = rm.compare(q, [RIGHT, WRONG, WRONG], [WRONG, RIGHT, WRONG])
    assert plain.values == [1.0, -1.0, 1.0]  # first better, second better, a tie read as "A" (position bias)
    swapped = rm.compare(q, [RIGHT, WRONG, WRONG], [WRONG, RIGHT, WRONG], swap=True)
    assert swapped.values == [1.0, -1.0, 0.0]  # the swap cancels the position bias of the tie
    with pytest.raises(PluginConfigError, match="is pairwise; this call needs a pointwise"):
        rm.score(q, q)


def test_meta_filter_keeps_the_best_rated_samples_before_voting():
    answers = iter(["\\boxed{2}", "\\boxed{9}", "\\boxed{8}", "\\boxed{1}"])
    rm = GenerativeRewardModel(ScriptedGenRMBackend(lambda m: next(answers)), POINTWISE, k=4, aggregate="vote",
                               meta_filter=lambda m, texts: [int(t.strip("\\boxed{}")) for t in texts], meta_keep=2)
    out = rm.score(["q"], ["r"])
    assert out.samples[0] == [None, 9.0, 8.0, None]
    assert out.values[0] == 34.0  # the two kept (9, 8) voted over k=4: mean 8.5 * 4
    # a meta judge that is itself a GenRM reading the critiques
    meta = GenerativeRewardModel(ScriptedGenRMBackend(lambda m: "\\boxed{9}" if "\\boxed{7}" in m[-1]["content"]
                                                      else "\\boxed{1}"), POINTWISE, k=1)
    texts = iter(["\\boxed{7}", "\\boxed{3}"])
    rm2 = GenerativeRewardModel(ScriptedGenRMBackend(lambda m: next(texts)), POINTWISE, k=2, aggregate="mean",
                                meta_filter=meta_judge_filter(meta), meta_keep=1)
    assert rm2.score(["q"], ["r"]).values == [7.0]


# ------------------------------------------------------------------------------------------------ unparsable
def test_unparsable_verdicts_are_counted_logged_and_refused_past_the_share(caplog):
    texts = {"good": "\\boxed{8}", "bad": "I cannot decide."}
    rm = GenerativeRewardModel(ScriptedGenRMBackend(lambda m: texts["bad" if "BAD" in m[-1]["content"] else "good"]),
                               POINTWISE, k=2, max_unparsable=0.5, name="judge-under-test")
    with caplog.at_level(logging.WARNING, logger="trl_plugins.components.genrm"):
        out = rm.score(["q", "q"], ["fine", "BAD row"])
    assert out.values[0] == 16.0 and math.isnan(out.values[1])  # NaN, never a silent zero
    assert out.unparsable_rows == [1] and rm.stats["unparsable_samples"] == 2 and rm.stats["unparsable_rows"] == 1
    assert "judge-under-test" in caplog.text and "row 1" in caplog.text and "I cannot decide." in caplog.text
    with pytest.raises(GenRMParseError, match=r"judge-under-test.*scripted.*4 of 4 samples.*row 0.*"
                                              r"I cannot decide.*max_unparsable=0.5"):
        rm.score(["q", "q"], ["BAD", "BAD too"])  # 4 of 4 > 0.5 (the cached "fine" row is not asked)
    tolerant = GenerativeRewardModel(rm.backend, POINTWISE, k=2, max_unparsable=1.0)
    tolerant.score(["q"], ["BAD row"])
    tolerant.score(["q"], ["BAD row"])  # a row without a verdict is not cached: asked again
    assert tolerant.stats["samples"] == 4 and tolerant.stats["unparsable_rows"] == 2


def test_parse_retries_ask_again_for_unparsable_samples():
    answers = iter(["garbage", "\\boxed{6}", "\\boxed{4}"])
    backend = Counting(lambda m: next(answers))
    rm = GenerativeRewardModel(backend, POINTWISE, k=2, aggregate="mean", parse_retries=1, max_unparsable=0.0)
    out = rm.score(["q"], ["r"])
    assert out.values == [5.0] and len(backend.asked) == 3 and rm.stats["unparsable_samples"] == 0


# ------------------------------------------------------------------------------------------------ backends
def test_endpoint_backend_on_loopback_samples_k_requests_and_votes():
    seen = []
    with serve_openai_compatible(genrm_handler(ScriptedGenRMBackend(scripted_genrm()), seen)) as url:
        backend = EndpointGenRMBackend(_fast(url, model="grm"), sampling={"temperature": 0.5, "max_tokens": 64})
        rm = GenerativeRewardModel(backend, POINTWISE, k=3)
        out = rm.score([PROBLEM.question, PROBLEM.question], [RIGHT, WRONG])
        rm.score([PROBLEM.question], [RIGHT])  # cached: no request
        backend.close()
    assert out.values[0] == 30.0 and out.values[1] < 30.0
    assert len(seen) == 6  # k identical requests are k samples: the client's response cache is off
    assert seen[0]["model"] == "grm" and seen[0]["temperature"] == 0.5 and seen[0]["messages"][0]["role"] == "system"


def test_endpoint_backend_retries_with_backoff_and_fails_loudly():
    state = {"n": 0}

    def flaky(path, payload):
        state["n"] += 1
        return (503, {"error": "busy"}) if state["n"] == 1 else chat_response("\\boxed{5}")

    with serve_openai_compatible(flaky) as url:
        rm = GenerativeRewardModel(EndpointGenRMBackend(_fast(url, max_retries=2)), POINTWISE, k=1)
        assert rm.score(["q"], ["r"]).values == [5.0] and state["n"] == 2
    dead = GenerativeRewardModel(EndpointGenRMBackend(_fast("http://127.0.0.1:9/v1", max_retries=0)), POINTWISE)
    with pytest.raises(EndpointError, match=r"http://127\.0\.0\.1:9/v1/chat/completions"):
        dead.score(["q"], ["r"])


def test_hf_backend_runs_a_local_model_through_the_teacher(tmp_path):
    from trl_plugins.tasks.tiny import build_and_save

    path = build_and_save(tmp_path / "grm", hidden_size=16, num_layers=1, num_heads=2)
    backend = HFGenRMBackend(str(path), temperature=1.0, max_tokens=4)
    rm = GenerativeRewardModel(backend, POINTWISE, k=2, max_unparsable=1.0)
    out = rm.score([PROBLEM.question], [RIGHT])
    assert len(out.texts[0]) == 2 and all(isinstance(t, str) for t in out.texts[0])
    assert rm.stats["samples"] == 2 and backend.location == f"local model {str(path)!r}"
    # a tiny random model writes no verdict: the row is NaN and counted, not a zero
    assert math.isnan(out.values[0]) and rm.stats["unparsable_rows"] == 1
    with pytest.raises(EndpointError, match="Could not load the generative reward model"):
        HFGenRMBackend(str(tmp_path / "missing"))
