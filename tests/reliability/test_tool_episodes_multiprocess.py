"""The tool-episode seam on two processes (gloo, ``accelerate launch``): with uneven work (one rank continues whole
tool episodes, whose tool rounds differ from row to row, the other nothing; then the reverse from turn 1; then
neither) both ranks make the same generation calls with the same padded sizes, the budget counts agree, and the
training step finishes (nothing hangs); and ``aepo``'s rollout half with one rank branching, the other not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("tool_episodes_worker.py")
AEPO_WORKER = Path(__file__).with_name("aepo_branching_worker.py")


def test_uneven_tool_episodes_make_equal_calls_on_both_ranks(tmp_path):
    returncode, log = _mp.launch_two_processes(WORKER, tmp_path, 420, "tool-episode seam")
    assert returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["steps"] == r1["steps"] == 1
    p0, p1 = r0["phases"], r1["phases"]
    for a, b in zip(p0, p1):  # every call on both ranks, padded to the same rows (rank 1 with dummy requests)
        assert a["calls"] == b["calls"]
    # phase 1: rank 0's two rows (first turn, then its tool rounds); rank 1 joins every round with dummies
    assert p0[0]["episodes"] == 2 and p1[0]["episodes"] == 0 and len(p0[0]["calls"]) >= 2
    assert p0[0]["calls"][0] == 2 and any(p0[0]["tool_rounds"])
    # phase 2: rank 1 alone, from turn 1; phase 3: nobody asks, nothing is generated
    assert p0[1]["episodes"] == 0 and p1[1]["episodes"] >= 1 and p0[1]["calls"][0] == p1[1]["episodes"]
    assert p0[2]["calls"] == p1[2]["calls"] == []
    assert r0["total"] == r1["total"] == 2 + p1[1]["episodes"]
    assert (r0["used"], r1["used"]) == (2, p1[1]["episodes"])


def test_aepo_branching_on_one_rank_finishes_on_both(tmp_path):
    """Rank 0's groups branch (gold traces: tool boundaries), rank 1's cannot (one-turn answers): both ranks make
    aepo's collective calls (two entropy forwards, one seam call) and finish the step."""
    returncode, log = _mp.launch_two_processes(AEPO_WORKER, tmp_path, 420, "aepo branching")
    assert returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"aepo-rank{k}.json").read_text()) for k in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["steps"] == r1["steps"] == 1
    (rows0,), (rows1,) = r0["filled"], r1["filled"]
    assert rows0 and rows1 == []  # rank 0 filled slots with branches of its global rollouts (budget_scale 0: 3 of 4)
    assert all(int(tag.split("@")[0]) % 4 < 3 and int(tag.split("@")[1]) >= 1 for tag in rows0)
