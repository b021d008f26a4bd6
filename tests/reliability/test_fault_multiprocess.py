"""A failure on one process is named on every process (two processes on CPU, gloo, ``accelerate launch`` of
``fault_worker.py``): refill plugins rejecting groups on one rank only, an environment ``reset`` raising on one rank,
a teacher probe failing at construction on one rank (a stand-in plugin, and kepo's own probe of a teacher endpoint
that is down on one rank), unreadable gold traces in one rank's rows. The failing rank
raises its own error; the other a ``PluginError`` naming the process and its error -- never a gloo "connection closed"
or a collective size mismatch, never a hang; and both go on to the next phase together."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "fault_worker.py"
LAUNCH_TIMEOUT = 300


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults_two_processes")
    returncode, log = _mp.launch_two_processes(WORKER, out, LAUNCH_TIMEOUT, "fault")
    assert returncode == 0, log[-4000:]
    return out, log


def _records(launch, phase):
    out, log = launch
    records = []
    for r in range(2):
        path = Path(out) / f"{phase}-rank{r}.json"
        assert path.exists(), f"{path.name} was not written:\n{log[-3000:]}"
        records.append(json.loads(path.read_text()))
    return records


def _peer_names(record, what, cause):
    assert record["error"] == "PluginError", record
    assert f"{what}: process 1 failed with {cause}" in record["message"], record["message"]
    assert "connection closed" not in record["message"].lower()


def test_refill_rejections_on_one_rank_only_are_named_on_both(launch):
    r0, r1 = _records(launch, "refill_differs")
    for record in (r0, r1):  # the same decision check on both: both raise the same error
        assert record["error"] == "PluginError", record
        assert ("Refill round 0: the plugins ['test_reject_on_rank1'] rejected different groups on different "
                "processes (process 0: rejected groups [], 0 replacements; process 1: rejected groups [0], "
                "0 replacements)") in record["message"]
        assert "ctx.rewards" in record["message"]


def test_an_environment_reset_raising_on_one_rank_is_named_on_both(launch):
    r0, r1 = _records(launch, "reset_fails")
    assert r1["error"] == "EnvironmentResetError", r1
    assert ("ResetFailsOnRank1.reset raised FileNotFoundError: /data/towns.db: no such file on this node for row 3 "
            "(local row 0 on process 1)") in r1["message"]
    _peer_names(r0, "environment reset", "EnvironmentResetError: environment_factory: ResetFailsOnRank1.reset raised "
                                         "FileNotFoundError: /data/towns.db")


def test_a_teacher_probe_failing_at_construction_on_one_rank_is_named_on_both(launch):
    r0, r1 = _records(launch, "probe_fails")
    assert r1["error"] == "EndpointError" and "did not answer the log-prob probe" in r1["message"], r1
    _peer_names(r0, "plugin 'test_teacher_probe' (trl_plugins_configure)",
                "EndpointError: teacher endpoint http://10.0.0.7:8000/v1/completions did not answer")


def test_kepos_teacher_probe_failing_on_one_rank_at_construction_is_named_on_both(launch):
    r0, r1 = _records(launch, "kepo_probe_fails")
    assert r1["error"] == "EndpointError", r1
    assert "http://127.0.0.1:" in r1["message"], r1
    _peer_names(r0, "plugin 'kepo' (trl_plugins_configure)", "EndpointError: ")


def test_unreadable_gold_traces_in_one_ranks_rows_are_named_on_both(launch):
    r0, r1 = _records(launch, "gold_fails")
    assert r1["error"] == "PluginConfigError", r1
    assert "matchtir: column 'gold_calls' holds str" in r1["message"] and "in row 3" in r1["message"]
    _peer_names(r0, "matchtir", "PluginConfigError: matchtir: column 'gold_calls' holds str")
