"""listener: a frozen listener re-reads the reasoning (answer hidden); its probability of the answer is a reward column.
The formula on small tensors, the column against the listener's own log-probs (local model and loopback endpoint),
the neutral setting against vanilla TRL and the refusals."""

import math

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.errors import PluginError
from trl_plugins.components.client import EndpointConfig
from trl_plugins.components.local_server import serve_openai_compatible
from trl_plugins.components.teacher import EndpointTeacher, HFTeacher, clear_shared_teachers
from trl_plugins.components.teacher_logprobs import teacher_logprob_handler
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    run_on_processes,
    tiny_model,
    tiny_tokenizer,
)
from trl_plugins_builtin.listener import COLUMN, listener_confidence, split_reasoning

TOK = tiny_tokenizer()
QUESTION = "Compute 3+4 step by step."
TEXTS = ["3+4=7\nAnswer: 7", "3+4=8\nAnswer: 8", "Answer: 7", "3 plus 4 is 7"]


@pytest.fixture(autouse=True)
def _fresh_listeners():
    yield
    clear_shared_teachers()


@pytest.fixture(scope="module")
def local():
    return HFTeacher(model=tiny_model(TOK, seed=5), tokenizer=TOK, batch_size=3)


def _ctx(texts=TEXTS, G=2, **processes):
    N = len(texts)
    return make_reward_context(torch.zeros(N, 2), num_generations=G, reward_func_names=["accuracy_reward", COLUMN],
                               rows=[{"prompt": [{"role": "user", "content": QUESTION}], "answer": "7"}] * N,
                               completions=[[{"role": "assistant", "content": t}] for t in texts], tokenizer=TOK,
                               **processes)


def _run(ctx, listener, **options):
    stack = build_plugins(["listener"], {"listener": {"teacher_model": "unused", **options}})
    plugin = list(stack)[0]
    plugin.listener = listener
    stack.call("trl_plugins_transform_rewards", ctx)
    return plugin


def _expected(listener, reasoning, answer):
    prompt = TOK(f"{QUESTION}\n\n{reasoning}\nAnswer:", add_special_tokens=False)["input_ids"]
    target = TOK(f" {answer}", add_special_tokens=False)["input_ids"]
    return math.exp(float(listener.logprobs([prompt], [target])[0].double().sum()))


def test_split_hides_the_answer_from_the_listener():
    assert split_reasoning("3+4=7\nAnswer: 7\nmore", r"(?i)answer\s*:") == ("3+4=7", "7")
    assert split_reasoning("no marker here", r"(?i)answer\s*:") == ("no marker here", None)
    assert split_reasoning("x ANSWER:", r"(?i)answer\s*:") == ("x", "")


def test_confidence_is_the_answer_probability_or_the_mean_token_probability():
    logps = [torch.log(torch.tensor([0.5, 0.4])), torch.zeros(0), torch.log(torch.tensor([1.0]))]
    torch.testing.assert_close(listener_confidence(logps, "sequence"), torch.tensor([0.2, 0.0, 1.0]))
    torch.testing.assert_close(listener_confidence(logps, "mean_token"), torch.tensor([0.45, 0.0, 1.0]))


def test_column_is_the_listeners_probability_of_the_reference_after_the_reasoning(local):
    ctx = _ctx()
    _run(ctx, local)
    column = ctx.rewards_per_func[:, 1]
    expected = [_expected(local, "3+4=7", "7"), _expected(local, "3+4=8", "7"), 0.0,
                _expected(local, "3 plus 4 is 7", "7")]
    torch.testing.assert_close(column, torch.tensor(expected), rtol=1e-5, atol=1e-7)
    assert 0.0 < column[0] < 1.0 and column[0] != column[1]  # another reasoning, another confidence
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0] * 4  # the other column untouched
    assert ctx.metrics["plugins/listener/no_answer_fraction"] == [0.25]
    assert ctx.metrics["plugins/listener/confidence_mean"][0] == pytest.approx(sum(expected) / 4, rel=1e-5)


