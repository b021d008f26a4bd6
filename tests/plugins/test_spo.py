"""SPO: the chain's official cut-point rule, segment advantages and whitening on small tensors, the advantage hook from
annotations, the neutral setting, the vLLM refusal, and a run on the tiny model through the branching seam; the
tree's values and edge advantages on hand-built trees, its node budget and leaf choice, a tree grown through a stub
seam on one process and on two (a group straddling them: one grows the tree, the other has none), and a run on the
tiny model."""

import random
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api import Continuation, RunInfo
from trl_plugins.testing import assert_reduces_to_vanilla, build_stack, char_decode, char_encode, \
    digit_fraction_reward, make_advantage_context, make_prompt_context, make_rollout_context, make_tiny_trainer, \
    record_run, run_on_processes
from trl_plugins_builtin.spo import CUTS_KEY, LENGTH_KEY, LOW_KEY, SEGMENTS_KEY, SegmentTree, SpoOptions, \
    SpoPlugin, budget_children, choose_leaves, cut_points, edge_advantages, row_segments, segment_advantages, \
    tree_token_advantages, tree_values, whiten_over

ALL = torch.ones(6, dtype=torch.bool)


def test_cut_points_follow_the_official_rule():
    probs = torch.tensor([0.5, 0.95, 0.3, 0.2, 0.99, 0.1, 0.4])  # below 0.9 at 0, 2, 3, 5, 6
    assert cut_points(probs, 0.9, 1) == [-1, 1, 2, 4, 5]  # the boundary just before each low-probability token
    assert cut_points(probs, 0.9, 2) == [-1, 2, 5]  # every 2nd candidate, the first one kept
    assert cut_points(probs, 0.9, 2, limit=2) == [-1, 2]
    assert cut_points(probs, 0.25, 1) == [2, 4]


def test_segment_advantages_by_hand():
    # cuts after tokens -1 (the prompt), 1 and 3; reward 0: segments [0, 1], [2, 3], [4, 5]
    adv = segment_advantages(6, [-1, 1, 3], [0.5, 0.25, 1.0], 0.0, ALL)
    torch.testing.assert_close(adv, torch.tensor([-0.25, -0.25, 0.75, 0.75, -1.0, -1.0]))
    # without the prompt's value the first segment has no start: 0
    adv = segment_advantages(6, [1, 3], [0.25, 1.0], 1.0, ALL)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.75, 0.75, 0.0, 0.0]))
    # high-probability tokens get 0; a rollout without a cut point gets 0 everywhere
    low = torch.tensor([True, False, True, False, True, True])
    adv = segment_advantages(6, [-1, 1, 3], [0.5, 0.25, 1.0], 0.0, low)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.0, 0.75, 0.0, -1.0, -1.0]))
    assert torch.equal(segment_advantages(6, [], [], 1.0, ALL), torch.zeros(6))


def test_whitening_over_the_trained_tokens_only():
    adv = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = whiten_over(adv, mask)
    valid = torch.tensor([1.0, 3.0, 5.0])
    torch.testing.assert_close(out[mask], (valid - 3.0) / torch.sqrt(valid.var() + 1e-8))
    assert torch.equal(whiten_over(adv, torch.zeros_like(mask)), adv)


def _annotated(cuts, low, length=6):
    return {CUTS_KEY: cuts, LOW_KEY: low, LENGTH_KEY: length}


def test_advantage_hook_builds_token_advantages_from_the_annotations():
    notes = [_annotated([[-1, 0.5], [1, 0.25], [3, 1.0]], [0, 1, 2, 3, 4, 5]),
             _annotated([[-1, 0.5], [1, 0.25], [3, 1.0]], [0, 2, 4]),
             {"refill_round": 1}, _annotated([], [0, 1])]
    ctx = make_advantage_context(torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2, annotations=notes,
                                 completion_lengths=[6, 6, 6, 6])
    trl_advantages = ctx.advantages.clone()
    build_plugins(["spo"], {"spo": {"whiten": False}}).call("trl_plugins_transform_advantages", ctx)
    assert ctx.advantages.shape[0] == 4
    torch.testing.assert_close(ctx.advantages[0], torch.tensor([-0.25, -0.25, 0.75, 0.75, -1.0, -1.0]))
    torch.testing.assert_close(ctx.advantages[1], torch.tensor([-0.25, 0.0, 0.75, 0.0, 0.0, 0.0]))
    assert torch.all(ctx.advantages[2] == trl_advantages[2])  # no annotation: TRL's advantage
    assert torch.equal(ctx.advantages[3], torch.zeros(6))  # no cut point: 0 (official)
    mixed = make_advantage_context(torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2, annotations=notes,
                                   completion_lengths=[6, 6, 6, 6])
    build_plugins(["spo"], {"spo": {"whiten": False, "weight": 0.5}}).call("trl_plugins_transform_advantages", mixed)
    torch.testing.assert_close(mixed.advantages[0], 0.5 * trl_advantages[0] + 0.5 * ctx.advantages[0])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_neutral_weight_switches_every_hook_off(mode):
    stack = build_plugins(["spo"], {"spo": {"weight": 0.0, "mode": mode}})
    assert not any(stack.has(f"trl_plugins_{hook}")
                   for hook in ("generation_prompts", "after_generation", "transform_advantages"))
    assert build_plugins(["spo"], {"spo": {"mode": mode}}).has("trl_plugins_generation_prompts") == (mode == "tree")


