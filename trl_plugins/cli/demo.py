"""``trl-plugins demo``: the embedded default, end to end, offline, on a CPU.

1. Build (or load from the per-user cache) the tiny character-level model, warm-started on reference solutions of
   the bundled arithmetic tasks, so that it solves some problems but far from all. ``--model builtin:smollm2`` (or
   any model name / path) uses that pretrained model instead, trained with LoRA and smaller batches.
2. Measure greedy held-out accuracy.
3. Train it with ``PluginGRPOTrainer`` and a plugin stack (default: ``hint_scaffold`` + ``lp_reg``) against
   the exact verifier.
4. Measure held-out accuracy again and write the reward curve (PNG) and a JSON summary to the output dir.

Exit status 0 when held-out accuracy rose, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

DEFAULT_PLUGINS = ["hint_scaffold", "lp_reg"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trl-plugins demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugins", nargs="*", default=DEFAULT_PLUGINS, help="Plugins to stack (default: %(default)s).")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the tuned DemoSettings value).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the GRPO run.")
    parser.add_argument("--output-dir", default="runs/demo", help="Where the plot, summary and logs go.")
    parser.add_argument("--model", default="builtin:tiny",
                        help="builtin:tiny (default: warm-started offline), builtin:smollm2 (the offline real model, "
                        "fetched and converted once) or any model name / local path.")
    parser.add_argument("--verbose", action="store_true",
                        help="Print every step's whole metrics dict above the progress bar (they always go to "
                        "<output-dir>/trainer/metrics.jsonl).")
    parser.add_argument("--cache-dir", default=None,
                        help="Cache of the warm-started tiny model (default: $TRL_PLUGINS_CACHE, else "
                        "~/.cache/trl-plugins; shared with `trl-plugins train`).")
    return parser.parse_args(argv)


# A pretrained model (builtin:smollm2 or a name / path) is trained with LoRA and smaller batches than the tiny one, so
# that a step takes seconds rather than minutes on a CPU. 135M parameters learn the verifier's strict answer format
# slowly: a short run shows the pipeline on a real BPE tokenizer and chat template, not a large accuracy gain.
REAL_MODEL_SETTINGS = dict(
    grpo_steps=10, grpo_learning_rate=2e-5, num_generations=4, per_device_train_batch_size=8,
    max_completion_length=64, train_size=256, eval_size=32, torch_threads=2,
)


def real_model_lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")


def load_pretrained(name: str):
    """``(model, tokenizer)`` of ``builtin:smollm2`` or any model name / path (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_plugins.runtime.models import resolve_model

    path, _ = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # batched greedy evaluation
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def plot_rewards(log_history: list[dict], path: Path, title: str) -> None:
    """Write the per-step mean training reward (and a moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in log_history if "reward" in h]
    rewards = [h["reward"] for h in log_history if "reward" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.4, label="mean reward per step")
    if len(rewards) >= 5:
        window = 5
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from trl_plugins.runtime.config import PluginGRPOConfig
    from trl_plugins.runtime.models import cache_root
    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset
    from trl_plugins.tasks.tiny import DemoSettings, demo_model, evaluate_accuracy, shipped_weights
    from trl_plugins.runtime.trainer import PluginGRPOTrainer

    settings = DemoSettings()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    tiny = args.model == "builtin:tiny"
    if tiny:
        cache = args.cache_dir or cache_root()
        if shipped_weights(settings) is not None:
            print("[1/4] Loading the tiny model (its weights ship in the package) ...", flush=True)
        else:
            print(f"[1/4] Warm-starting the tiny model (cached under {cache}) ...", flush=True)
        model, tokenizer = demo_model(cache, settings, progress=True)
    else:
        print(f"[1/4] Loading {args.model} ...", flush=True)
        model, tokenizer = load_pretrained(args.model)
        settings = dataclasses.replace(settings, **REAL_MODEL_SETTINGS)
    torch.set_num_threads(settings.torch_threads)
    eval_set = make_dataset(settings.eval_size, levels=settings.levels, seed=1, split="test")
    train_set = make_dataset(settings.train_size, levels=settings.levels, seed=0, split="train")

    print("[2/4] Held-out accuracy before GRPO ...", flush=True)
    before = evaluate_accuracy(model, tokenizer, eval_set, max_new_tokens=settings.max_completion_length)
    print(f"      accuracy before: {before:.3f}", flush=True)

    print(f"[3/4] GRPO with plugins {args.plugins} ...", flush=True)
    fields = settings.grpo_config_fields(str(out / "trainer"), seed=args.seed)
    fields["max_steps"] = args.steps or settings.grpo_steps
    config = PluginGRPOConfig(plugins=list(args.plugins), **fields)
    trainer = PluginGRPOTrainer(
        model=model, reward_funcs=[accuracy_reward], args=config, train_dataset=train_set, processing_class=tokenizer,
        peft_config=None if tiny else real_model_lora(),
    )
    from trl_plugins.cli.console import install, table

    install(trainer, verbose=args.verbose, desc="GRPO")
    trainer.train()

    print("[4/4] Held-out accuracy after GRPO ...", flush=True)
    after = evaluate_accuracy(trainer.model, tokenizer, eval_set, max_new_tokens=settings.max_completion_length)
    elapsed = time.perf_counter() - start
    plot_path = out / "reward_curve.png"
    plot_rewards(trainer.state.log_history, plot_path, f"GRPO + {', '.join(args.plugins) or 'no plugins'}")
    summary = {
        "plugins": list(args.plugins),
        "accuracy_before": before,
        "accuracy_after": after,
        "steps": config.max_steps,
        "seconds": round(elapsed, 1),
        "plugin_metrics_last_step": {
            k: v for k, v in (trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}).items()
            if k.startswith("plugins/")
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(table([("held-out accuracy", "before", "after"), ("", f"{before:.3f}", f"{after:.3f}")])))
    print(f"Reward curve: {plot_path}   Summary: {out / 'summary.json'}   Total time: {elapsed:.0f}s")
    if after <= before:
        print("Held-out accuracy did not rise in this run.")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
