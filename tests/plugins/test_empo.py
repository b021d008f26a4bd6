"""empo: label-free semantic-cluster reward (EMPO) and majority-vote reward (TTRL).

Exact rewards on a hand-built RewardContext (whole groups, answers gathered), the optional entropy filter, the
neutral setting (weight 0) against trl.GRPOTrainer, and a short label-free run (EMPO is the only reward)."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.empo import empo_rewards


def reward_ctx(texts, G, names=("acc", "empo")):
    N = len(texts)
    gathered = []

    def gather(values):
        gathered.append(values)
        return values

    ctx = make_reward_context(torch.full((N, len(names)), 0.5), num_generations=G, reward_func_names=list(names),
                              completions=[[{"role": "assistant", "content": t}] for t in texts], gather_object=gather)
    ctx.gathered = gathered
    return ctx


TEXTS = ["Answer: 3", "Answer: 3", "Answer: 4", "nothing",  # group 0: clusters {3: 2, 4: 1}, one unanswered
         "Answer: 7", "Answer: 7", "Answer: 7", "Answer: 7"]  # group 1: all agree


def test_empo_rewards_exact():
    assert empo_rewards([[0, 0, 1, None], [0, 0, 0, 0]], "semantic_cluster") == [0.5, 0.5, 0.25, 0.0, 1, 1, 1, 1]
    assert empo_rewards([[0, 1, 1, None], [0, 1, 0, 1]], "majority_vote") == [0, 1, 1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("mode,expected", [
    ("semantic_cluster", [0.5, 0.5, 0.25, 0.0, 1.0, 1.0, 1.0, 1.0]),
    ("majority_vote", [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
])
def test_transform_fills_the_empo_column_with_whole_groups_in_view(mode, expected):
    stack = build_plugins(["empo"], {"empo": {"mode": mode}})
    ctx = reward_ctx(TEXTS, G=4)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == expected
    assert ctx.rewards_per_func[:, 0].tolist() == [0.5] * 8  # other columns untouched
    assert len(ctx.gathered) == 1
    H0 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))  # entropy over the answered rows of group 0
    assert ctx.metrics["plugins/empo/semantic_entropy"] == [pytest.approx(H0 / 2)]
    assert ctx.metrics["plugins/empo/answered_fraction"] == [7 / 8]


def test_entropy_thresholds_zero_the_advantages_of_filtered_groups():
    stack = build_plugins(["empo"], {"empo": {"entropy_low": 0.1}})
    stack.call("trl_plugins_transform_rewards", reward_ctx(TEXTS, G=4))
    N = 8
    actx = make_advantage_context(torch.zeros(N), num_generations=4, rewards_per_func=torch.zeros(N, 2),
                                  advantages=torch.arange(1.0, 9.0), completion_lengths=torch.ones(N))
    stack.call("trl_plugins_transform_advantages", actx)
    assert actx.advantages.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]  # group 1 has entropy 0 <= 0.1: filtered


def test_options_refused():
    with pytest.raises(PluginConfigError, match="extractor"):
        build_plugins(["empo"], {"empo": {"extractor": "nope"}})


RUN = dict(max_steps=2, log_level="error")


def test_neutral_weight_zero_is_vanilla(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, reward_funcs=[digit_fraction_reward],
                                           output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(plugins=["empo"], reward_funcs=[digit_fraction_reward],
                                        plugin_config={"empo": {"reward_weight": 0.0, "extractor": "last_number"}},
                                        output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    for x, y in zip(vanilla.completion_ids, ours.completion_ids):
        assert torch.equal(x, y)
    for x, y in zip(vanilla.rewards, ours.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
    for x, y in zip(vanilla.advantages, ours.advantages):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(ours.losses), rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], ours.params[key], rtol=0, atol=0)


def test_end_to_end_label_free(tmp_path):
    trainer = make_tiny_trainer(plugins=["empo"], reward_funcs=[],
                                plugin_config={"empo": {"extractor": "last_number"}}, output_dir=str(tmp_path), **RUN)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert trainer.reward_func_names == ["empo"]
    assert any(r.std() > 0 for r in run.rewards)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert "rewards/empo/mean" in log and "plugins/empo/semantic_entropy" in log
