"""search_r2: the trajectory rendering, the refiner's parsers, the information density and the hybrid reward on small
values; bad options refused; the neutral setting is vanilla TRL; on the tiny tool trainer, the policy-as-Meta-Refiner
(scripted answers) cuts flagged trajectories at the named step and the regenerated episodes replace them, keeping the
turns before the cut."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import IncompatiblePluginsError, Plugin, PluginConfigError, build_plugins, hookimpl
from trl_plugins.tasks.tools import gold_trace_script, make_tool_dataset
from trl_plugins.testing import assert_runs_equal, make_tool_trainer, record_run, temporary_plugin
from trl_plugins_builtin.search_r2 import (
    CUT_KEY, hybrid_reward, information_density, parse_cut, parse_verdict, render_trajectory,
)

MESSAGES = [
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {"query": "A"}}}]},
    {"role": "tool", "content": "A has 12 people."},
    {"role": "assistant", "content": "Answer: 12"},
]


def test_render_numbers_the_assistant_turns_with_their_results():
    text, steps = render_trajectory(MESSAGES)
    assert steps == 2
    assert text.splitlines() == ["Step 1: [search call search: {'query': 'A'}]", "  Result: A has 12 people.",
                                 "Step 2: Answer: 12"]
    assert render_trajectory([]) == ("", 0)


def test_verdict_and_cut_parsing():
    assert parse_verdict("Verdict: flawed") is True
    assert parse_verdict("thinking... verdict: **Coherent**") is False
    assert parse_verdict("Verdict: coherent\nVerdict: flawed") is True  # the last verdict counts
    assert parse_verdict("it looks fine") is None
    assert parse_cut("Flawed step: 2", 3) == 2
    assert parse_cut("flawed step:1 ... Flawed step: 3", 3) == 3
    assert parse_cut("Flawed step: 4", 3) is None and parse_cut("Flawed step: 0", 3) is None
    assert parse_cut("step two", 3) is None


def test_information_density_is_the_useful_fraction_of_the_calls():
    # turn 0: two calls, one useful (summed reward 1); turn 1: one call, useful; turn 2: the answer (no call, NaN)
    assert information_density([1.0, 1.0, math.nan], [2, 1, 0]) == pytest.approx(2 / 3)
    assert information_density([math.nan], [0]) == 0.0  # no calls
    assert information_density([math.nan, math.nan], [1, 0]) == 0.0  # calls without per-call rewards
    assert information_density([5.0, -1.0], [1, 1]) == pytest.approx(0.5)  # each call clipped to [0, 1]


def test_hybrid_reward_adds_the_weighted_density_to_correct_answers():
    outcome = torch.tensor([1.0, 0.0, 1.0, math.nan])
    density = torch.tensor([0.5, 1.0, 0.0, 1.0])
    out = hybrid_reward(outcome, density, 0.4, gate=True)
    assert torch.allclose(out[:3], torch.tensor([1.2, 0.0, 1.0])) and math.isnan(out[3])
    ungated = hybrid_reward(outcome, density, 0.4, gate=False)
    assert torch.allclose(ungated[:3], torch.tensor([1.2, 0.4, 1.0]))
    assert torch.equal(hybrid_reward(outcome[:3], density[:3], 0.0, gate=False), outcome[:3])


@pytest.mark.parametrize("options, message", [
    ({"max_revisions": -1}, "max_revisions"),
    ({"process_weight": -0.5}, "process_weight"),
    ({"discriminator_template": "Judge {trajectory}"}, "discriminator_template"),
    ({"trimmer_template": "{question} {trajectory} {answer}"}, "trimmer_template"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["search_r2"], {"search_r2": options})


def test_refused_under_vllm_unless_reward_only():
    class Args:
        use_vllm = True

    stack = build_plugins(["search_r2"], {})
    with pytest.raises(IncompatiblePluginsError, match="tool-episode seam"):
        stack.plugins[0].trl_plugins_configure(None, Args())
    build_plugins(["search_r2"], {"search_r2": {"max_revisions": 0}}).plugins[0].trl_plugins_configure(None, Args())


@pytest.mark.slow
def test_neutral_setting_is_vanilla(tmp_path):
    vanilla = record_run(make_tool_trainer(GRPOTrainer, max_steps=1, output_dir=str(tmp_path / "v")))
    ours = record_run(make_tool_trainer(plugins=["search_r2"], max_steps=1, output_dir=str(tmp_path / "s"),
                                        plugin_config={"search_r2": {"max_revisions": 0, "process_weight": 0.0}}))
    assert any(a.abs().sum() > 0 for a in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


def refiner_script(dataset, cut: int = 2):
    """The gold-trace policy, answering the Meta-Refiner's prompts: every trajectory flawed, cut at step ``cut``."""
    actor = gold_trace_script(dataset)

    def script(prompt_text: str, row: int) -> str:
        if "'Verdict: coherent' or 'Verdict: flawed'" in prompt_text:
            return "Verdict: flawed"
        if "'Flawed step: N'" in prompt_text:
            return f"Flawed step: {cut}"
        return actor(prompt_text, row)

    return script


class SeeRows(Plugin):
    name = "test_search_r2_rows"
    multi_turn = True
    seen: list = []

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        SeeRows.seen.append({i: (ctx.annotations[i].get(CUT_KEY), list(ctx.completion_ids[i]), ctx.turns[i],
                                 ctx.episodes.get(i)) for i in range(len(ctx))})


@pytest.mark.slow
def test_flagged_trajectories_are_cut_at_the_named_step_and_regenerated(tmp_path):
    dataset = make_tool_dataset(8, kinds=("lookup", "scaled"))
    with temporary_plugin(SeeRows):
        SeeRows.seen = []
        tr = make_tool_trainer(plugins=["search_r2", "test_search_r2_rows"], max_steps=1, output_dir=str(tmp_path),
                               script=refiner_script(dataset))
        tr.train()
    (rows,) = SeeRows.seen
    cut = {i: v for i, v in rows.items() if v[0] is not None}
    assert cut, "no trajectory was cut although every one is judged flawed at step 2"
    for i, (tag, ids, turns, episode) in cut.items():
        assert tag == "2" and episode is not None and episode.row == i and episode.turn == 1
        assert ids == episode.completion_ids and turns is episode.turns
        assert 0 in episode.tool_mask[: episode.start]  # the kept step 1 ends with its tool result
    # single-turn rows (the script's shortcut answers) have no step 2: left as TRL generated them
    assert all(v[3] is None for i, v in rows.items() if i not in cut)
    logs = {k: v for entry in tr.state.log_history for k, v in entry.items()}
    assert logs["plugins/search_r2/refined"] == len(cut)
    assert logs["plugins/search_r2/flagged_fraction"] == 1.0
    assert logs["plugins/search_r2/density_mean"] > 0  # the gold traces' searches hit the question's town
    assert tr.state.global_step == 1
