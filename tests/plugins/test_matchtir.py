"""MatchTIR: tool calls matched against the gold trace give turn rewards; turn- and trajectory-level advantages mix."""

import json
import math

import datasets
import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError
from trl_plugins.testing import build_stack, group_normalized_advantages, make_advantage_context, run_hook
from trl_plugins.runtime.trainer import PluginGRPOTrainer
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.matchtir import (
    MatchtirOptions, call_similarity, dual_level_advantages, greedy_assignment, optimal_assignment, sinkhorn_plan,
    turn_call_rewards,
)

SEARCH_A = {"name": "search", "arguments": {"query": "Brellin"}}
SEARCH_B = {"name": "search", "arguments": {"query": "Tavok"}}
CALC = {"name": "calculator", "arguments": {"expression": "4+5"}}
GOLD = json.dumps([SEARCH_A, CALC])
TOOL = {"role": "tool", "name": "search", "content": "doc"}
ANSWER = {"role": "assistant", "content": "Answer: 9"}


def _call_turn(call):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}


def _turns(calls):
    """TurnStructure of a completion: one call per turn (2 model tokens, 1 tool-result token), then the answer."""
    mask, messages = [], []
    for call in calls:
        mask += [1, 1, 0]
        messages += [_call_turn(call), TOOL]
    return build_turn_structure(list(range(len(mask) + 2)), mask + [1, 1], messages + [ANSWER])


def _ctx(call_lists, rewards, G=2):
    turns = [_turns(c) for c in call_lists]
    return make_advantage_context(rewards, num_generations=G, turns=turns, rows=[{"gold_calls": GOLD}] * len(turns))


def _run(ctx, **options):
    return run_hook("matchtir", "trl_plugins_transform_advantages", ctx, {"matchtir": options})


def test_similarity_weighs_name_parameter_names_and_values():
    assert call_similarity(SEARCH_A, SEARCH_A) == 1.0
    assert call_similarity(SEARCH_B, SEARCH_A) == pytest.approx((1 + 1 + 0) / 3)  # right tool, wrong value
    assert call_similarity({"name": "search", "arguments": {"q": "Brellin"}}, SEARCH_A) == pytest.approx(1 / 3)
    assert call_similarity(CALC, SEARCH_A) == 0.0  # another tool: nothing counts
    assert call_similarity({"name": "Search", "arguments": '{"query": "Brellin"}'}, SEARCH_A) == 1.0
    numeric = {"name": "f", "arguments": {"x": 3}}
    assert call_similarity({"name": "f", "arguments": {"x": 3.0}}, numeric) == 1.0  # 3 == 3.0 in Python
    assert call_similarity({"name": "f", "arguments": {"x": " 3"}}, {"name": "f", "arguments": {"x": "3"}}) < 1.0
    assert call_similarity({"name": "f", "arguments": {"x": " 3"}}, {"name": "f", "arguments": {"x": "3"}},
                           normalised_values=True) == 1.0


def test_hard_assignment_is_optimal_where_greedy_is_not():
    S = torch.tensor([[1.0, 0.2], [0.9, 0.0]], dtype=torch.float64)
    assert optimal_assignment(S) == [1, 0]  # total 1.1
    assert greedy_assignment(S) == [0, None]  # takes the best pair first: total 1.0
    assert optimal_assignment(torch.tensor([[0.5], [0.9], [0.1]], dtype=torch.float64)) == [None, 0, None]
    assert optimal_assignment(torch.zeros(0, 2, dtype=torch.float64)) == []


