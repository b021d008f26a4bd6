"""decs (DECS): chunks cut before reflection words; the NRP ends at the first chunk holding the answer;
only the redundant tokens of correct completions lose reward (more in longer completions); per-position group
advantages leave tokens every row shares at 0 and push the redundant tail down; the curriculum keeps groups with
reward variance and int(kappa n / (1 - kappa)) all-correct ones; kappa follows the NRP ratio and survives a resume;
the hooks run through the kit's reward and advantage contexts; an end-to-end run on the tiny model trains."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.testing import (
    CharTokenizer,
    make_advantage_context,
    make_refill_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    run_hook,
    stub_policy_stats,
)
from trl_plugins_builtin.decs import (
    chunk_starts,
    contains_answer,
    curriculum_keep,
    curriculum_select,
    decs_token_rewards,
    nrp_split,
    official_chunks,
    per_position_advantages,
    redundant_span,
)

#: The plugin's behaviour before the official chunker was the default (no </think> cut, no merging).
LEGACY = {"think_end": None, "merge_single_line": False}


def test_chunks_cut_before_split_tokens():
    assert chunk_starts([5, 1, 5, 5, 1, 5], {1}) == [0, 1, 4]
    assert chunk_starts([1, 5], {1}) == [0]  # a split token at 0 does not make an empty chunk
    assert chunk_starts([], {1}) == []


def test_rule_judge_matches_whole_answers_only():
    assert contains_answer("so x = 12.", "12")
    assert not contains_answer("so x = 125", "12")
    assert not contains_answer("so x = 3.12", "12")
    assert not contains_answer("anything", "")


def test_official_chunker_stops_at_think_end_and_merges_one_line_chunks():
    # split token 1, newline token 9, </think> token 8 (pixas/DECS@0d12e53 reward_manager.py:78-85, 557)
    ids = [5, 9, 5, 1, 5, 9, 5, 1, 5, 1, 5, 9, 5, 8, 5, 5]
    # split before each 1: (0,3) (3,7) (7,9) (9,16); the last is cut before the 8: (9,13); (7,9) = [1, 5] has no line
    # break, so it is merged into the next (last) chunk; the answer after </think> (13..15) is in no chunk
    assert official_chunks(ids, {1}, {9}, 8) == [(0, 3), (3, 7), (7, 13)]
    assert official_chunks(ids, {1}) == [(0, 3), (3, 7), (7, 9), (9, 16)]  # the legacy split
    # [5, 9]: a break only at its end -- one line, merged; [1, 9, 5, 9]: a break after its first and before its last
    # non-newline token (read from both ends) -- multi-line
    assert official_chunks([5, 9, 1, 9, 5, 9, 1, 5], {1}, {9}, 8) == [(0, 6), (6, 8)]
    assert official_chunks([5, 5, 8, 5], {1}, {9}, 8) == [(0, 2)]  # no split token: the whole reasoning, cut at 8
    assert official_chunks([5, 8, 1, 5], {1}, {9}, 8) == [(0, 4)]  # only the last chunk is cut (officially too)
    # redundant span: the chunks after the first with the answer, to the end of the last chunk (the </think> cut)
    spans = [(0, 3), (3, 7), (7, 13)]
    assert redundant_span(spans, [False, True, False]) == (7, 13, 2 / 3)
    assert redundant_span(spans, [True, False, True]) == (3, 13, 1 / 3)
    assert redundant_span(spans, [False, False, True]) == (-1, 0, 1.0)
    assert redundant_span(spans, [False, False, False]) == (-1, 0, 0.0)
    assert redundant_span([(0, 3), (3, 3)], [True, False]) == (-1, 0, 0.5)  # an empty last chunk: nothing redundant


def test_final_answer_after_think_end_is_never_redundant():
    tok = CharTokenizer()
    completions = ["x=7\nok\nWait\nno\nsure\n</think>x=7", "x=7\nWait\n</think>x=7"]
    ids = [tok.encode(c) for c in completions]
    rows = [{"prompt": "p", "answer": "7"}] * 2

    def spans(plugin):
        ctx = make_reward_context(torch.tensor([1.0, 1.0]), num_generations=2, rows=rows, completions=completions,
                                  local_completion_ids=ids)
        ctx.set_active_plugin("decs")
        plugin.trl_plugins_transform_rewards(ctx)
        return plugin._batch

    wait, end = completions[0].index("Wait"), completions[0].index("</think>")
    # row 0: "x=7\nok\n" holds the answer, "Wait\nno\nsure\n" is redundant up to </think>; row 1: "x=7\n" is one
    # line, merged with "Wait\n" -- one chunk holding the answer, nothing redundant
    assert spans(_plugin(newline_words=["\n"])) == [(wait, end, 0.5), (-1, 0, 1.0)]
    legacy = spans(_plugin(**LEGACY))  # every token to the end could be redundant
    assert legacy == [(wait, len(ids[0]), 0.5), (completions[1].index("Wait"), len(ids[1]), 0.5)]
    # through the advantages: the final answer's tokens of row 0 are not pushed down
    plugin = _plugin(newline_words=["\n"], curriculum=False)
    spans(plugin)
    T = len(ids[0])
    mask = torch.tensor([[1.0] * T, [1.0] * len(ids[1]) + [0.0] * (T - len(ids[1]))])
    actx = make_advantage_context(torch.tensor([1.0, 1.0]), num_generations=2,
                                  policy_stats=stub_policy_stats(2, T, mask=mask))
    actx.set_active_plugin("decs")
    plugin.trl_plugins_transform_advantages(actx)
    assert torch.all(actx.advantages[0, wait:end] < 0) and torch.all(actx.advantages[0, end:] == 0)
    assert torch.all(actx.advantages[0, :wait] == 0)


def test_redundant_end_bounds_the_penalised_span():
    r = decs_token_rewards(torch.tensor([1.0]), torch.tensor([2]), torch.tensor([6]), 6, 10, 0.1,
                           redundant_end=torch.tensor([4]))
    shaped = 1.0 + 0.1 * (1 - 6 / 10)
    torch.testing.assert_close(r, torch.tensor([[1.1, 1.1, shaped, shaped, 1.1, 1.1]]))


def test_nrp_split():
    starts = [0, 4, 9]
    assert nrp_split(starts, [False, True, True], 12) == (9, 2 / 3)  # tail = the third chunk
    assert nrp_split(starts, [True, False, False], 12) == (4, 1 / 3)
    assert nrp_split(starts, [False, False, True], 12) == (-1, 1.0)  # answer in the last chunk: no tail
    assert nrp_split(starts, [False, False, False], 12) == (-1, 0.0)


def test_only_redundant_tokens_of_correct_rows_lose_reward():
    scores = torch.tensor([1.0, 1.0, 0.0])
    starts = torch.tensor([3, -1, -1])
    lengths = torch.tensor([6, 4, 5])
    r = decs_token_rewards(scores, starts, lengths, 8, 10, 0.1)
    assert r[0, :3].tolist() == pytest.approx([1.1] * 3)
    assert r[0, 3:6].tolist() == pytest.approx([1 + 0.1 * (1 - 6 / 10)] * 3)  # 1.04
    assert r[0, 6:].tolist() == pytest.approx([1.1] * 2)  # padding keeps s (1 + beta)
    assert r[1].tolist() == pytest.approx([1.1] * 8)
    assert r[2].tolist() == pytest.approx([0.0] * 8)
    # longer completions lose more on their redundant tokens
    longer = decs_token_rewards(scores, starts, torch.tensor([9, 4, 5]), 10, 10, 0.1)
    assert float(longer[0, 4]) < float(r[0, 4])


def test_per_position_advantages_penalise_only_the_redundant_tail():
    # one all-correct group: row 0 has a redundant tail from position 3, row 1 none; same length 6
    scores = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 6)
    r = decs_token_rewards(scores, torch.tensor([3, -1]), torch.tensor([6, 6]), 6, 10, 0.1)
    adv = per_position_advantages(r, mask, 2)
    assert torch.all(adv[:, :3] == 0)  # the necessary prefix is never penalised
    assert torch.all(adv[0, 3:] < 0) and torch.all(adv[1, 3:] > 0)
    # a mixed group: the correct row's prefix stays positive even though its tail is redundant
    r = decs_token_rewards(torch.tensor([1.0, 0.0]), torch.tensor([3, -1]), torch.tensor([6, 6]), 6, 10, 0.1)
    adv = per_position_advantages(r, mask, 2)
    assert torch.all(adv[0] > 0) and torch.all(adv[1] < 0)


def test_curriculum_keeps_varied_groups_and_kappa_many_easy_ones():
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # G=2: varied, easy, easy, wrong, easy
    keep = curriculum_keep(rewards, 2, 0.0, g)
    assert keep.tolist() == [True, False, False, False, False]
    keep = curriculum_keep(rewards, 2, 0.5, g)  # int(0.5 * 1 / 0.5) = 1 easy group
    assert keep[0] and not keep[3] and int(keep[[1, 2, 4]].sum()) == 1
    keep = curriculum_keep(rewards, 2, 0.9, g)  # int(9) capped by the 3 easy groups
    assert keep.tolist() == [True, True, True, False, True]


# ------------------------------------------------------------------------------------------ through the hooks
def _plugin(**options):
    # character tokens: the first token of " Wait" would be the space, so only the words without a leading space
    options = {"split_words": ["Wait", "But"], **options}
    plugin = build_plugins(["decs"], {"decs": options}).plugins[0]
    plugin.max_len = 20
    return plugin


COMPLETIONS = ["ab=7 Wait no", "ab=7 But fine", "x=3", "y=9"]  # group 0: both correct, both with a tail


def _run(plugin, verdict=(1.0, 1.0, 0.0, 1.0)):
    tok = CharTokenizer()
    ids = [tok.encode(c) for c in COMPLETIONS]
    rows = [{"prompt": "p", "answer": "7"}, {"prompt": "p", "answer": "7"},
            {"prompt": "q", "answer": "9"}, {"prompt": "q", "answer": "9"}]
    rctx = make_reward_context(torch.tensor(verdict), num_generations=2, rows=rows,
                               completions=COMPLETIONS, local_completion_ids=ids)
    rctx.set_active_plugin("decs")
    before = rctx.rewards_per_func.clone()
    plugin.trl_plugins_transform_rewards(rctx)
    assert torch.equal(rctx.rewards_per_func, before)  # DECS leaves the rewards alone
    T = max(len(i) for i in ids)
    mask = torch.tensor([[1.0] * len(i) + [0.0] * (T - len(i)) for i in ids])
    actx = make_advantage_context(torch.tensor(verdict), num_generations=2,
                                  policy_stats=stub_policy_stats(4, T, mask=mask))
    actx.set_active_plugin("decs")
    plugin.trl_plugins_transform_advantages(actx)
    return actx, mask


def test_hooks_build_token_advantages_from_the_answer_column():
    plugin = _plugin(curriculum=False, **LEGACY)  # one-line completions: the legacy chunker keeps their chunks
    actx, mask = _run(plugin)
    adv = actx.advantages
    assert adv.shape == mask.shape
    # group 0: both correct; "ab=7 " is the NRP of both (tails at 5), row 0 is shorter (12 vs 13 chars): its tail
    # loses less, so at the shared tail positions row 0 is above row 1
    assert torch.all(adv[0, :5] == 0) and torch.all(adv[1, :5] == 0)
    assert torch.all(adv[0, 5:12] > 0) and torch.all(adv[1, 5:12] < 0)
    # group 1: "x=3" wrong, "y=9" correct without a tail: ordinary positive / negative advantages
    assert torch.all(adv[3][mask[3] > 0] > 0) and torch.all(adv[2][mask[2] > 0] < 0)
    assert actx.metrics["plugins/decs/redundant_fraction"] == [0.5]
    assert actx.metrics["plugins/decs/nrp_ratio"] == [pytest.approx((0.5 + 0.5 + 1.0) / 3)]


def _official_filter(rewards, G, kappa, carried, sample):
    """The official curriculum filter of one generation batch (valid_ray_trainer.py:1545-1570, restated): kept uids =
    varied groups; if kappa > 0: carried += kept, n = int(kappa carried / (1 - kappa)), carried reset when n > 0, and
    min(n, all-correct) all-correct groups sampled (``sample(ids, k)``)."""
    groups = [rewards[i:i + G] for i in range(0, len(rewards), G)]
    stds = [torch.tensor(g).std(unbiased=False).item() for g in groups]
    means = [sum(g) / G for g in groups]
    kept = [i for i, s in enumerate(stds) if s > 0]
    easy = [i for i in range(len(groups)) if means[i] > 0 and stds[i] == 0]
    if kappa > 0:
        carried += len(kept)
        n = int(kappa * carried / (1 - kappa))
        if n > 0:
            carried = 0
        kept += sample(easy, min(n, len(easy)))
    return sorted(kept), carried


@pytest.mark.parametrize("kappa, carried", [(0.0, 0), (0.2, 0), (0.2, 3), (0.5, 1), (0.9, 0)])
def test_curriculum_select_is_the_official_filter(kappa, carried):
    # G=2: varied, easy, easy, wrong, easy, varied
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    keep, left = curriculum_select(torch.tensor(rewards), 2, kappa, carried, torch.Generator().manual_seed(0))
    chosen = []
    expected, expected_left = _official_filter(rewards, 2, kappa, carried,
                                               lambda ids, k: chosen.extend(ids[:k]) or ids[:k])
    assert left == expected_left
    assert sorted(i for i in range(6) if keep[i] and i in (0, 5)) == [i for i in expected if i in (0, 5)]
    assert int(keep[[1, 2, 4]].sum()) == len(chosen) and not keep[3]


def test_carried_count_lets_a_later_batch_keep_an_all_correct_group():
    # kappa 0.2: one varied group gives int(0.25) = 0 all-correct groups, so the count is carried; the fourth varied
    # group reaches int(0.2 * 4 / 0.8) = 1 (the per-batch rule of curriculum_keep never keeps one)
    g, carried = torch.Generator().manual_seed(0), 0
    batch = torch.tensor([1.0, 0.0, 1.0, 1.0])  # G=2: varied, easy
    for expected_easy, expected_carried in [(False, 1), (False, 2), (False, 3), (True, 0)]:
        keep, carried = curriculum_select(batch, 2, 0.2, carried, g)
        assert keep.tolist() == [True, expected_easy] and carried == expected_carried
        assert curriculum_keep(batch, 2, 0.2, g).tolist() == [True, False]


def _decs_stack(**options):
    from trl_plugins.testing import build_stack

    return build_stack("decs", {"decs": {"split_words": ["Wait"], **options}}, configure=False, num_generations=2,
                       per_device_train_batch_size=8)


def test_curriculum_rejects_and_refills_by_default():
    stack = _decs_stack()
    plugin = stack.plugins[0]
    assert plugin.hook_enabled("trl_plugins_reject_groups")
    ctx = make_refill_context(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), num_generations=2)
    run_hook(stack, "trl_plugins_reject_groups", ctx)
    assert ctx.rejected.tolist() == [False, True, True, False]  # kappa 0: the all-correct and all-wrong groups
    assert ctx.metrics["plugins/decs/kept_group_fraction"] == [0.5]
    # a refill round judges only the fresh groups
    assert plugin.carried_kept == 0  # kappa 0: nothing is counted (official: only while kappa > 0)
    plugin.kappa, plugin.carried_kept = 0.5, 2
    later = make_refill_context(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]), num_generations=2, round=1,
                                fresh=[False, True, True, False])
    run_hook(stack, "trl_plugins_reject_groups", later)
    # carried 2 + 0 varied fresh groups: int(0.5 * 2 / 0.5) = 2 >= the 2 all-correct fresh groups: both kept
    assert later.rejected.tolist() == [False, False, False, False] and plugin.carried_kept == 0


def test_zero_advantage_curriculum_keeps_the_batch():
    plugin = build_plugins(["decs"], {"decs": {"curriculum_drop": "zero_advantage"}}).plugins[0]
    assert not plugin.hook_enabled("trl_plugins_reject_groups") and plugin.multi_turn_refusal() != \
        build_plugins(["decs"]).plugins[0].multi_turn_refusal()
    assert not build_plugins(["decs"], {"decs": {"curriculum": False}}).plugins[0].hook_enabled(
        "trl_plugins_reject_groups")
    with pytest.raises(PluginConfigError, match="curriculum_drop"):
        build_plugins(["decs"], {"decs": {"curriculum_drop": "drop"}})


def test_curriculum_drops_easy_groups_and_kappa_follows_the_nrp_ratio():
    plugin = _plugin(kappa_lr=0.5, curriculum_drop="zero_advantage", **LEGACY)
    actx, _ = _run(plugin)
    assert torch.all(actx.advantages[:2] == 0)  # kappa = 0: the all-correct group is dropped
    assert actx.metrics["plugins/decs/kept_group_fraction"] == [0.5]
    ratio = (0.5 + 0.5 + 1.0) / 3
    assert plugin.kappa == pytest.approx(0.5 * (ratio - 0.5)) and plugin.last_nrp_ratio == pytest.approx(ratio)
    fresh = _plugin()
    fresh.trl_plugins_load_state_dict(state=plugin.trl_plugins_state_dict())
    assert fresh.kappa == plugin.kappa and fresh.last_nrp_ratio == plugin.last_nrp_ratio
    assert torch.equal(fresh._generator.get_state(), plugin._generator.get_state())


def test_decs_needs_the_answer_column():
    plugin = _plugin()
    assert plugin.required_columns() == ["answer"]
    assert _plugin(answer_column="reference").required_columns() == ["reference"]
    with pytest.raises(PluginConfigError, match="'beta' of plugin 'decs' got -1.0"):
        build_plugins(["decs"], {"decs": {"beta": -1.0}})
    with pytest.raises(PluginConfigError, match="'split_words' of plugin 'decs' got 'Wait'"):
        build_plugins(["decs"], {"decs": {"split_words": "Wait"}})


def test_advantages_without_the_reward_stage_are_refused():
    actx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2)
    with pytest.raises(PluginError, match="did not record this batch's chunks"):
        _plugin().trl_plugins_transform_advantages(actx)


def test_end_to_end_decs_trains(tmp_path):
    from trl_plugins.tasks.arithmetic import accuracy_reward

    trainer = make_tiny_trainer(reward_funcs=[accuracy_reward], max_steps=2, output_dir=str(tmp_path / "d"),
                                plugins=["decs"], max_refill_rounds=2)
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/decs/kappa" in log for log in logs)
    assert all("plugins/framework/refill_rounds" in log for log in logs)  # the curriculum refills
    assert all(a.dim() == 2 for a in run.advantages)
    assert all(math.isfinite(log["loss"]) for log in logs)
