"""The success rule (trl_plugins/api/success.py) in every plugin that decides success: the verdict is taken on the
verifier column, so adding a partial-credit reward column (here a format reward that pays every completion) changes
nothing a plugin does -- while the same column would have flipped a verdict taken on the weighted sum of rewards.

Each test runs the plugin twice on the same batch, with ``[accuracy]`` and with ``[accuracy, formatted]``, and
requires (a) that the plugin acted (non-vacuous) and (b) identical edits, generation requests and verdict metrics."""

import copy

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components.prm import ProgrammaticPRM
from trl_plugins.api.services import RunInfo
from trl_plugins.api.success import (
    RewardColumns,
    SuccessRule,
    mark_placeholder,
    success_mask,
    verifier_column,
)
from trl_plugins.tasks.arithmetic import Problem
from trl_plugins.testing import (
    StubGenerationService,
    make_reward_context,
    make_rollout_context,
    stub_rows,
)

PROBLEMS = [Problem.from_expression([3, 4, 2, 5], ["+", "*", "-"]), Problem.from_expression([6, 2, 3], ["-", "*"])]
# PROBLEMS[0]: 3+4=7 / 7*2=14 / 14-5=9 / Answer: 9      PROBLEMS[1]: 6-2=4 / 4*3=12 / Answer: 12
ONE_SLIP = "3+4=7\n7*2=15\n15-5=10\nAnswer: 10"


def _text(c):
    return c if isinstance(c, str) else c[-1]["content"]


def accuracy(completions, answer, **kwargs):
    """Exact verifier: 1.0 when the last line of the completion is 'Answer: <answer>' (EOS, id 0, ignored)."""
    return [1.0 if _text(c).replace("\x00", "").strip().splitlines()[-1:] == [f"Answer: {a}"] else 0.0
            for c, a in zip(completions, answer)]


def formatted(completions, **kwargs):
    """Partial credit that pays every completion (a lenient format reward)."""
    return [1.0 for _ in completions]


WITH_FORMAT = {"reward_funcs": [accuracy, formatted], "reward_weights": [1.0, 1.0]}
ACCURACY_ONLY = {"reward_funcs": [accuracy]}


RUN = RunInfo(max_completion_length=64)


def _rows(n_groups, G):
    problems = [PROBLEMS[g % 2] for g in range(n_groups)]
    return stub_rows(n_groups, G, answer=[str(p.answer) for p in problems], solution=[p.solution for p in problems],
                     problem=[p.to_json() for p in problems])


def _state(ctx):
    return (copy.deepcopy(ctx.completion_ids), copy.deepcopy(ctx.training_prompts), list(ctx.prompt_swapped),
            copy.deepcopy(ctx.offpolicy), copy.deepcopy(ctx.annotations), sorted(ctx.changed),
            [list(map(repr, call)) for call in ctx.service.calls])


def _run_twice(plugin, options, groups, respond, *, setup=None):
    """Run ``plugin`` on the same batch with and without the format column; return both contexts."""
    out = []
    for rewards in (ACCURACY_ONLY, WITH_FORMAT):
        ctx = make_rollout_context(groups, rows=_rows(len(groups), len(groups[0])),
                                   service=StubGenerationService(respond), run=RUN,
                                   **rewards)
        stack = build_plugins([plugin], {plugin: options})
        if setup is not None:
            setup(next(iter(stack)))
        stack.call("trl_plugins_after_generation", ctx)
        out.append(ctx)
    return out


def _verdict_metrics(ctx, names):
    return {k: v for k, v in ctx.metrics.items() if k.rsplit("/", 1)[-1] in names}


