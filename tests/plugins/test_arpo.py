"""arpo: the official segment entropy, branch test and branch plan on small values; bad options refused; the neutral
setting (no slot) is vanilla TRL; on the tiny tool trainer, branches from tool boundaries fill the slot rows through
the tool-episode seam, keeping their source's turns before the boundary."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import Plugin, PluginConfigError, build_plugins, hookimpl
from trl_plugins.testing import assert_runs_equal, make_tool_trainer, record_run, temporary_plugin
from trl_plugins_builtin.arpo import BRANCH_KEY, branches, plan_branches, segment_entropy


def test_segment_entropy_sums_the_first_tokens_of_the_turn_over_log_vocab():
    ent = torch.tensor([9.0, 1.0, 2.0, 4.0, 9.0])
    assert segment_entropy(ent, (1, 4), 2, 100) == pytest.approx(3.0 / math.log(100))
    assert segment_entropy(ent, (1, 4), 20, 100) == pytest.approx(7.0 / math.log(100))
    assert segment_entropy(ent, (2, 2), 20, 100) == 0.0


def test_branch_test_is_clipped_uniform_minus_weighted_entropy_change():
    assert branches(0.6, 0.5, 0.2, 0.5)  # 0.6 - 0.1 = 0.5 <= 0.5
    assert not branches(0.6, 0.4, 0.2, 0.5)  # 0.52 > 0.5
    assert branches(0.99, 10.0, 0.2, 0.0)  # clipped to 0 <= 0: a large entropy rise always branches
    assert not branches(0.0, -10.0, 0.2, 0.5)  # clipped to 1 > 0.5: a large drop never does


def _draw(values):
    it = iter(values)
    return lambda: next(it)


def test_branch_plan_goes_boundary_by_boundary_within_the_slots():
    # row 0 has 3 turns (boundaries 1, 2), row 1 has 2 turns (boundary 1), row 2 one turn (no boundary)
    sources = [(0, [0.1, 0.9, 0.5]), (1, [0.2, 0.2]), (2, [0.3])]
    always = [_draw([0.0] * 9) for _ in sources]
    assert plan_branches(sources, 3, 2, 0.2, 0.5, always) == [(0, 1), (1, 1), (0, 2)]
    assert plan_branches(sources, 2, 2, 0.2, 0.5, [_draw([0.0] * 9) for _ in sources]) == [(0, 1), (1, 1)]
    # beam_size 3: two branches per source and boundary; never more than the slots
    assert plan_branches(sources, 3, 3, 0.2, 0.5, [_draw([0.0] * 9) for _ in sources]) == [(0, 1), (0, 1), (1, 1)]
    # the test uses the entropy change of the turn before the boundary: row 0 at boundary 2 has dH = H[1] - H[0]
    never = [_draw([0.9, 0.9]), _draw([0.9]), _draw([])]
    assert plan_branches(sources, 3, 2, 0.2, 0.5, never) == []
    rising = [_draw([0.9, 0.6]), _draw([0.9]), _draw([])]  # 0.6 - 0.2 * 0.8 = 0.44 <= 0.5 at boundary 2
    assert plan_branches(sources, 3, 2, 0.2, 0.5, rising) == [(0, 2)]


@pytest.mark.parametrize("options, message", [
    ({"initial_rollouts": 0}, "initial_rollouts"),
    ({"beam_size": 0}, "beam_size"),
    ({"branch_probability": 1.5}, "branch_probability"),
    ({"entropy_weight": -0.1}, "entropy_weight"),
    ({"entropy_tokens": 0}, "entropy_tokens"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["arpo"], {"arpo": options})


def test_more_roots_than_the_group_is_refused(tmp_path):
    with pytest.raises(PluginConfigError, match=r"'initial_rollouts'.*got 5 with num_generations=4.*<= num_gen"):
        make_tool_trainer(plugins=["arpo"], plugin_config={"arpo": {"initial_rollouts": 5}}, max_steps=1,
                          output_dir=str(tmp_path))


@pytest.mark.slow
def test_neutral_all_roots_is_vanilla(tmp_path):
    vanilla = record_run(make_tool_trainer(GRPOTrainer, max_steps=1, output_dir=str(tmp_path / "v")))
    ours = record_run(make_tool_trainer(plugins=["arpo"], plugin_config={"arpo": {"initial_rollouts": 4}},
                                        max_steps=1, output_dir=str(tmp_path / "a")))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


class SeeRows(Plugin):
    name = "test_arpo_rows"
    multi_turn = True
    seen: list = []

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        SeeRows.seen.append({i: (ctx.annotations[i].get(BRANCH_KEY), list(ctx.completion_ids[i]), ctx.turns[i],
                                 ctx.episodes.get(i)) for i in range(len(ctx))})


@pytest.mark.slow
def test_branches_from_tool_boundaries_fill_the_slots(tmp_path):
    with temporary_plugin(SeeRows):
        SeeRows.seen = []
        tr = make_tool_trainer(plugins=["arpo", "test_arpo_rows"], max_steps=1, output_dir=str(tmp_path),
                               plugin_config={"arpo": {"branch_probability": 1.0}})
        tr.train()
    (rows,) = SeeRows.seen
    filled = {i: v for i, v in rows.items() if v[0] is not None}
    assert filled, "no branch was made although every boundary branches"
    for i, (tag, ids, turns, episode) in filled.items():
        assert i % 4 >= 2  # slots: index in group >= initial_rollouts (4 // 2)
        source, k = (int(x) for x in tag.split("@"))
        assert k >= 1 and source // 4 == i // 4 and source % 4 < 2  # a root of the same group
        assert episode is not None and ids == episode.completion_ids and turns is episode.turns
        assert 0 in episode.tool_mask[: episode.start]  # the kept prefix ends with the source's tool result
    assert tr.state.global_step == 1
