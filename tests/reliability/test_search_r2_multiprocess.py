"""search_r2 on two processes (gloo, ``accelerate launch``): with uneven Meta-Refiner verdicts (rank 0 cuts and
regenerates its multi-turn rows, rank 1 judges every trajectory coherent and cuts nothing) both ranks make the same
generation calls with the same padded sizes (Discriminator, Trimmer, the tool-episode rounds), the budget totals agree,
and the training step finishes (nothing hangs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("search_r2_worker.py")


def test_uneven_refinement_makes_equal_calls_on_both_ranks(tmp_path):
    returncode, log = _mp.launch_two_processes(WORKER, tmp_path, 420, "search_r2")
    assert returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["steps"] == r1["steps"] == 1
    assert r0["calls"] == r1["calls"]  # every backend call on both ranks, padded to the same rows
    assert r0["episodes"] and all(r0["cut"][i] == "2" for i in r0["episodes"])  # rank 0 cut at step 2
    assert r1["episodes"] == [] and r1["cut"] == [None] * len(r1["cut"])  # rank 1 cut nothing
    assert r0["total"] == r1["total"] and r0["used"] > r1["used"]
