"""FunRL: strict binary reward, calls verified structurally against the gold calls."""

import json

import pytest
import torch

from trl_plugins.testing import build_stack
from trl_plugins_builtin.funrl import call_key, calls_match, completion_calls, parse_text_calls

GOLD = json.dumps([{"name": "search", "arguments": {"query": "Pell"}},
                   {"name": "calculator", "arguments": {"expression": "1210*2"}}])


def _turn(name, arguments):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}


def _reward(completions, gold=GOLD, **options):
    (func,) = [f for plugin, funcs in build_stack(["funrl"], {"funrl": options}).call(
        "trl_plugins_reward_functions", args=None) for f in funcs]
    return func(completions=completions, gold_calls=[gold] * len(completions))


def test_exact_calls_score_one_anything_else_zero():
    right = [_turn("search", {"query": "Pell"}), {"role": "tool", "content": "x"},
             _turn("calculator", {"expression": "1210*2"}), {"role": "assistant", "content": "Answer: 2420"}]
    wrong_value = [_turn("search", {"query": "Hask"}), _turn("calculator", {"expression": "1210*2"})]
    extra_arg = [_turn("search", {"query": "Pell", "k": 1}), _turn("calculator", {"expression": "1210*2"})]
    missing = [_turn("search", {"query": "Pell"})]
    assert _reward([right, wrong_value, extra_arg, missing]) == [1.0, 0.0, 0.0, 0.0]


def test_text_calls_are_parsed_with_the_syntax_tree():
    assert parse_text_calls('[search(query="Pell"), calculator(expression="1210*2")]') == [
        call_key("search", {"query": "Pell"}), call_key("calculator", {"expression": "1210*2"})]
    assert parse_text_calls("search('Pell')") is None  # positional: not verifiable
    assert parse_text_calls("os.system(x=1)") is None
    assert parse_text_calls("not a call") is None
    text = [{"role": "assistant", "content": 'calculator(expression="1210*2"); '}]
    assert completion_calls(text) is None
    good = [{"role": "assistant", "content": 'calculator(expression=" 1210*2 ")'}]
    assert completion_calls(good) == [call_key("calculator", {"expression": "1210*2"})]


def test_order_and_value_normalisation():
    a, b = call_key("f", {"x": 1}), call_key("g", {"y": "s"})
    assert calls_match([b, a], [a, b], ordered=False) and not calls_match([b, a], [a, b], ordered=True)
    assert call_key("f", {"x": 1}) == call_key("f", {"x": 1.0})
    assert calls_match(None, [a], ordered=False) is False


def test_neutral_weight_and_column_check():
    stack = build_stack(["funrl"], {"funrl": {"reward_weight": 0.0}})
    (func,) = [f for _, funcs in stack.call("trl_plugins_reward_functions", args=None) for f in funcs]
    assert func.reward_weight == 0.0
    assert stack.plugins[0].required_columns() == ["gold_calls"]


@pytest.mark.slow
def test_funrl_column_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    run = record_run(make_tool_trainer(plugins=["funrl"], max_steps=1))
    rewards = run.rewards[0]
    assert rewards.shape[1] == 2
    # the scripted backend follows the gold trace on every other row: those rows verify, the shortcuts do not
    assert torch.equal(rewards[:, 1], rewards[:, 0])
