"""Plugin state in checkpoints: atomic writes, readable errors for damaged files, resuming from complete checkpoints.

Order of a save (``PluginGRPOTrainer.save_checkpoint``): the plugin state first, written to a temporary file and
renamed into place (a reader sees the whole file or none); then transformers writes the model, optimizer, scheduler,
RNG state and, last, ``trainer_state.json``. A checkpoint folder is therefore **complete** exactly when its
``trainer_state.json`` exists and parses: a run killed at any point of a save leaves a folder without it (or with a
truncated one), and :func:`last_complete_checkpoint` -- what ``train(resume_from_checkpoint=True)`` uses -- skips such
folders with a warning naming them and resumes from the newest complete one. Before a save into a folder that
already exists (a run resumed from an older checkpoint saves the same step again), its ``trainer_state.json`` is
removed first, so a half-overwritten folder never passes for complete.

Loading never runs code. The plugin state is read with ``torch.load(weights_only=True)``, like every other file of a
checkpoint that transformers reads: a file holding anything but tensors, numbers, strings, ``None`` and
lists / tuples / dicts / sets of them (a crafted pickle whose ``__reduce__`` would run a command, a class instance) is
refused with a :class:`CheckpointError` naming the file and the object, before any of it is built. Saving checks the
same rule, so a plugin whose ``trl_plugins_state_dict`` returns something else is named when its first checkpoint is
written, not when a resume fails (numpy scalars are turned into Python numbers; anything else is refused).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections import OrderedDict
from typing import Any

import torch

from trl_plugins.api.errors import PluginError

PLUGIN_STATE_FILE = "trl_plugins_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: the last file of a save
FRAMEWORK_KEY = "__framework__"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(PluginError, RuntimeError):
    """A checkpoint's plugin state file that cannot be used (empty, truncated, corrupt, wrong content)."""


_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor, torch.dtype, torch.device,
          torch.Size)
_ALLOWED = "tensors, numbers, strings, bytes, None and lists / tuples / dicts / sets of them"


def plain_state(value: Any, where: str = "state") -> Any:
    """``value`` with numpy scalars turned into Python numbers; a :class:`CheckpointError` naming ``where`` (e.g.
    ``state['replay']['buffers'][3]``) and the type for anything ``torch.load(weights_only=True)`` would refuse."""
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()  # np.float64 (a float subclass), np.int64, np.bool_ ...: the same number, plain
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, dict) and type(value) in (dict, OrderedDict):
        out = {plain_state(k, f"{where} key {k!r}"): plain_state(v, f"{where}[{k!r}]") for k, v in value.items()}
        return OrderedDict(out) if type(value) is OrderedDict else out
    if type(value) in (list, tuple, set):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return type(value)(items)
    raise CheckpointError(
        f"returned {where} = {type(value).__module__}.{type(value).__qualname__} {_short(value)}; plugin state may only "
        f"hold {_ALLOWED}, so that a checkpoint can be loaded without running code (torch.load(weights_only=True)). "
        "Convert it in trl_plugins_state_dict (e.g. a deque or array to a list, an object to a dict of its fields) "
        "and back in trl_plugins_load_state_dict."
    )


def save_plugin_state(state: dict, folder: str) -> str:
    """Write ``state`` to ``folder/trl_plugins_state.pt`` atomically (temporary file, fsync, rename).

    The state must be :func:`plain_state` (checked before anything is written, naming the plugin's entry); what is
    written is read back with ``weights_only=True`` in memory first, so a saved file can always be resumed from.
    """
    plain = {}
    for name, value in state.items():
        try:
            plain[name] = plain_state(value, f"state[{name!r}]")
        except CheckpointError as exc:
            raise CheckpointError(f"Plugin {name!r} cannot be checkpointed: its trl_plugins_state_dict() {exc}") from None
    state = plain
    os.makedirs(folder, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # a tensor subclass or anything else plain_state let through
        raise CheckpointError(
            f"The plugin state cannot be saved so that it loads without running code: {_unsafe_global(exc)}. "
            f"Plugin state may only hold {_ALLOWED}."
        ) from exc
    path = os.path.join(folder, PLUGIN_STATE_FILE)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as handle:
            handle.write(buffer.getvalue())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # no stale temporary file (a full disk, a kill between write and rename)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(
                f"The disk is full: no space left on the device of {folder} while writing the plugin state "
                f"({len(buffer.getvalue())} bytes; {exc.strerror}). Nothing was left behind; free space (or lower "
                "save_total_limit) and resume from the last complete checkpoint."
            ) from exc
        raise
    return path


_WRITE_FAILED = ("file write failed", "unexpected pos", "No space left on device", "Disk quota exceeded")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that failed for lack of space: an ``OSError``
    ENOSPC / EDQUOT, or torch's own writer failing (``torch.save`` reports a full disk as a ``RuntimeError``
    "PytorchStreamWriter failed writing file ...: file write failed" without the errno)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, (RuntimeError, OSError)) and any(text in str(exc) for text in _WRITE_FAILED):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(exc: BaseException, folder: str, removed: bool) -> CheckpointError:
    """The :class:`CheckpointError` for a checkpoint save into ``folder`` that ran out of space (``removed``: the
    incomplete folder was deleted)."""
    try:
        free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(folder)) or '.').free:,} bytes free now"
    except OSError:
        free = "free space unknown"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    left = ("the incomplete checkpoint folder was removed, so nothing is left behind" if removed
            else "the incomplete folder lacks trainer_state.json, so resuming skips it")
    return CheckpointError(
        f"The disk is full: no space left on the device of {folder} while saving the checkpoint (model, optimizer or "
        f"scheduler state; {type(exc).__name__}: {first[:160]}; {free}). {left}; free space (or lower "
        "save_total_limit) and resume from the last complete checkpoint."
    )


def _unsafe_global(exc: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, as its error names it (``it holds a pickled posix.system``),
    else the unpickler's own reason (``Unsupported operand 149``) without torch's advice to load it unsafely."""
    text = str(exc)
    match = re.search(r"GLOBAL ([\w.]+)", text)
    if match:
        return f"it holds a pickled {match.group(1)}"
    if "WeightsUnpickler error:" in text:
        detail = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        return f"{type(exc).__name__}: {detail[0] if detail else 'not a plain pickle'}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def load_plugin_state(path: str) -> dict:
    """Read a plugin state file; a :class:`CheckpointError` naming the file and what is wrong with it otherwise."""
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): the save that wrote it was interrupted. {_ADVICE}")
    try:
        state = torch.load(path, weights_only=True)  # never weights_only=False: unpickling objects can run code
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc) or "GLOBAL" not in str(exc):
            raise CheckpointError(
                f"{path} ({size} bytes) is truncated or corrupt (or not a plugin state file trl-plugins wrote) and "
                f"cannot be read ({_unsafe_global(exc)}). {_ADVICE}"
            ) from None
        raise CheckpointError(
            f"Refusing to load {path}: {_unsafe_global(exc)}, an object that is not plugin state (trl-plugins saves "
            f"only {_ALLOWED}). Unpickling such an object can run arbitrary code, so the file was not loaded; it may "
            "have been crafted. Use a checkpoint you trust, or delete the file to start the plugins' state fresh."
        ) from None
    except Exception as exc:  # EOFError, RuntimeError (zip) ... depending on where it broke
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
