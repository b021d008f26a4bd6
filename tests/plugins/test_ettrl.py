"""ETTRL: TTRL's majority vote, EAR (entropy-based advantage reshaping) and ETMR (entropy-fork tree rollouts)."""

import functools
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.api.answers import majority_votes
from trl_plugins.testing import assert_reduces_to_vanilla, digit_fraction_reward, make_advantage_context, \
    make_reward_context, make_tiny_trainer, record_run
from trl_plugins_builtin.ettrl import FORK_KEY, ROOT_KEY, EttrlPlugin, ear_scale, fork_positions, \
    reshape_advantages, tree_slot


def test_ear_scale_by_hand():
    H = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 0.0])  # groups of 2: means 2, 2, 0
    torch.testing.assert_close(ear_scale(H, 2), torch.tensor([1.5, 0.5, 1.0, 1.0, 1.0, 1.0]))
    A = torch.tensor([[1.0, 1.0], [-2.0, -2.0], [0.5, 0.5], [1.0, 1.0], [3.0, 3.0], [-3.0, -3.0]])
    out = reshape_advantages(A, ear_scale(H, 2))
    torch.testing.assert_close(out[:2], torch.tensor([[1.5, 1.5], [-1.0, -1.0]]))
    torch.testing.assert_close(out[4:], A[4:])  # a group with zero mean entropy is left alone


def test_tree_layout_and_fork_positions():
    # L = 1 + 2 * 2 = 5: row 0 root, rows 1-2 fork 0, rows 3-4 fork 1; rows 5.. the next tree
    assert [tree_slot(k, 5, 2) for k in range(7)] == [(0, None), (0, 0), (0, 0), (0, 1), (0, 1), (5, None), (5, 0)]
    assert fork_positions(torch.tensor([0.1, 0.9, 0.3, 0.7]), 2) == [1, 3]
    assert fork_positions(torch.tensor([0.1, 0.9]), 3) == [1, 0, 1]  # shorter than N: reused in turn
    assert fork_positions(torch.tensor([]), 2) == [0, 0] and fork_positions(torch.tensor([1.0]), 0) == []


def test_vote_fills_the_column_with_the_majority():
    completions = ["x = 3", "so 5", "it is 3", "none", "7", "8", "7", "7"]
    ctx = make_reward_context(torch.zeros(8, 1), num_generations=4, reward_func_names=["ettrl"],
                              completions=completions)
    build_plugins(["ettrl"], {"ettrl": {"extractor": "last_number", "advantage": "none"}}).call(
        "trl_plugins_transform_rewards", ctx)
    expected = majority_votes([0, 1, 0, None]) + majority_votes([0, 1, 0, 0])
    assert ctx.rewards_per_func[:, 0].tolist() == expected == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def test_advantage_hook_reshapes_with_the_policy_entropies_and_clips():
    H = torch.tensor([[1.0, 1.0, 9.0], [3.0, 3.0, 3.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])  # 9 is padding
    stats = PolicyStats(per_token_logps=torch.zeros(4, 3), entropies=H, mask=mask, completion_ids=torch.zeros(4, 3),
                        mean_entropy=(H * mask).sum(-1) / mask.sum(-1))
    plugin = EttrlPlugin(EttrlPlugin.Options(vote=False))
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2, policy_stats=stats)
    base = ctx.advantages.clone()
    plugin.trl_plugins_transform_advantages(ctx)
    torch.testing.assert_close(ctx.advantages, base * torch.tensor([1.5, 0.5, 1.0, 1.0]))  # H_resp = 1, 3 | 2, 2
    evaluation = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2, policy_stats=stats,
                                        mode="eval")
    plugin.trl_plugins_transform_advantages(evaluation)
    torch.testing.assert_close(evaluation.advantages, base)
    clip = EttrlPlugin(EttrlPlugin.Options(advantage="clip", clip_beta=0.5))
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 0.2, 0.0]), num_generations=2)
    clip.trl_plugins_transform_advantages(ctx)
    assert ctx.advantages.abs().max() <= 0.5 and base.abs().max() > 0.5


def test_neutral_setting_switches_every_hook_off_and_is_vanilla():
    neutral = {"vote": False, "advantage": "none", "fork_points": 0}
    stack = build_plugins(["ettrl"], {"ettrl": neutral})
    for hook in ("trl_plugins_reward_functions", "trl_plugins_transform_rewards", "trl_plugins_transform_advantages",
                 "trl_plugins_generation_prompts", "trl_plugins_after_generation"):
        assert not stack.has(hook), hook
    assert_reduces_to_vanilla("ettrl", neutral, loss_types=("grpo",))


def test_bad_options_too_big_trees_and_vllm_are_refused():
    for bad in ({"branches": 0}, {"fork_points": -1}, {"clip_beta": 0.0}, {"extractor": "nope"}):
        with pytest.raises(PluginConfigError, match=next(iter(bad))):
            build_plugins(["ettrl"], {"ettrl": bad})
    plugin = EttrlPlugin()  # N = 2, B = 2: trees of 5
    with pytest.raises(PluginConfigError, match="= 5 rollouts does not fit in a group of num_generations=4"):
        plugin.trl_plugins_configure(None, SimpleNamespace(num_generations=4))
    plugin.trl_plugins_configure(None, SimpleNamespace(num_generations=8))  # one tree and a partial one
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=False"):
        plugin.trl_plugins_configure(None, SimpleNamespace(use_vllm=True, num_generations=60))
    EttrlPlugin(EttrlPlugin.Options(fork_points=0)).trl_plugins_configure(None, SimpleNamespace(use_vllm=True))


@pytest.mark.parametrize("fork_tokens", ["sample", "distinct"])
def test_one_step_on_the_tiny_model_grows_trees(tmp_path, monkeypatch, fork_tokens):
    seen = []
    original = EttrlPlugin.trl_plugins_after_generation

    @functools.wraps(original)  # keeps the hookimpl marker
    def spy(self, ctx):
        original(self, ctx)
        seen.append(([list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations]))

    monkeypatch.setattr(EttrlPlugin, "trl_plugins_after_generation", spy)
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["ettrl"],
                                plugin_config={"ettrl": {"vote": False, "fork_points": 1, "branches": 1,
                                                         "fork_tokens": fork_tokens}},
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    assert seen
    ids, notes = seen[0]
    for k in range(1, len(ids), 2):  # G = 4, trees of 2: rows 0 and 2 are roots, rows 1 and 3 their branches
        root, t = notes[k][ROOT_KEY], notes[k][FORK_KEY]
        assert ids[k][:t] == ids[k - 1][:t]  # the branch shares the root's prefix up to the fork
        if fork_tokens == "distinct" and t < len(ids[k - 1]):
            assert ids[k][t] != ids[k - 1][t]  # and takes another token there
        assert root == (k - 1) % 4  # its root's index in the group
    logs = [log for log in run.logs if "plugins/ettrl/rollout_token_fraction" in log]
    assert logs and 0 < logs[0]["plugins/ettrl/rollout_token_fraction"] <= 1
    assert "plugins/ettrl/ear_scale_max" in run.logs[0]
