"""Two processes on CPU (gloo, ``accelerate launch``) against one: collectives never deadlock or
mis-assign, and equality with the single-process run where the run is deterministic.

One launch of ``mp_worker.py`` under ``docs/accelerate/cpu_2proc.yaml`` runs four phases (see the worker's docstring):
a deterministic ``hint_scaffold + canon + lp_reg`` run whose groups straddle the two ranks, an asymmetric run where the
ranks ask the generation service for different numbers of completions (deferred rows, entropies, extra completions) on
real HF generation, and two runs where one rank's reward function returns NaN (in hint_scaffold's sampling-stage
scoring, then in TRL's reward pass). The single-process reference of the
deterministic phase runs in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "mp_worker.py"
ACCELERATE_CONFIG = REPO / "docs" / "accelerate" / "cpu_2proc.yaml"
LAUNCH_TIMEOUT = 420  # seconds; a deadlock would otherwise hang for gloo's 30 minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_module():
    spec = importlib.util.spec_from_file_location("trl_plugins_mp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_two_processes(worker: Path, out: Path, timeout: float, what: str) -> tuple[int, str]:
    """``accelerate launch`` of ``worker out`` on two CPU processes (gloo); (exit status, log). A launch still running
    after ``timeout`` seconds is killed with its process group and fails the test as a hang, naming ``what``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
        "--main_process_port", str(_free_port()), str(worker), str(out),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the 2-process {what} launch did not finish in {timeout}s (a hang):\n{log[-4000:]}")
    return proc.returncode, log


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    returncode, log = launch_two_processes(WORKER, out, LAUNCH_TIMEOUT, "test")
    return out, returncode, log


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from trl_plugins import unregister_plugin

    out = tmp_path_factory.mktemp("one_process")
    worker = _worker_module()
    try:
        worker.run_phase("deterministic", str(out))
    finally:
        for name in ("test_layout_probe", "test_asymmetric"):
            unregister_plugin(name)
    return out


def _load(out, phase, rank):
    path = Path(out) / f"{phase}-rank{rank}.json"
    assert path.exists(), f"{path.name} was not written"
    return json.loads(path.read_text())


def test_groups_straddling_ranks_are_handled_and_nothing_deadlocks(two_processes):
    out, _rc, log = two_processes
    for phase in ("deterministic", "asymmetric"):
        r0, r1 = _load(out, phase, 0), _load(out, phase, 1)
        assert (r0["num_processes"], r1["num_processes"]) == (2, 2)
        # group 1 = global rows 2 and 3: index 0 on rank 0, index 1 on rank 1 (from the global position)
        for seen in r0["layout"]:
            assert seen == {"global_index": [0, 1, 2], "group_ids": [0, 0, 1], "index_in_group": [0, 1, 0]}
        for seen in r1["layout"]:
            assert seen == {"global_index": [3, 4, 5], "group_ids": [1, 2, 2], "index_in_group": [1, 0, 1]}
        for batch in r0["batches"]:
            assert len(batch["completion_ids"]) == 6 and len(batch["advantages"]) == 6 and len(batch["rewards"]) == 6
        assert r0["batches"] == r1["batches"]  # both ranks hold the same gathered view
    # the asymmetric phase really was asymmetric, on real generation
    a0, a1 = _load(out, "asymmetric", 0), _load(out, "asymmetric", 1)
    (s0,) = a0["asymmetric"]
    assert (s0["deferred"], s0["filled"], len(s0["entropies"]), s0["extra"]) == ([0], 1, 1, 1)
    assert a1["asymmetric"] == [{"deferred": [], "filled": 0, "entropies": [], "extra": 0}]
    # the service's total counts every process's completions: the same number on both ranks (rank 0 saves it)
    assert a0["extra_rollouts_total"] == a1["extra_rollouts_total"] > 0
    assert a0["logs"]["plugins/framework/extra_rollouts"] == a0["extra_rollouts_total"]
    assert a0["batches"][0]["completion_ids"][0], "the deferred row was filled with a real completion"


