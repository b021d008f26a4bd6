"""LATR: lookahead tree-based rollouts (probability-filtered forks, lookahead pruning, the mix ratio, filling)."""

from types import SimpleNamespace

import pytest

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, digit_fraction_reward, make_tiny_trainer, record_run
from trl_plugins_builtin.latr import FORK_KEY, PARENT_KEY, LatrOptions, LatrPlugin, assign_forks, branch_tokens, \
    edit_distance, keeps_math_symbol, mix_ratio, rouge_l, suffix_match, too_similar, tree_rows


def test_branching_filter_by_hand():
    # official defaults: m = 2, p_1 > 0.25 and p_0 - p_1 < 0.15
    assert branch_tokens([7, 8], [0.4, 0.3], own=7, m=2, abs_threshold=0.25, rel_threshold=0.15) == [(1, 8)]
    assert branch_tokens([7, 8], [0.5, 0.3], own=7, m=2, abs_threshold=0.25, rel_threshold=0.15) == []  # gap 0.2
    assert branch_tokens([7, 8], [0.3, 0.2], own=7, m=2, abs_threshold=0.25, rel_threshold=0.15) == []  # p_1 0.2
    # a member that sampled the runner-up forks onto the most likely token (candidate 0 always passes)
    assert branch_tokens([7, 8], [0.4, 0.3], own=8, m=2, abs_threshold=0.25, rel_threshold=0.15) == [(0, 7)]
    assert branch_tokens([7, 8, 9], [0.34, 0.33, 0.32], own=7, m=3, abs_threshold=None, rel_threshold=None) == \
        [(1, 8), (2, 9)]
    assert branch_tokens([7, 8, 9], [0.34, 0.33, 0.32], own=7, m=2, abs_threshold=None, rel_threshold=None) == [(1, 8)]


