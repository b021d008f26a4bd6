"""Console output a person reads, for ``trl-plugins train``, ``demo`` and ``compare``.

TRL prints every logging step's whole metrics dict (30+ numbers). :func:`install` replaces that, on the main
process, with one progress bar whose postfix holds the few metrics that matter — the mean reward, the accuracy
column when the run has one, and each plugin's headline metric (``Plugin.claim_metric``) — and, when training
ends, a summary table (first, last and mean of those metrics, steps, wall time).

Nothing is lost: every metric still goes to TRL's loggers (``report_to``) and ``trainer.state.log_history``, one JSON
object per logging step is appended to the log file (``<output_dir>/metrics.jsonl`` by default), and ``verbose``
prints each step's whole dict above the bar as TRL did.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

LOG_FILE_NAME = "metrics.jsonl"


def headline_metrics(plugins: Sequence[Any], reward_names: Sequence[str]) -> list[tuple[str, str]]:
    """``[(label, logged key)]`` of the metrics worth a glance: the mean reward, the accuracy column when a reward
    function's name says accuracy, and each plugin's ``claim_metric`` (``plugins/<name>/<metric>``)."""
    heads = [("reward", "reward")]
    for name in reward_names:
        if "acc" in name.lower() or "correct" in name.lower():
            heads.append(("accuracy", f"rewards/{name}/mean"))
            break
    for plugin in plugins:
        if plugin.claim_metric:
            heads.append((f"{plugin.name}:{plugin.claim_metric[0]}", f"plugins/{plugin.name}/{plugin.claim_metric[0]}"))
    return heads


def _short(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


class ConsoleCallback(TrainerCallback):
    """The progress bar, log file and closing summary of :func:`install` (main process only)."""

    def __init__(self, heads: list[tuple[str, str]], log_file: Path | None, verbose: bool = False,
                 desc: str = "training", summary: bool = True, leave: bool = True):
        self.heads = list(heads)
        self.print_summary, self.leave = summary, leave
        self.log_file = log_file
        self.verbose = verbose
        self.desc = desc
        self.bar = None
        self.values: dict[str, list[float]] = {key: [] for _, key in self.heads}
        self.start = None
        self.steps = 0

    def _extend_heads(self, logs: dict) -> None:
        """Plugins without ``claim_metric``: their first logged metric becomes their headline."""
        have = {key.split("/")[1] for _, key in self.heads if key.startswith("plugins/")}
        for key in logs:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "plugins" and parts[1] not in have and parts[1] != "framework":
                self.heads.append((f"{parts[1]}:{parts[2]}", key))
                self.values[key] = []
                have.add(parts[1])

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        self.start = time.perf_counter()
        self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True, leave=self.leave)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
            self.steps = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        logs = dict(logs)
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": state.global_step, **logs}, default=float) + "\n")
        if "train_runtime" in logs:  # the closing log of Trainer.train: the summary says it
            return
        self._extend_heads(logs)
        for _, key in self.heads:
            if isinstance(logs.get(key), (int, float)):
                self.values[key].append(float(logs[key]))
        if self.verbose:
            (self.bar.write if self.bar is not None else print)(str(logs))
        if self.bar is not None:
            shown = {label: _short(logs[key]) for label, key in self.heads if key in logs}
            self.bar.set_postfix(shown, refresh=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if state.is_world_process_zero and self.print_summary:
            print(self.summary(state.global_step), flush=True)

    def summary(self, steps: int) -> str:
        """The closing table: first, last and mean of each headline metric, then steps, wall time, log file."""
        rows = [("metric", "first", "last", "mean")]
        for label, key in self.heads:
            vals = [v for v in self.values.get(key, []) if not math.isnan(v)]
            if vals:
                rows.append((label, _short(vals[0]), _short(vals[-1]), _short(sum(vals) / len(vals))))
        seconds = time.perf_counter() - self.start if self.start is not None else float("nan")
        lines = [f"Summary: {steps} steps in {seconds:.0f}s"]
        lines += table(rows)
        if self.log_file is not None:
            lines.append(f"Every metric of every step: {self.log_file}")
        return "\n".join(lines)


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of strings as aligned text lines (the first row is the header, underlined)."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def install(trainer: Any, verbose: bool = False, log_file: str | Path | None = None, desc: str = "training",
            summary: bool = True, leave: bool = True) -> ConsoleCallback:
    """Give ``trainer`` the readable console output; returns the callback (its :meth:`ConsoleCallback.summary`).

    ``log_file`` defaults to ``<output_dir>/metrics.jsonl``. TRL's own progress bar and metric printing are
    removed; its loggers (``report_to``) are untouched. ``summary=False`` skips the closing table and
    ``leave=False`` clears the bar when training ends (``trl-plugins compare`` runs many trainings under one bar).
    """
    plugins = list(getattr(trainer, "plugin_stack", None) or [])
    names = list(getattr(trainer, "reward_func_names", []) or [])
    path = Path(log_file) if log_file is not None else Path(trainer.args.output_dir) / LOG_FILE_NAME
    callback = ConsoleCallback(headline_metrics(plugins, names), path, verbose=verbose, desc=desc, summary=summary,
                               leave=leave)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(callback)
    return callback
