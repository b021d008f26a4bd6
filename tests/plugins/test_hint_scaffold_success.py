"""hint_scaffold: success is decided on the verifier column (a partial-credit format column never hides an all-fail
group), GHPO keeps the last hinted group when no level succeeds, and the plugin reduces to vanilla GRPO when no group
fails."""

import pytest

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import StubGenerationService, assert_reduces_to_vanilla, make_rollout_context, stub_rows


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
