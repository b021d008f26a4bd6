"""Learning efficiency of the built-in plugins against vanilla GRPO at an equal rollout budget.

Task: the bundled chained-arithmetic task at the demo's levels (1, 2), with the demo's warm-started tiny model
(settings pinned in ``bench_common.BENCH_SETTINGS``): its sampled pass rate at temperature 1 is about 15 % (greedy
held-out accuracy about 23 %). Training: ``PluginGRPOTrainer`` with the demo's GRPO settings (G=8, 64 completions
per step, lr 5e-5, constant schedule, beta 0, at most 40 completion tokens) and the exact verifier
``accuracy_reward``; "grpo" is the same trainer with no plugins (identical to ``trl.GRPOTrainer``, ``tests/runtime/test_reduction.py``).
Plugin options and GRPOConfig fields per method: ``bench_common.PLUGIN_SETTINGS`` (overridden by
``learning_methods.LEARNING_SETTINGS``); they are each paper's recommended settings where the task allows.

Equal rollouts: every run has the same budget of policy rollouts (completions sampled from the policy: TRL's own
generation round plus every completion a plugin asks the generation service for, counted by the generation service
where they are sampled, ``trl_plugins.cli.equal_budget.count_policy_rollouts``); a run stops at the first optimizer step
where its cumulative rollouts reach the budget.
Vanilla GRPO spends 64 rollouts per step; a plugin that asks for extra completions takes fewer optimizer steps.
Reference solutions spliced in by a plugin (SCOPE's reference_suffix, DaGRPO's anchors) cost no rollouts.

Measured per run: held-out greedy accuracy (``--eval-size`` test problems) every ``--eval-every`` rollouts, the
rollouts needed to reach ``--target`` held-out accuracy (linear interpolation between evaluations), the final
accuracy, and per step from ``trainer.state.log_history`` the policy entropy, gradient norm, training reward, and
our own per-group statistics (distinct completions per group, correct rollouts per step) plus every plugin metric.

    python scripts/bench_learning.py --quick --write-docs      # 6 methods x 3 seeds, a few minutes on 2 quiet cores
    python scripts/bench_learning.py --write-docs              # every plugin + 4 stacks, 3 seeds (~50 min, estimated)
    python scripts/bench_learning.py --methods grpo fbos_rl scope+lp_reg --seeds 0 1 2 --budget 1920
    python scripts/bench_learning.py --task tools --write-docs  # agentic: tool agent, GRPO vs igpo & stacks
    python scripts/bench_learning.py --task chat --device cuda --max-minutes 3 --out-dir OUT  # builtin:smollm2, chat task

Chat mode (``--task chat``): builtin:smollm2 with LoRA on the bundled chat-arithmetic task, which the untrained model
already half-solves; the mode (run cache, workers from measured memory, deadline) is ``scripts/bench_chat.py``.

Agentic mode (``--task tools``): a multi-turn tool agent on the bundled offline tool environment; task, model (a
tool-use warm start on top of the demo model) and methods are described in ``scripts/bench_agentic.py``.

This module is the command line and the runs (one run: :func:`run_one`); the methods and what a run records per step
are ``scripts/learning_methods.py``, the tables and plots ``scripts/learning_tables.py``.

Runs are cached as JSON under ``--run-dir`` (``--fresh`` discards them), so an interrupted table resumes.
Outputs: ``docs/benchmarks/learning.json`` and ``learning_*.png`` (``learning_full*`` without ``--quick``) and
(``--write-docs``) the ``learning`` (``learning_full``) section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_agentic as ba  # noqa: E402
import bench_common as bc  # noqa: E402
import learning_methods as lm  # noqa: E402
import learning_tables as lt  # noqa: E402

from trl_plugins.cli.equal_budget import EqualBudget, count_policy_rollouts, merge_logs  # noqa: E402


# Token mode: GRPO's tokens at the rollout budget on the shipped model (2560 rollouts x about 30 tokens: 76,000-76,600
# in the full-mode runs of seeds 0-2), and the evaluation interval in tokens.
TOKEN_BUDGET, TOKEN_EVAL_EVERY = 76800, 19200
# With --task tools: GRPO's sampled tokens at the agentic rollout budget (384 rollouts: 25,365 tokens for seed 0 on the
# shipped tool model), and the evaluation interval in tokens.
TOOL_TOKEN_BUDGET, TOOL_TOKEN_EVAL_EVERY = 25600, 8533


# ------------------------------------------------------------------------------------------------ one run


def run_one(job: dict) -> dict:
    """Train one (method, seed) to the rollout budget; return its record (also written to job['path'])."""
    import torch

    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset
    from trl_plugins.tasks.tiny import evaluate_accuracy

    bc.set_threads(1)
    method, seed, budget = job["method"], job["seed"], job["budget"]
    unit = job.get("unit", "rollouts")
    s = bc.demo_settings()
    real = job.get("model") == "smollm2"
    agentic = job.get("task") == "tools"
    task = task_settings(real)
    if agentic:
        model, tokenizer = ba.load_model(job["cache_dir"], untrained=job.get("untrained", False))
        base_fields, peft_config = ba.grpo_fields(job.get("untrained", False)), None
        train_set, eval_set = ba.datasets(ba.TOOL_TASK["train_size"], job["eval_size"])
        task["max_completion_length"] = base_fields["max_completion_length"]
    elif real:
        model, tokenizer = bc.load_real_model(job["device"])
        base_fields, peft_config = bc.real_model_grpo_fields(job["device"]), bc.real_model_lora()
    else:
        model, tokenizer = bc.load_model(job["cache_dir"], untrained=job.get("untrained", False))
        base_fields, peft_config = {}, None
    if not agentic:
        train_set = make_dataset(task["train_size"], levels=task["levels"], seed=0, split="train",
                                 instruction=job.get("instruction"))
        eval_set = make_dataset(job["eval_size"], levels=task["levels"], seed=1, split="test",
                                instruction=job.get("instruction"))
    plugins, options, overrides = lm.method_settings(method, real_model=real, task=job.get("task", "arithmetic"))
    smoke = bc.SMOKE_OVERRIDES if job.get("untrained") and not agentic else {}
    overrides = {**base_fields, **smoke, **job.get("grpo_config", {}), **overrides}
    batch = overrides.get("per_device_train_batch_size", s.per_device_train_batch_size)
    # luffy's demonstration slots are not sampled from the policy (teacher rollouts): its steps cost fewer policy
    # rollouts, so it takes more steps for the same policy budget (the Budget callback below stops every run there)
    G = overrides.get("num_generations", s.num_generations)
    teacher_slots = options.get("luffy", {}).get("num_demonstrations", 1) if "luffy" in plugins else 0
    max_steps = math.ceil(budget / (batch * (G - teacher_slots) / G))  # a bound: the budget stops the run
    if unit == "tokens":  # at least one sampled token per rollout
        max_steps = math.ceil(budget / batch)
    out_dir = tempfile.mkdtemp(prefix="bench_learning_")
    trainer = bc.make_trainer(
        "plugin", model, tokenizer, train_set, ba.reward_funcs() if agentic else [accuracy_reward], out_dir,
        plugins=plugins, plugin_config=options, seed=seed, max_steps=max_steps, peft_config=peft_config,
        trainer_kwargs=ba.trainer_kwargs() if agentic else None, **overrides,
    )
    G = trainer.num_generations
    counts = count_policy_rollouts(trainer)
    pending: dict = {}

    lm.record_rewards(trainer, pending, G, ba.correct if agentic else
                   lambda completions, rows: accuracy_reward(completions, [r["answer"] for r in rows]),
                   ba.completion_text if agentic else None)
    evals: list[dict] = []
    eval_every = job["eval_every"]

    def evaluate(step: int) -> None:
        state = torch.get_rng_state()
        if agentic:  # accuracy and tool use
            numbers = ba.evaluate(trainer.model, tokenizer, eval_set, task["max_completion_length"])
        else:
            numbers = {"accuracy": evaluate_accuracy(trainer.model, tokenizer, eval_set,
                                                     max_new_tokens=task["max_completion_length"])}
        torch.set_rng_state(state)
        evals.append({"step": step, **dict(counts), **numbers})

    budget_cb = EqualBudget(counts, budget, eval_every, lambda step, spent: evaluate(step), unit=unit, pending=pending)
    trainer.add_callback(budget_cb)
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    per_step = merge_logs(budget_cb.per_step, trainer.state.log_history)
    record = {
        "method": method, "seed": seed, "budget": budget, "plugins": plugins, "plugin_config": options,
        "model": job.get("model", "tiny"), "task": job.get("task", "arithmetic"),
        "claim_metrics": {p.name: list(p.claim_metric) for p in trainer.plugin_stack if p.claim_metric},
        "grpo_overrides": overrides, "steps": trainer.state.global_step, "rollouts": counts["rollouts"],
        "tokens": counts["tokens"], "unit": unit,
        "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1), "evals": evals, "per_step": per_step,
    }
    Path(job["path"]).write_text(json.dumps(record, default=float))
    return record


def task_settings(real_model: bool) -> dict:
    """Task and generation sizes of a mode: the tiny model's pinned demo settings, or the real-model settings."""
    if real_model:
        r = bc.REAL_MODEL_SETTINGS
        return {k: r[k] for k in ("levels", "train_size", "max_completion_length")}
    s = bc.demo_settings()
    return {"levels": s.levels, "train_size": s.train_size, "max_completion_length": s.max_completion_length}


