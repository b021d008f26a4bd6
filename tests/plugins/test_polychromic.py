"""polychromic: set-level mean reward x diversity advantages.

Hand-computed set advantages on a 4-rollout group, the std scaling, the set draws, the diversity keys read at the
reward stage, set_size=1 over every subset reproducing TRL's advantage bit for bit (unit level for every
scale_rewards, and a whole run against trl.GRPOTrainer), bad settings refused, and a short run that trains."""

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.polychromic import (
    draw_sets,
    group_keys,
    polychromic_advantages,
    set_diversity,
)

# one group: rows 0 and 3 are correct with the same answer, row 2 correct with another, row 1 wrong
R = torch.tensor([1.0, 0.0, 1.0, 1.0])
KEYS = torch.tensor([0, 1, 2, 0])


def test_set_advantages_by_hand_every_pair():
    # the 6 pairs: (0,1) .5*1, (0,2) 1*1, (0,3) 1*.5 (same answer), (1,2) .5, (1,3) .5, (2,3) 1 -> V = 4/6
    adv, stats = polychromic_advantages(R, KEYS, 4, 2, None, "none")
    # row 0: (-1/6 + 1/3 - 1/6)/3 = 0; row 1: -1/6; row 2: (1/3 - 1/6 + 1/3)/3 = 1/6; row 3: 0
    assert adv.tolist() == pytest.approx([0.0, -1 / 6, 1 / 6, 0.0], abs=1e-7)
    assert stats["set_score"] == pytest.approx(4 / 6)
    assert stats["set_diversity"] == pytest.approx(5.5 / 6)
    assert stats["rollouts_in_no_set"] == 0.0
    # the duplicated correct answer earns less than the distinct one although both have reward 1
    assert adv[2] > adv[0]


def test_group_scaling_divides_by_the_std_of_the_set_scores():
    scores = torch.tensor([0.5, 1.0, 0.5, 0.5, 0.5, 1.0])
    std = float(scores.std())  # unbiased: sqrt((4/36 + 2/9) / 5)
    assert std == pytest.approx((1 / 15) ** 0.5)
    adv, _ = polychromic_advantages(R, KEYS, 4, 2, None, "group")
    assert adv.tolist() == pytest.approx([0.0, -1 / 6 / (std + 1e-4), 1 / 6 / (std + 1e-4), 0.0], abs=1e-6)


def test_diversity_off_is_a_scaled_group_advantage():
    # d = 1: every subset gives A_i = (N - n) / (n (N - 1)) * (R_i - mean R) = (R_i - .75) / 3 for N = 4, n = 2
    adv, stats = polychromic_advantages(R, torch.arange(4), 4, 2, None, "none")
    assert adv.tolist() == pytest.approx([1 / 12, -1 / 4, 1 / 12, 1 / 12])
    assert stats["set_diversity"] == 1.0
    # all keys equal: d = 1/2 for every pair, half the advantage
    adv, stats = polychromic_advantages(R, torch.zeros(4, dtype=torch.long), 4, 2, None, "none")
    assert adv.tolist() == pytest.approx([1 / 24, -1 / 8, 1 / 24, 1 / 24])
    assert stats["set_diversity"] == 0.5


def test_set_diversity_counts_distinct_keys():
    keys = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 1], [3, 2, 1, 0], [-2, -3, 5, 5]])
    assert set_diversity(keys).tolist() == [0.25, 0.5, 1.0, 0.75]


def test_draw_sets_are_distinct_rows_and_reproducible():
    sets = draw_sets(8, 4, 4, torch.Generator().manual_seed(3))
    assert sets.shape == (4, 4)
    assert all(len(set(row.tolist())) == 4 and 0 <= min(row) and max(row) < 8 for row in sets)
    assert torch.equal(sets, draw_sets(8, 4, 4, torch.Generator().manual_seed(3)))
    assert draw_sets(5, 2, None).shape == (10, 2)  # every subset
    adv_a, _ = polychromic_advantages(torch.rand(16), torch.arange(16), 8, 4, 4, "group", seed=0, step=0)
    adv_b, _ = polychromic_advantages(torch.rand(16), torch.arange(16), 8, 4, 4, "group", seed=0, step=1)
    assert adv_a.shape == adv_b.shape == (16,)


def test_random_sets_leave_uncovered_rows_at_zero():
    # one set of 2 out of 4: two rows in no set; with a single set V = f and every advantage is 0
    adv, stats = polychromic_advantages(R, KEYS, 4, 2, 1, "none")
    assert stats["rollouts_in_no_set"] == 0.5
    assert adv.tolist() == [0.0] * 4


