"""hbpo (HBPO): equal budget sub-groups with per-row budget sentences (generation and training prompt),
the budget-aware reward (official min(f1, f2) and the paper's piecewise rule) written into the correctness column, the
hierarchical advantage (inter-group normalisation + weighted intra-sub-group term) by hand, the refusals, and a tiny
training run whose rows are sampled under their budget prompts."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    build_stack,
    make_advantage_context,
    make_prompt_context,
    make_reward_context,
    make_tiny_trainer,
    stub_rows,
)
from trl_plugins_builtin.hbpo import budget_rewards, hierarchical_advantages

HBPO = {"budgets": [2, 8]}


def _f1(n, b, L=16, beta=4.0, alpha=1 / 16):
    return beta * math.cos(math.pi * n / (2 * L)) - alpha * abs(n - b)


def _f2(b, L=16, beta=4.0):
    return beta * math.cos(math.pi * b / (2 * L))


# ------------------------------------------------------------------------------------------ formulas
def test_budget_reward_official_min_and_paper_piecewise():
    n = torch.tensor([1, 5, 10, 5, 17])
    b = torch.tensor([8, 2, 8, 8, 8])
    correct = torch.tensor([True, True, True, False, True])
    official = budget_rewards(n, b, correct, 16, 4.0, 1 / 16, "official_min")
    paper = budget_rewards(n, b, correct, 16, 4.0, 1 / 16, "paper_piecewise")
    expected_official = [min(_f1(1, 8), _f2(8)), min(_f1(5, 2), _f2(2)), min(_f1(10, 8), _f2(8)), 0.0, 0.0]
    expected_paper = [_f2(8), _f1(5, 2), _f1(10, 8), 0.0, 0.0]  # wrong, and longer than L_max: 0
    torch.testing.assert_close(official, torch.tensor(expected_official))
    torch.testing.assert_close(paper, torch.tensor(expected_paper))
    # the paper's constants (L_max 4096, alpha 1/4096): an instant answer under budget 512 -- the deviation term bites
    # in the official rule (4 - 512/4096 = 3.875) but not in the paper's (f2(512) = 4 cos(pi/16) = 3.923)
    args = (torch.tensor([0]), torch.tensor([512]), torch.tensor([True]), 4096, 4.0, 1 / 4096)
    torch.testing.assert_close(budget_rewards(*args, "official_min"), torch.tensor([3.875]))
    torch.testing.assert_close(budget_rewards(*args, "paper_piecewise"), torch.tensor([4 * math.cos(math.pi / 16)]))


def test_hierarchical_advantage_by_hand():
    R = torch.tensor([3.0, 1.0, 0.0, 2.0])  # one group, sub-groups {0, 1} (budget 2) and {2, 3} (budget 8)
    slots = torch.tensor([0, 0, 1, 1])
    budgets = torch.tensor([2, 2, 8, 8])
    adv = hierarchical_advantages(R, slots, budgets, 4, 16, 4.0, intra_weight=2.0)
    mean, std = 1.5, float(torch.tensor([3.0, 1.0, 0.0, 2.0]).std())
    intra = [2.0 - _f2(2)] * 2 + [1.0 - _f2(8)] * 2
    expected = [(r - mean) / (std + 1e-6) + 2.0 * i for r, i in zip(R.tolist(), intra)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    only_inter = hierarchical_advantages(R, slots, budgets, 4, 16, 4.0, intra_weight=0.0)
    torch.testing.assert_close(only_inter, (R - mean) / (std + 1e-6))


# ------------------------------------------------------------------------------------------ hooks
def _plugin(**options):
    plugin = build_plugins(["hbpo"], {"hbpo": {**HBPO, **options}}).plugins[0]
    plugin.max_len = 16
    return plugin


def _call(plugin, hook, ctx):
    ctx.set_active_plugin("hbpo")
    getattr(plugin, f"trl_plugins_{hook}")(ctx=ctx)
    return ctx


def test_rows_get_their_sub_groups_budget_sentence_for_generation_and_training():
    ctx = make_prompt_context(stub_rows(2, 4, conversational=True), num_generations=4)
    _call(_plugin(), "generation_prompts", ctx)
    texts = [p[-1]["content"] for p in ctx.generation_prompts]
    assert texts[:4] == ["Q0\n\nI will answer the question with 2 tokens"] * 2 + \
        ["Q0\n\nI will answer the question with 8 tokens"] * 2
    assert texts[4].startswith("Q1") and texts[7].endswith("with 8 tokens")
    assert ctx.training_prompts == ctx.generation_prompts  # trained under the budget prompt, as officially
    assert [a["hbpo_budget"] for a in ctx.annotations] == [2, 2, 8, 8] * 2
    assert ctx.prompts[0] == [{"role": "user", "content": "Q0"}]  # the original prompt is untouched
    text = make_prompt_context(stub_rows(1, 2, conversational=False), num_generations=2)
    _call(_plugin(prompt="within {budget}"), "generation_prompts", text)
    assert text.generation_prompts == ["Q0 within 2", "Q0 within 8"]


def test_reward_replaces_the_correctness_column_in_training_only():
    plugin = _plugin(reward="paper_piecewise")
    ids = [[7], [7] * 5, [7] * 10, [7] * 3]
    rewards = [[1.0, 0.5], [1.0, 0.5], [0.0, 0.5], [1.0, float("nan")]]
    done = ["<think>r</think> \\boxed{4}"] * 4  # well formed: the official format check passes
    ctx = make_reward_context(rewards, num_generations=4, reward_func_names=["acc", "fmt"], completions=done,
                              local_completion_ids=ids)
    ctx.set_active_plugin("hbpo")
    plugin.trl_plugins_transform_rewards(ctx)
    out = ctx.rewards_per_func
    torch.testing.assert_close(out[:, 0], torch.tensor([_f2(2), _f1(5, 2), 0.0, _f2(8)]))
    assert out[:3, 1].tolist() == [0.5, 0.5, 0.5] and torch.isnan(out[3, 1])  # other columns untouched
    ev = make_reward_context(rewards, num_generations=4, completions=["c"] * 4, local_completion_ids=ids, mode="eval")
    plugin.trl_plugins_transform_rewards(ev)
    assert ev.rewards_per_func[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_format_errors_get_minus_one_as_officially():
    # The official reward (ZJU-REAL/HBPO@5c8991d math_reward.py:52, 62): no </think> -> -1; </think> but no \boxed{}
    # in the text after it (up to a second </think>) -> -1, even when the answer grades correct; well formed and wrong
    # -> 0; well formed and correct -> the budget reward.
    completions = [
        "<think>x</think> The answer is \\boxed{4}.",  # correct, well formed: budget reward
        "<think>x The answer is \\boxed{4}.",  # correct by the column, but no </think>: -1
        "<think>x</think> The answer is 4.",  # correct by the column, no boxed answer after </think>: -1
        "<think>\\boxed{4}</think> 4 </think> \\boxed{4}",  # boxed only outside split(...)[1]: -1
        "<think>x</think> \\boxed{5}",  # wrong, well formed: 0
        [{"role": "assistant", "content": "</think>\\boxed{4}"}],  # conversational, well formed, correct
    ]
    rewards = [[1.0], [1.0], [1.0], [1.0], [0.0], [1.0]]
    ids = [[7] * 3] * 6
    ctx = make_reward_context(rewards, num_generations=2, completions=completions, local_completion_ids=ids)
    ctx.set_active_plugin("hbpo")
    _plugin().trl_plugins_transform_rewards(ctx)
    budget = [min(_f1(3, 2), _f2(2)), min(_f1(3, 8), _f2(8))]
    expected = [budget[0], -1.0, -1.0, -1.0, 0.0, budget[1]]
    torch.testing.assert_close(ctx.rewards_per_func[:, 0], torch.tensor(expected))
    assert ctx.metrics["plugins/hbpo/format_error_fraction"] == [pytest.approx(0.5)]
    # format_reward: null -- only the correctness column decides (the plugin's behaviour before)
    off = make_reward_context(rewards, num_generations=2, completions=completions, local_completion_ids=ids)
    off.set_active_plugin("hbpo")
    _plugin(format_reward=None).trl_plugins_transform_rewards(off)
    torch.testing.assert_close(off.rewards_per_func[:, 0], torch.tensor([budget[0], budget[1]] * 2 + [0.0, budget[1]]))


def test_advantages_are_hierarchical_in_training_and_trls_in_eval():
    R = [3.0, 1.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    ctx = _call(_plugin(), "transform_advantages", make_advantage_context(R, num_generations=4))
    expected = torch.cat([
        hierarchical_advantages(torch.tensor(R[:4]), torch.tensor([0, 0, 1, 1]), torch.tensor([2, 2, 8, 8]), 4, 16,
                                4.0, 2.0),
        torch.tensor([2 * (1.0 - _f2(2))] * 2 + [2 * (1.0 - _f2(8))] * 2),  # zero spread: the intra term only
    ])
    torch.testing.assert_close(ctx.advantages, expected)
    ev = make_advantage_context(R, num_generations=4, mode="eval")
    before = ev.advantages.clone()
    _call(_plugin(), "transform_advantages", ev)
    torch.testing.assert_close(ev.advantages, before)


def test_stacking_rules_are_declared_on_the_class():
    stack = build_plugins(["hbpo"], {"hbpo": HBPO})
    assert stack.has("trl_plugins_generation_prompts") and stack.plugins[0].overwritten() == ("advantages",)
    from trl_plugins_builtin.hbpo import HbpoPlugin

    assert set(HbpoPlugin.conflicts_with_hooks) == {"trl_plugins_reject_groups"}


def test_refusals():
    with pytest.raises(PluginConfigError, match="'prompt' of plugin 'hbpo' got 'no placeholder'"):
        build_plugins(["hbpo"], {"hbpo": {**HBPO, "prompt": "no placeholder"}})
    with pytest.raises(PluginConfigError, match="'budgets' of plugin 'hbpo' got \\[\\]"):
        build_plugins(["hbpo"], {"hbpo": {**HBPO, "budgets": []}})
    with pytest.raises(IncompatiblePluginsError, match="advantages"):
        build_plugins(["hbpo", "canon"], {"hbpo": HBPO})
    for refill in ("dynamic_sampling", "dars"):  # any plugin with the refill hook, refused when the stack is built
        with pytest.raises(IncompatiblePluginsError, match=f"'hbpo' and '{refill}'.*budget sentences"):
            build_stack(["hbpo", refill], {"hbpo": HBPO},
                        trainer=SimpleNamespace(max_completion_length=16, reward_func_names=["acc"]))
    with pytest.raises(PluginConfigError, match="num_generations=4 is not a multiple of the 3 budgets"):
        make_tiny_trainer(plugins=["hbpo"], plugin_config={"hbpo": {**HBPO, "budgets": [2, 4, 8]}})


def test_tiny_run_samples_each_row_under_its_budget_prompt():
    trainer = make_tiny_trainer(plugins=["hbpo"], plugin_config={"hbpo": HBPO}, max_steps=1)
    seen = []
    original = trainer._tokenize_prompts

    def record(prompts):
        seen.extend(prompts)
        return original(prompts)

    trainer._tokenize_prompts = record
    trainer.train()
    sentences = [p[-1]["content"].rsplit("\n\n", 1)[-1] if isinstance(p, list) else p for p in seen[:4]]
    assert sentences == ["I will answer the question with 2 tokens"] * 2 + \
        ["I will answer the question with 8 tokens"] * 2
    logged = trainer.state.log_history[0]
    assert "plugins/hbpo/budget_reward" in logged
