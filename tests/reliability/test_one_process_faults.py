"""Faults named on one process (their two-process counterparts are in ``test_fault_multiprocess.py``): an environment
``reset`` raising, a plugin's ``trl_plugins_configure`` failing (a teacher endpoint probe), a refill plugin raising."""

from __future__ import annotations

import pytest

from trl_plugins import Plugin, PluginError, hookimpl, register_plugin, unregister_plugin
from trl_plugins.runtime.manager import build_plugins
from trl_plugins.testing import make_tool_trainer
from trl_plugins.guards.tool_guard import EnvironmentResetError, ResetGuard


class ResetFailsForRow2:
    """The bundled tool environment, whose reset fails for the third row it is given."""

    calls = 0

    def __init__(self):
        from trl_plugins.tasks.tools import ToolEnvironment

        self._env = ToolEnvironment()

    def reset(self, **row):
        ResetFailsForRow2.calls += 1
        if ResetFailsForRow2.calls == 3:
            raise KeyError("town 'Nowhere' is not in the encyclopedia")
        return self._env.reset(**row)

    def search(self, query: str) -> str:
        """Search the encyclopedia of towns.

        Args:
            query: words to look for.
        """
        return self._env.search(query)


def test_an_environment_reset_raising_is_named_with_class_row_and_cause(tmp_path):
    trainer = make_tool_trainer(n=8, output_dir=str(tmp_path), max_steps=1)
    trainer.environment_factories = {None: ResetFailsForRow2}
    trainer._environment_pool = {None: []}
    ResetFailsForRow2.calls = 0
    generated = []
    original = trainer._generate_single_turn
    trainer._generate_single_turn = lambda *a, **k: generated.append(1) or original(*a, **k)
    with pytest.raises(EnvironmentResetError, match=r"environment_factory: ResetFailsForRow2\.reset raised KeyError: "
                                                    r"\"town 'Nowhere' is not in the encyclopedia\" for row 2 \(local "
                                                    r"row 2 on process 0\), so its rollout could not start"):
        trainer.train()
    assert generated == []  # stopped before generating
    assert ResetFailsForRow2.calls == 3  # the rows after the failing one were not reset


def test_the_reset_guard_wraps_factories_and_pooled_instances_once():
    class Env:
        def reset(self, **row):
            raise ValueError("no")

    guard = ResetGuard()
    pooled = Env()
    factories = guard.guard({None: Env}, {None: [pooled]})
    assert guard.guard(factories, {None: [pooled]})[None] is factories[None]  # not wrapped twice
    made = factories[None]()
    assert made.reset(prompt="p") is None and pooled.reset(prompt="q") is None
    error = guard.take([pooled, made], 4, 1)
    assert isinstance(error, EnvironmentResetError) and "for row 5 (local row 1 on process 1)" in str(error)
    assert guard.take([made], 0, 0) is None


def test_call_each_hands_every_plugins_error_to_the_check_and_stops_at_the_first():
    class Fine(Plugin):
        name = "test_configure_fine"

        @hookimpl
        def trl_plugins_configure(self, trainer, args):
            seen.append(self.name)

    class Probe(Plugin):
        name = "test_configure_probe"

        @hookimpl
        def trl_plugins_configure(self, trainer, args):
            raise PluginError("teacher endpoint http://127.0.0.1:9/v1 did not answer the probe")

    seen, checked = [], []
    for cls in (Fine, Probe):
        register_plugin(cls)
    try:
        stack = build_plugins(["test_configure_fine", "test_configure_probe"])

        def check(name, error):
            checked.append((name, None if error is None else str(error)))
            if error is not None:
                raise error

        with pytest.raises(PluginError, match="did not answer the probe"):
            stack.call_each("trl_plugins_configure", check, trainer=None, args=None)
    finally:
        for cls in (Fine, Probe):
            unregister_plugin(cls.name)
    assert seen == ["test_configure_fine"]
    assert checked == [("test_configure_fine", None),
                       ("test_configure_probe", "teacher endpoint http://127.0.0.1:9/v1 did not answer the probe")]
