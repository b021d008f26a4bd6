"""hint_scaffold: success is decided on the verifier column (a partial-credit format column never hides an all-fail
group), GHPO keeps the last hinted group when no level succeeds, and the plugin reduces to vanilla GRPO when no group
fails; Scaf-GRPO tiered hints."""

import json

import pytest

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    build_stack,
    make_rollout_context,
    run_on_processes,
    stub_rows,
)
from trl_plugins_builtin.hint_scaffold import parse_tiers, tiered_levels


def accuracy(completions, answer, **kwargs):
    """Exact verifier: 1.0 when the completion's text is the answer."""
    return [1.0 if (c if isinstance(c, str) else c[-1]["content"]).strip() == a else 0.0
            for c, a in zip(completions, answer)]


def formatted(completions, **kwargs):
    """Partial credit: 1.0 for any completion ending in a period (every completion below is well formatted)."""
    return [1.0 if (c if isinstance(c, str) else c[-1]["content"]).endswith(".") else 0.0 for c in completions]


def _ctx(groups, respond, **kw):
    G = len(groups[0])
    rows = stub_rows(len(groups), G, answer=["7."] * len(groups), solution="The sum is 7.")
    return make_rollout_context(groups, rows=rows, service=StubGenerationService(respond),
                                reward_funcs=[accuracy, formatted], reward_weights=[1.0, 0.5], **kw)


def _run(ctx, **options):
    build_plugins(["hint_scaffold"], {"hint_scaffold": options}).call("trl_plugins_after_generation", ctx)
    return ctx


def test_format_column_does_not_hide_an_all_fail_group():
    # every rollout is wrong but well formatted: weighted reward 0.5 > 0, yet the verifier says all-fail
    ctx = _ctx([["1.", "2.", "3."], ["7.", "2.", "3."]], lambda prompt, j: "7." if j == 0 else "9.")
    assert ctx.score(range(6)).tolist() == [0.5, 0.5, 0.5, 1.5, 0.5, 0.5]  # the weighted sum is positive everywhere
    _run(ctx)
    assert len(ctx.service.calls) == 1 and len(ctx.service.calls[0]) == 3  # only group 0 was hinted, once
    assert ctx.changed == {0, 1, 2}
    assert [ctx.completions[i][-1]["content"] for i in range(3)] == ["7.", "9.", "9."]
    assert ctx.metrics["plugins/hint_scaffold/all_fail_group_fraction"] == [0.5]
    assert ctx.metrics["plugins/hint_scaffold/rescued_group_fraction"] == [0.5]


def test_success_column_and_threshold_select_the_verifier():
    # naming the format column as the verifier: every rollout succeeds, nothing is hinted
    ctx = _run(_ctx([["1.", "2."]], lambda prompt, j: "7."), success_column="formatted")
    assert ctx.service.calls == [[]] and not ctx.changed
    # a threshold at the verifier's top value: nothing can succeed, so the last hinted group is kept
    ctx = _run(_ctx([["7.", "2."]], lambda prompt, j: "7."), success_threshold=1.0)
    assert len(ctx.service.calls) == 3 and ctx.changed == {0, 1}


def test_unknown_success_column_is_a_clear_error():
    with pytest.raises(PluginConfigError, match=r"success_column='nope'.*accuracy, formatted"):
        _run(_ctx([["1.", "2."]], lambda prompt, j: "7."), success_column="nope")


def test_no_level_succeeds_keeps_the_last_hinted_group_as_ghpo():
    ctx = _run(_ctx([["1.", "2."]], lambda prompt, j: "wrong."))
    assert len(ctx.service.calls) == 3  # 25, 50 and 75 %
    assert ctx.changed == {0, 1}
    assert [a["hint_level"] for a in ctx.annotations] == [0.75, 0.75]
    assert all("The sum is 7"[:10] in p[-1]["content"] for p in ctx.training_prompts)  # the 75 % hint: 10 chars
    assert ctx.metrics["plugins/hint_scaffold/rescued_group_fraction"] == [0.0]


def test_one_mode_keeps_the_group_when_no_level_succeeds():
    ctx = _run(_ctx([["1.", "2."]], lambda prompt, j: "wrong."), replace="one")
    assert len(ctx.service.calls) == 3 and not ctx.changed


