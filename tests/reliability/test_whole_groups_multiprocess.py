"""Whole groups per loss micro-batch on two processes (gloo, ``accelerate launch``): p3o and a probe declaring
``needs_whole_groups`` see, on each rank, micro-batches of whole groups (rows of a group consecutive), the rank's
four groups once per generation batch, and both ranks finish the same steps (no collective in the group shuffle)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("trl_plugins_mp_test", Path(__file__).with_name("test_multiprocess.py"))
_mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mp)  # its launch settings: the accelerate config, the repository root, a free port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "whole_groups_worker.py"
LAUNCH_TIMEOUT = 420


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole_groups_two_processes")
    returncode, log = _mp.launch_two_processes(WORKER, out, LAUNCH_TIMEOUT, "whole groups")
    assert returncode == 0, log[-4000:]
    return [json.loads((out / f"groups-rank{r}.json").read_text()) for r in range(2)]


def test_every_micro_batch_holds_whole_groups_on_each_rank(records):
    for record in records:
        assert record["num_processes"] == 2 and record["steps"] == 2 and record["whole_groups"] == 2
        assert len(record["seen"]) == 4  # two steps of two micro-batches
        for start in (0, 2):  # each generation batch
            prompts = []
            for micro in record["seen"][start:start + 2]:
                assert micro["G"] == 2 and len(micro["prompts"]) == 4
                p = micro["prompts"]
                assert p[0] == p[1] and p[2] == p[3]
                prompts += [tuple(p[0]), tuple(p[2])]
            assert len(set(prompts)) == 4  # the rank's four groups, each once
