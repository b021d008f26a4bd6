#!/usr/bin/env python
"""GPU overhead: ``PluginGRPOTrainer`` with no plugins and with the recommended stacks against ``trl.GRPOTrainer``.

The GPU counterpart of ``scripts/bench_overhead.py`` (which measures CPU time on the tiny model): on one CUDA GPU,
for each configuration -- ``none`` (the plugin trainer with no plugin) and each non-tool recommended stack of
``scripts/gpu_smoke.py`` (``STACKS``, with that script's offline options ``SMOKE_CONFIG``) -- a vanilla
``trl.GRPOTrainer`` (A) and a ``PluginGRPOTrainer`` (B) are built from the same model path with the same GRPOConfig
fields, then trained in interleaved blocks A B, B A, A B ... (``--repeats`` blocks each). Every block restores the
initial weights, a fresh optimizer and the seed, and trains ``--steps`` optimizer steps; the first step of a block is
a warm-up and is not counted. Per block we record

* step time: wall time from ``on_step_begin`` to ``on_step_end`` with ``torch.cuda.synchronize()`` at both ends
  (generation, scoring, plugin stages, loss, backward, optimizer step), median over the counted steps;
* peak GPU memory: ``torch.cuda.max_memory_allocated()`` during the block minus the memory allocated when the block
  started (both trainers' weights stay resident, so the growth is what the block itself needed: activations,
  optimizer state, generation caches, plugin tensors).

The ratio of a configuration is the median over adjacent block pairs of B's step time over A's. Acting stacks change
what is generated (extra rollouts, hints, corrections), so their ratio is the method's cost, not only the
framework's.

    python scripts/gpu_overhead.py --model smollm2 --setting lora --out gpu_overhead.json --markdown gpu_overhead.md
    python scripts/gpu_overhead.py --device cpu --model tiny --setting fp32 --repeats 1 --steps 2   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_smoke as gs  # noqa: E402

#: Configurations measured by default: the plugin trainer with no plugins, and the recommended stacks that run on the
#: arithmetic task (the tool-agent stacks need the scripted tool task; their cost is in ``bench_overhead --task tools``).
DEFAULT_CONFIGS = ["none", *(name for name, stack in gs.STACKS.items() if not gs.TOOL_PLUGINS & set(stack))]


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def step_timer(device: str):
    """A TrainerCallback recording the wall time of each optimizer step, synchronised with the GPU."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            _sync(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def grpo_fields(setting: str, model_kind: str, output_dir: str, seed: int, device: str) -> dict[str, Any]:
    """GRPOConfig fields shared by A and B (the smoke test's sizes, a real model's completion length)."""
    precision, _, lora, _ = gs.SETTINGS[setting]
    return dict(
        output_dir=output_dir, seed=seed, max_steps=1, per_device_train_batch_size=32, num_generations=8,
        max_completion_length=64 if model_kind == "smollm2" else 32, learning_rate=1e-4 if lora else 1e-5,
        loss_type="dr_grpo", bf16=precision == "bf16", use_cpu=device == "cpu", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, log_level="error",
        model_init_kwargs={"dtype": "bfloat16" if precision == "bf16" else "float32"},
    )


def build_pair(config: str, *, setting: str, model_path: Path, model_kind: str, output_dir: str, seed: int,
               device: str) -> dict:
    """``{"vanilla": trl.GRPOTrainer, "plugin": PluginGRPOTrainer}`` for one configuration, each with a step timer."""
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_plugins import PluginGRPOConfig, PluginGRPOTrainer
    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset
    from trl_plugins.testing import digit_fraction_reward, tiny_dataset

    plugins = [] if config == "none" else gs.STACKS[config]
    lora = gs.SETTINGS[setting][2]
    fields = grpo_fields(setting, model_kind, output_dir, seed, device)
    for p in plugins:
        fields.update(gs.SMOKE_ARGS.get(p, {}))
    options = {p: {k: str(model_path) if v == gs.POLICY_MODEL else v for k, v in gs.SMOKE_CONFIG[p].items()}
               for p in plugins if p in gs.SMOKE_CONFIG}
    dataset = (make_dataset(256, levels=(1, 2), seed=0, split="train") if model_kind == "smollm2"
               else tiny_dataset(256, levels=(1, 2)))
    kwargs: dict[str, Any] = {"peft_config": gs._lora_config()} if lora else {}
    trainers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ("vanilla", "plugin"):
            common = dict(model=str(model_path), reward_funcs=[accuracy_reward, digit_fraction_reward],
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_path), **kwargs)
            if kind == "vanilla":
                trainer = GRPOTrainer(args=GRPOConfig(**fields), **common)
            else:
                trainer = PluginGRPOTrainer(args=PluginGRPOConfig(plugins=list(plugins), plugin_config=options,
                                                                  **fields), **common)
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            trainer.step_timer = step_timer(device)
            trainer.add_callback(trainer.step_timer)
            trainers[kind] = trainer
    return trainers


