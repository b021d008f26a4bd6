"""DeepSearch: MCTS in the rollout (backup, PUCT and global selection on hand-built trees, step credit, replay buffer)."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, digit_fraction_reward, make_tiny_trainer, record_run, \
    tiny_tokenizer
from trl_plugins_builtin.deepsearch import CACHED_KEY, LENGTHS_KEY, VALUES_KEY, DeepsearchOptions, DeepsearchPlugin, \
    SearchTree, backup_weight, credit_advantages, cut_step, global_score, prompt_key, puct, step_credit, update_value


def test_backup_rule_puct_and_global_score_by_hand():
    # weight max((d + 1) / (D + 1), 0.1): the leaf 1, the root 1 / (D + 1), floored
    assert backup_weight(2, 3, 0.1) == 1.0 and backup_weight(0, 3, 0.1) == pytest.approx(1 / 3)
    assert backup_weight(0, 20, 0.1) == 0.1
    assert update_value(0.3, 1.0, 0.5) == pytest.approx(0.8)  # same signs add
    assert update_value(-0.5, 1.0, 0.5) == 0.5  # a correct outcome overrides a negative value
    assert update_value(0.5, -1.0, 0.5) == 0.5  # a wrong one leaves a positive value
    assert update_value(0.0, -1.0, 0.5) == -0.5 and update_value(0.7, 0.0, 1.0) == 0.7
    assert puct(0.5, 0, 3, 2.0) == 0.5 and puct(0.5, 2, 0, 2.0) == 0.5  # no bonus while a count is 0
    assert puct(0.5, 2, 4, 2.0) == pytest.approx(0.5 + 2.0 * math.sqrt(math.log(4) / 2))
    o = DeepsearchOptions(max_depth=4)
    assert global_score(0.5, 9.0, 9.0, 1, o) == pytest.approx(0.4 * math.tanh(0.5) + 0.01 * math.sqrt(1 / 4))
    o = DeepsearchOptions(max_depth=4, uncertainty_bonus=True, global_lambda4=0.2, depth_bonus="log")
    assert global_score(0.5, -1.0, 2.0, 3, o) == pytest.approx(
        0.4 * math.tanh(0.5) + 0.2 * math.tanh(-1.0) + 0.4 * 2.0 + 0.01 * math.log(4))
    assert global_score(0.0, 0.0, 0.0, 3, DeepsearchOptions(depth_bonus="constant")) == pytest.approx(0.03)


def _small_tree():
    """Width 2, depth 3, two rows: the hand-worked search of the docstring below."""
    o = DeepsearchOptions(expansion_width=2, max_depth=3)
    t = SearchTree(o, rows=2, budget=10)
    a, b = t.expand(0, [([1, 2], [-1.0, -1.0], False), ([3], [-0.1], False)])
    return o, t, a, b


def test_search_on_a_hand_built_tree():
    o, t, a, b = _small_tree()
    assert t.pending() == (a, 2)  # the root is full: pending backs up and selects (no terminal), then asks
    # both children were visited; the root has no visit, so PUCT is Q = 0 for both and the first wins
    assert t.current == a and t.nodes[a].visits == 1 and t.nodes[b].visits == 1
    c, d = t.expand(a, [([4], [-0.5], True), ([5], [-0.2], True)])
    t.judge(c, True)
    t.judge(d, True)
    assert t.nodes[c].entropy == pytest.approx((1 + 1 + 0.5) / 3)
    t.backup_and_select()
    assert t.recorded == [d]  # both correct: the most confident path (lowest -mean log p)
    assert t.nodes[d].value == 1.0 and t.nodes[a].value == pytest.approx(2 / 3) and t.nodes[0].value == pytest.approx(1 / 3)
    assert t.nodes[a].visits == 2 and t.nodes[0].visits == 1 and not t.nodes[c].final_backup
    assert t.current == b  # global selection: a is full, b is the only frontier node
    assert t.pending() == (b, 2)
    e, f = t.expand(b, [([6], [-0.3], True), ([7], [-0.3], False)])
    t.judge(e, False)
    t.backup_and_select()
    assert t.nodes[e].score == -1.0 and t.nodes[b].value == pytest.approx(-2 / 3)
    assert t.nodes[0].value == pytest.approx(1 / 3)  # a wrong outcome leaves the positive root value
    assert t.recorded == [d, e] and t.done and t.pending() is None
    lengths, values = t.row_credit(d)
    assert lengths == [2, 1] and values == pytest.approx([math.tanh(2 / 3), 1.0])
    assert t.row_credit(e) == ([1, 1], pytest.approx([math.tanh(-2 / 3), -1.0]))
    assert t.path_ids(d) == [1, 2, 5] and t.path_ids(e) == [3, 6]


def test_terminal_choice_prefers_correct_then_wrong_then_incomplete():
    o = DeepsearchOptions(expansion_width=3, max_depth=1, incomplete_score=-0.5)
    t = SearchTree(o, rows=3, budget=10)
    w, i, r = t.expand(0, [([1], [-0.1], True), ([2], [-0.01], False), ([3], [-2.0], True)])
    t.judge(w, False)
    t.judge(i, False)  # cut at the depth limit without EOS
    t.judge(r, True)
    assert t.nodes[i].terminal and t.nodes[i].score == -0.5
    t.backup_and_select()
    assert t.recorded == [r]  # correct first, however unconfident
    # no frontier (every child is terminal): the search stops; the spare paths fill, wrong before incomplete
    assert t.stopped and t.pending() is None
    t.fill_from_tree()
    assert t.recorded == [r, w, i] and t.fill_sources() == []


def test_budget_stop_and_fill_sources():
    o = DeepsearchOptions(expansion_width=2, max_depth=4)
    t = SearchTree(o, rows=4, budget=3)
    a, b = t.expand(0, [([1], [-1.0], False), ([2], [-1.0], False)])
    assert t.pending() == (a, 1)  # one node of budget left
    (c,) = t.expand(a, [([3], [-1.0], True)])
    t.judge(c, False)
    t.backup_and_select()
    assert t.pending() is None and t.stopped and t.recorded == [c]
    # rows left: the best frontier nodes by the global score, cycled; a and b share the root (the same parent Q and
    # depth): depth-first order on ties
    assert t.fill_sources() == [a, b, a]
    sources = t.fill_sources()
    (leaf,) = t.expand(sources[0], [([9, 9], [-0.1, -0.1], False)], final=True)
    assert t.nodes[leaf].terminal


def test_step_credit_and_sibling_normalisation_by_hand():
    o = DeepsearchOptions()
    assert step_credit([0.5, -2.0, 1.0], o) == pytest.approx([math.tanh(0.5), math.tanh(-2.0), 1.0])
    assert step_credit([0.5, 1.0], DeepsearchOptions(adv_temperature=2.0, q_value_max=0.5)) == \
        pytest.approx([0.5 * math.tanh(0.25), 1.0])
    assert step_credit([0.5, 1.0], DeepsearchOptions(adv_temperature=0.0)) == [0.5, 1.0]
    # two rows of one group (finals 1 and -1: mean 0, std 1), one row alone (kept)
    adv = credit_advantages([[2, 1], [1, 2], [3]], [[0.5, 1.0], [0.2, -1.0], [0.7]], [0, 0, 1], 4, False)
    expected = torch.tensor([[0.5, 0.5, 1.0, 0.0], [0.2, -1.0, -1.0, 0.0], [0.7, 0.7, 0.7, 0.0]])
    torch.testing.assert_close(adv, expected)
    adv = credit_advantages([[1, 1], [1, 1]], [[0.5, 1.0], [0.0, 0.0]], [0, 0], 3, True)
    # finals 1 and 0: mean 0.5, biased std 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, 0.0], [-1.0, -1.0, 0.0]]), atol=1e-5, rtol=0)


def test_cut_step_and_prompt_key():
    tok = tiny_tokenizer()
    ids = tok.encode("12\n345\n6", add_special_tokens=False)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    n = cut_step(ids, 100, "\n", decode)
    assert decode(ids[:n]).endswith("\n") and "\n" not in decode(ids[:n - 1])
    assert cut_step(ids, 2, "\n", decode) == min(2, n) and cut_step(ids, 3, None, decode) == 3
    assert prompt_key("q") == prompt_key("q") != prompt_key("r") and prompt_key("q") < 2 ** 48


def test_replay_buffer_registration_and_deferral():
    p = DeepsearchPlugin()
    paths = {(0, s): ([s], [1], [1.0], s == 0) for s in range(4)}  # 1 of 4 correct: 0.25, registered
    paths.update({(1, s): ([s], [1], [1.0], s < 2) for s in range(4)})  # 2 of 4: above the threshold
    paths.update({(2, s): ([s], [1], [-1.0], False) for s in range(4)})  # unsolved
    p.register(paths, {0: 11, 1: 12, 2: 13}, 4)
    assert p._cached == {11: [[0]]}
    deferred = []
    ctx = SimpleNamespace(rows=[{}] * 4, prompts=["a", "a", "b", "b"], index_in_group=[0, 1, 0, 1],
                          defer=deferred.append)
    p._cached = {prompt_key("a"): [[5]]}
    p.trl_plugins_generation_prompts(ctx)
    assert deferred == [3]  # the cached prompt is sampled whole, the other's rows but row 0 wait for the tree


def test_neutral_setting_switches_every_hook_off_and_is_vanilla():
    stack = build_plugins(["deepsearch"], {"deepsearch": {"weight": 0.0}})
    for hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation", "trl_plugins_configure",
                 "trl_plugins_transform_advantages"):
        assert not stack.has(hook), hook
    assert_reduces_to_vanilla("deepsearch", {"weight": 0.0}, loss_types=("grpo",))


def test_bad_options_and_vllm_are_refused():
    for bad, what in (({"expansion_width": 0}, "expansion_width"), ({"max_depth": 0}, "max_depth"),
                      ({"node_budget": 0}, "node_budget"), ({"weight": 1.5}, "weight"),
                      ({"backup_threshold": -0.1}, "backup_threshold"), ({"buffer_threshold": 0.0}, "buffer_threshold"),
                      ({"depth_bonus": "cube"}, "depth_bonus"), ({"step_delimiter": ""}, "step_delimiter"),
                      ({"step_delimiter": "  "}, "step_delimiter")):
        with pytest.raises(PluginConfigError, match=what):
            build_plugins(["deepsearch"], {"deepsearch": bad})
    args = SimpleNamespace(use_vllm=False, num_generations=8, max_completion_length=64)
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=True"):
        DeepsearchPlugin().trl_plugins_configure(None, SimpleNamespace(use_vllm=True, num_generations=8))
    with pytest.raises(PluginConfigError, match="'node_budget' of plugin 'deepsearch' got 4; allowed: a budget >= "
                       "num_generations=8"):
        DeepsearchPlugin(DeepsearchOptions(node_budget=4)).trl_plugins_configure(None, args)
    with pytest.raises(PluginConfigError, match="'max_depth' of plugin 'deepsearch' got 65; allowed: at most"):
        DeepsearchPlugin(DeepsearchOptions(max_depth=65)).trl_plugins_configure(None, args)

    class DropsHash:  # a tokenizer that cannot write '#'
        def encode(self, s, add_special_tokens=False):
            return [ord(c) for c in s if c != "#"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    trainer = SimpleNamespace(text_tokenizer=DropsHash())
    with pytest.raises(PluginConfigError, match="'step_delimiter' of plugin 'deepsearch' got '#'; allowed: a string "
                       "the policy's decoded text can contain"):
        DeepsearchPlugin(DeepsearchOptions(step_delimiter="#")).trl_plugins_configure(trainer, args)
    DeepsearchPlugin(DeepsearchOptions(step_delimiter="\n")).trl_plugins_configure(trainer, args)  # can match


def test_one_step_on_the_tiny_model_grows_a_tree(tmp_path, monkeypatch):
    seen = []
    write = DeepsearchPlugin._write_rows

    def recording_write(self, ctx, trees, *args):
        write(self, ctx, trees, *args)
        seen.append(([list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations],
                     list(ctx.group_ids), {g: t.generated for g, t in trees.items()}))

    monkeypatch.setattr(DeepsearchPlugin, "_write_rows", recording_write)
    options = {"expansion_width": 2, "max_depth": 4, "node_budget": 8}  # 12-token completions: 3-token steps
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["deepsearch"],
                                plugin_config={"deepsearch": options}, output_dir=str(tmp_path))
    run = record_run(trainer)
    ids, notes, groups, generated = seen[0]
    assert generated and all(1 <= n <= 8 for n in generated.values())  # the node budget holds
    for row, note in zip(ids, notes):
        lengths, values = note[LENGTHS_KEY], note[VALUES_KEY]
        assert sum(lengths) == len(row) and len(values) == len(lengths) and CACHED_KEY not in note
        assert all(n <= 3 for n in lengths[:-1])  # steps of max_completion_length // max_depth tokens (the last
        # one may be a completion of the fill)
    # rows of a group share their tree's first step (prefix) whenever they went through the same root child
    for g in set(groups):
        rows = [r for r, gg in zip(ids, groups) if gg == g]
        firsts = {tuple(r[:3]) for r in rows}
        assert len(firsts) <= 2  # the root has expansion_width = 2 children
    log = next(log for log in run.logs if "plugins/deepsearch/tree_nodes" in log)
    assert 1 <= log["plugins/deepsearch/tree_nodes"] <= 8 and "plugins/deepsearch/credit_abs_mean" in log
