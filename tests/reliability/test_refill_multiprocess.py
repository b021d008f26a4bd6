"""Refill on two processes (gloo, ``accelerate launch``): ranks regenerate different numbers of rows per round
(0 and 2, 2 and 0, 1 and 1) and a repeat needs rows held by the other rank -- no deadlock, the same steps, rounds,
rewards, stream position and rollout count on both ranks, whole groups in every final batch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "refill_worker.py"
LAUNCH_TIMEOUT = 420


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("refill_two_processes")
    returncode, log = _mp.launch_two_processes(WORKER, out, LAUNCH_TIMEOUT, "refill")
    assert returncode == 0, log[-4000:]
    return [json.loads((out / f"refill-rank{r}.json").read_text()) for r in range(2)]


def test_both_ranks_run_the_same_rounds_and_steps(records):
    r0, r1 = records
    assert r0["num_processes"] == r1["num_processes"] == 2
    assert r0["steps"] == r1["steps"] == 2
    assert [s["round"] for s in r0["seen"]] == [s["round"] for s in r1["seen"]] == [0, 1, 2, 3] * 2
    assert r0["seen"] == r1["seen"]  # identical gathered rewards and prompt keys in every round
    assert r0["stream"] == r1["stream"] == {"epoch": 0, "position": 4}  # 2 stream draws per step (rounds 0 and 2)
    assert r0["rollouts"] == r1["rollouts"] == 2 * 3 * 2  # 3 refilled groups of 2 rows per step
    assert r0["metrics"]["plugins/framework/refill_rounds"] == 3
    assert r0["metrics"]["plugins/framework/rejected_groups"] == 3


def test_final_batches_are_whole_groups_with_the_repeat_in_place(records):
    r0, r1 = records
    assert r0["final_prompts"] == r1["final_prompts"]
    for prompts in r0["final_prompts"]:
        assert len(prompts) == 6
        assert all(prompts[i] == prompts[i + 1] for i in range(0, 6, 2))
    for seen in (r0["seen"][2], r0["seen"][6]):  # round 2 sees slot 2 holding slot 1's prompt again (same key)
        assert seen["round"] == 2 and seen["keys"][2] == seen["keys"][1] and seen["keys"][0] == 3