# ------------------------------------------------------------------------------------------ the rule itself
def test_rule_defaults_to_the_first_non_placeholder_column_and_refuses_bad_names():
    values = torch.tensor([[0.0, 1.0, float("nan")], [1.0, 0.0, 0.0], [float("nan"), 1.0, 1.0]])
    names = ["accuracy", "format", "empo"]
    assert success_mask(values, names).tolist() == [False, True, False]  # NaN = failure
    assert success_mask(values, names, SuccessRule("format", 0.5)).tolist() == [True, False, True]
    assert verifier_column(["empo", "accuracy"], [True, False]) == 1  # a placeholder is never the verifier
    with pytest.raises(PluginConfigError, match=r"success_column='empo' is a placeholder.*non-placeholder: accuracy"):
        verifier_column(["empo", "accuracy"], [True, False], "empo")
    with pytest.raises(PluginConfigError, match=r"success_column='acc' is not a reward function.*accuracy, format"):
        success_mask(values[:, :2], names[:2], SuccessRule("acc"))
    with pytest.raises(PluginConfigError, match=r"none besides placeholder columns \(empo\)"):
        verifier_column(["empo"], [True])


def test_score_is_the_weighted_sum_and_placeholders_are_nan():
    def empo(completions, **kwargs):
        return [0.0] * len(completions)

    ctx = make_rollout_context([["Answer: 9", "Answer: 8"]], rows=_rows(1, 2),
                               reward_funcs=[accuracy, formatted, mark_placeholder(empo)], reward_weights=[1.0, 0.5, 2.0])
    columns = ctx.reward_columns([0, 1])
    assert columns.names == ["accuracy", "formatted", "empo"] and columns.placeholders == (False, False, True)
    assert torch.isnan(columns.values[:, 2]).all()  # the placeholder is not run before the reward stage
    assert ctx.score([0, 1]).tolist() == [1.5, 0.5]  # TRL's weighted nansum, as before
    assert ctx.success([0, 1]).tolist() == [True, False]
    # a legacy scorer returning a (n,) tensor is one column
    assert RewardColumns.of(torch.tensor([0.2, 0.0])).success().tolist() == [True, False]


def test_reward_context_success_skips_the_runs_placeholder_columns():
    matrix = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["empo", "accuracy"])
    assert ctx.success().tolist() == [True, False]  # no placeholder declared: first column
    ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["empo", "accuracy"],
                              run=RunInfo(placeholder_columns=(True, False)))
    assert ctx.success().tolist() == [False, True]  # the placeholder column is skipped


# ------------------------------------------------------------------------------------------ per plugin
def test_scope_repairs_the_same_rows_with_a_format_column():
    groups = [[ONE_SLIP, PROBLEMS[0].solution]]

    def setup(plugin):
        plugin.prm = ProgrammaticPRM()

    plain, with_format = _run_twice("scope", {"mode": "reference_suffix", "prm": "programmatic"}, groups,
                                    lambda p, j: "", setup=setup)
    assert plain.changed == {0}  # the one-slip rollout was repaired (reward > 0.5 only on the verifier)
    assert _state(with_format) == _state(plain)
    names = ("candidate_fraction", "rectified_fraction", "acceptance_rate")
    assert _verdict_metrics(with_format, names) == _verdict_metrics(plain, names)


def test_critique_grpo_feedback_and_choice_ignore_a_format_column():
    groups = [["Answer: 1", "Answer: 2", "Answer: 3"]]
    plain, with_format = _run_twice("critique_grpo", {}, groups,
                                    lambda p, j: "Answer: 9" if j == 1 else "Answer: 0")
    assert plain.changed == {0}  # slot 0 holds the first successful refinement (request 1)
    assert _text(plain.completions[0]) == "Answer: 9"
    assert all("is incorrect" in repr(p) for p in plain.service.calls[0])  # simple_gt critiques say "incorrect"
    assert _state(with_format) == _state(plain)
    names = ("initial_success_rate", "refinement_success_rate", "replaced_with_success_fraction")
    assert _verdict_metrics(with_format, names) == _verdict_metrics(plain, names)