def test_target_policy_scores_the_reasoners_own_answer(local):
    ctx = _ctx()
    _run(ctx, local, target="policy")
    column = ctx.rewards_per_func[:, 1]
    assert column[1].item() == pytest.approx(_expected(local, "3+4=8", "8"), rel=1e-5)
    assert column[3].item() == 0.0  # no answer given: nothing to be confident in


def test_an_endpoint_listener_over_loopback_gives_the_local_column(local):
    with serve_openai_compatible(teacher_logprob_handler(local)) as url:
        endpoint = EndpointTeacher(EndpointConfig(base_url=url, model="listener", max_retries=0))
        remote = _ctx()
        _run(remote, endpoint)
        endpoint.close()
    here = _ctx()
    _run(here, local)
    torch.testing.assert_close(remote.rewards_per_func, here.rewards_per_func, rtol=1e-4, atol=1e-6)


def test_two_processes_each_score_their_rows_and_share_the_whole_column(local):
    here = _ctx()
    _run(here, local)

    def work(rank, gather):
        ctx = _ctx(num_processes=2, process_index=rank, gather=gather)
        _run(ctx, local)
        return ctx.rewards_per_func[:, 1]

    for column in run_on_processes(2, work, timeout=60):
        torch.testing.assert_close(column, here.rewards_per_func[:, 1], rtol=1e-5, atol=1e-7)


def test_a_listener_failing_on_one_process_stops_both(local):
    class Broken:
        def logprobs(self, prompt_ids, completion_ids):
            raise RuntimeError("listener endpoint gone")

    def work(rank, gather):
        ctx = _ctx(num_processes=2, process_index=rank, gather=gather)
        try:
            _run(ctx, local if rank == 0 else Broken())
        except Exception as exc:
            return exc
        return None

    first, second = run_on_processes(2, work, timeout=60)
    assert isinstance(second, RuntimeError) and "listener endpoint gone" in str(second)
    assert isinstance(first, PluginError) and "listener: process 1 failed" in str(first)


@pytest.mark.parametrize(("options", "message"), [
    ({"answer_marker": "("}, r"answer_marker='\(' is not a valid regex"),
    ({"answer_template": " {solution}"}, "answer_template"),
    ({"teacher_model": "default"}, "needs teacher_model"),
    ({"teacher": "endpoint"}, "base"),
    ({"target": "both"}, "target"),
    ({"reward_weight": -1.0}, "reward_weight"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["listener"], {"listener": {"teacher_model": "unused", **options}})


def test_a_listener_with_another_tokenizer_is_refused_when_the_trainer_is_built(tmp_path):
    path = build_and_save(tmp_path / "listener", hidden_size=16, num_layers=1, num_heads=2)
    other = tiny_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(PluginConfigError, match="does not share the policy's tokenizer"):
        make_tiny_trainer(plugins=["listener"], plugin_config={"listener": {"teacher_model": str(path)}},
                          tokenizer=other, model=tiny_model(other), max_steps=1, output_dir=str(tmp_path / "o"))


def test_neutral_weight_zero_matches_vanilla_grpo_and_the_column_trains(tmp_path):
    path = str(build_and_save(tmp_path / "listener", hidden_size=16, num_layers=1, num_heads=2))
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["listener"], plugin_config={"listener": {"teacher_model": path, "reward_weight": 0.0}}, **common))
    for a, b in zip(vanilla.rewards, neutral.rewards):
        assert b.shape[1] == a.shape[1] + 1 and torch.equal(a, b[:, :2])
        assert ((b[:, 2] >= 0) & (b[:, 2] <= 1)).all()  # the listener column is filled, a probability
    for a, b in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], atol=0, rtol=0)
    logs = [log for log in neutral.logs if "loss" in log]
    assert logs and all("plugins/listener/confidence_mean" in log for log in logs)
