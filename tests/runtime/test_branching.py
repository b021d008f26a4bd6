"""The branching seam (GenerationService.continue_prefixes): request checks, per-request cuts, and on the tiny model
the log-probs and probes against a manual teacher-forced forward, the budget count and the vLLM refusal."""

import math

import pytest
import torch

from trl_plugins.api import PluginError
from trl_plugins.runtime.branching import check_requests, cut_continuation
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, script_generation


def _decode(ids):
    return "".join(chr(96 + i) for i in ids)  # 1 -> 'a', 2 -> 'b', ...


def test_cut_at_length_stop_and_eos():
    assert cut_continuation([1, 2, 3, 4], 2, [], [0], _decode) == ([1, 2], False, None)
    assert cut_continuation([1, 2, 3, 0], 9, [], [0], _decode) == ([1, 2, 3, 0], True, None)
    # 'bc' completes at the third token; 'a' would too but needs the first only: the earliest completion wins
    assert cut_continuation([1, 2, 3, 4], 9, ["bc"], [0], _decode) == ([1, 2, 3], True, "bc")
    assert cut_continuation([1, 2, 3, 4], 9, ["cd", "b"], [0], _decode) == ([1, 2], True, "b")
    # a stop string beyond the request's own limit does not count
    assert cut_continuation([1, 2, 3, 4], 2, ["cd"], [0], _decode) == ([1, 2], False, None)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens=0 for request 0; allowed: an integer >= 1"),
    ({"max_new_tokens": [3, 2.5]}, "max_new_tokens=2.5 for request 1"),
    ({"max_new_tokens": [3]}, "1 values of max_new_tokens for 2 requests"),
    ({"stop": [""]}, "stop string '' for request 0; allowed: non-empty strings"),
    ({"stop": [["x"], [""]]}, "stop string '' for request 1"),
    ({"probe_positions": [[0], [3]]}, "probe position 3 for request 1; allowed: 0 .. 2"),
    ({"top_k": -1}, "top_k=-1; allowed: an integer >= 0"),
])
def test_bad_requests_are_refused_with_the_reason(kwargs, message):
    args = {"max_new_tokens": 4, "stop": None, "probe_positions": None, "top_k": 0, **kwargs}
    with pytest.raises(PluginError, match=message.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        check_requests([[5], [6]], [[], [1, 2]], args["max_new_tokens"], args["stop"], args["probe_positions"],
                       args["top_k"], max_completion_length=8)


def test_prefix_filling_the_length_cap_is_refused_and_limits_are_capped():
    with pytest.raises(PluginError, match="prefix has 8 tokens; allowed: fewer than max_completion_length=8"):
        check_requests([[5]], [[1] * 8], 4, None, None, 0, max_completion_length=8)
    (r,) = check_requests([[5]], [[1] * 6], 4, ["x"], [[6]], 2, max_completion_length=8)
    assert (r.max_new, r.stop, r.positions) == (2, ["x"], [6])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tr = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, max_completion_length=12,
                           output_dir=str(tmp_path_factory.mktemp("seam")))
    tr.generation_service.begin_batch([1, 2, 3])
    tr.model.train()
    return tr


