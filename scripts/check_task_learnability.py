"""Check that the embedded arithmetic task is learnable by RL with the tiny offline model.

Builds the tiny character-level model, warm-starts it on reference solutions, measures held-out
greedy accuracy and sampled accuracy, then runs a short plain ``trl.GRPOTrainer`` (no plugins) with
``accuracy_reward`` and measures held-out greedy accuracy again. Everything runs offline on CPU.

    python scripts/check_task_learnability.py                 # the tuned DemoSettings
    python scripts/check_task_learnability.py --grpo-steps 60 --grpo-lr 3e-3 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402


def _fraction(text: str) -> float | dict[int, float]:
    value = json.loads(text)
    return {int(k): float(v) for k, v in value.items()} if isinstance(value, dict) else float(value)


def _parse_args() -> argparse.Namespace:
    from trl_plugins.tasks.tiny import DemoSettings

    d = DemoSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--levels", type=int, nargs="+", default=list(d.levels))
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--warm-start-steps", type=int, default=d.warm_start_steps)
    p.add_argument("--warm-start-lr", type=float, default=d.warm_start_lr)
    p.add_argument("--warm-start-batch-size", type=int, default=d.warm_start_batch_size)
    p.add_argument(
        "--informal-fraction",
        type=_fraction,
        default=d.warm_start_informal_fraction,
        help='share of informal warm-start endings: a number or JSON per level, e.g. \'{"1": 0.2, "2": 0.7}\'',
    )
    p.add_argument("--grpo-steps", type=int, default=d.grpo_steps)
    p.add_argument("--grpo-lr", type=float, default=d.grpo_learning_rate)
    p.add_argument("--num-generations", type=int, default=d.num_generations)
    p.add_argument("--batch-size", type=int, default=d.per_device_train_batch_size)
    p.add_argument("--max-completion-length", type=int, default=d.max_completion_length)
    p.add_argument("--temperature", type=float, default=d.temperature, help="GRPO sampling temperature")
    p.add_argument("--eval-size", type=int, default=d.eval_size)
    p.add_argument("--threads", type=int, default=d.torch_threads, help="torch intra-op threads")
    p.add_argument("--cache-dir", default=None, help="cache the warm-started model here (default: no cache)")
    p.add_argument(
        "--grpo-config", default="{}", help='extra GRPOConfig fields as JSON, e.g. \'{"loss_type": "grpo"}\''
    )
    p.add_argument("--save-dir", default=None, help="save the GRPO-trained model and tokenizer here")
    p.add_argument("--json", default=None, help="write the measurements to this file")
    return p.parse_args()


def _measure(model, tokenizer, held_out) -> dict[str, float]:
    """Greedy held-out accuracy (overall and per level), share of greedy completions with an
    'Answer:' line, and the share of correct samples at temperature 1.0 (8 x 32 prompts)."""
    from trl_plugins.tasks import split_steps, verify
    from trl_plugins.tasks.tiny import generate_completions

    rows = list(held_out)
    questions = [r["prompt"][-1]["content"] for r in rows]
    max_new = max(len(r["solution"]) for r in rows) + 8
    greedy = generate_completions(model, tokenizer, questions, max_new_tokens=max_new)
    ok = [verify(t, r["answer"]) for t, r in zip(greedy, rows)]
    out: dict[str, float] = {"greedy": sum(ok) / len(ok)}
    for level in sorted({r["level"] for r in rows}):
        sel = [o for o, r in zip(ok, rows) if r["level"] == level]
        out[f"greedy_level{level}"] = sum(sel) / len(sel)
    formatted = [any(line.lower().startswith("answer:") for line in split_steps(t)) for t in greedy]
    out["greedy_answer_format_share"] = sum(formatted) / len(formatted)
    sampled = generate_completions(
        model, tokenizer, questions[:32], max_new_tokens=max_new, temperature=1.0, num_samples=8, seed=1
    )
    out["sampled_t1"] = sum(verify(t, rows[i // 8]["answer"]) for i, t in enumerate(sampled)) / len(sampled)
    return out


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from trl import GRPOConfig, GRPOTrainer

    from trl_plugins.tasks import accuracy_reward, make_dataset
    from trl_plugins.tasks.tiny import DemoSettings, demo_model

    settings = dataclasses.replace(
        DemoSettings(),
        seed=args.seed,
        levels=tuple(args.levels),
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        warm_start_steps=args.warm_start_steps,
        warm_start_lr=args.warm_start_lr,
        warm_start_batch_size=args.warm_start_batch_size,
        warm_start_informal_fraction=args.informal_fraction,
    )
    results: dict[str, object] = {"settings": dataclasses.asdict(settings), "args": vars(args)}

    t0, c0 = time.perf_counter(), time.process_time()
    model, tokenizer = demo_model(args.cache_dir, settings, verbose=True)
    results["warm_start_s"] = round(time.perf_counter() - t0, 1)
    results["warm_start_cpu_s"] = round(time.process_time() - c0, 1)

    held_out = make_dataset(args.eval_size, levels=settings.levels, seed=10_000 + args.seed, split="test")
    results["before"] = _measure(model, tokenizer, held_out)
    print(json.dumps(results["before"]), flush=True)

    train = make_dataset(settings.train_size, levels=settings.levels, seed=args.seed, split="train")
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            num_generations=args.num_generations,
            per_device_train_batch_size=args.batch_size,
            max_completion_length=args.max_completion_length,
            learning_rate=args.grpo_lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=args.grpo_steps,
            beta=0.0,
            temperature=args.temperature,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=args.seed,
            dataloader_num_workers=0,
            **json.loads(args.grpo_config),
        )
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=accuracy_reward,
            args=config,
            train_dataset=train,
        )
        t, c = time.perf_counter(), time.process_time()
        trainer.train()
        results["grpo_s"] = round(time.perf_counter() - t, 1)
        results["grpo_cpu_s"] = round(time.process_time() - c, 1)
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    results["train_rewards"] = [round(r, 3) for r in rewards]
    results["train_reward_first10"] = sum(rewards[:10]) / max(1, len(rewards[:10]))
    results["train_reward_last10"] = sum(rewards[-10:]) / max(1, len(rewards[-10:]))

    results["after"] = _measure(trainer.model, tokenizer, held_out)
    if args.save_dir:
        trainer.model.save_pretrained(args.save_dir)
        tokenizer.save_pretrained(args.save_dir)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    results["total_cpu_s"] = round(time.process_time() - c0, 1)

    print(json.dumps({k: v for k, v in results.items() if k not in ("settings", "args", "train_rewards")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
