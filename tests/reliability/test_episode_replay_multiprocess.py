"""Tool-episode replay on two processes (gloo, ``accelerate launch``): the buffers stay identical on both ranks, a
success stored from rank 1 is replayed into the all-fail group's slot 0 on rank 0 while rank 1 replays nothing (it joins the seam's
collectives with zero rows), the loss trains the replayed tokens against the stored behaviour log-probs, and both
steps finish (nothing hangs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("episode_replay_worker.py")


def test_tool_episode_replay_keeps_buffers_identical_and_calls_even_on_both_ranks(tmp_path):
    returncode, log = _mp.launch_two_processes(WORKER, tmp_path, 420, "tool-episode replay")
    assert returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["steps"] == r1["steps"] == 2
    assert r0["digest"] == r1["digest"] and r0["entries"] == 1
    assert r0["replayed"] == [0] and r1["replayed"] == []  # rank 0's slot 0 got the episode rank 1 stored
    assert r0["exact"] and all(r0["exact"]) and r1["exact"] == []