def test_similarity_measures_by_hand():
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0 and edit_distance([1, 2, 3], [2, 3]) == 1
    assert edit_distance([1, 2, 3, 4], [4, 3, 2, 1]) == 4 and edit_distance([], [5, 6]) == 2
    assert suffix_match([1, 2, 3, 4], [9, 3, 4, 9]) == 0.5  # "3 4" (a's suffix) occurs in b
    assert suffix_match([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
    assert rouge_l([1, 2, 3, 4], [1, 9, 3, 4]) == pytest.approx(0.75) and rouge_l([1], [2]) == 0.0


def test_lookahead_pruning_windows():
    o = LatrOptions(pruning_steps=[2, 4], edit_distance_threshold=0.4)
    parent = [1, 2, 3, 4, 5, 6, 7, 8]
    near = [1, 2, 9, 4, 5, 6, 7, 8]  # differs in the fork token only: window 2 -> 1/2, window 4 -> 1/4 < 0.4
    far = [1, 2, 9, 8, 7, 0, 7, 8]  # window 2 -> 1.0, window 4 -> 1.0
    assert too_similar(near, parent, 2, o, eos=None) and not too_similar(far, parent, 2, o, eos=None)
    assert not too_similar(near, parent, 2, o, eos=6)  # the 4-window holds EOS: only the 2-window, 0.5 >= 0.4
    assert not too_similar(near, parent, 2, o, eos=None, keep=True)  # a math-symbol fork is never pruned
    assert not too_similar(near[:5], parent, 2, o, eos=None)  # both windows reach the end of the branch
    o = LatrOptions(pruning_steps=[4], edit_distance_threshold=None, rouge_l_threshold=0.5)
    assert too_similar(near, parent, 2, o, eos=None) and not too_similar(far, parent, 2, o, eos=None)
    o = LatrOptions(pruning_steps=[4], edit_distance_threshold=None, suffix_match_threshold=0.2)
    assert too_similar(near, parent, 2, o, eos=None) and not too_similar(far, parent, 2, o, eos=None)


def test_math_symbols_schedule_and_fork_order():
    assert keeps_math_symbol(" +") and keeps_math_symbol(" ") and keeps_math_symbol("01")
    assert not keeps_math_symbol(" the") and not keeps_math_symbol("10")  # the official substring test
    assert mix_ratio([1.0, 0.75, 0.5], [0, 10, 20], 0) == 1.0 and mix_ratio([1.0, 0.75, 0.5], [0, 10, 20], 15) == 0.75
    assert mix_ratio([1.0, 0.75, 0.5], [0, 10, 20], 99) == 0.5
    assert [tree_rows(8, r) for r in (1.0, 0.75, 0.5, 0.25, 0.0)] == [8, 6, 4, 2, 0]
    # earliest position first, then candidate rank, then member; lowest free row first
    points = [(9, 1, 0), (3, 2, 0), (3, 1, 2), (5, 1, 0)]
    assert assign_forks(points, [3, 1]) == [(1, (3, 1, 2)), (3, (3, 2, 0))]


def test_neutral_setting_switches_every_hook_off_and_is_vanilla():
    neutral = {"mix_ratios": [0.0]}
    stack = build_plugins(["latr"], {"latr": neutral})
    for hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation", "trl_plugins_configure"):
        assert not stack.has(hook), hook
    assert_reduces_to_vanilla("latr", neutral, loss_types=("grpo",))


def test_bad_options_and_vllm_are_refused():
    for bad, what in (({"max_branch_per_token": 1}, "max_branch_per_token"), ({"max_branch_per_token": 0}, "max_"),
                      ({"pruning_steps": [0, 20]}, "pruning_steps"), ({"pruning_steps": []}, "pruning_steps"),
                      ({"rounds": 0}, "rounds"), ({"mix_ratios": [1.5]}, "mix_ratios"),
                      ({"mix_ratios": [1.0, 0.5]}, "mix_ratio_steps"),
                      ({"mix_ratios": [1.0, 0.5], "mix_ratio_steps": [0, 0]}, "mix_ratio_steps"),
                      ({"prob_abs_threshold": 1.5}, "prob_abs_threshold"), ({"fill": "nope"}, "fill")):
        with pytest.raises(PluginConfigError, match=what):
            build_plugins(["latr"], {"latr": bad})
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=True"):
        LatrPlugin().trl_plugins_configure(None, SimpleNamespace(use_vllm=True, num_generations=8))


@pytest.mark.parametrize("fill", ["duplicate", "sample"])
def test_one_step_on_the_tiny_model_grows_a_tree(tmp_path, monkeypatch, fill):
    seen = []
    fill_rows = LatrPlugin._fill

    def recording_fill(self, ctx, *args):  # the last step of the tree: the group's rows are final afterwards
        fill_rows(self, ctx, *args)
        seen.append(([list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations],
                     list(ctx.index_in_group)))

    monkeypatch.setattr(LatrPlugin, "_fill", recording_fill)
    # every position forks (no probability test); tiny lookahead windows on the 12-token completions
    options = {"prob_abs_threshold": None, "prob_rel_threshold": None, "pruning_steps": [2, 3], "rounds": 2,
               "fill": fill}
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["latr"],
                                plugin_config={"latr": options}, output_dir=str(tmp_path))
    run = record_run(trainer)
    ids, notes, slots = seen[0]
    base = {0: 0}
    forked = 0
    for k, (row, note, slot) in enumerate(zip(ids, notes, slots)):
        if slot == 0:
            base = {0: row}
            continue
        parent, t = note[PARENT_KEY], note[FORK_KEY]
        if parent == -1 and fill == "duplicate":
            assert row == base[0]  # the official filling: a copy of the root
        elif parent >= 0:
            forked += 1
            parent_ids = ids[k - slot + parent]
            assert row[:t] == parent_ids[:t] and row[t] != parent_ids[t]  # shares the prefix, forks onto another token
        base[slot] = row
    assert forked > 0
    log = next(log for log in run.logs if "plugins/latr/generated_token_fraction" in log)
    assert 0 < log["plugins/latr/generated_token_fraction"]
    assert log["plugins/latr/branches_kept"] >= 1 and "plugins/latr/generated_tokens" in log
