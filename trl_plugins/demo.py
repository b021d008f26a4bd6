"""``trl-plugins demo``: the embedded default, end to end, offline, on a CPU.

1. Build (or load from the cache) the tiny character-level model, warm-started on reference solutions of the
   bundled arithmetic tasks, so that it solves some problems but far from all.
2. Measure greedy held-out accuracy.
3. Train it with ``PluginGRPOTrainer`` and a plugin stack (default: ``hint_scaffold`` + ``lp_reg``) against
   the exact verifier.
4. Measure held-out accuracy again and write the reward curve (PNG) and a JSON summary to the output dir.

Exit status 0 when held-out accuracy rose, 1 otherwise.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--cache-dir", default=None, help="Cache of the warm-started model (default: <output-dir>/cache).")
    return parser.parse_args(argv)


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

    from .config import PluginGRPOConfig
    from .tasks.arithmetic import accuracy_reward, make_dataset
    from .tasks.tiny import DemoSettings, demo_model, evaluate_accuracy
    from .trainer import PluginGRPOTrainer

    settings = DemoSettings()
    torch.set_num_threads(settings.torch_threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    print(f"[1/4] Warm-starting the tiny model (cached under {args.cache_dir or out / 'cache'}) ...", flush=True)
    model, tokenizer = demo_model(args.cache_dir or out / "cache", settings, verbose=True)
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
        model=model, reward_funcs=[accuracy_reward], args=config, train_dataset=train_set, processing_class=tokenizer
    )
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
    print(f"      accuracy after:  {after:.3f}   (before: {before:.3f})")
    print(f"Reward curve: {plot_path}   Summary: {out / 'summary.json'}   Total time: {elapsed:.0f}s")
    if after <= before:
        print("Held-out accuracy did not rise in this run.")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
