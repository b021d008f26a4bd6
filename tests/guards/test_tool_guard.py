"""Tool guard: the model's bad calls go back to it; a tool that raises, hangs or returns garbage is retried and then
stops the run with an error naming the tool and the row."""

import asyncio
import time

import pytest

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.guards.tool_guard import ToolError, ToolGuard, ToolInputError, ToolPolicy, check_tool_result

FAST = ToolPolicy(timeout=0.5, retries=2, backoff=0.0)


def lookup(query: str) -> str:
    """Look up.

    Args:
        query: what to look for.
    """
    return f"found {query}"


def test_working_tool_is_transparent():
    guarded = ToolGuard(FAST).wrap_sync("lookup", lookup, 0, 0)
    assert guarded(query="x") == "found x"
    assert guarded.__name__ == "lookup" and guarded.__doc__ == lookup.__doc__


def test_bad_arguments_are_the_models_fault_no_retry():
    calls = []

    def tool(query: str) -> str:
        calls.append(query)
        raise ToolInputError("query too short")

    guard = ToolGuard(FAST)
    with pytest.raises(TypeError, match="unexpected keyword argument 'q'"):  # the message TRL shows the model
        guard.wrap_sync("tool", tool, 0, 0)(q="x")
    with pytest.raises(ToolInputError, match="too short"):
        guard.wrap_sync("tool", tool, 0, 0)(query="x")
    assert calls == ["x"] and guard.take() is None


def test_flaky_tool_succeeds_on_retry():
    attempts = []

    def flaky(query: str) -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("backend down")
        return "ok"

    guard = ToolGuard(FAST)
    assert guard.wrap_sync("flaky", flaky, 0, 0)(query="x") == "ok"
    assert len(attempts) == 3 and guard.take() is None


@pytest.mark.parametrize(
    ("behaviour", "cause"),
    [("raise", "ConnectionError: backend down"), ("hang", "no result within 0.5 s"), ("garbage", "returned None")],
)
def test_failing_tool_is_retried_then_names_tool_and_row(behaviour, cause):
    attempts = []

    def broken(query: str) -> str:
        attempts.append(1)
        if behaviour == "raise":
            raise ConnectionError("backend down")
        if behaviour == "hang":
            time.sleep(5)
        return None

    guard = ToolGuard(FAST)
    start = time.monotonic()
    with pytest.raises(ToolError) as info:
        guard.wrap_sync("broken", broken, 2, 7)(query="x")
    assert time.monotonic() - start < 4  # a hang is cut at the timeout, three times
    message = str(info.value)
    assert "'broken'" in message and "local row 2 (global row 7)" in message and "3 attempts" in message
    assert cause in message
    assert len(attempts) == 3
    assert guard.take() is info.value  # held for the trainer's raise-together


def test_async_tool_timeout_and_garbage():
    async def slow(query: str) -> str:
        await asyncio.sleep(5)

    async def nan(query: str) -> float:
        return float("nan")

    guard = ToolGuard(ToolPolicy(timeout=0.2, retries=1, backoff=0.0))
    with pytest.raises(ToolError, match="no result within 0.2 s"):
        asyncio.run(guard.wrap_async("slow", slow, 0, 0)(query="x"))
    # after a fatal failure the step is lost: later calls return at once
    with pytest.raises(ToolError, match="skipped: an earlier tool call of this step failed"):
        asyncio.run(guard.wrap_async("nan", nan, 1, 1)(query="x"))
    guard.begin_batch()
    with pytest.raises(ToolError, match="returned nan"):
        asyncio.run(guard.wrap_async("nan", nan, 1, 1)(query="x"))


def test_result_check():
    assert check_tool_result("text") is None and check_tool_result(3) is None and check_tool_result({"a": [1]}) is None
    assert "None" in check_tool_result(None)
    assert "inf" in check_tool_result(float("inf"))
    assert "object" in check_tool_result(object())


@pytest.mark.parametrize(
    ("field", "value"),
    [("timeout", 0), ("retries", -1), ("retries", 1.5), ("backoff", -1.0), ("failure", "ignore")],
)
def test_bad_policy_is_refused(field, value):
    with pytest.raises(PluginConfigError, match=field if field != "failure" else "tool_failure"):
        ToolPolicy(**{field: value})


def test_config_refuses_bad_tool_fields():
    from trl_plugins.testing import tiny_config

    with pytest.raises(PluginConfigError, match="tool_failure must be one of"):
        tiny_config(tool_failure="ignore")


class FlakyEnvironment:
    """The bundled environment with a search backend that is down."""

    def __init__(self):
        from trl_plugins.tasks.tools import ToolEnvironment

        self._env = ToolEnvironment()

    def reset(self, **row):
        return self._env.reset(**row)

    def search(self, query: str) -> str:
        """Search.

        Args:
            query: words to look for.
        """
        raise ConnectionError("search backend unreachable")


def test_trainer_stops_with_the_tool_and_row_named():
    from trl_plugins.testing import make_tool_trainer

    trainer = make_tool_trainer(tool_retries=1, tool_retry_backoff=0.0, max_steps=1)
    trainer.environment_factories = {None: FlakyEnvironment}
    trainer._environment_pool = {None: []}
    with pytest.raises(ToolError, match=r"Tool 'search' failed on local row \d+ \(global row \d+\) after 2 attempts"):
        trainer.train()


def test_feedback_mode_gives_the_error_to_the_model_as_trl_does():
    from trl_plugins.testing import make_tool_trainer

    trainer = make_tool_trainer(tool_retries=0, tool_failure="feedback", max_steps=1)
    trainer.environment_factories = {None: FlakyEnvironment}
    trainer._environment_pool = {None: []}
    trainer.train()  # no error: TRL's tool loop turned it into a tool message
    assert any(log.get("tools/failure_frequency", 0) > 0 for log in trainer.state.log_history)


@pytest.mark.parametrize("field, value, expected", [
    ("timeout", float("inf"), "tool_timeout must be a finite number of seconds > 0, or None for no limit; got inf"),
    ("timeout", float("nan"), "got nan"),
    ("timeout", "60", "got '60'"),
    ("backoff", float("nan"), "tool_retry_backoff must be a finite number of seconds in [0, 3600]; got nan"),
    ("backoff", float("inf"), "got inf"),
    ("backoff", 1e9, "got 1000000000.0"),
])
def test_non_finite_timeouts_and_backoffs_are_refused(field, value, expected):
    with pytest.raises(PluginConfigError) as err:
        ToolPolicy(**{field: value})
    assert expected in str(err.value)


def test_a_decorated_tool_whose_wrapper_accepts_other_arguments_runs_once_under_its_timeout():
    import functools

    calls = []

    def accepting(func):
        @functools.wraps(func)  # inspect.signature reports lookup's (query), the wrapper takes anything
        def wrapper(**kwargs):
            calls.append(kwargs)
            time.sleep(2)
            return "late"

        return wrapper

    guard = ToolGuard(ToolPolicy(timeout=0.2, retries=0, backoff=0.0))
    start = time.perf_counter()
    with pytest.raises(ToolError, match="TimeoutError: no result within 0.2 s"):
        guard.wrap_sync("lookup", accepting(lookup), 0, 0)(q="x")
    assert time.perf_counter() - start < 1.5 and calls == [{"q": "x"}]  # one call, stopped by the timeout