def test_reduces_to_vanilla_when_no_group_fails():
    # every rollout's verifier value is above -1: no group is all-fail, the plugin must change nothing
    runs = assert_reduces_to_vanilla("hint_scaffold", {"success_threshold": -1.0}, loss_types=("dapo",), steps=1)
    logged = [log for log in runs["dapo"].logs if "plugins/hint_scaffold/all_fail_group_fraction" in log]
    assert logged and all(log["plugins/hint_scaffold/all_fail_group_fraction"] == 0.0 for log in logged)


# ------------------------------------------------------------------------------------------ Scaf-GRPO tiered hints
HINTS = {"knowledge": ["K1", "K2"], "planning": ["P1"], "solution": ["S1", "S2"]}


def test_tiered_levels_are_cumulative_over_the_chosen_tiers():
    assert tiered_levels(HINTS, ["knowledge", "solution"]) == [
        ("knowledge", 1, "K1"), ("knowledge", 2, "K1\nK2"),
        ("solution", 1, "K1\nK2\nS1"), ("solution", 2, "K1\nK2\nS1\nS2"),
    ]
    assert [t for t, _, _ in tiered_levels(HINTS, ["knowledge", "planning", "solution"])].count("planning") == 1
    assert tiered_levels({"knowledge": "only one"}, ["knowledge", "solution"]) == [("knowledge", 1, "only one")]
    assert tiered_levels(None, ["knowledge"]) == []


def _tiered_ctx(groups, hints, respond):
    G = len(groups[0])
    rows = stub_rows(len(groups), G, answer=["7."] * len(groups), hints=hints)
    return make_rollout_context(groups, rows=rows, service=StubGenerationService(respond),
                                reward_funcs=[accuracy, formatted], reward_weights=[1.0, 0.5])


def test_scaf_grpo_one_mode_tries_tiers_and_keeps_the_minimal_successful_level():
    # group 0 succeeds once the first solution part is in the hint; group 1 has only one knowledge part
    hints = [HINTS, {"knowledge": ["K1"]}]

    def respond(prompt, j):
        return "7." if "S1" in prompt[-1]["content"] else "no."

    ctx = _run(_tiered_ctx([["1.", "2."], ["3.", "4."]], hints, respond), hints="tiered", replace="one",
               warmup_steps=0)
    hinted = [[p[-1]["content"].split("Hint:\n", 1)[1] for p in call] for call in ctx.service.calls]
    assert hinted == [["K1", "K1"], ["K1\nK2"], ["K1\nK2\nS1"]]  # group 1 is out of levels after the first
    assert ctx.changed == {0}  # slot 0 of group 0, from the knowledge + first solution part level
    assert ctx.annotations[0]["hint_level"] == "solution:1"
    assert ctx.training_prompts[0][-1]["content"].endswith("Hint:\nK1\nK2\nS1")
    assert ctx.metrics["plugins/hint_scaffold/rescued_group_fraction"] == [0.5]


def test_tiered_group_mode_keeps_each_groups_own_last_level():
    hints = [HINTS, {"knowledge": ["K1"]}]
    ctx = _run(_tiered_ctx([["1.", "2."], ["3.", "4."]], hints, lambda prompt, j: "no."), hints="tiered")
    assert [a["hint_level"] for a in ctx.annotations] == ["solution:2"] * 2 + ["knowledge:1"] * 2


def test_tiered_hints_missing_is_a_clear_error():
    with pytest.raises(PluginConfigError, match=r"row 0 has no tiered hints .* column 'hints'"):
        _run(_tiered_ctx([["1.", "2."]], [{"planning": ["P1"]}], lambda prompt, j: "no."), hints="tiered")


def test_tiered_levels_agree_across_processes():
    # process 0 holds group 0 (4 levels), process 1 holds group 1 (1 level): both must call the service 4 times
    def work(rank, gather):
        hints = [HINTS] if rank == 0 else [{"knowledge": ["K1"]}]
        rows = stub_rows(1, 2, first_group=rank, answer="7.", hints=hints)
        ctx = make_rollout_context([["1.", "2."]], rows=rows, process_index=rank, gather=gather,
                                   service=StubGenerationService(lambda prompt, j: "no."),
                                   reward_funcs=[accuracy, formatted])
        _run(ctx, hints="tiered")
        return [len(call) for call in ctx.service.calls], [a.get("hint_level") for a in ctx.annotations]

    (calls0, levels0), (calls1, levels1) = run_on_processes(2, work)
    assert calls0 == [2, 2, 2, 2] and calls1 == [2, 0, 0, 0]
    assert levels0 == ["solution:2"] * 2 and levels1 == ["knowledge:1"] * 2