def test_bad_options_and_vllm_are_refused():
    for bad in ({"prob_threshold": 0.0}, {"mc_samples": 0}, {"cutpoint_interval": 0}, {"weight": 1.5},
                {"branch_factors": []}, {"branch_factors": [6, 0, 6]}, {"segment_tokens": 0}, {"max_nodes": 0},
                {"max_nodes": 2, "branch_factors": [2, 2, 2]}, {"mode": "forest"}):
        with pytest.raises(PluginConfigError, match=next(iter(bad))):
            build_plugins(["spo"], {"spo": bad})
    for mode in ("chain", "tree"):
        with pytest.raises(IncompatiblePluginsError, match="use_vllm=False"):
            SpoPlugin(SpoOptions(mode=mode)).trl_plugins_configure(None, SimpleNamespace(use_vllm=True))
    # the group must fit in the tree: enough leaves in the shape, a node budget of at least G
    with pytest.raises(PluginConfigError, match=r"at most 3 leaves cannot fill a group of num_generations=4"):
        build_stack("spo", {"spo": {"mode": "tree", "branch_factors": [3]}}, num_generations=4)
    with pytest.raises(PluginConfigError, match=r"'max_nodes' of plugin 'spo' got 3, smaller than the group"):
        build_stack("spo", {"spo": {"mode": "tree", "max_nodes": 3}}, num_generations=4)
    build_stack("spo", {"spo": {"mode": "tree", "branch_factors": [2, 2], "max_nodes": 4}}, num_generations=4)


def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("spo", {"weight": 0.0}, loss_types=("grpo",))


def test_one_step_on_the_tiny_model_through_the_branching_seam(tmp_path):
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["spo"],
                                plugin_config={"spo": {"mc_samples": 2, "max_cutpoints": 2}},
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    logs = [log for log in run.logs if "plugins/spo/cutpoints" in log]
    assert logs and logs[0]["plugins/spo/cutpoints"] > 0  # the random tiny policy has low-probability tokens
    assert trainer.generation_service.total == logs[0]["plugins/spo/extra_rollouts"] > 0
    assert logs[0]["plugins/spo/trained_token_fraction"] > 0


# ------------------------------------------------------------------------------------------------ SPO-tree
def _hand_tree():
    """root -> a (leaf, reward 1), b; b -> b1 (0), b2 (1), b3 (0). Paths are token lists of the lengths below."""
    tree = SegmentTree()
    a = tree.add(0, [1, 1], leaf=True)
    b = tree.add(0, [2, 2], leaf=False)
    leaves = [tree.add(b, [2, 2, k, k], leaf=True) for k in (3, 4, 5)]
    tree.reward.update({a: 1.0, leaves[0]: 0.0, leaves[1]: 1.0, leaves[2]: 0.0})
    return tree, a, b, leaves


