"""E-GRPO: incorrect rollouts earn alpha times their group-normalised entity match rate; correct ones keep 1."""

import pytest
import torch

from trl_plugins.testing import make_reward_context, run_hook
from trl_plugins_builtin.e_grpo import match_rate, normalised_rates, reasoning_text

ROWS = [{"entities": ["Brellin", "Tavok"]}] * 4


def _completion(text, tool_text=""):
    return [{"role": "assistant", "content": text}, {"role": "tool", "content": tool_text},
            {"role": "assistant", "content": "Answer: 1"}]


def test_near_misses_earn_partial_credit():
    completions = [_completion("Brellin and Tavok"), _completion("Brellin only"), _completion("nothing"),
                   _completion("Brellin, Tavok")]
    ctx = make_reward_context(torch.tensor([[0.0], [0.0], [0.0], [1.0]]), num_generations=4, rows=ROWS,
                              completions=completions)
    run_hook("e_grpo", "trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == pytest.approx([0.3, 0.15, 0.0, 1.0])
    assert ctx.metrics["plugins/e_grpo/near_miss_fraction"]


def test_tool_results_do_not_count_by_default():
    completion = _completion("no names", tool_text="Brellin: population 4120")
    assert match_rate(reasoning_text(completion, "assistant"), ["Brellin"]) == 0.0
    assert match_rate(reasoning_text(completion, "all"), ["Brellin"]) == 1.0


def test_normalisation_by_the_best_rate_of_the_group():
    rates = torch.tensor([0.5, 0.25, 0.0, 0.0])
    assert normalised_rates(rates, torch.tensor([0, 0, 1, 1]), "group_max").tolist() == [1.0, 0.5, 0.0, 0.0]


def test_neutral_alpha_leaves_rewards():
    ctx = make_reward_context(torch.tensor([[0.0], [1.0]]), num_generations=2, rows=ROWS[:2],
                              completions=[_completion("Brellin"), _completion("")])
    run_hook("e_grpo", "trl_plugins_transform_rewards", ctx, {"e_grpo": {"alpha": 0.0}})
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0, 1.0]
