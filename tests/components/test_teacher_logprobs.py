"""The teacher log-prob channel: per-token log-probs of given completions from a local HF teacher and from an
OpenAI-compatible endpoint (the completions echo protocol, on a real loopback server), the checks at construction
(tokenizer mismatch, a teacher that cannot return log-probs, a dead endpoint), and the ride from the advantage stage
(``AdvantageContext.attach_teacher_logps``) to the loss stage (``LossContext.teacher_logps``)."""

import copy
import math
import socket

import pytest
import torch

from trl_plugins import Plugin, PluginConfigError, PluginError, hookimpl
from trl_plugins.components.client import EndpointConfig, EndpointError
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.teacher import EndpointTeacher, HFTeacher, ReferenceTeacher
from trl_plugins.components.teacher_logprobs import (
    ECHO_PARAMS,
    PROBE_TEXT,
    parse_echo_logprobs,
    teacher_logprob_handler,
)
from trl_plugins.api.contexts import TEACHER_LOGPS_EXTRA
from trl_plugins.testing import (
    make_advantage_context,
    make_tiny_trainer,
    run_on_processes,
    stub_policy_stats,
    temporary_plugin,
    tiny_model,
    tiny_tokenizer,
)

TOK = tiny_tokenizer()
PROMPTS = [TOK("Q: 3+4?")["input_ids"], TOK("Q: 12*2?")["input_ids"], TOK("x")["input_ids"]]
COMPLETIONS = [TOK("3+4=7\nAnswer: 7")["input_ids"], TOK("Answer: 24")["input_ids"], []]


@pytest.fixture(scope="module")
def teacher():
    return HFTeacher(model=tiny_model(TOK, seed=3), tokenizer=TOK, batch_size=2)


def _dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _client(url, retries=0):
    return EndpointTeacher(EndpointConfig(base_url=url, model="teacher", max_retries=retries, backoff=0.01))


# ------------------------------------------------------------------------------------------ local model
def test_local_teacher_logprobs_are_the_models_next_token_logprobs_whatever_the_batch(teacher):
    batched = teacher.logprobs(PROMPTS, COMPLETIONS)
    assert [t.shape for t in batched] == [torch.Size([len(c)]) for c in COMPLETIONS]
    for p, c, got in zip(PROMPTS, COMPLETIONS, batched):
        if not c:
            continue
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = teacher.model(input_ids=ids).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, ids[0, len(p):, None]).squeeze(-1)
        assert torch.allclose(got, want, atol=1e-5)  # left padding of the batch changes nothing
        alone = teacher.logprobs([p], [c])[0]
        assert torch.allclose(got, alone, atol=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused_with_the_reason(teacher):
    teacher.check_logprobs(tiny_tokenizer())  # the same tokenizer passes
    other = tiny_tokenizer()
    other.add_tokens(["<tool>"])
    with pytest.raises(PluginConfigError, match=r"does not share the policy's tokenizer: vocabulary sizes differ"):
        teacher.check_logprobs(other)
    renamed = copy.deepcopy(tiny_tokenizer())
    renamed.eos_token = "<pad>"
    with pytest.raises(PluginConfigError, match="EOS ids differ"):
        teacher.check_logprobs(renamed)


def test_a_teacher_without_a_model_cannot_return_logprobs():
    with pytest.raises(PluginConfigError, match="cannot return per-token log-probs"):
        ReferenceTeacher().check_logprobs(TOK)
    with pytest.raises(PluginConfigError, match="cannot return per-token log-probs"):
        ReferenceTeacher().logprobs(PROMPTS, COMPLETIONS)


# ------------------------------------------------------------------------------------------ endpoint
def test_endpoint_logprobs_over_loopback_equal_the_local_teacher(teacher):
    seen = []
    with serve_openai_compatible(teacher_logprob_handler(teacher, seen=seen)) as url:
        endpoint = _client(url)
        endpoint.check_logprobs(TOK)  # the probe: log-probs come back, tokens match the policy's
        remote = endpoint.logprobs(PROMPTS, COMPLETIONS)
        endpoint.close()
    local = teacher.logprobs(PROMPTS, COMPLETIONS)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(remote, local))
    probe, requests = seen[0], seen[1:]
    assert probe["prompt"] == PROBE_TEXT
    assert len(requests) == 2  # the empty completion is not sent
    for payload in requests:
        assert {k: payload[k] for k in ECHO_PARAMS} == ECHO_PARAMS and payload["max_tokens"] == 0
        assert payload["model"] == "teacher" and payload["prompt"] in [p + c for p, c in zip(PROMPTS, COMPLETIONS)]