def test_tree_values_are_means_of_children_and_edges_get_value_minus_parent():
    tree, a, b, (b1, b2, b3) = _hand_tree()
    values = tree_values(tree)
    # b = mean(0, 1, 0); the root = mean(a, b), not the mean of its four leaves (0.5): the official recursion
    assert values[b] == pytest.approx(1 / 3) and values[0] == pytest.approx(2 / 3)
    adv, kept = edge_advantages(tree, values)
    assert adv[a] == pytest.approx(1 / 3) and adv[b] == pytest.approx(-1 / 3)
    assert [adv[n] for n in (b1, b2, b3)] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    assert kept == [False, True, True, True, True, True]  # the root is no edge
    # 'grpo': divided by the population std of the parent's children's values
    g, _ = edge_advantages(tree, values, "grpo")
    assert g[a] == pytest.approx((1 / 3) / (1 / 3 + 1e-8)) and g[b2] == pytest.approx((2 / 3) / (2 ** 0.5 / 3))
    # a full tree: the root's value is the mean of its leaves; equal-valued edges are dropped
    full = SegmentTree()
    for k in range(2):
        node = full.add(0, [k], leaf=False)
        for r in (1.0, 1.0) if k == 0 else (0.0, 1.0):
            full.reward[full.add(node, [k, 9], leaf=True)] = r
    values = tree_values(full)
    assert values[0] == pytest.approx(0.75)
    adv, kept = edge_advantages(full, values)
    assert adv[1:] == pytest.approx([0.25, 0.0, 0.0, -0.25, -0.5, 0.5])  # nodes: k=0, its leaves, k=1, its leaves
    assert [kept[n] for n in range(1, 7)] == [True, False, False, True, True, True]


def test_rows_train_each_kept_edge_once_and_tokens_take_their_segment_advantage():
    tree, a, b, (b1, b2, b3) = _hand_tree()
    values = tree_values(tree)
    adv, kept = edge_advantages(tree, values)
    segs = row_segments(tree, [b2, b1, a, b2], adv, kept)
    assert segs[0] == [[2.0, adv[b], 1.0], [4.0, adv[b2], 1.0]]
    assert segs[1] == [[2.0, adv[b], 0.0], [4.0, adv[b1], 1.0]]  # b was trained in row 0 already
    assert segs[2] == [[2.0, adv[a], 1.0]]
    assert [s[2] for s in segs[3]] == [0.0, 0.0]  # a leaf drawn twice trains nothing the second time
    token_adv, on = tree_token_advantages(4, segs[1])
    torch.testing.assert_close(token_adv, torch.tensor([0.0, 0.0, adv[b1], adv[b1]]))
    assert on.tolist() == [False, False, True, True]


def test_node_budget_and_leaf_choice():
    assert budget_children([6, 6], None, 2) == [6, 6]
    assert budget_children([3, 3], 8, 2) == [2, 2]  # 4 children, each with room for one more level
    assert budget_children([3, 3], 9, 2) == [2, 2] and budget_children([3, 3], 10, 2) == [3, 2]
    assert budget_children([6], 3, 3) == [1]  # the root of a depth-3 tree with 3 nodes: one chain
    leaves = [4, 7, 9]
    assert sorted(choose_leaves(leaves, 3, random.Random(0))) == leaves
    drawn = choose_leaves(leaves, 5, random.Random(0))
    assert sorted(drawn[:3]) == leaves and set(drawn[3:]) <= set(leaves) and len(set(drawn[3:])) == 2
    assert len(set(choose_leaves(list(range(20)), 8, random.Random(1)))) == 8


class SeamStub:
    """The branching seam's ``continue_prefixes``: request ``j`` of call ``c`` gets ``max_new`` copies of the digit
    ``(c + j) % 10`` when ``j`` is even, of ``x`` when odd (never finished early). Records the requests per call."""

    def __init__(self):
        self.calls: list[int] = []

    def continue_prefixes(self, prompt_ids, prefix_ids, max_new_tokens, **kwargs):
        self.calls.append(len(prompt_ids))
        room = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        out = []
        for j, (prefix, m) in enumerate(zip(prefix_ids, room)):
            new = char_encode((str((len(self.calls) + j) % 10) if j % 2 == 0 else "x") * m)
            out.append(Continuation(completion_ids=list(prefix) + new, new_ids=new, logprobs=[-1.0] * m,
                                    finished=False))
        return out


def _p_low(prompts, completions):
    return [torch.full((len(c),), -1.0) for c in completions]  # p = 0.37 < 0.9: every token trained


TREE = {"mode": "tree", "branch_factors": [2, 2], "segment_tokens": 3, "whiten": False}


def _tree_context(completions, process_index=0, gather=None, deferred=()):
    return make_rollout_context(completions, num_generations=4, process_index=process_index, gather=gather,
                                service=SeamStub(), deferred=deferred, sampling_logprob=None,
                                run=RunInfo(max_completion_length=12), policy_logprobs=_p_low)


def _grow(ctx, process_index=0):
    stack = build_stack("spo", {"spo": TREE}, num_generations=4)
    prompt = make_prompt_context(num_groups=1, num_generations=4, process_index=process_index)
    prompt.rows, prompt.prompts = prompt.rows[: len(ctx)], prompt.prompts[: len(ctx)]
    stack.call("trl_plugins_generation_prompts", prompt)
    stack.call("trl_plugins_after_generation", ctx)
    return stack


