"""FunRL: strict binary reward, calls verified structurally against the gold calls."""

import json

import pytest
import torch

from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import build_stack, group_normalized_advantages, make_advantage_context, run_hook
from trl_plugins_builtin.funrl import (
    call_key,
    calls_match,
    completion_calls,
    entropy_advantages,
    parse_text_calls,
)

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


def test_entropy_bonus_formula_is_clipped_by_the_advantage():
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0])
    entropy = torch.tensor([0.3, 0.9, 0.7, 5.0])
    out = entropy_advantages(advantages, entropy, weight=0.4, alpha=2.0)
    # bounds |A|/2 = 0.5, 0.25, 0, 1: H is kept, capped, zeroed, capped
    torch.testing.assert_close(out, torch.tensor([1.0 + 0.4 * 0.3, -0.5 + 0.4 * 0.25, 0.0, 2.0 + 0.4 * 1.0]))
    assert (torch.sign(out) == torch.sign(advantages)).all()  # the bonus never flips an advantage
    per_token = torch.tensor([[1.0, 0.0], [-0.5, -0.5]])  # token-level advantages: the bound is per token
    torch.testing.assert_close(entropy_advantages(per_token, torch.tensor([0.3, 0.9]), 0.4, 2.0),
                               torch.tensor([[1.12, 0.0], [-0.4, -0.4]]))


class MarkerTokenizer:
    """Token 9 is the text '</think>', every other token 'a'."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("</think>" if i == 9 else "a" for i in ids)


def _advantage_ctx():
    entropies = torch.tensor([[0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.6, 0.8], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    ids = torch.tensor([[1, 2, 9, 3], [1, 2, 3, 4], [5, 5, 9, 5], [9, 1, 1, 1]])
    stats = PolicyStats(per_token_logps=torch.zeros(4, 4), entropies=entropies, mask=loss_mask, completion_ids=ids,
                        mean_entropy=entropies.mean(-1))
    ctx = make_advantage_context([1.0, 0.0, 0.0, 1.0], num_generations=2, policy_stats=stats,
                                 tokenizer=MarkerTokenizer())
    ctx.local_completion_mask = torch.ones(4, 4)  # row 1's token 1 is a tool result: out of the loss mask only
    return ctx


def test_entropy_of_the_chain_of_thought_shapes_the_advantages():
    ctx = run_hook("funrl", "trl_plugins_transform_advantages", _advantage_ctx())
    # row 0: tokens up to the marker (.1, .3, .5); row 1: no marker, loss tokens only (.2, .6, .8); row 3: the marker
    cot = torch.tensor([0.3, 1.6 / 3.0, 1.0, 0.0])
    trl = group_normalized_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    torch.testing.assert_close(ctx.advantages, entropy_advantages(trl, cot, 0.4, 2.0))
    # |A| = 0.707 bounds the entropy at 0.354: row 0 keeps its 0.3, rows 1 (0.53) and 2 (1.0) are capped
    bound = trl.abs()[0].item() / 2
    torch.testing.assert_close(ctx.advantages, trl + 0.4 * torch.tensor([0.3, bound, bound, 0.0]))
    assert ctx.policy_stats_calls == [False]
    assert ctx.metrics["plugins/funrl/cot_entropy"] == [pytest.approx(float(cot.mean()))]
    assert not torch.equal(ctx.advantages, trl)


def test_entropy_neutral_setting_leaves_trls_advantages_without_a_forward():
    ctx = _advantage_ctx()
    before = ctx.advantages.clone()
    run_hook("funrl", "trl_plugins_transform_advantages", ctx, options={"entropy_weight": 0.0})
    assert torch.equal(ctx.advantages, before) and ctx.policy_stats_calls == []


def test_entropy_clip_must_keep_the_sign():
    from trl_plugins import PluginConfigError

    with pytest.raises(PluginConfigError, match="entropy_clip"):
        build_stack(["funrl"], {"funrl": {"entropy_clip": 1.0}})


@pytest.mark.slow
def test_funrl_column_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    run = record_run(make_tool_trainer(plugins=["funrl"], max_steps=1))
    rewards = run.rewards[0]
    assert rewards.shape[1] == 2
    # the scripted backend follows the gold trace on every other row: those rows verify, the shortcuts do not
    assert torch.equal(rewards[:, 1], rewards[:, 0])
