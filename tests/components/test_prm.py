"""PRMs (trl_plugins.components.prm) and step utilities (trl_plugins.components.steps).

The HF PRM is exercised with a tiny two-label token-classification model built locally, saved with
``save_pretrained`` and loaded **by path** (the Qwen2.5-Math-PRM convention: steps followed by ``<extra_0>``, the
positive-class probability read at those positions). Endpoint PRMs talk HTTP to a real loopback server."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from trl_plugins.components.client import EndpointConfig, EndpointError
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.prm import (
    STEP_TOKEN,
    EndpointPRM,
    FunctionPRM,
    HFProcessRewardModel,
    ProgrammaticPRM,
    arithmetic_row,
    build_prm,
    clear_shared_prms,
    load_prm_model,
    prm_handler,
    shared_prm,
)
from trl_plugins.components.steps import first_error, split_steps, token_boundary
from trl_plugins.api.errors import PluginConfigError
from trl_plugins.tasks import arithmetic
from trl_plugins.tasks.arithmetic import Problem
from trl_plugins.testing import tiny_tokenizer

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14, Answer: 14
ROW = {"prompt": [{"role": "user", "content": PROBLEM.question}], "problem": PROBLEM.to_json(),
       "solution": PROBLEM.solution, "answer": "14"}


# ------------------------------------------------------------------------------------------ steps
def test_first_error_is_zero_based_spec_check():
    assert first_error([0.9, 0.8, 0.3, 0.9], 0.5) == 2  # the spec's 1-based k* = 3
    assert first_error([0.9, 0.8, 0.6], 0.5) is None
    assert first_error([0.1, 0.9], 0.5) == 0
    assert first_error([], 0.5) is None
    assert first_error([0.5], 0.5) is None  # "below" the threshold, not "at"


@pytest.mark.parametrize("text", ["3+4=7\n7*2=14\nAnswer: 14", "  3+4=7 \n\n7*2=15\r\nAnswer: 15\n", "", "\n\n"])
def test_split_steps_lines_matches_the_task_and_spans_point_into_the_text(text):
    spans = split_steps(text, "\n")
    assert [s.text for s in spans] == arithmetic.split_steps(text)
    assert all(text[s.start:s.end] == s.text for s in spans)


def test_split_steps_blank_line_separator():
    text = "Step one.\nstill one\n\n  Step two.\n\n\n\nThree"
    spans = split_steps(text, "\n\n")
    assert [s.text for s in spans] == ["Step one.\nstill one", "Step two.", "Three"]
    assert all(text[s.start:s.end] == s.text for s in spans)


def test_token_boundary_char_tokenizer_is_exact():
    tok = tiny_tokenizer()
    text = "3+4=7\n7*2=15\nAnswer: 15"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = split_steps(text, "\n")[1].start
    cut = token_boundary(ids, start, lambda x: tok.decode(x))
    assert tok.decode(ids[:cut]) == "3+4=7\n" and ids[:cut] == tok("3+4=7\n", add_special_tokens=False)["input_ids"]


def test_token_boundary_leaves_out_a_straddling_token():
    vocab = ["3+4", "=7", "\n7", "*2=", "15", "\nAns", "wer: 15"]  # "\n7" straddles the start of step 2
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    ids = list(range(len(vocab)))
    text = decode(ids)
    start = split_steps(text, "\n")[1].start  # index of "7*2=15"
    assert token_boundary(ids, start, decode) == 2  # keeps "3+4", "=7"; "\n7" is left out
    assert token_boundary(ids, len(text), decode) == len(ids)
    assert token_boundary(ids, 0, decode) == 0


# ------------------------------------------------------------------------------------------ programmatic PRM
def test_programmatic_prm_scores_and_first_error():
    prm = ProgrammaticPRM()
    good, bad = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15"
    assert prm.score_steps([ROW, ROW], [good, [{"role": "assistant", "content": bad}]]) == [
        [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert prm.first_error([ROW, ROW, ROW], [good, bad, ""], threshold=0.5) == [None, 1, None]
    with pytest.raises(PluginConfigError, match="'problem'"):
        prm.score_steps([{"prompt": "q"}], ["1+1=2"])


def test_function_prm_and_wrong_score_count_is_loud():
    prm = FunctionPRM(lambda row, steps: [0.25] * len(steps), separator="\n")
    assert prm.score_steps(["q"], ["a\nb"]) == [[0.25, 0.25]]
    broken = FunctionPRM(lambda row, steps: [1.0])
    with pytest.raises(EndpointError, match="1 step scores for a completion with 2 steps"):
        broken.score_steps(["q"], ["a\n\nb"])


def test_arithmetic_row_rebuilds_the_problem_from_the_question():
    row = arithmetic_row(PROBLEM.question)
    assert Problem.from_json(row["problem"]).answer == 14


# ------------------------------------------------------------------------------------------ HF PRM (tiny, by path)
@pytest.fixture(scope="module")
def tiny_prm_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_prm")
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [STEP_TOKEN]})
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForTokenClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _manual_scores(prm, question, steps):
    ids = prm.encode(question, steps)
    with torch.no_grad():
        logits = prm.model(input_ids=torch.tensor([ids])).logits[0]
    positions = [j for j, t in enumerate(ids) if t == prm.step_token_id]
    return torch.softmax(logits[positions], -1)[:, 1].tolist()


def test_hf_prm_loaded_by_path_follows_the_qwen_convention(tiny_prm_path):
    prm = HFProcessRewardModel(tiny_prm_path, separator="\n", batch_size=2)
    assert isinstance(prm.model, LlamaForTokenClassification)
    steps = ["3+4=7", "7*2=14", "Answer: 14"]
    text = prm.tokenizer.decode(prm.encode(PROBLEM.question, steps))
    assert text == (f"<|system|>{prm.system_prompt}<|user|>{PROBLEM.question}"
                    f"<|assistant|>3+4=7{STEP_TOKEN}7*2=14{STEP_TOKEN}Answer: 14{STEP_TOKEN}<|end|>")
    completions = ["\n".join(steps), "3+4=7\n7*2=15", "1+1=2\n2+2=4\n4+4=8\n8+8=16\nAnswer: 16"]
    batched = prm.score_steps([ROW] * 3, completions)  # batch of 2 + 1, right padded
    assert [len(s) for s in batched] == [3, 2, 5]
    for completion, scores in zip(completions, batched):
        expected = _manual_scores(prm, PROBLEM.question, [s.text for s in split_steps(completion, "\n")])
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-5, rtol=1e-5)
        assert all(0.0 < s < 1.0 for s in scores)
    assert prm.score_steps([ROW], [""]) == [[]]


def test_build_prm_hf_and_sharing(tiny_prm_path):
    clear_shared_prms()
    a = shared_prm("hf", model=tiny_prm_path, separator="\n")
    b = shared_prm("hf", model=tiny_prm_path, separator="\n")
    c = shared_prm("hf", model=tiny_prm_path, separator="\n\n")
    assert a is b and a is not c and isinstance(build_prm("programmatic"), ProgrammaticPRM)
    clear_shared_prms()


def test_load_prm_model_refuses_what_is_not_a_prm(tmp_path):
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    with pytest.raises(PluginConfigError, match="ForTokenClassification"):
        load_prm_model(str(tmp_path / "lm"))
    remote = json.loads((tmp_path / "lm" / "config.json").read_text())
    remote.update(architectures=["Qwen2ForProcessRewardModel"], auto_map={"AutoModel": "modeling_rm.Qwen2ForPRM"})
    (tmp_path / "lm" / "config.json").write_text(json.dumps(remote))
    with pytest.raises(PluginConfigError, match="trust_remote_code"):
        load_prm_model(str(tmp_path / "lm"))


# ------------------------------------------------------------------------------------------ endpoint PRM
def _endpoint(url, **kwargs):
    return EndpointPRM(EndpointConfig(base_url=url, max_retries=0, timeout=10), **kwargs)


@pytest.mark.parametrize("protocol", ["pooling", "chat"])
def test_endpoint_prm_over_loopback_matches_the_local_prm(protocol):
    seen = []
    local = ProgrammaticPRM()
    completions = [PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15", "", "9+9=18"]
    with serve_openai_compatible(prm_handler(local, seen=seen)) as url:
        prm = _endpoint(url, protocol=protocol, separator="\n")
        got = prm.score_steps([ROW] * 4, completions)
        prm.close()
    assert got == local.score_steps([ROW] * 4, completions)
    assert len(seen) == 3  # the empty completion is not sent
    path = "/pooling" if protocol == "pooling" else "/v1/chat/completions"
    assert {p for p, _, _ in seen} == {path}
    assert all(q == PROBLEM.question for _, q, _ in seen)
    assert sorted(s for _, _, s in seen)[0] == ["3+4=7", "7*2=14", "Answer: 14"]


def test_endpoint_pooling_serves_the_hf_prm(tiny_prm_path):
    hf = HFProcessRewardModel(tiny_prm_path, separator="\n")
    with serve_openai_compatible(prm_handler(hf, row_of=lambda q: q)) as url:
        prm = _endpoint(url, protocol="pooling", separator="\n")
        got = prm.score_steps([ROW], ["3+4=7\n7*2=15"])
        prm.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(hf.score_steps([ROW], ["3+4=7\n7*2=15"])))


def test_endpoint_prm_fails_loudly():
    def handler(path, payload):
        if path.endswith("/pooling"):
            return {"data": [{"data": [[0.1, 0.9]]}]}  # one score for two steps
        return chat_response("no json here")

    with serve_openai_compatible(handler) as url:
        with pytest.raises(EndpointError, match=r"/pooling returned 1 step scores for 2 steps"):
            _endpoint(url, separator="\n").score_steps([ROW], ["a\nb"])
        with pytest.raises(EndpointError, match=r"chat/completions answered without a JSON object"):
            _endpoint(url, protocol="chat", separator="\n").score_steps([ROW], ["a\nb"])
    with pytest.raises(EndpointError, match=r"http://127\.0\.0\.1:9/pooling failed"):
        _endpoint("http://127.0.0.1:9/v1", separator="\n").score_steps([ROW], ["a\nb"])
    with pytest.raises(PluginConfigError, match="base URL"):
        build_prm("endpoint")


def test_a_prm_that_cannot_be_loaded_is_one_error_naming_the_model_and_the_option(tmp_path):
    missing = tmp_path / "no-such-prm"
    with pytest.raises(EndpointError, match=r"Could not load the process reward model '.*no-such-prm' \(plugin option "
                                            r"prm_model"):
        HFProcessRewardModel(str(missing))