def _worker(job: dict) -> tuple[str, int, float, str | None]:
    try:
        rec = run_one(job)
        return job["method"], job["seed"], rec["seconds"], None
    except Exception as exc:  # reported, the table marks the run as failed
        import traceback

        Path(job["path"]).with_suffix(".error").write_text(traceback.format_exc())
        return job["method"], job["seed"], 0.0, f"{type(exc).__name__}: {exc}"



# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"methods {', '.join(lm.QUICK_METHODS)}; budget 1920")
    p.add_argument("--tiny", action="store_true",
                   help="smoke mode: untrained tiny model, grpo + hint_scaffold, 1 seed, 2 steps (with --task tools: "
                   "grpo + igpo, 1 step of 8 rollouts)")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: the warm-started character-level model; smollm2: the real-model mode "
                   f"(builtin:smollm2 with LoRA; methods {', '.join(lm.REAL_METHODS)}; budget 1536)")
    p.add_argument("--task", choices=["arithmetic", "tools", "chat"], default="arithmetic",
                   help="arithmetic: the chained-arithmetic task; tools: the agentic mode, a multi-turn tool agent on "
                   f"the bundled tool environment (tiny model; methods {', '.join(ba.AGENTIC_METHODS)}; budget "
                   f"{ba.TOOL_TASK['budget']}; see scripts/bench_agentic.py); chat: the real-model mode with signal, "
                   "builtin:smollm2 + LoRA on the bundled chat-arithmetic task (implies --model smollm2; methods "
                   f"{', '.join(lm.CHAT_METHODS)}; see scripts/bench_chat.py)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="real-model mode: where to train (default: cuda when available)")
    p.add_argument("--pilot-lrs", type=float, nargs="*", default=None,
                   help="real-model mode: first train vanilla GRPO (seed 0, full budget) at each of these learning "
                   "rates and use the one with the best final held-out accuracy for every method")
    p.add_argument("--instruction", default="auto",
                   help="real-model mode: the format instruction appended to each question (a key of "
                   "trl_plugins.tasks.arithmetic.FORMAT_INSTRUCTIONS), or auto: the one with the best sampled pass "
                   "rate of the untrained model on 64 training problems")
    p.add_argument("--summarize-only", action="store_true",
                   help="run nothing: summarize the runs already in --run-dir (an interrupted benchmark)")
    p.add_argument("--base-from", default=None, metavar="JSON",
                   help="take the untrained model's numbers (and the chosen format instruction and device) from this "
                   "earlier result JSON of the same mode instead of evaluating them again")
    p.add_argument("--methods", nargs="*", default=None, help="grpo, plugin names or stacks a+b (default: all)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--budget-unit", choices=["rollouts", "tokens"], default="rollouts",
                   help="what the budget counts: policy rollouts, or generated tokens (token mode: the branching "
                        f"methods {', '.join(lm.TOKEN_METHODS)}; budget {TOKEN_BUDGET}, evaluations every "
                        f"{TOKEN_EVAL_EVERY} tokens)")
    p.add_argument("--budget", type=int, default=None,
                   help="policy rollouts per run (default 2560 = 40 vanilla steps of 64; quick 1920; smollm2 1536)")
    p.add_argument("--eval-every", type=int, default=None, help="rollouts between evaluations (default 640)")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems (default 128)")
    p.add_argument("--target", type=float, default=None,
                   help="target held-out accuracy (default: base + 0.12; quick: base + 0.08; smollm2: base + 0.15)")
    p.add_argument("--lr", type=float, default=None, help="GRPO learning rate (default: DemoSettings, 1e-4)")
    p.add_argument("--grpo-config", default="{}", help="extra GRPOConfig fields for every method, as JSON")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel worker processes, one torch thread each (default 2; --task chat: chosen from the "
                   "peak memory of a first run alone)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="--task chat: stop every run at this wall time (runs still training are evaluated and recorded "
                   "as truncated, runs not started are left out) and write the results")
    p.add_argument("--model-path", default=None,
                   help="--task chat: a model folder instead of builtin:smollm2 (tests: a tiny model of the same "
                   "tokenizer)")
    p.add_argument("--cache-from", nargs="*", default=None, metavar="JSON",
                   help="--task chat: put the finished runs of these earlier result JSONs (same weights) into the run "
                   "cache first, so that a session resumes what another machine ran")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="--task chat: write the table, plots and docs section from this result JSON (run nothing)")
    p.add_argument("--cache-dir", default=None, help="warm-started model cache (default runs/bench_cache)")
    p.add_argument("--run-dir", default=None, help="per-run JSON cache (default runs/bench_learning/<mode>)")
    p.add_argument("--fresh", action="store_true", help="ignore cached runs")
    p.add_argument("--out-dir", default=str(bc.ROOT / "docs" / "benchmarks"), help="JSON and PNG output folder")
    p.add_argument("--write-docs", action="store_true", help="rewrite the learning section of docs/benchmarks.md")
    p.add_argument("--write-summary", action="store_true",
                   help="run nothing: rewrite the summary table of docs/benchmarks.md from the full-mode and agentic "
                   "results in --out-dir (learning_full.json or --section's JSON, and learning_agentic.json)")
    p.add_argument("--section", default=None,
                   help="name of the output files and of the docs/benchmarks.md section (default: by mode, e.g. "
                   "learning for --quick), so that a run of a few methods does not replace the mode's table")
    return p.parse_args(argv)


def _run_jobs(jobs: list[dict], workers: int) -> list[tuple[str, int, str]]:
    """Run the jobs (in ``workers`` spawned processes when > 1); returns the failures (method, seed, error)."""
    failed = []

    def report(method, seed, secs, err):
        print(f"  {method:24s} seed {seed}: {'FAILED ' + err if err else f'{secs:.0f}s'}", flush=True)
        if err:
            failed.append((method, seed, err))

    if workers > 1 and len(jobs) > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(min(workers, len(jobs)), maxtasksperchild=4) as pool:
            for result in pool.imap_unordered(_worker, jobs):
                report(*result)
    else:
        for job in jobs:
            report(*_worker(job))
    return failed


def _base_model_numbers(args, eval_size: int, real: bool) -> tuple[float, float, dict | None]:
    """Held-out greedy accuracy and sampled (T=1, 4 samples) pass rate of the model before training, and (real-model
    mode with ``--instruction auto``) the format-instruction pilot: each instruction's sampled pass rate on 64
    training problems (never the held-out ones); the best is written to ``args.instruction``."""
    from trl_plugins.tasks.arithmetic import FORMAT_INSTRUCTIONS, make_dataset
    from trl_plugins.tasks.tiny import evaluate_accuracy

    task = task_settings(real)
    pilot = None
    if real:
        import torch
        from transformers import AutoModelForCausalLM

        path, tokenizer = bc.load_real_model(args.device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
        if args.instruction == "auto":
            rates = {}
            for name in FORMAT_INSTRUCTIONS:
                dev = make_dataset(64, levels=task["levels"], seed=2, split="train", instruction=name)
                rates[name] = evaluate_accuracy(model, tokenizer, dev, max_new_tokens=task["max_completion_length"],
                                                temperature=1.0, num_samples=4)
            args.instruction = max(FORMAT_INSTRUCTIONS, key=lambda n: rates[n])
            pilot = {"sampled_pass_rate": rates, "chosen": args.instruction}
            print(f"format-instruction pilot (sampled pass rate on 64 training problems): {rates}; "
                  f"chosen {args.instruction!r}", flush=True)
    else:
        model, tokenizer = bc.load_model(args.cache_dir, untrained=args.tiny)
        args.instruction = None
    eval_set = make_dataset(eval_size, levels=task["levels"], seed=1, split="test", instruction=args.instruction)
    base_acc = evaluate_accuracy(model, tokenizer, eval_set, max_new_tokens=task["max_completion_length"])
    base_pass = evaluate_accuracy(model, tokenizer, eval_set, max_new_tokens=task["max_completion_length"],
                                  temperature=1.0, num_samples=4)
    return base_acc, base_pass, pilot


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_learning.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.write_summary:
        print(f"wrote {lt.write_summary(Path(args.out_dir), command.strip(), args.section or 'learning_full')}")
        return 0
    if args.task == "chat":
        import bench_chat

        args.workers_override = args.workers
        return bench_chat.main(args, command)
    args.workers = 2 if args.workers is None else args.workers
    start = time.perf_counter()
    info = bc.machine_info()
    real = args.model == "smollm2"
    agentic = args.task == "tools"
    if agentic and real:
        print("--task tools runs the tiny model only (the tool-use warm start is the tiny model's); "
              "drop --model smollm2", file=sys.stderr)
        return 2
    if real and args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if agentic and args.tiny:  # one step of 8 rollouts per method
        methods, budget, eval_every, eval_size, seeds = ["grpo", "igpo"], 8, 8, 4, args.seeds[:1]
        gain = 0.05
    elif agentic:
        t = ba.TOOL_TASK
        methods, budget, eval_every, eval_size, seeds = ba.AGENTIC_METHODS, t["budget"], t["eval_every"], \
            t["eval_size"], args.seeds
        gain = 0.20
    elif args.tiny:
        methods, budget, eval_every, eval_size, seeds = ["grpo", "hint_scaffold"], 16, 8, 8, args.seeds[:1]
        gain = 0.05
    elif real:
        methods, budget, eval_every, eval_size, seeds = lm.REAL_METHODS, 1536, 512, 128, args.seeds
        gain = 0.15
    elif args.quick:
        methods, budget, eval_every, eval_size, seeds = lm.QUICK_METHODS, 1920, 640, 128, args.seeds
        gain = 0.08
    else:
        methods, budget, eval_every, eval_size, seeds = lm.ALL_METHODS, 2560, 640, 128, args.seeds
        gain = 0.12
    tokens = args.budget_unit == "tokens"
    if tokens and (real or args.tiny or args.quick):
        print("--budget-unit tokens runs the full arithmetic mode or the agentic mode only (the tiny models, no "
              "--quick / --tiny / --model smollm2)", file=sys.stderr)
        return 2
    if tokens:
        methods, budget, eval_every = ((lm.TOOL_TOKEN_METHODS, TOOL_TOKEN_BUDGET, TOOL_TOKEN_EVAL_EVERY)
                                       if agentic else (lm.TOKEN_METHODS, TOKEN_BUDGET, TOKEN_EVAL_EVERY))
    methods = args.methods or methods
    budget = args.budget or budget
    eval_every = args.eval_every or eval_every
    eval_size = args.eval_size or eval_size
    mode = "tiny" if args.tiny else ("smollm2" if real else ("quick" if args.quick else "full"))
    if agentic:
        mode = "agentic_tiny" if args.tiny else "agentic"
    mode = (mode + "_tokens" if agentic else "tokens") if tokens else mode
    grpo_config = json.loads(args.grpo_config)
    if args.lr is not None:
        grpo_config["learning_rate"] = args.lr
    run_dir = Path(args.run_dir or bc.ROOT / "runs" / "bench_learning" / mode)
    run_dir.mkdir(parents=True, exist_ok=True)

    # the model's weights are part of a cached run's name: other weights re-run every method (set below, once the base
    # numbers have built or loaded the model)
    model_tag = ""

    def make_jobs(methods_: list[str], seeds_: list[int], config: dict) -> tuple[list[dict], list[dict]]:
        tag = "" if not config else "__" + "_".join(f"{k}={v}" for k, v in sorted(config.items()))
        tag += f"__{args.instruction}" if args.instruction else ""
        jobs_, cached = [], []
        for method in methods_:
            for seed in seeds_:
                unit = "__tokens" if tokens else ""
                path = run_dir / (f"{method}__s{seed}__b{budget}{unit}__e{eval_every}__n{eval_size}{tag}{model_tag}"
                                  ".json")
                if path.exists() and not args.fresh:
                    cached.append(json.loads(path.read_text()))
                    continue
                jobs_.append({"method": method, "seed": seed, "budget": budget, "eval_every": eval_every,
                              "eval_size": eval_size, "cache_dir": args.cache_dir, "path": str(path),
                              "grpo_config": config, "untrained": args.tiny, "model": args.model,
                              "device": args.device, "instruction": args.instruction, "task": args.task,
                              "unit": args.budget_unit})
        return jobs_, cached

    # base model numbers (shared by every run) and the model cache, built once before the workers start
    bc.set_threads(1)
    earlier = json.loads(Path(args.base_from).read_text()) if args.base_from else None
    if earlier:  # the numbers, machine and device of the run that made the cached runs
        info, args.device = earlier["machine"], earlier.get("device", args.device)
        base_acc, base_pass = earlier["base_accuracy"], earlier["base_pass_rate"]
        instruction_pilot, args.instruction = earlier.get("instruction_pilot"), earlier.get("instruction")
        base_tool = {k: earlier.get(f"base_{k}") for k in ("tool_use", "sampled_tool_use", "held_out_accuracy",
                                                           "held_out_tool_use")}
    elif agentic:
        base_tool = ba.base_numbers(args.cache_dir, eval_size, args.tiny,
                                    ba.grpo_fields(args.tiny)["max_completion_length"])
        base_acc, base_pass, instruction_pilot, args.instruction = base_tool["accuracy"], base_tool["pass_rate"], None, None
    else:
        base_acc, base_pass, instruction_pilot = _base_model_numbers(args, eval_size, real)
    if agentic and not args.tiny:
        model_tag = f"__w{bc.weights_sha256(ba.model_dir(args.cache_dir))}"
    elif not real and not args.tiny:
        model_tag = f"__w{bc.weights_sha256(bc.demo_model_dir(args.cache_dir))}"
    target = args.target if args.target is not None else round(base_acc + gain, 2)
    print(f"base {'seen-pair' if agentic else 'held-out'} greedy accuracy {base_acc:.3f}, sampled pass rate "
          f"{base_pass:.3f}, target {target:.2f}", flush=True)

    failed, pilot = [], None
    if real and args.pilot_lrs:
        pilot_jobs, pilot_records = [], []
        for lr in args.pilot_lrs:
            jobs_, cached = make_jobs(["grpo"], [0], {**grpo_config, "learning_rate": lr})
            pilot_jobs += jobs_
            pilot_records += cached
        print(f"learning-rate pilot (vanilla GRPO, seed 0): {args.pilot_lrs}", flush=True)
        failed += _run_jobs(pilot_jobs, args.workers)
        pilot_records += [json.loads(Path(j["path"]).read_text()) for j in pilot_jobs if Path(j["path"]).exists()]
        finals = {r["grpo_overrides"]["learning_rate"]: r["evals"][-1]["accuracy"] for r in pilot_records if r["evals"]}
        if finals:
            best = max(sorted(finals), key=lambda lr: finals[lr])
            grpo_config["learning_rate"] = best
            pilot = {"learning_rates": args.pilot_lrs, "final_accuracy": finals, "chosen": best}
            print(f"pilot final held-out accuracy {finals}; chosen learning rate {best}", flush=True)

    jobs, records = make_jobs(methods, seeds, grpo_config)
    if args.summarize_only:
        failed += [(j["method"], j["seed"], _run_error(Path(j["path"]))) for j in jobs]
        print(f"{len(records)} finished runs summarized, {len(jobs)} missing", flush=True)
        jobs = []
    print(f"{len(records)} cached runs, {len(jobs)} to run with {args.workers} workers", flush=True)
    failed += _run_jobs(jobs, args.workers)
    records += [json.loads(Path(j["path"]).read_text()) for j in jobs if Path(j["path"]).exists()]

    s = bc.demo_settings()
    summary = lt.summarize(records, base_acc, target)
    result = {
        "command": command.strip(), "quick": args.quick or args.tiny, "mode": mode, "machine": info,
        "seeds": seeds, "budget": budget, "budget_unit": args.budget_unit, "grpo_config": grpo_config,
        "eval_every": eval_every,
        "eval_size": eval_size, "target": target,
        "base_accuracy": base_acc, "base_pass_rate": base_pass, "workers": args.workers,
        "batch": s.per_device_train_batch_size, "num_generations": s.num_generations,
        "learning_rate": grpo_config.get("learning_rate", s.grpo_learning_rate),
        "wall_seconds": time.perf_counter() - start, "loadavg_end": bc.machine_info()["loadavg_1_5_15"],
        "summary": summary, "failed": failed, "runs": records,
        "warm_start_sha256": None if real or args.tiny else bc.weights_sha256(bc.demo_model_dir(args.cache_dir)),
    }
    if agentic:
        result.update(ba.result_fields(args.tiny), base_tool_use=base_tool["tool_use"],
                      tool_warm_start_sha256=None if args.tiny else bc.weights_sha256(ba.model_dir(args.cache_dir)),
                      base_sampled_tool_use=base_tool["sampled_tool_use"],
                      base_held_out_accuracy=base_tool["held_out_accuracy"],
                      base_held_out_tool_use=base_tool["held_out_tool_use"],
                      learning_rate=grpo_config.get("learning_rate", ba.grpo_fields(args.tiny)["learning_rate"]))
    if real:
        r = bc.REAL_MODEL_SETTINGS
        device_name = earlier["device_name"] if earlier else bc.device_name(args.device)
        result.update(model="builtin:smollm2 (SmolLM2-135M-Instruct) + LoRA", device=args.device,
                      device_name=device_name, batch=r["per_device_train_batch_size"],
                      num_generations=r["num_generations"], lora=r["lora"], levels=list(r["levels"]),
                      max_completion_length=r["max_completion_length"],
                      learning_rate=grpo_config.get("learning_rate", r["learning_rate"]), lr_pilot=pilot,
                      instruction=args.instruction, instruction_pilot=instruction_pilot)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = {"quick": "learning", "full": "learning_full", "tiny": "learning_tiny", "smollm2": "learning_smollm2",
              "agentic": "learning_agentic", "agentic_tiny": "learning_agentic_tiny", "tokens": "learning_tokens",
              "agentic_tokens": "learning_agentic_tokens"}[mode]
    prefix = result["section"] = args.section or prefix
    md = lt.markdown(result)
    print(md)
    (out_dir / f"{prefix}.json").write_text(json.dumps(result, default=float))
    if mode not in ("tiny", "agentic_tiny") and records:
        lt.plot(records, methods, out_dir, base_acc, target, prefix=prefix, unit=args.budget_unit)
    if args.write_docs:
        from bench_overhead import write_docs_section

        print(f"wrote {write_docs_section(prefix, md, result['command'])}")
    return 0 if not failed else 1



def _run_error(path: Path) -> str:
    """The last line of a failed run's traceback (``<run>.error``), or "not run"."""
    error = path.with_suffix(".error")
    if not error.exists():
        return "not run"
    lines = [line for line in error.read_text().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "failed"



if __name__ == "__main__":
    raise SystemExit(main())
