"""polychromic: set-level mean reward x diversity advantages.

Hand-computed set advantages on a 4-rollout group, the std scaling, the set draws, the diversity keys read at the
reward stage, set_size=1 over every subset reproducing TRL's advantage bit for bit (unit level for every
scale_rewards, and a whole run against trl.GRPOTrainer), bad settings refused, and a short run that trains."""

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api import Continuation
from trl_plugins.api.services import RunInfo
from trl_plugins.api.text import completion_text
from trl_plugins.testing import (
    assert_runs_equal,
    char_encode,
    digit_fraction_reward,
    make_advantage_context,
    make_prompt_context,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    stub_rows,
)
from trl_plugins_builtin.polychromic import (
    VINE_ROW_KEY,
    VINES_KEY,
    draw_sets,
    group_keys,
    polychromic_advantages,
    rollout_positions,
    set_diversity,
    state_advantage,
    state_advantages,
    vine_slot,
    window_advantages,
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
        ({"num_sets": 1}, "num_sets"),  # one set is its own baseline: every advantage 0 (NaN-scaled before the fix)
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


# --- vine sampling -------------------------------------------------------------------------------------------------


def test_rollout_positions_are_evenly_spaced_inner_states():
    assert rollout_positions(9, 1) == [4]
    assert rollout_positions(10, 2) == [3, 6]
    assert rollout_positions(2, 2) == [1]  # distinct, inside the completion
    assert rollout_positions(1, 2) == []


def test_state_advantage_of_the_rollout_among_its_vines():
    # member 0 (the rollout): reward 1 and an answer no vine gives; vines: two equal correct answers and one wrong.
    # pairs: (0,1) 1, (0,2) 1, (0,3) .5, (1,2) 1 * .5, (1,3) .5, (2,3) .5 -> V = 4/6; member 0: (1/3 + 1/3 - 1/6) / 3
    value, mean_score = state_advantage(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 1, 1, 2]), 2, None,
                                        False, torch.Generator())
    assert value == pytest.approx(1 / 6)
    assert mean_score == pytest.approx(4 / 6)


def test_window_advantages_overwrite_the_tokens_after_each_state():
    out = window_advantages(torch.tensor([1.0, -1.0]), [[[1, 0.5], [4, 2.0]], None], 6, 2)
    assert out.tolist() == [[1.0, 0.5, 0.5, 1.0, 2.0, 2.0], [-1.0] * 6]


class _VineService:
    """Continues each prefix with the next scripted text (char tokens), recording the requests."""

    def __init__(self, texts):
        self.texts, self.requests = list(texts), []

    def continue_prefixes(self, prompt_ids, prefix_ids, max_new_tokens, **kwargs):
        self.requests.append((list(prefix_ids), list(max_new_tokens)))
        out = []
        for prefix in prefix_ids:
            new = char_encode(self.texts.pop(0))
            out.append(Continuation(completion_ids=list(prefix) + new, new_ids=new, logprobs=[-1.0] * len(new),
                                    finished=True))
        return out


def _answer_reward(prompts, completions, **kwargs):
    texts = [completion_text(c) for c in completions]
    return [1.0 if ("5" in t or "7" in t) else 0.0 for t in texts]


def test_vine_sampling_scores_the_sets_of_each_rollout_state():
    service = _VineService(["er: 5", "er: 5", "er: 0", "er: 0", "er: 0", "er: 0"])
    ctx = make_rollout_context([["Answer: 7", "Answer: 0"]], service=service, reward_funcs=[_answer_reward],
                               run=RunInfo(max_completion_length=16))
    stack = build_plugins(["polychromic"], {"polychromic": {
        "set_size": 2, "num_sets": None, "rollout_states": 1, "vines": 4, "vine_rows": "scored"}})
    stack.plugins[0]._scale_rewards = "none"
    stack.call("trl_plugins_after_generation", ctx)
    # one state per rollout at c = 9 // 2 = 4 ("Answ"), 3 vines each, up to max_completion_length
    assert service.requests == [([char_encode("Answ")] * 6, [12] * 6)]
    # row 0: rollout "7" (1), vines "5" (1), "5" (1), "0" (0) -> 1/6 (hand-computed above); row 1: all 0 -> 0
    assert ctx.annotations[0][VINES_KEY] == [[4, pytest.approx(1 / 6)]]
    assert ctx.annotations[1][VINES_KEY] == [[4, 0.0]]
    assert ctx.metrics["plugins/polychromic/extra_rollouts"] == [6]


