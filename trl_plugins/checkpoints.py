"""Plugin state in checkpoints: atomic writes, readable errors for damaged files, resuming from complete checkpoints.

Order of a save (``PluginGRPOTrainer.save_checkpoint``): the plugin state first, written to a temporary file and
renamed into place (a reader sees the whole file or none); then transformers writes the model, optimizer, scheduler,
RNG state and, last, ``trainer_state.json``. A checkpoint folder is therefore **complete** exactly when its
``trainer_state.json`` exists and parses: a run killed at any point of a save leaves a folder without it (or with a
truncated one), and :func:`last_complete_checkpoint` -- what ``train(resume_from_checkpoint=True)`` uses -- skips such
folders with a warning naming them and resumes from the newest complete one. Before a save into a folder that
already exists (a run resumed from an older checkpoint saves the same step again), its ``trainer_state.json`` is
removed first, so a half-overwritten folder never passes for complete.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import torch

from .errors import PluginError

PLUGIN_STATE_FILE = "trl_plugins_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: the last file of a save
FRAMEWORK_KEY = "__framework__"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(PluginError, RuntimeError):
    """A checkpoint's plugin state file that cannot be used (empty, truncated, corrupt, wrong content)."""


def save_plugin_state(state: dict, folder: str) -> str:
    """Write ``state`` to ``folder/trl_plugins_state.pt`` atomically (temporary file, fsync, rename)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, PLUGIN_STATE_FILE)
    tmp = path + ".tmp"
    with open(tmp, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def load_plugin_state(path: str) -> dict:
    """Read a plugin state file; a :class:`CheckpointError` naming the file and what is wrong with it otherwise."""
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): the save that wrote it was interrupted. {_ADVICE}")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # UnpicklingError, EOFError, RuntimeError (zip) ... depending on where it broke
        raise CheckpointError(
            f"{path} ({size} bytes) is truncated or corrupt and cannot be read ({type(exc).__name__}: {exc}). "
            f"{_ADVICE}"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
        raise CheckpointError(
            f"{path} holds {type(state).__name__} {_short(state)}, not the dict of plugin states (plugin name -> "
            f"state) that trl-plugins writes. {_ADVICE}"
        )
    return state


_ADVICE = "Resume from an earlier checkpoint, or delete the file to start the plugins' state fresh."


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def foreign_entries(state: dict, plugin_names: list[str]) -> list[str]:
    """Entries of a plugin state dict that belong to no plugin of the stack (``__framework__`` excluded)."""
    return sorted(key for key in state if key != FRAMEWORK_KEY and key not in plugin_names)


def is_complete_checkpoint(folder: str) -> bool:
    """True when transformers finished saving ``folder``: its ``trainer_state.json`` exists and parses."""
    path = os.path.join(folder, TRAINER_STATE_FILE)
    try:
        with open(path) as handle:
            json.load(handle)
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` folder of ``output_dir`` (None if none); incomplete newer ones warn."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    skipped = []
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if is_complete_checkpoint(folder):
            if skipped:
                warnings.warn(
                    f"Skipping incomplete checkpoint folder(s) {skipped} (no readable {TRAINER_STATE_FILE}: the run "
                    f"was stopped while saving); resuming from {folder}.",
                    stacklevel=2,
                )
            return folder
        skipped.append(folder)
    if skipped:
        warnings.warn(
            f"No complete checkpoint in {output_dir}: {skipped} lack a readable {TRAINER_STATE_FILE} (the run was "
            "stopped while saving).",
            stacklevel=2,
        )
    return None


def mark_incomplete(folder: str) -> None:
    """Remove ``folder``'s ``trainer_state.json`` before saving into it again (see the module docstring)."""
    path = os.path.join(folder, TRAINER_STATE_FILE)
    if os.path.exists(path):
        os.remove(path)
