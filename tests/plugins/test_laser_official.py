"""laser against the official LASER code: LASER-D's coverage target (hard prompts keep the budget of their
longest rollout), LASER-DE's exploration bonus only for finished, well-formatted, non-repetitive wrong answers, and
the correctness column chosen by the success rule (never a placeholder)."""

import torch

from trl_plugins import build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.testing import make_reward_context
from trl_plugins_builtin.laser import (
    band_sizes,
    coverage_target,
    is_repetitive,
)

EOS = 2


def _plugin(max_len, **options):
    plugin = build_plugins(["laser"], {"laser": options}).plugins[0]
    plugin.max_len, plugin.eos_ids = max_len, {EOS}
    return plugin


def _ctx(rewards, names, ids, G, **kwargs):
    return make_reward_context(torch.tensor(rewards, dtype=torch.float32), num_generations=G, reward_func_names=names,
                               local_completion_ids=ids, **kwargs)


def _plain(n, finished=True):
    """``n`` distinct tokens (never repetitive), ending in EOS when finished."""
    return list(range(10, 10 + n - 1)) + [EOS if finished else 9]


def test_coverage_target_matches_the_official_rule():
    lengths = torch.tensor([2, 3, 6, 8])
    assert band_sizes(8) == (5, 2, 1) and band_sizes(4) == (2, 1, 1)
    # easy band of G=4 (n_band 2): floor(coverage * 2) >= 1 first at coverage 1/2 -> L = 3
    assert coverage_target(lengths, list(range(1, 9)), 2, 1.0) == 3
    # hard band (n_band 1): every rollout must be covered -> the longest rollout's budget
    assert coverage_target(lengths, list(range(1, 9)), 1, 1.0) == 8
    assert coverage_target(torch.tensor([2, 5]), [4, 8, 12], 1, 1.0) == 8
    assert coverage_target(torch.tensor([], dtype=torch.long), [4, 8], 1, 1.0) == 8


def test_laser_d_hard_prompts_keep_the_full_budget_even_with_a_short_correct_answer():
    # G = 4, budgets 1..8. Group 1 is hard (1 of 4 correct) and its correct answer is short (length 2): the official
    # estimator keeps the budget covering all its rollouts (8); the 'ecr' estimator would cut it to 2.
    plugin = _plugin(8, variant="laser_d", alpha=1.0)
    acc = [1, 1, 1, 1, 0, 1, 0, 0]
    lengths = [2, 3, 6, 8, 5, 2, 7, 8]
    plugin.trl_plugins_transform_rewards(_ctx([[a, 0] for a in acc], ["acc", "laser"],
                                              [_plain(n) for n in lengths], 4))
    assert plugin.targets == [3, None, 8]
    ecr = _plugin(8, variant="laser_d", alpha=1.0, target_estimator="ecr")
    ecr.trl_plugins_transform_rewards(_ctx([[a, 0] for a in acc], ["acc", "laser"],
                                           [_plain(n) for n in lengths], 4))
    assert ecr.targets[2] == 2


def test_is_repetitive():
    assert not is_repetitive([1, 1, 1, 1, 1, 1, 1, 1])  # 8 tokens: too short to judge
    assert not is_repetitive(list(range(100, 140)))  # 40 distinct tokens
    assert is_repetitive([1, 2, 3] * 12)  # a loop
    assert is_repetitive(list(range(100, 120)) + [5, 6, 7, 5, 6, 7])  # a trigram twice, close together
    assert not is_repetitive([9] * 2 + list(range(100, 140)))  # one bigram of one token is not a repeat (n = 3)


def test_laser_de_explores_only_with_finished_formatted_non_repetitive_wrong_answers():
    # every row is wrong and longer than the targets (10, fixed: an eval batch does not update them)
    ids = [
        _plain(20),                          # finished, formatted, not repetitive -> bonus
        list(range(10, 30)),                 # cut off at max_len without EOS -> no bonus
        [1, 2, 3, 4] * 4 + [1, 2, 3, EOS],   # a repetition loop -> no bonus
        _plain(20),                          # the format column says unformatted -> no bonus
    ]
    rewards = [[0, 1, 0], [0, 1, 0], [0, 1, 0], [0, 0, 0]]
    for gate, expected in (("formatted_non_repetitive", [0.5, 0.0, 0.0, 0.0]), ("none", [0.5] * 4)):
        plugin = _plugin(20, variant="laser_de", alpha=0.5, format_column="fmt", explore_gate=gate)
        plugin.targets = [10, 10, 10]
        ctx = _ctx(rewards, ["acc", "fmt", "laser"], ids, 2, mode="eval")
        plugin.trl_plugins_transform_rewards(ctx)
        assert ctx.rewards_per_func[:, 2].tolist() == expected, gate


def test_correctness_column_skips_placeholder_columns():
    plugin = _plugin(8, variant="laser", target_length=4, alpha=1.0)
    ctx = _ctx([[1, 0, 0], [1, 1, 0]], ["empo", "acc", "laser"], [_plain(3), _plain(3)], 2,
               run=RunInfo(placeholder_columns=(True, False, True)))
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 2].tolist() == [0.0, 1.0]  # correct = the 'acc' column, not empo's placeholder