def test_endpoint_probe_refuses_a_server_without_logprobs_or_with_another_tokenizer():
    with serve_openai_compatible(lambda path, payload: {"choices": [{"index": 0, "text": "hi"}]}) as url:
        with pytest.raises(EndpointError, match=rf"{url}/completions cannot return teacher log-probs"):
            _client(url).check_logprobs(TOK)
    ids = TOK(PROBE_TEXT, add_special_tokens=False)["input_ids"]

    def shifted(path, payload):  # a server whose tokenizer splits the text into other ids
        return {"choices": [{"index": 0, "text": "", "logprobs": {
            "tokens": [f"token_id:{i + 1}" for i in ids], "token_logprobs": [None] + [-1.0] * (len(ids) - 1)}}]}

    with serve_openai_compatible(shifted) as url:
        with pytest.raises(PluginConfigError, match=rf"teacher endpoint {url}/completions tokenizes"):
            _client(url).check_logprobs(TOK)
        _client(url).check_logprobs(TOK, probe=False)  # no request: nothing to refuse


def test_a_dead_endpoint_is_retried_then_named_at_construction_and_at_scoring():
    url = _dead_url()
    with pytest.raises(EndpointError, match=rf"{url}/completions failed after 3 attempts"):
        _client(url, retries=2).check_logprobs(TOK)
    with pytest.raises(EndpointError, match=rf"{url}/completions failed after 1 attempts"):
        _client(url).logprobs(PROMPTS[:1], COMPLETIONS[:1])


def test_echo_answers_are_parsed_strictly():
    ids = [5, 6, 7, 8]
    url = "http://h/v1/completions"
    openai = {"logprobs": {"tokens": ["a", "b", "c", "d", "e"], "token_logprobs": [None, -1.0, -2.0, -3.0, -9.0]}}
    assert parse_echo_logprobs(openai, ids, 2, url) == [-2.0, -3.0]  # a generated 5th token is ignored
    vllm = {"prompt_logprobs": [None, {"6": {"logprob": -1.5}}, {"7": {"logprob": -0.5, "rank": 1}},
                                {"8": {"logprob": -0.25}}]}
    assert parse_echo_logprobs(vllm, ids, 2, url) == [-0.5, -0.25]
    with pytest.raises(EndpointError, match="echoed other tokens"):
        parse_echo_logprobs({"logprobs": {"tokens": ["token_id:5", "token_id:9", "token_id:7", "token_id:8"],
                                          "token_logprobs": [None, -1, -1, -1]}}, ids, 2, url)
    with pytest.raises(EndpointError, match=r"invalid log-prob None for completion token 1"):
        parse_echo_logprobs({"logprobs": {"token_logprobs": [None, -1.0, -1.0, None]}}, ids, 2, url)
    with pytest.raises(EndpointError, match="without prompt log-probs for the 4 tokens"):
        parse_echo_logprobs({"logprobs": {"token_logprobs": [None, -1.0]}}, ids, 2, url)


# ------------------------------------------------------------------------------------------ advantage -> loss
class FixedTeacher:
    """log-prob -(position + 1) / 10 for every token; ``fail`` raises like a dead endpoint."""

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def logprobs(self, prompt_ids, completion_ids):
        self.calls.append((prompt_ids, completion_ids))
        if self.fail:
            raise EndpointError("http://teacher/v1/completions failed after 5 attempts")
        return [-(torch.arange(len(c), dtype=torch.float32) + 1) / 10 for c in completion_ids]


