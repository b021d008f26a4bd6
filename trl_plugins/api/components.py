"""The components plugins build on, as the plugin-facing API offers them (re-exported from trl_plugins.components).

Judges, process reward models, teachers, verifier feedback and the step helpers live in
:mod:`trl_plugins.components` (each module documents its classes); a plugin imports them from here, so that the
API is the one thing a plugin module imports. The components themselves build only on :mod:`trl_plugins.api`.
"""

from trl_plugins.components.client import EndpointConfig, EndpointError, OpenAICompatibleClient, endpoint_options
from trl_plugins.components.feedback import VERIFIER_FEEDBACK, feedback_oracle
from trl_plugins.components.judge import (
    RUBRIC_VERDICTS,
    EndpointJudge,
    HFJudge,
    JudgeEndpointOptions,
    JudgeRequest,
    RubricJudge,
    RuleJudge,
)
from trl_plugins.components.prm import STEP_VERIFIERS, PRMOptions, prm_from_options
from trl_plugins.components.steps import first_error, question_text, split_steps, token_boundary
from trl_plugins.components.teacher import (
    ReferenceTeacher,
    TeacherEndpointOptions,
    TeacherOptions,
    shared_teacher,
    teacher_from_options,
)

__all__ = [
    "RUBRIC_VERDICTS",
    "STEP_VERIFIERS",
    "VERIFIER_FEEDBACK",
    "EndpointConfig",
    "EndpointError",
    "EndpointJudge",
    "HFJudge",
    "JudgeEndpointOptions",
    "JudgeRequest",
    "OpenAICompatibleClient",
    "PRMOptions",
    "ReferenceTeacher",
    "RubricJudge",
    "RuleJudge",
    "TeacherEndpointOptions",
    "TeacherOptions",
    "endpoint_options",
    "feedback_oracle",
    "first_error",
    "prm_from_options",
    "question_text",
    "shared_teacher",
    "split_steps",
    "teacher_from_options",
    "token_boundary",
]
