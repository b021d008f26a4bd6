"""ASPO: bounded advantage shaping of correct rollouts; the sign of an advantage never flips."""

import pytest
import torch

from trl_plugins.testing import make_advantage_context, run_hook
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.aspo import bounded_shaping, row_features, shaping_terms

CALL = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
TOOL = {"role": "tool", "name": "search", "content": "doc"}
ANSWER = {"role": "assistant", "content": "Answer: 1"}


def _turns(thinking_tokens, calls=1):
    """``thinking_tokens`` model tokens, then the call text (3 tokens, found by its marker), the result, the answer."""
    text = "x" * thinking_tokens + "<t>"
    ids = [ord(c) for c in text] + [0, 0, 1, 1]
    mask = [1] * len(text) + [0, 0, 1, 1]
    messages = [CALL, TOOL, ANSWER] if calls else [ANSWER]
    if not calls:
        mask = [1] * len(ids)
    return build_turn_structure(ids, mask, messages, decode_one=lambda t: chr(t) if t > 1 else "", marker="<t>")


def test_feature_is_the_first_call_position():
    assert row_features([_turns(5), _turns(2), _turns(4, calls=0)], "first_call_position").tolist() == [5.0, 2.0, 11.0]
    assert row_features([_turns(5), _turns(4, calls=0)], "tool_calls").tolist() == [1.0, 0.0]


def test_shaping_is_bounded_and_never_flips_a_sign():
    advantages = torch.tensor([0.5, 0.5, -1.0, 2.0])
    terms = torch.tensor([10.0, -10.0, 10.0, 0.1])
    out = bounded_shaping(advantages, terms, k=0.7)
    assert out.tolist() == pytest.approx([0.85, 0.15, -0.3, 2.1])
    assert (torch.sign(out) == torch.sign(advantages)).all()


def test_earlier_calls_gain_among_correct_rows_only():
    turns = [_turns(2), _turns(8), _turns(5), _turns(1)]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    ctx = make_advantage_context(rewards, num_generations=4, turns=turns)
    before = ctx.advantages.clone()
    run_hook("aspo", "trl_plugins_transform_advantages", ctx)
    after = ctx.advantages
    assert after[0] > before[0] and after[1] < before[1]  # the earliest correct call gains, the latest loses
    assert after[3] == before[3]  # a wrong row is not shaped
    assert (torch.sign(after) == torch.sign(before)).all()
    terms = shaping_terms(torch.tensor([2.0, 8.0, 5.0, 1.0]), rewards > 0, torch.zeros(4, dtype=torch.long), -1.0)
    assert terms[3] == 0 and terms[:3].sum().abs() < 1e-5  # standardised among the correct rows


def test_only_correct_rows_with_a_tool_call_are_shaped_by_default():
    # the third-party verl recipe shapes correct rollouts with at least one tool call; a correct row without one keeps
    # TRL's advantage and does not enter the statistics; shaped_rows='correct' shapes it too (the paper's text)
    turns = [_turns(2), _turns(8), _turns(4, calls=0), _turns(1)]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    ctx = make_advantage_context(rewards, num_generations=4, turns=turns)
    before = ctx.advantages.clone()
    run_hook("aspo", "trl_plugins_transform_advantages", ctx)
    assert ctx.advantages[2] == before[2] and ctx.advantages[3] == before[3]
    expected = shaping_terms(torch.tensor([2.0, 8.0, 11.0, 1.0]), torch.tensor([True, True, False, False]),
                             torch.zeros(4, dtype=torch.long), -1.0)
    torch.testing.assert_close(ctx.advantages, bounded_shaping(before, expected, 0.7))
    every = make_advantage_context(rewards, num_generations=4, turns=turns)
    run_hook("aspo", "trl_plugins_transform_advantages", every, {"aspo": {"shaped_rows": "correct"}})
    assert every.advantages[2] != before[2]  # the row without a call (position = its length 11) loses


def test_neutral_delta_leaves_trls_advantages():
    turns = [_turns(2), _turns(8)]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2, turns=turns)
    before = ctx.advantages.clone()
    run_hook("aspo", "trl_plugins_transform_advantages", ctx, {"aspo": {"delta": 0.0}})
    assert torch.equal(ctx.advantages, before)