def _manual_logps(tr, prompt, completion):
    """(C, V) log-probs of the policy's next-token distribution before each completion token: one plain forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = tr.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / tr.temperature, dim=-1)


def test_continuations_on_the_tiny_model_match_a_teacher_forced_forward(trainer):
    svc = trainer.generation_service
    prompt = svc.tokenize(["Compute 1+2 step by step"])[0]
    prefix = [7, 8, 9]
    before = (svc.used_this_batch, svc.total, svc.policy_rollouts)
    tokens_before = svc.policy_tokens
    out = svc.continue_prefixes([prompt, prompt], [[], prefix], [5, 2], probe_positions=[[0], [1, 3]], top_k=4)
    assert (svc.used_this_batch, svc.total, svc.policy_rollouts) == (before[0] + 2, before[1] + 2, before[2] + 2)
    # sampled tokens: both requests sample up to the largest length (5) and are cut after; the prefix is not counted
    assert len(out[0].new_ids) + len(out[1].new_ids) <= svc.policy_tokens - tokens_before <= 2 * 5
    assert 1 <= len(out[0].new_ids) <= 5 and 1 <= len(out[1].new_ids) <= 2
    assert out[1].completion_ids[:3] == prefix and out[1].completion_ids[3:] == out[1].new_ids
    for r, pre in zip(out, [[], prefix]):
        table = _manual_logps(trainer, prompt, r.completion_ids)
        expected = table[torch.arange(len(r.completion_ids)), torch.tensor(r.completion_ids)][len(pre):]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=1e-4)
        for probe in r.probes:
            row = table[probe.position]
            top = torch.topk(row, 4)
            assert probe.top_ids == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(probe.top_logprobs), top.values, atol=1e-4, rtol=1e-4)
            assert probe.entropy == pytest.approx(float(-(row.exp() * row).sum()), abs=1e-4)
    assert [p.position for p in out[1].probes] == [1, 3]
    # the fork point of the prefix (t = len(prefix)) is the first new token's distribution
    assert out[1].probes[1].top_logprobs[0] >= out[1].logprobs[0]


def test_stop_strings_and_per_request_lengths_with_a_scripted_backend(trainer):
    svc = trainer.generation_service
    script_generation(trainer, lambda prompt, row: "ab. cd. ef")
    prompt = svc.tokenize(["Compute 1+2 step by step"])[0]
    out = svc.continue_prefixes([prompt] * 3, [[], [], []], [20, 20, 2], stop=[["."], ["cd"], ["."]])
    tok = trainer.processing_class
    texts = [tok.decode(r.new_ids, skip_special_tokens=True) for r in out]
    assert texts[0] == "ab." and out[0].stop == "." and out[0].finished
    assert texts[1] == "ab. cd" and out[1].stop == "cd"
    assert len(out[2].new_ids) == 2 and out[2].stop is None and not out[2].finished
    free = svc.continue_prefixes([prompt], [[]], 20)[0]  # no stop: runs to EOS
    assert free.finished and free.new_ids[-1] == tok.eos_token_id
    assert all(len(r.logprobs) == len(r.new_ids) and all(math.isfinite(x) for x in r.logprobs) for r in out)
    assert svc.continue_prefixes([], [], 3) == []  # a process with nothing to ask still takes part


def test_refused_under_vllm_with_the_reason(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "use_vllm", True)
    with pytest.raises(PluginError, match="use_vllm=False"):
        trainer.generation_service.continue_prefixes([[1]], [[]], 2)


def test_fork_prefixes_forces_distinct_top_tokens_at_the_fork(trainer):
    svc = trainer.generation_service
    prompt = svc.tokenize(["Compute 1+2 step by step"])[0]
    prefix = [7, 8]
    table = _manual_logps(trainer, prompt, prefix + [1])[len(prefix)]  # (V,) the distribution at the fork
    top = torch.topk(table, 4).indices.tolist()
    before = svc.used_this_batch
    out = svc.fork_prefixes([prompt] * 3, [prefix] * 3, [0, 1, 2], 4, exclude=[top[0], top[0], None])
    assert [r.new_ids[0] for r in out] == [top[1], top[2], top[2]]  # rank r of the top list once top[0] is left out
    assert svc.used_this_batch <= before + 3  # a forced EOS ends its fork without a generation
    for r in out:
        assert r.completion_ids[:2] == prefix and r.completion_ids[2:] == r.new_ids and len(r.new_ids) <= 4
        assert r.logprobs[0] == pytest.approx(float(table[r.new_ids[0]]), abs=1e-4)
        assert r.probes[0].position == 2 and r.probes[0].entropy == pytest.approx(
            float(-(table.exp() * table).sum()), abs=1e-4)
    assert svc.fork_prefixes([], [], [], 3) == []  # a process with nothing to ask still takes part
    with pytest.raises(PluginError, match="rank -1 for request 0"):
        svc.fork_prefixes([prompt], [prefix], [-1], 3)
    with pytest.raises(PluginError, match="2 ranks for 1 requests"):
        svc.fork_prefixes([prompt], [prefix], [0, 1], 3)


def test_forced_token_skips_the_excluded_one():
    from trl_plugins.runtime.branching import forced_token

    assert forced_token([5, 6, 7], 0, 5) == 6 and forced_token([5, 6, 7], 1, None) == 6
    assert forced_token([5, 6], 4, 6) == 5  # shorter than the rank: the least likely listed