def run_block(trainer, init_state: dict, steps: int, seed: int, device: str) -> dict:
    """Train ``steps`` steps from the initial weights: median step seconds (first step dropped), peak memory growth."""
    import torch
    from transformers import set_seed

    trainer.model.load_state_dict(init_state)
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.args.max_steps = steps
    trainer.step_timer.times.clear()
    set_seed(seed)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    counted = trainer.step_timer.times[1:] or trainer.step_timer.times
    return {"step_s": statistics.median(counted),
            "peak_growth_mib": (torch.cuda.max_memory_allocated() - start) / 2**20 if cuda else None,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def bench_config(config: str, *, repeats: int, steps: int, **build) -> dict:
    """A/B blocks of one configuration; its row."""
    trainers = build_pair(config, **build)
    init = {kind: {k: v.detach().clone() for k, v in t.model.state_dict().items()} for kind, t in trainers.items()}
    blocks: dict[str, list[dict]] = {"vanilla": [], "plugin": []}
    for r in range(repeats):
        for kind in (("vanilla", "plugin") if r % 2 == 0 else ("plugin", "vanilla")):
            blocks[kind].append(run_block(trainers[kind], init[kind], steps, build["seed"], build["device"]))
    ratios = [b["step_s"] / a["step_s"] for a, b in zip(blocks["vanilla"], blocks["plugin"])]
    row = {"config": config, "repeats": repeats, "steps_per_block": steps, "blocks": blocks,
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    for kind in ("vanilla", "plugin"):
        row[f"step_s_{kind}"] = statistics.median(b["step_s"] for b in blocks[kind])
        peaks = [b["peak_growth_mib"] for b in blocks[kind] if b["peak_growth_mib"] is not None]
        row[f"peak_growth_mib_{kind}"] = max(peaks) if peaks else None
    service = getattr(trainers["plugin"], "generation_service", None)
    row["extra_rollouts_per_step"] = (service.total / max(1, repeats * steps)) if service is not None else 0.0
    trainers.clear()
    return row


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {env.get('gpu') or 'CPU'}; torch {env['torch']}, transformers "
        f"{env['transformers']}, trl {env['trl']}; model {s['model']}, setting {s['setting']}; "
        f"{s['repeats']} interleaved block(s) of {s['steps']} steps per trainer (first step of a block not counted); "
        "batch 32 completions (8 per prompt).",
        "",
        "| configuration | step s, trl.GRPOTrainer | step s, PluginGRPOTrainer | ratio (min-max) | peak memory growth "
        "MiB, trl / plugin | extra rollouts / step |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        peak_v, peak_p = row["peak_growth_mib_vanilla"], row["peak_growth_mib_plugin"]
        peak = "n/a" if peak_v is None else f"{peak_v:.0f} / {peak_p:.0f}"
        lines.append(f"| `{row['config']}` | {row['step_s_vanilla']:.3f} | {row['step_s_plugin']:.3f} | "
                     f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | {peak} | "
                     f"{row['extra_rollouts_per_step']:.1f} |")
    for config, error in result.get("errors", {}).items():
        lines.append(f"| `{config}` | failed: {error.splitlines()[0][:120]} | | | | |")
    for config in result.get("not_run", []):
        lines.append(f"| `{config}` | not run (--max-minutes reached) | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--setting", choices=["bf16", "fp32", "lora"], default="lora",
                        help="precision and LoRA, as in scripts/gpu_smoke.py (QLoRA and vLLM are not measured here)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated: none and names of gpu_smoke.STACKS (default {DEFAULT_CONFIGS})")
    parser.add_argument("--repeats", type=int, default=2, help="blocks per trainer (interleaved A B, B A, ...)")
    parser.add_argument("--steps", type=int, default=3, help="steps per block; the first is not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="Start no further configuration after this many minutes (the rows measured are kept).")
    parser.add_argument("--out", default="gpu_overhead.json")
    parser.add_argument("--markdown", default="gpu_overhead.md")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - {"none", *gs.STACKS})
    if unknown:
        parser.error(f"unknown configurations {unknown}; allowed: none, {sorted(gs.STACKS)}")
    if any(gs.TOOL_PLUGINS & set(gs.STACKS.get(c, ())) for c in configs):
        parser.error("tool-agent stacks are not measured here (they need the scripted tool task)")
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be >= 1 and --steps >= 2 (the first step of a block is not counted)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --model tiny --setting fp32 for a CPU dry run")
    result: dict[str, Any] = {"environment": gs.environment(args.device), "settings": vars(args), "rows": []}
    with tempfile.TemporaryDirectory(prefix="trl_plugins_gpu_overhead_") as tmp:
        if args.model == "smollm2":
            from trl_plugins.runtime.models import smollm2_path

            model_path = smollm2_path()
        else:
            model_path = gs.build_model(Path(tmp), hidden_size=256, num_layers=4)
        deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
        for config in configs:
            if deadline is not None and time.monotonic() > deadline:
                result.setdefault("not_run", []).append(config)
                continue
            t0 = time.monotonic()
            try:
                row = bench_config(config, repeats=args.repeats, steps=args.steps, setting=args.setting,
                                   model_path=model_path, model_kind=args.model, output_dir=str(Path(tmp) / "run"),
                                   seed=args.seed, device=args.device)
            except Exception as exc:  # noqa: BLE001 -- reported in the table; the other configurations go on
                import traceback

                traceback.print_exc()
                result.setdefault("errors", {})[config] = f"{type(exc).__name__}: {exc}"
                continue
            result["rows"].append(row)
            print(f"{config:<44} trl {row['step_s_vanilla']:.3f}s  plugin {row['step_s_plugin']:.3f}s  ratio "
                  f"{row['ratio']:.3f}  peak +{row['peak_growth_mib_vanilla']} / +{row['peak_growth_mib_plugin']} MiB"
                  f"  ({time.monotonic() - t0:.0f}s)", flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    Path(args.markdown).write_text(md)
    print(md)
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