def test_vine_sampling_refuses_sets_larger_than_the_vines():
    with pytest.raises(PluginConfigError, match=r"'set_size'.*got 4 with vines=3"):
        build_plugins(["polychromic"], {"polychromic": {"set_size": 4, "rollout_states": 2, "vines": 3}})


def test_short_run_trains_with_scored_vines(tmp_path):
    trainer = make_tiny_trainer(plugins=["polychromic"],
                                plugin_config={"polychromic": {"set_size": 2, "rollout_states": 1, "vines": 2,
                                                               "window": 3, "diversity": "texts",
                                                               "vine_rows": "scored"}},
                                output_dir=str(tmp_path), **{**RUN, "max_steps": 1})
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and logs[0]["plugins/polychromic/extra_rollouts"] > 0
    assert logs[0]["plugins/polychromic/vine_states"] > 0
    assert run.advantages[0].dim() == 2  # per-token: the windows after the vine states


def test_a_single_set_per_group_gives_finite_zero_advantages():
    """set_size = G with every subset: one set per group, whose score std is NaN (one value); the advantages are 0,
    never NaN (a NaN advantage made every gradient NaN in a two-process run)."""
    from trl_plugins_builtin.polychromic import polychromic_advantages

    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5])
    keys = torch.tensor([0, 1, 0, 0])
    for scale in ("group", "batch", "none"):
        adv, _ = polychromic_advantages(rewards, keys, group_size=2, set_size=2, num_sets=None, scale_rewards=scale)
        assert torch.equal(adv, torch.zeros(4)), (scale, adv)


# ------------------------------------------------------------------------------------- trained vines (the paper)
def test_vine_rows_form_trees_of_a_root_and_its_vines_per_state():
    # rollout_states 2, vines 3: trees of L = 1 + 2 * 2 = 5 rows; a group of 8 ends with a partial tree
    assert [vine_slot(k, 5, 2) for k in range(8)] == [None, (0, 0), (0, 0), (0, 1), (0, 1), None, (5, 0), (5, 0)]
    # every member's set advantage at one state (pairs of 4, hand-computed: V = 4/6)
    values, _ = state_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 1, 1, 2]), 2, None, False,
                                 torch.Generator())
    assert values.tolist() == pytest.approx([1 / 6, 0.0, 0.0, -1 / 6], abs=1e-6)


def test_sampling_stage_fills_the_vine_rows_from_their_roots_state():
    service = _VineService(["er: 5", "er: 5", "er: 0"])
    ctx = make_rollout_context([["Answer: 7", "", "", ""]], service=service, deferred=[1, 2, 3],
                               run=RunInfo(max_completion_length=16))
    stack = build_plugins(["polychromic"], {"polychromic": {
        "set_size": 2, "num_sets": None, "rollout_states": 1, "vines": 4}})
    stack.call("trl_plugins_generation_prompts", _prompt_context(stack, 4))
    stack.call("trl_plugins_after_generation", ctx)
    # the root "Answer: 7" (9 tokens) has one state at c = 4; its three vines continue "Answ", up to 16 tokens
    assert service.requests == [([char_encode("Answ")] * 3, [12] * 3)]
    assert [completion_text(ctx.decode(ctx.completion_ids[i], i)) for i in range(4)] == [
        "Answer: 7", "Answer: 5", "Answer: 5", "Answer: 0"]
    assert [ctx.annotations[i].get(VINE_ROW_KEY) for i in range(4)] == [None, [0, 0, 4], [0, 0, 4], [0, 0, 4]]
    assert ctx.metrics["plugins/polychromic/vine_rows"] == [3]