def test_r3l_reflection_feedback_ignores_a_format_column():
    groups = [["Answer: 1", "Answer: 9"]]
    plain, with_format = _run_twice("r3l", {"reflection_source": "policy"}, groups, lambda p, j: "not json")
    assert len(plain.service.calls[0]) == 1 and "Incorrect." in repr(plain.service.calls[0][0])
    assert _state(with_format) == _state(plain)


def test_r3l_warns_once_and_logs_when_no_reflection_is_valid():
    ctx = make_rollout_context([["Answer: 1", "Answer: 9"]], rows=_rows(1, 2), run=RUN,
                               service=StubGenerationService(lambda p, j: "not json"), **ACCURACY_ONLY)
    stack = build_plugins(["r3l"], {"r3l": {}})
    with pytest.warns(RuntimeWarning, match="no reflection report of this batch was valid"):
        stack.call("trl_plugins_after_generation", ctx)
    assert ctx.metrics["plugins/r3l/fallback_no_valid_reflection"] == [1.0]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second batch is silent but still counted
        stack.call("trl_plugins_after_generation", ctx)
    assert ctx.metrics["plugins/r3l/fallback_no_valid_reflection"] == [1.0, 1.0]


def test_dagrpo_anchors_the_same_groups_with_a_format_column():
    groups = [["Answer: 1", "Answer: 2"], ["Answer: 12", "Answer: 3"]]
    plain, with_format = _run_twice("dagrpo", {"scorer": "reward"}, groups, lambda p, j: "")
    assert plain.changed == {0}  # group 0 has no success: its slot 0 becomes the reference solution
    assert _state(with_format) == _state(plain)
    assert _verdict_metrics(with_format, ("no_positive_group_fraction",)) == {
        "plugins/dagrpo/no_positive_group_fraction": [0.5]}


def test_fbos_rl_rounds_ignore_a_format_column():
    groups = [["Answer: 1", "", "Answer: 9", ""]]

    def respond(prompt, j):
        return "Answer: 9"

    out = []
    for rewards in (ACCURACY_ONLY, WITH_FORMAT):
        ctx = make_rollout_context(groups, rows=_rows(1, 4), service=StubGenerationService(respond),
                                   run=RUN, deferred=[1, 3], **rewards)
        build_plugins(["fbos_rl"], {"fbos_rl": {"feedback": "simple_gt"}}).call("trl_plugins_after_generation", ctx)
        out.append(ctx)
    plain, with_format = out
    assert any(a.get("fbos_role") == "epa" for a in plain.annotations)  # the failed attempt got an EPA copy
    assert _state(with_format) == _state(plain)
    names = ("round1_success_rate", "round2_success_rate", "rescued_group_fraction", "epa_fraction")
    assert _verdict_metrics(with_format, names) == _verdict_metrics(plain, names)


def test_scope_warns_once_and_logs_when_the_prm_finds_no_error_in_any_failure():
    class ApprovingPRM(ProgrammaticPRM):
        def score_steps(self, rows, texts):  # every step passes: the PRM disagrees with the verifier
            return [[1.0] * len(self.steps(t)) for t in texts]

    ctx = make_rollout_context([[ONE_SLIP, PROBLEMS[0].solution]], rows=_rows(1, 2), run=RUN,
                               **ACCURACY_ONLY)
    stack = build_plugins(["scope"], {"scope": {"mode": "reference_suffix", "prm": "programmatic"}})
    next(iter(stack)).prm = ApprovingPRM()
    with pytest.warns(RuntimeWarning, match="the PRM found no wrong step in any failed rollout"):
        stack.call("trl_plugins_after_generation", ctx)
    assert not ctx.changed
    assert ctx.metrics["plugins/scope/fallback_prm_found_no_error"] == [1.0]
    # with no_error_policy='last_step' the failures are still repaired: no fallback
    ctx = make_rollout_context([[ONE_SLIP, PROBLEMS[0].solution]], rows=_rows(1, 2), run=RUN,
                               **ACCURACY_ONLY)
    stack = build_plugins(["scope"], {"scope": {"mode": "reference_suffix", "prm": "programmatic",
                                                "no_error_policy": "last_step"}})
    next(iter(stack)).prm = ApprovingPRM()
    stack.call("trl_plugins_after_generation", ctx)
    assert ctx.metrics["plugins/scope/fallback_prm_found_no_error"] == [0.0]