def test_two_processes_equal_one_process(two_processes, one_process):
    out, _rc, _log = two_processes
    single = _load(one_process, "deterministic", 0)
    r0, r1 = _load(out, "deterministic", 0), _load(out, "deterministic", 1)
    assert len(single["batches"]) == len(r0["batches"]) == 2
    for a, b in zip(single["batches"], r0["batches"]):
        assert a["completion_ids"] == b["completion_ids"]
        torch.testing.assert_close(torch.tensor(a["rewards"]), torch.tensor(b["rewards"]))
        torch.testing.assert_close(torch.tensor(a["advantages"]), torch.tensor(b["advantages"]), atol=1e-6, rtol=0)
    # dr_grpo: the single-process loss over 6 rows is the mean of the two ranks' losses over 3 rows each
    torch.testing.assert_close(
        torch.tensor(single["losses"]), (torch.tensor(r0["losses"]) + torch.tensor(r1["losses"])) / 2, atol=1e-5, rtol=0
    )
    p1 = torch.load(Path(one_process) / "deterministic-params.pt")
    p2 = torch.load(Path(out) / "deterministic-params.pt")
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], atol=1e-4, rtol=0, msg=f"parameter {name} differs")
    changed = max((p1[n] - _initial_params()[n]).abs().max().item() for n in p1)
    assert changed > 1e-3, "the run did not train (the comparison would be vacuous)"
    for key in ("reward", "plugins/hint_scaffold/rescued_group_fraction", "plugins/canon/abs_advantage",
                "plugins/lp_reg/selected_token_fraction", "plugins/framework/extra_rollouts"):
        assert single["logs"][key] == pytest.approx(r0["logs"][key], abs=1e-6), key
    assert single["logs"]["plugins/hint_scaffold/rescued_group_fraction"] == 1.0


def _initial_params():
    from trl_plugins.testing import tiny_model

    return {n: p.detach() for n, p in tiny_model(seed=0).named_parameters()}


def test_scoring_error_in_the_sampling_stage_on_one_rank_is_raised_on_both_ranks_together(two_processes):
    out, _rc, _log = two_processes
    first, second = _load(out, "nan_scored_on_one_rank", 0), _load(out, "nan_scored_on_one_rank", 1)
    assert second["error"] == "RewardValueError", second
    assert "Reward function 'nan_on_rank1' returned nan for row 1" in second["message"] and "on process 1" in second[
        "message"]
    assert first["error"] == "PluginError", first
    assert "reward functions (sampling-stage scoring): process 1 failed" in first["message"], first
    # and both went on, in step, to the next phase (which ends the launch)
    assert "rank 0 raised PluginError: reward functions: process 1 failed" in _log


def test_a_tool_run_on_two_processes_keeps_whole_groups(two_processes):
    out, _rc, _log = two_processes
    r0, r1 = _load(out, "tools", 0), _load(out, "tools", 1)
    for batch in r0["batches"]:
        assert len(batch["completion_ids"]) == 6 and len(batch["advantages"]) == 6
    assert r0["batches"] == r1["batches"]
    assert r0["logs"]["tools/call_frequency"] > 0
    assert "plugins/igpo/info_gain_mean" in r0["logs"] and "plugins/otc_po/tool_calls_mean" in r0["logs"]
    assert "plugins/igpo/clip_factor_mean" in r0["logs"]  # A2TGPO mode: clip factors sent with the rows to both ranks


def test_a_tool_failing_on_one_rank_stops_both_ranks_together(two_processes):
    out, _rc, _log = two_processes
    first, second = _load(out, "tool_fails_on_one_rank", 0), _load(out, "tool_fails_on_one_rank", 1)
    assert second["error"] == "ToolError", second
    assert "Tool 'search' failed on local row" in second["message"] and "after 2 attempts" in second["message"]
    assert "ConnectionError: search backend unreachable" in second["message"]
    assert first["error"] == "PluginError", first
    assert "tool calls: process 1 failed" in first["message"], first


def test_error_on_one_rank_ends_the_launch_instead_of_hanging(two_processes):
    _out, rc, log = two_processes
    assert rc != 0, "the nan_on_one_rank phase should have failed the launch"
    assert "rank 1 raised RewardValueError: Reward function 'nan_on_rank1' returned nan for row 1" in log, log[-3000:]
    assert "on process 1" in log
    # rank 0 stopped by itself (not only by the launcher killing it): the failure flag reached it after the gather
    assert "rank 0 raised PluginError: reward functions: process 1 failed" in log, log[-3000:]