def _prompt_context(stack, n):
    return make_prompt_context(stub_rows(1, n), num_groups=1, num_generations=n)


def test_advantage_stage_gives_every_vine_row_its_state_set_advantage_on_its_window():
    # G = 5: a tree of 4 (root 0 and its 3 vines at c = 1) and a partial tree (root 4, no vines)
    stack = build_plugins(["polychromic"], {"polychromic": {
        "set_size": 2, "num_sets": None, "rollout_states": 1, "vines": 4, "window": 2}})
    plugin = stack.plugins[0]
    plugin._scale_rewards = "none"
    plugin._keys = torch.tensor([0, 1, 1, 2, 3])
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0]
    notes = [{}, {VINE_ROW_KEY: [0, 0, 1]}, {VINE_ROW_KEY: [0, 0, 1]}, {VINE_ROW_KEY: [0, 0, 1]}, {}]
    ctx = make_advantage_context(rewards, num_generations=5, annotations=notes)
    ctx.set_active_plugin("polychromic")
    plugin.trl_plugins_transform_advantages(ctx)
    base, _ = polychromic_advantages(torch.tensor(rewards), torch.tensor([0, 1, 1, 2, 3]), 5, 2, None, "none")
    state = [1 / 6, 0.0, 0.0, -1 / 6]  # the tree's four trajectories (hand-computed above)
    adv = ctx.advantages
    assert adv.shape == (5, 4)
    for n in range(4):
        assert adv[n, 1:3].tolist() == pytest.approx([state[n]] * 2, abs=1e-6)  # the window: tokens 1 and 2
        assert adv[n, [0, 3]].tolist() == pytest.approx([float(base[n])] * 2, abs=1e-6)  # elsewhere: group-level
    assert adv[4].tolist() == pytest.approx([float(base[4])] * 4, abs=1e-6)  # a root without vines
    assert ctx.metrics["plugins/polychromic/vine_set_score"] == [pytest.approx(4 / 6)]


def test_trees_larger_than_the_group_are_refused(tmp_path):
    with pytest.raises(PluginConfigError, match=r"= 1 \+ 2 \* \(3 - 1\) = 5 rows does not fit in a group of "
                                                 r"num_generations=4"):
        make_tiny_trainer(plugins=["polychromic"], output_dir=str(tmp_path), num_generations=4,
                          plugin_config={"polychromic": {"set_size": 2, "rollout_states": 2, "vines": 3}}, **RUN)


def test_short_run_trains_the_vines_as_rows(tmp_path):
    trainer = make_tiny_trainer(plugins=["polychromic"],
                                plugin_config={"polychromic": {"set_size": 2, "rollout_states": 1, "vines": 2,
                                                               "window": 3, "diversity": "texts"}},
                                output_dir=str(tmp_path), **{**RUN, "max_steps": 1})
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and logs[0]["plugins/polychromic/vine_rows"] > 0 and logs[0]["plugins/polychromic/extra_rollouts"] == 0
    assert logs[0]["plugins/polychromic/vine_states"] > 0
    assert run.advantages[0].dim() == 2


def test_trained_vines_are_refused_with_ares_branching(tmp_path):
    with pytest.raises(IncompatiblePluginsError, match=r"\['ares'\] with branch_rollouts > 0 both defer rows"):
        make_tiny_trainer(plugins=["ares", "polychromic"], output_dir=str(tmp_path), num_generations=4,
                          plugin_config={"polychromic": {"set_size": 2, "rollout_states": 1, "vines": 2},
                                         "ares": {"branch_rollouts": 1, "correct_threshold": 0.2}}, **RUN)