def test_adaptive_sampler_accuracy_ignores_a_format_column():
    def record(with_format):
        plugin = build_plugins(["adaptive_sampler"], {"adaptive_sampler": {}}).by_name["adaptive_sampler"]
        plugin.reset_state(4, [])
        plugin._seed, plugin._delay = 0, 2
        chunk = plugin.draw_chunk(0, 2)
        acc = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # chunk[0]: 1 of 4 correct; chunk[1]: none
        matrix = torch.stack([acc, torch.ones(8)], dim=1) if with_format else acc.unsqueeze(1)
        names = ["accuracy", "formatted"] if with_format else ["accuracy"]
        ctx = make_reward_context(matrix, num_generations=4, reward_func_names=names)
        plugin.trl_plugins_transform_rewards(ctx)
        plugin.draw_chunk(1, 2)
        plugin.draw_chunk(2, 2)  # the outcome of chunk 0 is applied when chunk 0 + delay is drawn
        return chunk, plugin.accuracy.clone()

    chunk, plain = record(False)
    _, with_format = record(True)
    assert plain[chunk[0]] == 0.25 and plain[chunk[1]] == 0.0  # the verifier's pass rates (non-vacuous)
    torch.testing.assert_close(with_format, plain, equal_nan=True)  # a weighted sum would have counted every row as correct


def test_disco_positives_are_read_on_the_verifier_column():
    """DisCO's positive set (advantage stage) ignores a partial-credit column that pays every response; decided on
    the weighted sum (the combined reward), every response would be positive and no group would be mixed."""
    from trl_plugins.testing import make_advantage_context

    accuracy_column, format_column = [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]
    names = RunInfo(reward_func_names=("accuracy", "formatted"))
    outcomes = []
    for columns in ([accuracy_column], [accuracy_column, format_column]):
        matrix = torch.tensor(columns).T
        ctx = make_advantage_context(matrix.sum(1), rewards_per_func=matrix, num_generations=2,
                                     run=RunInfo(reward_func_names=names.reward_func_names[: len(columns)]))
        build_plugins(["disco"], {"disco": {"variant": "disco_b"}}).call("trl_plugins_transform_advantages", ctx)
        outcomes.append((ctx.advantages.tolist(), ctx.metrics["plugins/disco/positive_fraction"]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [2.0, -2.0, 0.0, 0.0]  # group 0 mixed: G/|P| = 2, -G/|N| = -2; group 1 all negative


def test_r3l_full_success_is_read_on_the_verifier_column():
    """R3L's amplification sets A = 1 only for a full success on the verifier; a wrong answer whose accuracy plus a
    format reward reaches ``success_reward`` (combined 1.0) stays an ordinary, amplified advantage."""
    from trl_plugins.testing import make_advantage_context

    matrix = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # accuracy, formatted
    outcomes = []
    for columns in (1, 2):
        ctx = make_advantage_context(matrix[:, :columns].sum(1), rewards_per_func=matrix[:, :columns],
                                     num_generations=2,
                                     run=RunInfo(reward_func_names=("accuracy", "formatted")[:columns]))
        build_plugins(["r3l"], {"r3l": {"baseline": "mean"}}).call("trl_plugins_transform_advantages", ctx)
        outcomes.append(ctx.advantages.tolist())
    assert outcomes[0] == [1.0, -0.5, 0.0, 0.0]  # row 0 full success; row 1 below the mean
    assert outcomes[1][0] == 1.0 and outcomes[1][1] != 1.0  # the format column does not make row 1 a success
