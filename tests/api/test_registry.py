"""The components' oracle registries: built-in names load the bundled task on first use, a task registers its own,
a config value names one, and an unknown name is refused with the known ones."""

import os

import pytest

from trl_plugins import PluginConfigError
from trl_plugins.components.feedback import VERIFIER_FEEDBACK, VerifierFeedback, feedback_oracle
from trl_plugins.components.judge import RUBRIC_VERDICTS, JudgeRequest, RuleJudge
from trl_plugins.components.local_server import QUESTION_ROWS
from trl_plugins.components.prm import STEP_VERIFIERS, ProgrammaticPRM, build_prm
from trl_plugins.runtime.models import BUILTIN_MODEL_CODE
from trl_plugins.api.registry import Registry, import_path


def double(x):
    return 2 * x


def test_lazy_builtin_names_resolve_on_first_use():
    registry = Registry("joiner", {"join": "os.path:join"})
    assert "join" in registry and registry.names() == ["join"]
    assert registry.get("join") is os.path.join
    assert registry.get("os:path.join") is os.path.join  # a path works wherever a name does; dotted attributes
    assert registry.get(double) is double  # an entry passed directly


def test_register_unregister_and_refusals():
    registry = Registry("doubler", contract="fn(x) -> 2x")
    registry.register("mine", double)

    @registry.register("other")
    def other(x):
        return x

    assert registry.get("mine") is double and registry.get("other") is other
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine", other)
    registry.register("mine", other, replace=True)
    assert registry.get("mine") is other
    with pytest.raises(PluginConfigError, match="not callable"):
        registry.register("bad", 3)
    with pytest.raises(PluginConfigError, match=r"Unknown doubler 'mien'\. Did you mean 'mine'\?.*fn\(x\) -> 2x"):
        registry.get("mien")
    with pytest.raises(PluginConfigError, match=r"Option 'o': Unknown doubler 'nope'"):
        registry.check("nope", "Option 'o': ")
    registry.check("mine")
    registry.check("any.module:attr")  # a path is checked when it is used, not before
    registry.unregister("mine")
    assert "mine" not in registry


def test_import_path_errors_name_the_path():
    assert import_path("os.path:join") is os.path.join
    with pytest.raises(PluginConfigError, match="not of the form"):
        import_path("os.path")
    with pytest.raises(PluginConfigError, match="cannot be imported"):
        import_path("no_such_module_xyz:f")
    with pytest.raises(PluginConfigError, match="has no attribute"):
        import_path("os.path:nothing")


def test_the_bundled_task_is_registered_under_its_name_in_every_component():
    from trl_plugins.tasks import arithmetic, tiny, tools

    assert STEP_VERIFIERS.get("arithmetic") is arithmetic.prm_step_scores
    assert RUBRIC_VERDICTS.get("arithmetic") is arithmetic.rubric_oracle
    assert VERIFIER_FEEDBACK.get("arithmetic") is arithmetic.verifier_feedback
    assert QUESTION_ROWS.get("arithmetic") is arithmetic.row_from_question
    assert BUILTIN_MODEL_CODE.get("builtin:tiny") is tiny.demo_model
    assert BUILTIN_MODEL_CODE.get("tool_calling") is tools.enable_tool_calling


def _problem():
    from trl_plugins.tasks.arithmetic import Problem

    return Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14, Answer: 14


def test_a_task_registers_its_own_oracles_and_the_components_use_them():
    STEP_VERIFIERS.register("upper", lambda problem, steps: [1.0 if s.isupper() else 0.0 for s in steps])
    RUBRIC_VERDICTS.register("upper", lambda item, problem, text: item["criterion"].lower() in text.lower())
    VERIFIER_FEEDBACK.register("upper", lambda problem, text: VerifierFeedback("shout", text.isupper(), 0))
    try:
        prm = build_prm("programmatic", problem_column="q", verifier="upper")
        assert prm.score_steps([{"prompt": "Q?", "q": "x"}], ["AB\ncd"]) == [[1.0, 0.0]]
        judge = RuleJudge(problem_column="q", oracle="upper")
        request = JudgeRequest([], "says Hello", {"criterion": "hello", "points": 1.0}, {"q": "x"})
        assert judge.grade([request]) == [True]
        assert feedback_oracle("upper")("x", "LOUD") == VerifierFeedback("shout", True, 0)
    finally:
        for registry in (STEP_VERIFIERS, RUBRIC_VERDICTS, VERIFIER_FEEDBACK):
            registry.unregister("upper")


def test_the_bundled_oracles_grade_as_the_task_does():
    from trl_plugins.tasks.arithmetic import feedback, make_rubrics, rubric_verdict, step_scores

    problem = _problem()
    text = "3+4=7\n7*2=15\nAnswer: 15"
    row = {"prompt": problem.question, "problem": problem.to_json()}
    assert ProgrammaticPRM().score_steps([row], [text]) == [step_scores(problem, text)]
    items = make_rubrics(problem)
    requests = [JudgeRequest([], text, item, {"problem": problem.to_json()}) for item in items]
    assert RuleJudge().grade(requests) == [rubric_verdict(item, problem, text) for item in items]
    verdict = feedback_oracle("arithmetic")(problem.to_json(), text)
    assert verdict == VerifierFeedback(feedback(problem, text), False, 1)
    assert feedback_oracle("arithmetic")(problem, problem.solution).correct  # a Problem itself is accepted
    row = QUESTION_ROWS.get("arithmetic")(problem.question)
    assert row["answer"] == "14" and row["rubrics"] == items and row["prompt"][0]["content"] == problem.question


def test_a_feedback_oracle_with_a_wrong_answer_type_is_an_error():
    from trl_plugins import PluginError

    VERIFIER_FEEDBACK.register("broken", lambda problem, text: "just a string")
    try:
        with pytest.raises(PluginError, match="'broken' answered 'just a string'"):
            feedback_oracle("broken")("x", "y")
    finally:
        VERIFIER_FEEDBACK.unregister("broken")