# ------------------------------------------------------------------------------------------ Scaf-GRPO teacher tiers
def test_parse_tiers_keeps_the_requested_tiers_only():
    answer = 'Sure: {"knowledge": ["K1", "K2"], "planning": "P1", "solution": [], "extra": ["X"]} done'
    assert parse_tiers(answer, ["knowledge", "planning", "solution"]) == {"knowledge": ["K1", "K2"], "planning": ["P1"]}
    assert parse_tiers("no json here", ["knowledge"]) == {}
    assert parse_tiers("{not json}", ["knowledge"]) == {}


def test_teacher_tiers_from_a_loopback_endpoint_once_per_problem():
    requests = []

    def handler(path, payload):
        requests.append(payload["messages"][-1]["content"])
        return chat_response(json.dumps({"knowledge": ["K1"], "planning": ["P1"], "solution": ["S1", "S2"]}))

    def respond(prompt, j):
        return "7." if "S1" in prompt[-1]["content"] else "no."

    clear_shared_teachers()
    try:
        with serve_openai_compatible(handler) as url:
            stack = build_stack("hint_scaffold", {"hint_scaffold": {
                "hints": "tiered", "tiers_from": "teacher", "teacher_base_url": url, "teacher_max_retries": 0,
                "replace": "one", "tiers": ["knowledge", "planning", "solution"]}})
            rows = stub_rows(2, 2, answer=["7."] * 2, solution="3+4=7")
            ctx = make_rollout_context([["1.", "2."], ["3.", "4."]], rows=rows,
                                       service=StubGenerationService(respond), reward_funcs=[accuracy, formatted],
                                       reward_weights=[1.0, 0.5])
            stack.call("trl_plugins_after_generation", ctx)
            assert len(requests) == 2 and "## Reference solution\n3+4=7" in requests[0]  # one request per problem
            assert ctx.changed == {0, 2}
            assert ctx.annotations[0]["hint_level"] == "solution:1"
            assert ctx.training_prompts[0][-1]["content"].endswith("Hint:\nK1\nP1\nS1")
            ctx2 = make_rollout_context([["1.", "2."], ["3.", "4."]], rows=rows, service=StubGenerationService(respond),
                                        reward_funcs=[accuracy, formatted])
            stack.call("trl_plugins_after_generation", ctx2)
            assert len(requests) == 2  # the tiers are kept for the rest of the run
        state = stack.plugins[0].trl_plugins_state_dict()
        assert state["teacher_tiers"][ctx.prompts[0][-1]["content"]]["solution"] == ["S1", "S2"]
    finally:
        clear_shared_teachers()


def test_teacher_without_usable_tiers_leaves_the_group_and_reports_it():
    clear_shared_teachers()
    try:
        with serve_openai_compatible(lambda path, payload: chat_response("I cannot help.")) as url:
            stack = build_stack("hint_scaffold", {"hint_scaffold": {
                "hints": "tiered", "tiers_from": "teacher", "teacher_base_url": url, "teacher_max_retries": 0}})
            ctx = _tiered_ctx([["1.", "2."]], [None], lambda prompt, j: "7.")
            with pytest.warns(RuntimeWarning, match="no usable tiers"):
                stack.call("trl_plugins_after_generation", ctx)
        assert not ctx.changed and ctx.service.calls == []
        assert ctx.metrics["plugins/hint_scaffold/fallback_teacher_tiers_invalid"] == [1.0]
    finally:
        clear_shared_teachers()


def test_teacher_tiers_need_an_endpoint_url():
    with pytest.raises(PluginConfigError, match="teacher_base_url"):
        build_plugins(["hint_scaffold"], {"hint_scaffold": {"hints": "tiered", "tiers_from": "teacher"}})
