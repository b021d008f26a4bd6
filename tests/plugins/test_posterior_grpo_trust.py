"""posterior_grpo trust mode with the official SophiaVL-R1 defaults: one-sided groups get no process reward, only
answers with outcome >= 0.2 are scored (and sent to the PRM), the process column's weight is 0.3; the outcome column
is chosen by the success rule (never a placeholder)."""

import math

import pytest
import torch

from trl_plugins import build_plugins
from trl_plugins.components.prm import FunctionPRM
from trl_plugins.services import RunInfo
from trl_plugins.testing import make_reward_context
from trl_plugins_builtin.posterior_grpo import COLUMN


class RecordingPRM(FunctionPRM):
    """Step score 0.5 for the first step, 1.0 for the next; records what it scored."""

    def __init__(self):
        super().__init__(lambda row, steps: [0.5 + 0.5 * (k % 2) for k in range(len(steps))], separator="\n")
        self.seen = []

    def score_steps(self, rows, completions):
        self.seen.extend(completions)
        return super().score_steps(rows, completions)


def _run(outcome, texts, G, **options):
    N = len(outcome)
    matrix = torch.stack([torch.tensor(outcome, dtype=torch.float32), torch.zeros(N)], dim=1)
    ctx = make_reward_context(matrix, num_generations=G, reward_func_names=["accuracy", COLUMN],
                              completions=[[{"role": "assistant", "content": t}] for t in texts])
    stack = build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic", "mode": "trust",
                                                                  "anneal": "none", **options}})
    plugin = next(iter(stack))
    plugin.prm = RecordingPRM()
    stack.call("trl_plugins_transform_rewards", ctx)
    return ctx, plugin


def test_official_trust_mode_defaults():
    # group 0 all correct, group 1 all wrong, group 2 mixed with outcomes 1.0, 0.3 (scored), 0.1 (not scored)
    outcome = [1.0, 1.0, 0.0, 0.0, 1.0, 0.3, 0.1, 1.0]
    texts = ["a", "a", "a", "a", "a\nb", "a\nb", "a\nb", "a"]
    ctx, plugin = _run(outcome, texts, 2)
    assert plugin.process_weight() == 0.3
    # groups 0 and 1 are one-sided: no PRM call, no process reward; row 6 (outcome 0.1 < 0.2) is not scored
    assert plugin.prm.seen == ["a\nb", "a\nb", "a"]
    values = ctx.rewards_per_func[:, 1].tolist()
    assert values[:4] == [0.0] * 4
    # group 2: correct 0.75 vs wrong 0.75 -> trust 1; group 3: correct 0.5 vs wrong (unscored) 0 -> trust 1
    assert values[4:] == [0.75, 0.75, 0.0, 0.5]
    assert ctx.metrics["plugins/posterior_grpo/process_reward_mean"] == [pytest.approx((0.75 + 0.75 + 0.5) / 3)]


def test_earlier_trust_mode_as_options():
    outcome = [1.0, 1.0, 0.0, 0.1]
    ctx, plugin = _run(outcome, ["a", "a\nb", "a", "a\nb"], 2, trust_one_sided="full", trust_min_outcome=None,
                       process_weight=1.0)
    assert plugin.process_weight() == 1.0
    assert len(plugin.prm.seen) == 4
    assert ctx.rewards_per_func[:, 1].tolist() == [0.5, 0.75, 0.5, math.exp(0.0) * 0.75]


def test_posterior_mode_keeps_weight_one_and_outcome_skips_placeholders():
    stack = build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic"}})
    assert next(iter(stack)).process_weight() == 1.0

    matrix = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["empo", "accuracy", COLUMN],
                              completions=[[{"role": "assistant", "content": t}] for t in ("a", "a\nb")],
                              run=RunInfo(placeholder_columns=(True, False, True)))
    plugin = next(iter(stack))
    plugin.prm = RecordingPRM()
    stack.call("trl_plugins_transform_rewards", ctx)
    assert plugin.prm.seen == ["a\nb"]  # the outcome is 'accuracy' (row 1), not the placeholder 'empo' (row 0)
    assert ctx.rewards_per_func[:, 2].tolist() == [0.0, 0.75]
