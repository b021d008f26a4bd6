"""OTC-PO: among correct answers, the fewest tool calls score highest; wrong answers stay at zero."""

import math

import pytest
import torch

from trl_plugins.testing import make_reward_context, run_hook
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.otc_po import cosine_coefficient, grpo_coefficient, optimal_calls

CALL = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
TOOL = {"role": "tool", "name": "search", "content": "doc"}
ANSWER = {"role": "assistant", "content": "Answer: 1"}


def _turns(calls):
    """A completion making ``calls`` tool calls (one per turn) before answering."""
    mask, messages = [], []
    for _ in range(calls):
        mask += [1, 1, 0]
        messages += [CALL, TOOL]
    return build_turn_structure(list(range(len(mask) + 2)), mask + [1, 1], messages + [ANSWER])


def test_grpo_coefficient_peaks_at_the_optimal_number_of_calls():
    n = torch.tensor([2, 2, 2, 2])
    m = torch.tensor([1, 2, 3, 6])
    coeff = grpo_coefficient(m, n, c=1.0)
    assert coeff[1] == pytest.approx(1.0)
    assert coeff[0] < 1 and coeff[2] < 1 and coeff[3] < coeff[2]
    assert coeff[0] == pytest.approx(math.sin((2 * 2 * 1 / 3) * math.pi / 4))
    # no call needed (n = 0): no calls scores 1, calls decay by the cosine
    assert grpo_coefficient(torch.tensor([0, 2]), torch.tensor([0, 0]), 1.0).tolist() == pytest.approx(
        [1.0, math.cos(2 * math.pi / 5)])
    assert cosine_coefficient(torch.tensor([0]), 1.0).item() == 1.0


def test_optimal_calls_come_from_correct_rows_of_the_group():
    calls = torch.tensor([3, 1, 2, 5])
    correct = torch.tensor([True, False, True, False])
    assert optimal_calls(calls, correct, torch.tensor([0, 0, 1, 1])).tolist() == [3, 3, 2, 2]


def test_reward_favours_the_correct_answer_with_fewest_calls():
    # group of 4: correct with 1 call, correct with 3 calls, wrong with 1 call, correct with 1 call
    turns = [_turns(1), _turns(3), _turns(1), _turns(1)]
    ctx = make_reward_context(torch.tensor([[1.0], [1.0], [0.0], [1.0]]), num_generations=4, turns=turns)
    run_hook("otc_po", "trl_plugins_transform_rewards", ctx)
    rewards = ctx.rewards_per_func[:, 0]
    assert rewards[0] == pytest.approx(1.0) and rewards[3] == pytest.approx(1.0)  # m = n = 1
    assert 0 < rewards[1] < 1  # more calls than needed
    assert rewards[2] == 0.0  # wrong stays wrong
    assert "plugins/otc_po/tool_calls_mean" in ctx.metrics


def test_neutral_strength_and_no_tools_leave_rewards():
    turns = [_turns(1), _turns(3)]
    ctx = make_reward_context(torch.tensor([[1.0], [1.0]]), num_generations=2, turns=turns)
    run_hook("otc_po", "trl_plugins_transform_rewards", ctx, {"otc_po": {"strength": 0.0}})
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 1.0]
    ctx = make_reward_context(torch.tensor([[1.0], [0.5]]), num_generations=2)  # single-turn rows: no calls
    run_hook("otc_po", "trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.5]


def test_only_the_verifier_column_is_reshaped():
    turns = [_turns(1), _turns(3)]
    ctx = make_reward_context(torch.tensor([[1.0, 0.3], [1.0, 0.3]]), num_generations=2, turns=turns)
    run_hook("otc_po", "trl_plugins_transform_rewards", ctx, {"otc_po": {"variant": "ppo"}})
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.3, 0.3])
    assert ctx.rewards_per_func[0, 0] == pytest.approx(math.cos(math.pi / 3))


def test_must_run_before_partial_credit_transforms():
    from trl_plugins import IncompatiblePluginsError
    from trl_plugins.testing import build_stack

    build_stack(["otc_po", "e_grpo"])
    with pytest.raises(IncompatiblePluginsError, match="otc_po must come before e_grpo"):
        build_stack(["e_grpo", "otc_po"])
