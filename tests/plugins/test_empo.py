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


# ------------------------------------------------------------------------------ TTRL vote pool (vote_pool > G)
def test_pooled_majority_votes_count_the_extra_votes():
    from trl_plugins_builtin.empo import pooled_majority_votes

    answers = ["3", "4", "4", None, "7", "7", "8", "8"]
    # group 0: trained answers alone elect 4; with three extra votes for 3 the pool elects 3
    # group 1: a 2-2 tie among the trained answers (first seen: 7) is broken by the extra votes for 8
    assert pooled_majority_votes(answers, [["3", "3", "3"], ["8", None]], 4) == [1, 0, 0, 0, 0, 0, 1, 1]
    assert pooled_majority_votes(answers, [[], []], 4) == empo_rewards([[0, 1, 1, None], [0, 0, 1, 1]], "majority_vote")


def _vote_pool_stage(rank, gather, texts, G, pool, respond, B):
    """Sampling stage then reward stage of one (simulated) process holding rows [rank*B, (rank+1)*B)."""
    from trl_plugins.testing import StubGenerationService, make_reward_context, make_rollout_context

    stack = build_plugins(["empo"], {"empo": {"mode": "majority_vote", "vote_pool": pool, "extractor": "last_number"}})
    service = StubGenerationService(respond)
    local = texts[rank * B:(rank + 1) * B]
    rctx = make_rollout_context(local, num_generations=G, process_index=rank, gather=gather, service=service)
    stack.call("trl_plugins_after_generation", rctx)
    N = len(texts)
    gather_objects = getattr(gather, "objects", list)  # the reward builder takes all N rows (collective)
    rows, completions = gather_objects(rctx.rows), gather_objects(rctx.completions)
    ctx = make_reward_context(torch.zeros(N, 2), num_generations=G, reward_func_names=["acc", "empo"], rows=rows,
                              completions=completions, num_processes=N // B, process_index=rank, gather=gather)
    stack.call("trl_plugins_transform_rewards", ctx)
    return service.calls, ctx.rewards_per_func[:, 1].tolist(), ctx.metrics


def test_vote_pool_generates_the_extra_votes_once_per_prompt_and_elects_over_the_pool():
    G, pool = 4, 7
    texts = ["Answer: 3", "Answer: 4", "Answer: 4", "none", "Answer: 7", "Answer: 7", "Answer: 8", "Answer: 8"]
    extra = {"Q0": "Answer: 3", "Q1": "Answer: 8"}  # each prompt's extra votes

    def respond(prompt, j):
        return extra[prompt[-1]["content"]]

    calls, rewards, metrics = _vote_pool_stage(0, lambda t: t, texts, G, pool, respond, B=8)
    assert [len(c) for c in calls] == [2 * (pool - G)]  # one collective call, P - G prompts per group
    assert [p[-1]["content"] for p in calls[0]] == ["Q0"] * 3 + ["Q1"] * 3
    assert rewards == [1, 0, 0, 0, 0, 0, 1, 1]  # 3 (1+3 votes) beats 4 (2); 8 (2+3) beats 7 (2)
    assert metrics["plugins/empo/vote_pool_size"] == [7.0]
    # without the pool the trained rollouts alone elect 4 and 7
    stack = build_plugins(["empo"], {"empo": {"mode": "majority_vote", "extractor": "last_number"}})
    ctx = reward_ctx(texts, G=4)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]


def test_vote_pool_on_two_processes():
    from trl_plugins.testing import run_on_processes

    G, pool = 2, 4
    texts = ["Answer: 5", "Answer: 6", "Answer: 6", "Answer: 5",  # process 0: groups 0, 1 (Q0, Q1)
             "Answer: 5", "Answer: 6", "Answer: 6", "Answer: 6"]  # process 1: groups 2, 3 (Q2, Q3)
    votes = {"Q0": "Answer: 6", "Q1": "Answer: 5", "Q2": "Answer: 6", "Q3": "Answer: 5"}
    results = run_on_processes(2, lambda rank, gather: _vote_pool_stage(
        rank, gather, texts, G, pool, lambda prompt, j: votes[prompt[-1]["content"]], B=4))
    (calls0, rewards0, _), (calls1, rewards1, _) = results
    assert [[p[-1]["content"] for p in c] for c in calls0] == [["Q0", "Q0", "Q1", "Q1"]]
    assert [[p[-1]["content"] for p in c] for c in calls1] == [["Q2", "Q2", "Q3", "Q3"]]
    # every process rewards the whole batch from the gathered pools; group 3's two extra votes for 5 lose to 6 x 2
    # (tie broken by first appearance: 6 is seen first)
    assert rewards0 == rewards1 == [0, 1, 0, 1, 0, 1, 1, 1]


def test_vote_pool_up_to_g_asks_nothing_and_belongs_to_ttrl_mode():
    from types import SimpleNamespace

    from trl_plugins.testing import make_rollout_context

    for options in ({"vote_pool": 4}, {}):
        stack = build_plugins(["empo"], {"empo": {"mode": "majority_vote", "extractor": "last_number", **options}})
        ctx = make_rollout_context([["Answer: 1"] * 4], num_generations=4)
        stack.call("trl_plugins_after_generation", ctx)
        assert ctx.service.calls == []
    plugin = build_plugins(["empo"], {"empo": {"mode": "majority_vote", "vote_pool": 4}}).by_name["empo"]
    with pytest.warns(UserWarning, match="vote_pool=4 <= num_generations=4"):
        plugin.trl_plugins_configure(trainer=None, args=SimpleNamespace(num_generations=4))
    with pytest.raises(PluginConfigError, match="vote_pool.*majority_vote"):
        build_plugins(["empo"], {"empo": {"vote_pool": 8}})


def test_vote_pool_extra_votes_count_in_the_generation_budget(tmp_path):
    from trl_plugins import GenerationBudgetExceeded

    options = {"mode": "majority_vote", "vote_pool": 6, "extractor": "last_number"}
    trainer = make_tiny_trainer(plugins=["empo"], reward_funcs=[], plugin_config={"empo": options},
                                output_dir=str(tmp_path / "a"), **RUN)
    run = record_run(trainer)
    prompts_per_batch = trainer.args.per_device_train_batch_size // trainer.num_generations
    assert trainer.generation_service.total == 2 * prompts_per_batch * (6 - 4)  # two steps, P - G per prompt
    assert all(log["plugins/empo/extra_votes"] == prompts_per_batch * 2 for log in run.logs if "loss" in log)
    capped = make_tiny_trainer(plugins=["empo"], reward_funcs=[], plugin_config={"empo": options},
                               plugin_generation_budget=1, output_dir=str(tmp_path / "b"), **RUN)
    with pytest.raises(GenerationBudgetExceeded, match="plugin_generation_budget"):
        capped.train()