def test_nan_rewards_count_as_zero_and_get_zero_advantage():
    rewards = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    adv, _ = polychromic_advantages(rewards, KEYS, 4, 2, None, "none")
    assert adv[1] == 0.0
    assert adv.tolist() == pytest.approx([0.0, 0.0, 1 / 6, 0.0], abs=1e-7)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_set_size_one_over_every_subset_is_trls_advantage_bit_for_bit(scale):
    G = 4
    rewards = torch.tensor([0.3, 0.7, 0.7, 0.1, 1.0, 0.0, 0.25, 0.5, 0.9, 0.9, 0.9, 0.9])
    ours, _ = polychromic_advantages(rewards, torch.arange(12), G, 1, None, scale)
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)  # TRL 1.16 _generate_and_score
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) if scale == "group" else nanstd(rewards)
    trl = rewards - mean
    if scale != "none":
        trl = trl / (std + 1e-4)
    assert torch.equal(ours, trl)


def test_group_keys_for_unanswered_rows():
    ids = [[0, None, 1, None]]
    assert group_keys(ids, "singleton").tolist() == [0, -3, 1, -5]
    assert group_keys(ids, "cluster").tolist() == [0, -1, 1, -1]


def _run_stages(texts, rewards, options):
    N = len(texts)
    rctx = make_reward_context(rewards.view(-1, 1).clone(), num_generations=4, reward_func_names=["r"],
                               completions=list(texts))
    actx = make_advantage_context(rewards.clone(), num_generations=4, completion_lengths=torch.ones(N))
    stack = build_plugins(["polychromic"], {"polychromic": options})
    stack.call("trl_plugins_transform_rewards", rctx)
    stack.call("trl_plugins_transform_advantages", actx)
    return actx


def test_stages_read_answers_and_write_set_advantages():
    texts = ["Answer: 5", "Answer: 3", "Answer: 7", "Answer: 5"]
    actx = _run_stages(texts, R, {"set_size": 2, "num_sets": None, "diversity": "answers"})
    expected, _ = polychromic_advantages(R, KEYS, 4, 2, None, "group")
    assert torch.equal(actx.advantages, expected)
    assert actx.metrics["plugins/polychromic/set_diversity"] == [pytest.approx(5.5 / 6)]
    # whole texts: "Answer: 5" and "answer:  5" are the same text up to case and whitespace
    texts = ["Answer: 5", "x", "y", "answer:  5"]
    actx = _run_stages(texts, R, {"set_size": 2, "num_sets": None, "diversity": "texts"})
    assert torch.equal(actx.advantages, expected)


def test_advantage_stage_without_reward_stage_is_refused():
    actx = make_advantage_context(R.clone(), num_generations=4, completion_lengths=torch.ones(4))
    stack = build_plugins(["polychromic"], {"polychromic": {"set_size": 2}})
    with pytest.raises(PluginConfigError, match="reward stage did not run"):
        stack.call("trl_plugins_transform_advantages", actx)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"set_size": 0}, "set_size"),
        ({"num_sets": 0}, "num_sets"),
        ({"extractor": "nope"}, "extractor"),
        ({"diversity": "rooms"}, "diversity"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["polychromic"], {"polychromic": options})


RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")


def test_set_size_larger_than_the_group_is_refused(tmp_path):
    with pytest.raises(PluginConfigError, match=r"'set_size'.*got 5 with num_generations=4.*set_size <= num_gen"):
        make_tiny_trainer(plugins=["polychromic"], plugin_config={"polychromic": {"set_size": 5}},
                          output_dir=str(tmp_path), **RUN)


def test_neutral_set_size_one_every_subset_is_vanilla(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, output_dir=str(tmp_path / "v"), **RUN))
    ours = record_run(make_tiny_trainer(
        plugins=["polychromic"], plugin_config={"polychromic": {"set_size": 1, "num_sets": None}},
        output_dir=str(tmp_path / "p"), **RUN))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


def test_short_run_trains_with_texts_diversity(tmp_path):
    trainer = make_tiny_trainer(plugins=["polychromic"],
                                plugin_config={"polychromic": {"set_size": 2, "diversity": "texts"}},
                                output_dir=str(tmp_path), **RUN)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert 0.0 < log["plugins/polychromic/set_diversity"] <= 1.0
