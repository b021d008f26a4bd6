"""Crash safety of checkpoints: a run stopped at any point of a save resumes from the newest complete checkpoint, and a
damaged ``trl_plugins_state.pt`` is an error naming the file (``trl_plugins/runtime/checkpoints.py``).

Damaged or foreign plugin state files are cases of ``test_bad_inputs.py`` (stage ``resume``). The kills are simulated in-process: one trained run leaves a complete ``checkpoint-1``; then, for each point of the
save of step 2 (the plugin state half-written, written but the model not, the model but not the optimizer, a
truncated ``trainer_state.json``, or everything written and only the checkpoint rotation left), the real
``_save_checkpoint`` runs with that point raising. ``tests/reliability/test_resume_sigkill.py`` kills a real process.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import transformers.trainer as hf_trainer
from transformers.trainer_utils import get_last_checkpoint

import trl_plugins.runtime.checkpoints as checkpoints
from trl_plugins.runtime.checkpoints import (
    PLUGIN_STATE_FILE,
    TRAINER_STATE_FILE,
    last_complete_checkpoint,
    load_plugin_state,
)
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing on the way catches it."""


def _trainer(out, max_steps=1):
    return make_tiny_trainer(
        plugins=["laser"], reward_funcs=[digit_fraction_reward], output_dir=str(out), max_steps=max_steps,
        save_strategy="steps", save_steps=1, log_level="error", max_completion_length=8,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer after one step, with a complete checkpoint-1 in its output_dir."""
    out = tmp_path_factory.mktemp("run") / "out"
    trainer = _trainer(out)
    trainer.train()
    assert checkpoints.is_complete_checkpoint(str(out / "checkpoint-1"))
    return trainer


def _half_written(fd):  # os.fsync of the temporary file: stopped before the data reached the disk and the rename
    raise Killed


def _kill(target, name, replacement=None):
    def raising(*args, **kwargs):
        if replacement is not None:
            replacement(*args, **kwargs)
        raise Killed

    return target, name, raising


def _truncated_json(self, path):
    with open(path, "w") as handle:
        handle.write('{"global_step": 2, "log_hist')
    raise Killed


KILL_POINTS = {
    "while-writing-plugin-state": lambda t: (checkpoints.os, "fsync", _half_written),
    "after-plugin-state-before-model": lambda t: _kill(t, "save_model"),
    "after-model-before-optimizer": lambda t: _kill(t, "_save_optimizer_and_scheduler"),
    "after-optimizer-before-rng": lambda t: _kill(t, "_save_rng_state"),
    "while-writing-trainer-state": lambda t: (type(t.state), "save_to_json", _truncated_json),
    "after-everything-during-rotation": lambda t: _kill(hf_trainer, "rotate_checkpoints"),
}


def _save_step_2_killed(trainer, out, point, monkeypatch):
    """Copy the run's output_dir to ``out`` and save step 2 there, stopped at ``point``."""
    shutil.copytree(trainer.args.output_dir, out)
    target, name, replacement = KILL_POINTS[point](trainer)
    with monkeypatch.context() as patch:
        patch.setattr(trainer.args, "output_dir", str(out))
        patch.setattr(trainer.state, "global_step", 2)
        patch.setattr(target, name, replacement)
        with pytest.raises(Killed):
            trainer._save_checkpoint(trainer.model, None)
    assert (out / "checkpoint-2").is_dir()


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_save_stopped_at_any_point_leaves_the_last_complete_checkpoint_found(point, trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _save_step_2_killed(trained, out, point, monkeypatch)
    expected = "checkpoint-2" if point == "after-everything-during-rotation" else "checkpoint-1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = last_complete_checkpoint(str(out))
    assert os.path.basename(found) == expected
    if expected == "checkpoint-1":
        assert get_last_checkpoint(str(out)).endswith("checkpoint-2")  # what transformers alone would have resumed
        assert any("Skipping incomplete checkpoint folder" in str(w.message) and "checkpoint-2" in str(w.message)
                   for w in caught)
    else:
        assert load_plugin_state(str(out / "checkpoint-2" / PLUGIN_STATE_FILE))["laser"] is not None


@pytest.mark.parametrize("point", ["after-plugin-state-before-model", "while-writing-trainer-state"])
def test_resume_true_after_a_killed_save_continues_from_the_complete_checkpoint(point, trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _save_step_2_killed(trained, out, point, monkeypatch)
    saved = torch.load(out / "checkpoint-1" / PLUGIN_STATE_FILE, weights_only=True)
    resumed = _trainer(out, max_steps=2)
    loaded = []
    original = resumed.load_plugin_state_dict
    resumed.load_plugin_state_dict = lambda state: loaded.append(state) or original(state)
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint folder.*checkpoint-2.*resuming from .*"
                                         r"checkpoint-1"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    assert loaded and loaded[0]["laser"] == saved["laser"]
    assert checkpoints.is_complete_checkpoint(str(out / "checkpoint-2"))  # the step was saved again, completely
    assert not list(out.glob("**/*.tmp"))


def test_resaving_into_an_existing_folder_marks_it_incomplete_first(trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(trained.args.output_dir, out)
    target, name, replacement = _kill(trained, "save_model")
    with monkeypatch.context() as patch:
        patch.setattr(trained.args, "output_dir", str(out))
        patch.setattr(target, name, replacement)
        with pytest.raises(Killed):
            trained._save_checkpoint(trained.model, None)  # step 1 again, over the complete checkpoint-1
    assert not (out / "checkpoint-1" / TRAINER_STATE_FILE).exists()
    with pytest.warns(UserWarning, match=r"No complete checkpoint .* \[.*checkpoint-1'\] lack a readable"):
        assert last_complete_checkpoint(str(out)) is None


def test_resume_true_without_any_complete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / PLUGIN_STATE_FILE).write_bytes(b"")
    trainer = _trainer(tmp_path)
    with pytest.warns(UserWarning, match="No complete checkpoint"), pytest.raises(
        Exception, match=r"holds no complete checkpoint-N folder"
    ):
        trainer.train(resume_from_checkpoint=True)


# ============================================================================================ loading runs no code
class _Planted:
    """A pickled object whose unpickling would create ``path`` (stands for any command a crafted file could run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_crafted_plugin_state_is_refused_on_resume_and_runs_nothing(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained.args.output_dir, out)
    marker = tmp_path / "code-ran"
    state_file = out / "checkpoint-1" / PLUGIN_STATE_FILE
    torch.save({"__framework__": {}, "length_shaping": _Planted(marker)}, state_file)  # what a crafted push holds
    resumed = _trainer(out, max_steps=2)
    with pytest.raises(checkpoints.CheckpointError) as err:
        resumed.train(resume_from_checkpoint=True)
    message = str(err.value)
    assert f"Refusing to load {state_file}" in message
    assert "it holds a pickled posix.mkdir" in message and "can run arbitrary code" in message
    assert not marker.exists()


def test_a_plain_pickle_with_code_is_refused_too(tmp_path):
    import pickle

    marker = tmp_path / "code-ran"
    path = tmp_path / PLUGIN_STATE_FILE
    path.write_bytes(pickle.dumps({"length_shaping": _Planted(marker)}))  # not torch's zip format
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on the pickle protocol
        with pytest.raises(checkpoints.CheckpointError, match="cannot be read"):
            load_plugin_state(str(path))
    assert not marker.exists()


def test_saving_a_state_that_would_need_code_to_load_names_the_plugin_and_the_entry(tmp_path):
    from collections import deque

    import numpy as np

    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.save_plugin_state({"__framework__": {}, "my_plugin": {"history": deque([1.0])}}, str(tmp_path))
    assert "Plugin 'my_plugin' cannot be checkpointed" in str(err.value)
    assert "state['my_plugin']['history'] = collections.deque" in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing written, no temporary file
    path = checkpoints.save_plugin_state({"p": {"x": np.float64(0.5), "n": [np.int64(3)]}}, str(tmp_path))
    assert load_plugin_state(path) == {"p": {"x": 0.5, "n": [3]}}


# options under which each stateful built-in holds more than its initial state after two steps
STATEFUL = {
    "adaptive_sampler": {}, "clip_cov": {}, "clpo": {}, "dcpo": {}, "decs": {}, "epo": {}, "fleming_r1": {"min_failures": 1},
    "ares": {"dynamic_kl": False},  # its HWE threshold and bucket weights (TRL's beta is 0 here: no KL half)
    "hapo": {"temperature_tau": 0.05},
    "hint_scaffold": {}, "laser": {}, "oreal": {"token_rm": True}, "r2vpo": {"replay_groups": 1}, "replay": {}, "rlpr": {},
    "rlp": {"text_column": "solution", "min_context_words": 1},  # the EMA baseline (the arithmetic solutions as text)
    "rapo_retention": {"teacher_model": "unused", "retention_lambda": 0.0},  # CTAN's statistics (no previous policy)
    "seele": {}, "siren": {}, "verl_erank": {},  # verl_erank: the running baselines of its three bonus terms
    "capo": {},  # the Adam step model's moments over the head rows
}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b


def test_every_stateful_builtin_is_listed():
    from trl_plugins.runtime.manager import available_plugins

    stateful = {name for name, cls in available_plugins().items()
                if cls.__module__.startswith("trl_plugins_builtin") and hasattr(cls, "trl_plugins_state_dict")}
    assert stateful == set(STATEFUL)


@pytest.mark.slow
@pytest.mark.parametrize("plugin", sorted(STATEFUL))
def test_every_stateful_builtin_round_trips_through_a_code_free_load(plugin, tmp_path):
    from trl_plugins.tasks.arithmetic import accuracy_reward

    def build(out):
        return make_tiny_trainer(
            plugins=[plugin], plugin_config={plugin: STATEFUL[plugin]} if STATEFUL[plugin] else None,
            reward_funcs=[digit_fraction_reward, accuracy_reward], output_dir=str(out), max_steps=2,
            save_strategy="steps", save_steps=1, log_level="error", max_completion_length=8,
        )

    trainer = build(tmp_path / "a")
    trainer.train()
    live = trainer.plugin_stack.by_name[plugin].trl_plugins_state_dict()
    loaded = load_plugin_state(str(tmp_path / "a" / "checkpoint-2" / PLUGIN_STATE_FILE))  # weights_only=True
    assert _same(live, loaded[plugin]), (live, loaded[plugin])
    fresh = build(tmp_path / "b")
    fresh.load_plugin_state_dict(loaded)
    assert _same(fresh.plugin_stack.by_name[plugin].trl_plugins_state_dict(), live)


def test_a_full_disk_while_writing_the_plugin_state_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.os, "fsync", full)
    with pytest.raises(checkpoints.CheckpointError, match=r"The disk is full: no space left on the device of .* "
                                                          r"while writing the plugin state"):
        checkpoints.save_plugin_state({"p": {"x": 1}}, str(tmp_path / "checkpoint-1"))
    assert list((tmp_path / "checkpoint-1").iterdir()) == []


def test_an_unwritable_output_dir_is_refused_when_the_config_is_built(tmp_path, monkeypatch):
    import trl_plugins.runtime.config as config_module
    from trl_plugins import PluginConfigError, PluginGRPOConfig

    locked = tmp_path / "locked"
    locked.mkdir()
    real = config_module.os.access
    monkeypatch.setattr(config_module.os, "access", lambda path, mode: False if str(path) == str(locked) else
                        real(path, mode))  # (as root, chmod alone would not stop writes)
    with pytest.raises(PluginConfigError, match=r"output_dir '.*locked/run/out' cannot be written \(.*locked is not "
                                                r"writable\)"):
        PluginGRPOConfig(output_dir=str(locked / "run" / "out"), report_to="none", use_cpu=True)


def test_a_full_disk_while_writing_the_optimizer_is_named_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(f, str) and f.endswith("optimizer.pt"):
            with open(f, "wb") as handle:  # part of it reached the disk, then the device was full
                handle.write(b"PK\x03\x04" + b"\0" * 4096)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/3: file write failed")
        return real_save(obj, f, *args, **kwargs)

    trainer = _trainer(tmp_path / "out")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoints.CheckpointError, match=r"The disk is full: no space left on the device of "
                                                          r".*checkpoint-1 while saving the checkpoint .*file write "
                                                          r"failed.*bytes free now\)\. the incomplete checkpoint folder "
                                                          r"was removed"):
        trainer.train()
    assert not (tmp_path / "out" / "checkpoint-1").exists()  # no partial optimizer.pt, no model file left
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.endswith((".tmp", ".pt"))]


def test_another_save_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert not checkpoints.is_disk_full(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert checkpoints.is_disk_full(RuntimeError("x")) is False
    import errno

    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert checkpoints.is_disk_full(wrapped)
    trainer = _trainer(tmp_path / "out")
    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        trainer.train()
    assert not isinstance(info.value, checkpoints.CheckpointError)


def test_a_run_resumed_from_its_final_checkpoint_trains_no_step_past_max_steps(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained.args.output_dir, out)
    final = out / "checkpoint-1"
    before = {k: v.clone() for k, v in torch.load(final / "optimizer.pt", weights_only=True)["state"][0].items()}
    resumed = _trainer(out, max_steps=1)
    generated = []
    original = resumed._generate_and_score_completions
    resumed._generate_and_score_completions = lambda inputs: generated.append(1) or original(inputs)
    with pytest.warns(UserWarning, match=r"Resumed at step 1, which is this run's max_steps=1: nothing is left to "
                                         r"train"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 1 and generated == []
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    model = resumed.accelerator.unwrap_model(resumed.model)
    saved = trained.accelerator.unwrap_model(trained.model)
    for (name, p), q in zip(model.named_parameters(), saved.parameters()):
        torch.testing.assert_close(p, q, msg=f"{name}: the model is not the final checkpoint's")
    after = torch.load(final / "optimizer.pt", weights_only=True)["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and a longer run resumes from it and trains on (the stop is only at max_steps)
    longer = _trainer(out, max_steps=2)
    longer.train(resume_from_checkpoint=True)
    assert longer.state.global_step == 2


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """What os.access does not reveal (root on a read-only bind mount, an immutable folder): the write probe at the
    start of train() finds it, before any generation."""
    import tempfile

    from trl_plugins import PluginConfigError

    trainer = _trainer(tmp_path / "out")
    generated = []
    original = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: generated.append(1) or original(inputs)

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "out" / ".probe"))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(PluginConfigError, match=r"output_dir '.*out' cannot be written \(OSError: \[Errno 30\] "
                                                 r"Read-only file system.*refused before its first step"):
        trainer.train()
    assert generated == []


def test_an_output_dir_below_a_file_is_refused_when_the_config_is_built(tmp_path):
    from trl_plugins import PluginConfigError, PluginGRPOConfig

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(PluginConfigError, match=r"output_dir '.*a_file/out' cannot be created: .*a_file in its path "
                                                 r"is a file"):
        PluginGRPOConfig(output_dir=str(blocker / "out"), report_to="none", use_cpu=True)


def test_the_write_probe_leaves_nothing_in_output_dir(tmp_path):
    trainer = _trainer(tmp_path / "out")
    trainer._check_output_dir_writable()
    assert list((tmp_path / "out").iterdir()) == []