# the tree of one group: TRL's row 0 "1234567" gives the path 123 | 4567; the seam adds the root's second child
# "111" (call 1) and, at the last depth (call 2, 9 tokens to the length 12), "123" + "2" * 9, "111" + "x" * 9 and
# "111" + "4" * 9. Rewards (digit fraction): 1, 1, 0.25, 1; values: "123" 1, "111" 0.625, root 0.8125.
LEAVES = {"1234567": [(3, 0.1875), (7, None)], "123" + "2" * 9: [(3, 0.1875), (12, None)],
          "111" + "x" * 9: [(3, -0.1875), (12, -0.375)], "111" + "4" * 9: [(3, -0.1875), (12, 0.375)]}


def _check_rows(rows):
    """rows: (completion text, segments) of the group's four rows."""
    assert sorted(text for text, _ in rows) == sorted(LEAVES)
    trained_first = {}
    for text, segs in rows:
        assert [int(s[0]) for s in segs] == [end for end, _ in LEAVES[text]]
        for (end, want), (_, got, on) in zip(LEAVES[text], segs):
            if want is None:  # "123"'s two leaves have its value: equal, the edge is dropped
                assert on == 0.0 and got == 0.0
            else:
                assert got == pytest.approx(want)
        trained_first.setdefault(text[:3], []).append(segs[0][2])
    assert sorted(trained_first["123"]) == [0.0, 1.0] and sorted(trained_first["111"]) == [0.0, 1.0]


def test_tree_grows_through_the_seam_and_fills_the_group_with_its_leaves():
    ctx = _tree_context(["1234567", "", "", ""], deferred=[1, 2, 3])
    _grow(ctx)
    assert ctx.service.calls == [1, 3]  # one call per depth: the root's second child, then 3 last-depth children
    texts = [char_decode(ids) for ids in ctx.completion_ids]
    _check_rows([(t, note[SEGMENTS_KEY]) for t, note in zip(texts, ctx.annotations)])
    assert all(note[LENGTH_KEY] == len(t) and note[LOW_KEY] == list(range(len(t)))
               for t, note in zip(texts, ctx.annotations))
    assert ctx.metrics["plugins/spo/tree_nodes"] == [6.0] and ctx.metrics["plugins/spo/extra_rollouts"] == [4.0]
    # the advantage stage: each row's tokens take their trained segments' advantages
    adv = make_advantage_context(torch.zeros(4), num_generations=4, annotations=ctx.annotations,
                                 completion_lengths=[len(t) for t in texts])
    build_plugins(["spo"], {"spo": TREE}).call("trl_plugins_transform_advantages", adv)
    for n, (t, note) in enumerate(zip(texts, ctx.annotations)):
        want, _ = tree_token_advantages(len(t), note[SEGMENTS_KEY])
        want = want * tree_token_advantages(len(t), note[SEGMENTS_KEY])[1].float()
        torch.testing.assert_close(adv.advantages[n, : len(t)], want)


def test_a_group_straddling_two_processes_makes_equal_calls_and_fills_both():
    # G = 4 rows, two per process: process 0 holds row 0 and grows the tree, process 1 holds rows 2, 3 and none
    def work(rank, gather):
        ctx = _tree_context(["1234567", ""] if rank == 0 else ["", ""], process_index=rank, gather=gather,
                            deferred=[1] if rank == 0 else [0, 1])
        _grow(ctx, rank)
        return ctx.service.calls, [(char_decode(ids), note[SEGMENTS_KEY])
                                   for ids, note in zip(ctx.completion_ids, ctx.annotations)]

    (calls0, rows0), (calls1, rows1) = run_on_processes(2, work)
    assert calls0 == [1, 3] and calls1 == [0, 0]  # the same seam calls on both, no request on process 1
    _check_rows(rows0 + rows1)


def test_one_step_of_the_tree_on_the_tiny_model(tmp_path):
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["spo"],
                                plugin_config={"spo": {"mode": "tree", "branch_factors": [2, 2], "segment_tokens": 4}},
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    logs = [log for log in run.logs if "plugins/spo/tree_nodes" in log]
    assert logs and logs[0]["plugins/spo/tree_leaves"] >= 2 and logs[0]["plugins/spo/tree_nodes"] >= 4
    assert trainer.generation_service.total == logs[0]["plugins/spo/extra_rollouts"] > 0
    assert logs[0]["plugins/spo/trained_token_fraction"] > 0