def test_soft_assignment_transports_uniform_mass():
    S = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.5]], dtype=torch.float64)
    T = sinkhorn_plan(S, reg=0.1)
    assert torch.allclose(T.sum(1), torch.full((3,), 1 / 3, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(T.sum(0), torch.full((2,), 1 / 2, dtype=torch.float64), atol=1e-6)
    assert T[0, 0] > 0.33 and T[1, 1] > 0.33  # the exact matches carry (almost) all of their rows' mass


def test_each_gold_call_rewards_one_predicted_call():
    opts = MatchtirOptions()
    # a redundant repeat of the first search earns nothing: the gold search is already matched
    rewards, matched = turn_call_rewards([[SEARCH_A], [SEARCH_A], [CALC], []], json.loads(GOLD), opts)
    assert rewards == pytest.approx([1.0, 0.0, 1.0, 0.0]) and matched == 2
    # two calls in one turn: the turn gets their mean
    rewards, _ = turn_call_rewards([[SEARCH_B, CALC], []], json.loads(GOLD), opts)
    assert rewards == pytest.approx([(2 / 3 + 1.0) / 2, 0.0])
    rewards, _ = turn_call_rewards([[SEARCH_A], [SEARCH_A]], json.loads(GOLD), MatchtirOptions(unmatched_reward=-0.5))
    assert rewards == pytest.approx([1.0, -0.5])


def test_dual_level_advantage_averages_the_group_and_turn_normalisations():
    # one group of two rows with two turns each; turn rewards r, trajectory reward = their sum
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    adv = dual_level_advantages(rewards, rewards.sum(1), torch.tensor([0, 0]), gamma=0.5, turn_weight=0.5,
                                scale=False)
    a_traj = torch.tensor([0.5, -0.5])  # 2 and 1, centred
    returns = torch.tensor([[1.5, 1.0], [0.5, 1.0]])  # r_0 + 0.5 r_1, r_1
    a_turn = returns - returns.mean(0)
    assert torch.allclose(adv, 0.5 * a_traj.unsqueeze(1) + 0.5 * a_turn)


def test_turn_advantages_reach_the_tokens_and_credit_the_matching_calls():
    # both rows answer correctly; row 0 follows the gold trace, row 1 searches the wrong place first
    ctx = _run(_ctx([[SEARCH_A, CALC], [SEARCH_B, CALC]], [1.0, 1.0]), scale=False)
    assert ctx.turn_rewards[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert ctx.turn_rewards[1].tolist() == pytest.approx([2 / 3, 1.0, 1.0])
    adv = ctx.advantages
    assert adv.shape == (2, 8)
    # trajectory level: sums 3 and 8/3 centred to +-1/6; turn level: the first turns' returns differ by 1/3
    assert adv[0, 0] == pytest.approx(1 / 6, abs=1e-6) and adv[1, 0] == pytest.approx(-1 / 6, abs=1e-6)
    # identical second turns: only the trajectory level tells them apart
    assert adv[0, 3] == pytest.approx(1 / 12, abs=1e-6) and adv[1, 3] == pytest.approx(-1 / 12, abs=1e-6)
    assert adv[0, 2] == 0.0 and adv[0, 5] == 0.0  # tool-result tokens carry no advantage
    assert adv[0, 0] == adv[0, 1]  # every token of a turn gets the turn's advantage
    assert ctx.metrics["plugins/matchtir/match_reward_mean"] == [pytest.approx((1 + 1 + 2 / 3 + 1) / 4)]
    assert ctx.metrics["plugins/matchtir/gold_matched_fraction"] == [1.0]


def test_neutral_setting_and_single_turn_rows_leave_trls_advantages():
    ctx = _ctx([[SEARCH_A], [SEARCH_B]], [1.0, 0.0])
    before = ctx.advantages.clone()
    _run(ctx, match_weight=0.0)
    assert torch.equal(ctx.advantages, before)
    ctx = make_advantage_context([1.0, 0.0], num_generations=2)  # no tools: no turn structure
    _run(ctx)
    assert torch.equal(ctx.advantages, group_normalized_advantages(torch.tensor([1.0, 0.0]), 2))
    assert build_stack(["matchtir"], {"matchtir": {"match_weight": 0.0}}).plugins[0].overwritten() == ()


def test_bad_options_and_missing_column_are_refused_at_construction():
    with pytest.raises(PluginConfigError, match="matching"):
        build_stack(["matchtir"], {"matchtir": {"matching": "fuzzy"}})
    with pytest.raises(PluginConfigError, match="unmatched_reward"):
        build_stack(["matchtir"], {"matchtir": {"unmatched_reward": 0.5}})
    stack = build_stack(["matchtir"], {"matchtir": {"gold_column": "trace"}})
    dataset = datasets.Dataset.from_dict({"prompt": ["q"], "answer": ["1"]})
    with pytest.raises(PluginConfigError, match=r"'trace'.*columns: prompt, answer"):
        PluginGRPOTrainer._check_columns(stack, dataset)
    with pytest.raises(IncompatiblePluginsError, match="'matchtir' and 'igpo' cannot be stacked"):
        build_stack(["igpo", "matchtir"])


def test_soft_matching_gives_each_call_its_transported_similarity():
    ctx = _run(_ctx([[SEARCH_A, CALC], [CALC, CALC]], [1.0, 0.0]), matching="soft", scale=False)
    # row 0 matches the trace exactly: each call carries 1/2 of the mass onto its own gold call (similarity 1)
    assert ctx.turn_rewards[0, 0] == pytest.approx(0.5, abs=1e-3) and ctx.turn_rewards[0, 1] == pytest.approx(0.5, abs=1e-3)
    assert ctx.turn_rewards[1, 0] < 0.5  # a repeated calculator call shares the calculator's mass
    assert "plugins/matchtir/gold_matched_fraction" not in ctx.metrics
    assert not math.isnan(float(ctx.advantages.sum()))


@pytest.mark.slow
def test_matchtir_trains_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    run = record_run(make_tool_trainer(plugins=["matchtir"], max_steps=1))
    adv = run.advantages[0]
    assert adv.dim() == 2 and adv.abs().sum() > 0  # token-level advantages reached the loss
    assert any(log.get("plugins/matchtir/match_reward_mean", 0) > 0.9 for log in run.logs)  # the scripted gold trace
