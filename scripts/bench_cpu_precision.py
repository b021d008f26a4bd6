"""Step time of GRPO on the real model (``builtin:smollm2``, LoRA) on a CPU, with ``bf16=False`` and ``bf16=True``.

Why it exists: TRL's ``GRPOConfig`` defaults to ``bf16=True``; on a CPU that means bf16 autocast.
:class:`trl_plugins.PluginGRPOConfig` picks ``bf16=False`` on a CPU without AMX bf16 units and warns when it is set
by hand there, quoting this measurement. The script runs the two settings on the same run (SmolLM2-135M-Instruct,
LoRA r=8 on the attention projections, the bundled arithmetic prompts as chat messages, 8 completions per step, at
most ``--max-completion-length`` new tokens, no plugins), ``--steps`` optimizer steps each, and prints per-step wall and CPU times as JSON (``--json``
writes them to a file) and one markdown row per setting.

    python scripts/bench_cpu_precision.py --steps 2 --threads 1 --max-completion-length 32 \
        --json docs/benchmarks/cpu_precision.json

The first step of each run includes one-off work (optimizer state), so the row reports the median over the steps
after the first when there are at least two. Wall time depends on the machine's load; the CPU time of the process
(``time.process_time``, all its threads) much less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps per setting (default: %(default)s).")
    parser.add_argument("--settings", nargs="+", default=["false", "true"], choices=["false", "true"],
                        help="bf16 settings to measure, in this order (default: %(default)s).")
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s).")
    parser.add_argument("--json", default=None, help="Write the results to this JSON file.")
    return parser.parse_args(argv)


def run_setting(bf16: bool, steps: int, max_completion_length: int) -> dict:
    """Train ``steps`` steps and return per-step wall / process-CPU seconds."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_plugins import PluginGRPOConfig, PluginGRPOTrainer
    from trl_plugins.runtime.config import checkpointing_off
    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu = [], []
            self._t = self._c = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)

    with tempfile.TemporaryDirectory() as out:
        args = PluginGRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=max_completion_length, learning_rate=1e-5, beta=0.0, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, bf16=bf16, disable_tqdm=True, log_level="error",
            seed=0, **checkpointing_off(),
        )
        trainer = PluginGRPOTrainer(
            model="builtin:smollm2", reward_funcs=[accuracy_reward], args=args,
            train_dataset=make_dataset(64, levels=(1, 2), seed=0, split="train"),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                   task_type="CAUSAL_LM"),
        )
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
    steady = timer.wall[1:] or timer.wall
    return {
        "bf16": bf16,
        "steps": steps,
        "wall_s_per_step": [round(x, 1) for x in timer.wall],
        "cpu_s_per_step": [round(x, 1) for x in timer.cpu],
        "median_wall_s_after_first": round(statistics.median(steady), 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import warnings

    import torch

    from trl_plugins.runtime.precision import cpu_bf16_is_native

    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    results = []
    for setting in args.settings:
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        row = run_setting(setting == "true", args.steps, args.max_completion_length)
        row["load_average_1min_before"] = load_before
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "command": "python scripts/bench_cpu_precision.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "torch": torch.__version__,
            "cpu_bf16_native (AMX)": cpu_bf16_is_native(),
        },
        "results": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print("| bf16 | s/step (median after the first) | per step (wall) | per step (CPU) |")
    print("|---|---|---|---|")
    for row in results:
        print(f"| {row['bf16']} | {row['median_wall_s_after_first']} | {row['wall_s_per_step']} | {row['cpu_s_per_step']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