def test_attach_scores_the_asked_rows_under_their_prompts_with_nan_elsewhere():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    stats = stub_policy_stats(4, 4, mask=mask)
    ctx = make_advantage_context([1.0, 0.0, 1.0, 0.0], num_generations=2, policy_stats=stats,
                                 prompt_ids=[[1], [1], [2, 3], [2, 3]])
    teacher = FixedTeacher()
    out = ctx.attach_teacher_logps(teacher, rows=[0, 2])
    (prompts, completions), = teacher.calls
    assert prompts == [[1], [2, 3]] and completions == [stats.completion_ids[0, :3].tolist(),
                                                        stats.completion_ids[2].tolist()]
    assert torch.allclose(out[0, :3], torch.tensor([-0.1, -0.2, -0.3])) and math.isnan(out[0, 3])
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()
    assert ctx.local_extras[TEACHER_LOGPS_EXTRA] is out
    again = ctx.attach_teacher_logps(FixedTeacher(), rows=[1])  # a second plugin: its rows overwrite, others stay
    assert torch.equal(again[0].nan_to_num(), out[0].nan_to_num()) and not torch.isnan(again[1, :2]).any()


def test_a_teacher_failing_on_one_process_stops_every_process():
    def work(rank, gather):
        ctx = make_advantage_context([1.0, 0.0], num_generations=2, gather=gather)
        try:
            ctx.attach_teacher_logps(FixedTeacher(fail=rank == 1), rows=[0])
        except Exception as exc:  # each process's own error
            return exc
        return None

    first, second = run_on_processes(2, work, timeout=10)
    assert isinstance(second, EndpointError) and "http://teacher/v1" in str(second)
    assert isinstance(first, PluginError) and "process 1 failed" in str(first)


class ChannelProbe(Plugin):
    """Attaches a teacher's log-probs at the advantage stage and records what the loss stage receives."""

    name = "test_teacher_channel"
    teacher = None
    seen: list = []

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ctx.attach_teacher_logps(ChannelProbe.teacher, rows=[i for i in range(len(ctx.local_prompt_ids)) if i % 2])

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ChannelProbe.seen.append((ctx.teacher_logps.clone(), ctx.old_per_token_logps.detach().clone(),
                                  ctx.mask.clone(), ctx.inputs["completion_ids"].clone()))


def test_teacher_logps_ride_to_the_loss_stage_aligned_with_the_policy_tokens(tmp_path):
    """A teacher that is a copy of the policy (temperature 1) gives the policy's own log-probs on every scored token,
    whatever the shuffle between the advantage and the loss stage."""
    ChannelProbe.seen = []
    with temporary_plugin(ChannelProbe):
        trainer = make_tiny_trainer(plugins=["test_teacher_channel"], max_steps=1, output_dir=str(tmp_path),
                                    gradient_accumulation_steps=2, per_device_train_batch_size=4)
        ChannelProbe.teacher = HFTeacher(model=copy.deepcopy(trainer.model), tokenizer=trainer.processing_class)
        trainer.train()
    assert len(ChannelProbe.seen) == 2
    scored_rows = 0
    for teacher_logps, policy_logps, mask, ids in ChannelProbe.seen:
        assert teacher_logps.shape == ids.shape
        present = ~torch.isnan(teacher_logps)
        assert torch.equal(present.any(-1), present[:, 0])  # whole rows, from their first token
        assert torch.equal(present & mask.bool(), present)  # never past a completion's end
        rows = present.any(-1)
        scored_rows += int(rows.sum())
        assert torch.equal(present[rows], mask.bool()[rows])
        assert torch.allclose(teacher_logps[present], policy_logps[present], atol=1e-4)
    assert scored_rows == 4  # every other row of the 8-row generation batch


def test_an_endpoint_teacher_answering_chat_and_echo_on_one_server(teacher):
    with serve_openai_compatible(teacher_logprob_handler(teacher, chat_text="Try 7.")) as url:
        endpoint = _client(url)
        assert endpoint.chat([[{"role": "user", "content": "hint?"}]]) == ["Try 7."]
        assert endpoint.logprobs(PROMPTS[:1], COMPLETIONS[:1])[0].numel() == len(COMPLETIONS[0])
        endpoint.close()
    assert chat_response("x")["choices"][0]["message"]["content"] == "x"
