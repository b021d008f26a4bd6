"""Checkpoint and resume under a real crash: a run killed with SIGKILL in the middle of a step resumes from its last checkpoint
with every plugin's state restored, and continues exactly as the unbroken run (final parameters, plugin state).

The killed run is a separate Python process (``resume_worker.py``); the unbroken and the resumed runs train in this
process. The stack (adaptive_sampler, hint_scaffold, laser, clip_cov) carries sampler history, length history,
a random generator and the generation-service counter. ``test_e2e.py`` covers resume in-process with a test plugin;
this adds the crash, a fresh process and the built-in plugins' state.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trl_plugins.runtime.trainer import PLUGIN_STATE_FILE

HERE = Path(__file__).resolve().parent
WORKER = HERE / "resume_worker.py"
BLOCK_AT = 2  # killed during the generation of step 3, after checkpoint-2 was written
KILL_TIMEOUT = 300


def _worker():
    spec = importlib.util.spec_from_file_location("trl_plugins_resume_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed run uses one thread too: same float reductions
    yield
    torch.set_num_threads(threads)


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        torch.testing.assert_close(a, b, equal_nan=True, atol=1e-6, rtol=0, msg=f"{where} differs")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, abs=1e-6, nan_ok=True), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _kill_mid_step(out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), str(BLOCK_AT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + KILL_TIMEOUT
    try:
        while not (out / "blocked").exists():
            if proc.poll() is not None:
                pytest.fail(f"the run to kill exited by itself:\n{proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the run to kill did not reach step {BLOCK_AT + 1} in {KILL_TIMEOUT}s")
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_equals_the_unbroken_run(tmp_path, one_thread):
    from transformers.trainer_utils import get_last_checkpoint

    worker = _worker()
    killed = tmp_path / "killed"
    _kill_mid_step(killed)
    last = get_last_checkpoint(str(killed))
    assert last is not None and Path(last).name == f"checkpoint-{BLOCK_AT}"
    assert (Path(last) / PLUGIN_STATE_FILE).exists()
    assert not list(killed.glob("**/*.tmp")), "a temporary plugin state file was left behind"

    unbroken = worker.build_trainer(str(tmp_path / "unbroken"))
    unbroken.train()

    resumed = worker.build_trainer(str(tmp_path / "resumed"))
    fresh_state = resumed.plugin_state_dict()
    resumed.train(resume_from_checkpoint=last)

    # the checkpoint the killed run left equals the unbroken run's checkpoint of the same step
    _assert_same(
        torch.load(tmp_path / "unbroken" / f"checkpoint-{BLOCK_AT}" / PLUGIN_STATE_FILE, weights_only=True),
        torch.load(Path(last) / PLUGIN_STATE_FILE, weights_only=True),
        "plugin state at the kill",
    )
    # after resuming, every plugin's state and the model continue as the unbroken run
    final = f"checkpoint-{worker.MAX_STEPS}"
    unbroken_state = torch.load(tmp_path / "unbroken" / final / PLUGIN_STATE_FILE, weights_only=True)
    resumed_state = torch.load(tmp_path / "resumed" / final / PLUGIN_STATE_FILE, weights_only=True)
    # hint_scaffold saves the teacher tiers it asked for (none with solution-prefix hints)
    assert set(resumed_state) == {"__framework__", "adaptive_sampler", "laser", "clip_cov", "hint_scaffold"}
    _assert_same(unbroken_state, resumed_state, "final plugin state")
    _assert_same(unbroken.plugin_state_dict(), resumed.plugin_state_dict(), "live plugin state")
    assert resumed_state["__framework__"]["generation_service"]["total"] == worker.MAX_STEPS  # 1 hint request/step
    with pytest.raises(AssertionError):  # the restored state is not what a fresh run starts with
        _assert_same(fresh_state, resumed_state)
    for name, param in unbroken.model.named_parameters():
        torch.testing.assert_close(resumed.model.state_dict()[name], param.detach(), atol=1e-6, rtol=0,
                                   msg=f"parameter {name} differs")


@pytest.mark.slow
def test_resume_from_a_checkpoint_without_plugin_state_warns(tmp_path, one_thread):
    worker = _worker()
    plugins = ["laser", "clip_cov"]  # (adaptive_sampler refuses to resume without its draw history)
    first = worker.build_trainer(str(tmp_path / "a"), max_steps=1, plugins=plugins)
    first.train()
    checkpoint = tmp_path / "a" / "checkpoint-1"
    bare = tmp_path / "bare-checkpoint-1"
    shutil.copytree(checkpoint, bare)
    os.remove(bare / PLUGIN_STATE_FILE)  # e.g. a checkpoint of a run without plugins
    resumed = worker.build_trainer(str(tmp_path / "b"), max_steps=2, plugins=plugins)
    with pytest.warns(UserWarning, match=rf"has no {PLUGIN_STATE_FILE}.*'laser', 'clip_cov'.*starts fresh"):
        resumed.train(resume_from_checkpoint=str(bare))
