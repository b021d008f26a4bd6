"""The branching seam on two processes (gloo, ``accelerate launch``): with uneven requests (one rank asks for three
continuations, the other for none, then the reverse, then neither; then a fork on one rank) both ranks make the same backend calls with the
same padded sizes and the same ``max_new_tokens``, and the same padded forwards; nothing hangs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("branching_worker.py")


def test_uneven_requests_make_equal_calls_on_both_ranks(tmp_path):
    returncode, log = _mp.launch_two_processes(WORKER, tmp_path, 420, "branching seam")
    assert returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    # two calls generate (the third has no request anywhere): 3 rows padded on both, then 1 row on both
    assert r0["generate"] == r1["generate"] == [[3, 6], [1, 4]]
    assert r0["forward"] == r1["forward"] and len(r0["forward"]) == 3  # 3 rows in chunks of 2, then 1 row
    assert [len(x) for x in r0["lengths"]] == [3, 0, 0] and [len(x) for x in r1["lengths"]] == [0, 1, 0]
    assert all(1 <= n <= m for n, m in zip(r0["lengths"][0], [2, 6, 3]))
    assert r0["total"] == r1["total"] == 4 and (r0["used"], r1["used"]) == (3, 1)
    # the fork: the same probe forward and continuation calls on both ranks (rank 1 padded), two distinct first tokens
    f0, f1 = r0["fork"], r1["fork"]
    assert f0["generate"] == f1["generate"] and f0["forward"] == f1["forward"] and len(f0["forward"]) >= 1
    assert all(rows <= 2 and new == 3 for rows, new in f0["generate"])  # max_new_tokens 4 - the forced token
    assert len(f0["first"]) == 2 and len(set(f0["first"])) == 2 and 6 not in f0["first"] and f1["first"] == []
    assert all(1 <= n <= 4 for n in f0["lengths"])
