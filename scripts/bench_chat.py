"""Real-model learning benchmark with signal: builtin:smollm2 + LoRA on the bundled chat-arithmetic task.

Run through ``scripts/bench_learning.py --task chat`` (this module holds the mode; the methods' settings are
``scripts/learning_methods.py``'s, the analysis, table and plots ``scripts/learning_tables.py``'s). The model is
``builtin:smollm2`` (SmolLM2-135M-Instruct, converted offline); the task is :mod:`trl_plugins.tasks.chat_arith`
("What is 23 + 17? Reply with only the number.", lenient verifier), on which the untrained model already succeeds on
part of its samples, so vanilla GRPO has a signal.

* Equal rollout budget per run (policy rollouts counted at the generation backend, as in bench_learning); LoRA.
* Run cache: one JSON per run under ``--run-dir``, named by (method, seed, config hash, weights hash); the config hash
  covers the task, the GRPO fields, the budget, the evaluation, the device and the method's settings, the weights hash
  is the converted model's safetensors. An interrupted table resumes in a later session.
* Workers: the first run goes alone in its own process and its peak memory is measured (CUDA:
  ``torch.cuda.max_memory_reserved`` plus the process's CUDA context; CPU: peak RSS); then
  ``workers = floor(available * 0.8 / peak)``, capped by the CPU cores and the runs left. A resumed CPU table whose
  cached runs recorded their peaks uses the largest of them and sends no probe alone (a lone probe leaves a core idle
  for a whole run). Measurement and choice go
  into the result JSON. Every run is its own spawned process (on CUDA all of them share the one GPU).
* The untrained model's held-out accuracy (every run's first point: LoRA B = 0 is the base model) is measured once,
  by the probe run (or read from the run cache), and reused by the other runs (``from_run_cache`` in their first
  evaluation).
* ``--max-minutes``: runs still training at the deadline stop at their next step, are evaluated and recorded as
  truncated (not cached, so a resume re-runs them); runs not yet started are left out; results are written anyway.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import learning_methods as lm  # noqa: E402
import learning_tables as lt  # noqa: E402

# The task and GRPO settings of the mode (full size). 20 vanilla GRPO steps of 64 rollouts (8 prompts x G=8).
# Tuned so that the untrained model's sampled pass rate is between 10 % and 60 % (held-out problems, 4 samples each,
# 2026-11-27, CPU): operands up to 40 at T=1.0: 5.9 % of 256 (greedy: 28 % of 64); up to 40 at T=0.7: 10.9 % of 128;
# up to 20 at T=0.7: 14.8 % of 128. At T=1 with neither top-k nor top-p the 135M model often rambles off the question.
CHAT_TASK: dict = {
    "ops": ["+", "-"], "max_operand": 20, "max_multiplicand": 12, "train_size": 1024,
    "num_generations": 8, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 4,
    "max_completion_length": 16, "temperature": 0.7, "learning_rate": 2e-4, "budget": 1280, "eval_every": 320,
    "eval_size": 128,
}
# The loss runs in micro-batches of 16 (4 accumulation steps, one generation of 64 rollouts per optimizer step): with
# SmolLM2's 49k vocabulary, one micro-batch of 64 took about 14 GB on a CPU (the worker was killed for memory).
# --tiny: the plumbing only (one step of 8 rollouts, 8 held-out problems).
CHAT_TINY: dict = {"train_size": 32, "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                   "max_completion_length": 8, "budget": 8, "eval_every": 8, "eval_size": 8}
# Settings that differ from bench_learning's (bench_common.PLUGIN_SETTINGS / learning_methods.LEARNING_SETTINGS) on
# this task.
CHAT_PLUGIN_SETTINGS: dict[str, tuple[dict, dict]] = {
    # a reply is one step ("23 + 17 = 40", or just "40"): a failed reply's first step is wrong, so a repair keeps no
    # verified prefix; min_prefix_steps 0 lets SCOPE repair from scratch (the reference reply), LUFFY-style
    "scope": ({"mode": "reference_suffix", "prm": "programmatic", "min_prefix_steps": 0},
              {"scale_rewards": "none", "loss_type": "dr_grpo"}),
}
REWARD_METRIC = "rewards/chat_accuracy_reward/mean"
# How long past --max-minutes the runs still training may take to finish their step, evaluate and write their record
# before they are abandoned.
GRACE_SECONDS = 30


def settings(tiny: bool) -> dict:
    return {**CHAT_TASK, **(CHAT_TINY if tiny else {})}


def method_settings(method: str) -> tuple[list[str], dict, dict]:
    """Plugins, plugin options and GRPOConfig overrides of a method on this task."""
    plugins, options, overrides = lm.method_settings(method, real_model=True)
    for name in plugins:
        if name in CHAT_PLUGIN_SETTINGS:
            opts, over = CHAT_PLUGIN_SETTINGS[name]
            options[name] = {**options.get(name, {}), **opts}
            overrides.update(over)
    return plugins, options, overrides


def grpo_fields(task: dict, device: str) -> dict:
    return dict(num_generations=task["num_generations"], per_device_train_batch_size=task["per_device_train_batch_size"],
                gradient_accumulation_steps=task["gradient_accumulation_steps"],
                max_completion_length=task["max_completion_length"], temperature=task["temperature"],
                learning_rate=task["learning_rate"], use_cpu=device == "cpu", bf16=device == "cuda")


def rollouts_per_step(fields: dict) -> int:
    """Rollouts of one optimizer step: the micro-batch times the accumulation steps (one process)."""
    return fields["per_device_train_batch_size"] * fields.get("gradient_accumulation_steps", 1)


def config_hash(task: dict, device: str, method: str, grpo_config: dict) -> str:
    """Hash of everything a run's numbers depend on, but the seed and the weights."""
    plugins, options, overrides = method_settings(method)
    blob = json.dumps({"task": task, "device": device, "grpo": grpo_config, "lora": bc.REAL_MODEL_SETTINGS["lora"],
                       "plugins": plugins, "options": options, "overrides": overrides}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def weights_hash(model_path: str | Path) -> str:
    """First 16 hex digits of the SHA-256 of the model's safetensors files (sorted by name)."""
    h = hashlib.sha256()
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def datasets(task: dict, eval_size: int):
    from trl_plugins.tasks.chat_arith import make_chat_dataset

    kw = dict(ops=task["ops"], max_operand=task["max_operand"], max_multiplicand=task["max_multiplicand"])
    return (make_chat_dataset(task["train_size"], seed=0, split="train", **kw),
            make_chat_dataset(eval_size, seed=1, split="test", **kw))


def evaluate(model, tokenizer, rows: list[dict], max_new_tokens: int, temperature: float = 0.0,
             num_samples: int = 1) -> float:
    """Fraction of replies :func:`~trl_plugins.tasks.chat_arith.chat_accuracy_reward` accepts (greedy by default)."""
    from trl_plugins.tasks.chat_arith import chat_accuracy_reward
    from trl_plugins.tasks.tiny import generate_completions

    texts = generate_completions(model, tokenizer, [r["prompt"][-1]["content"] for r in rows], max_new_tokens,
                                 batch_size=128, temperature=temperature, num_samples=num_samples)
    per = [rows[i // num_samples] for i in range(len(texts))]
    return sum(chat_accuracy_reward(texts, [r["answer"] for r in per], [r["problem"] for r in per])) / len(texts)


# ------------------------------------------------------------------------------------------------ memory


def _cuda_used_mib() -> float:
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _processor(device: str) -> str:
    """The chip a run ran on (tables built over several sessions may mix machines): the GPU's name, or the CPU's model
    name from /proc/cpuinfo (with "AMX bf16" when it has those units)."""
    if device == "cuda":
        return bc.device_name(device)
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    return name + (" (AMX bf16)" if "amx_bf16" in info else "")


def _memory_record(device: str, used_before_mib: float | None) -> dict:
    """This process's peak memory. CUDA: the allocator's peak reservation plus the process's context (device memory
    in use now, less what was in use before this process started, less what the allocator holds now)."""
    if device == "cuda":
        import torch

        reserved = torch.cuda.memory_reserved() / 2**20
        peak_reserved = torch.cuda.max_memory_reserved() / 2**20
        rec = {"kind": "cuda", "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
               "max_memory_reserved_mib": round(peak_reserved, 1)}
        if used_before_mib is not None:  # only meaningful when this process is alone on the GPU (the probe)
            context = max(0.0, _cuda_used_mib() - used_before_mib - reserved)
            rec["context_mib"] = round(context, 1)
            rec["peak_mib"] = round(peak_reserved + context, 1)
        return rec
    return {"kind": "cpu", "peak_mib": round(bc.peak_rss_mib() or float("nan"), 1)}


def _available_mib(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def choose_workers(available_mib: float, peak_mib: float, cores: int, jobs_left: int, fraction: float = 0.8) -> int:
    """``floor(available * fraction / peak)``, capped by ``cores`` and ``jobs_left``, at least 1."""
    if not peak_mib > 0:
        raise ValueError(f"peak memory must be positive, got {peak_mib!r}")
    return max(1, min(math.floor(available_mib * fraction / peak_mib), cores, max(1, jobs_left)))


# ------------------------------------------------------------------------------------------------ one run


def run_chat(job: dict) -> dict:
    """Train one (method, seed) to the rollout budget (or the deadline); write and return its record."""
    import torch
    from transformers import AutoTokenizer

    from trl_plugins.cli.equal_budget import EqualBudget, count_policy_rollouts, merge_logs
    from trl_plugins.tasks.chat_arith import chat_accuracy_reward

    device, task, budget = job["device"], job["task"], job["budget"]
    torch.set_num_threads(job.get("threads", 1))
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    tokenizer = AutoTokenizer.from_pretrained(job["model_path"])
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_set, eval_set = datasets(task, job["eval_size"])
    eval_rows = list(eval_set)
    plugins, options, overrides = method_settings(job["method"])
    overrides = {**grpo_fields(task, device), **job.get("grpo_config", {}), **overrides}
    # rollouts per optimizer step: one generation batch (steps_per_generation defaults to the accumulation steps)
    batch, G = rollouts_per_step(overrides), overrides["num_generations"]
    teacher_slots = options.get("luffy", {}).get("num_demonstrations", 1) if "luffy" in plugins else 0
    max_steps = math.ceil(budget / (batch * (G - teacher_slots) / G))
    out_dir = tempfile.mkdtemp(prefix="bench_chat_")
    trainer = bc.make_trainer("plugin", job["model_path"], tokenizer, train_set, [chat_accuracy_reward], out_dir,
                              plugins=plugins, plugin_config=options, seed=job["seed"], max_steps=max_steps,
                              peft_config=bc.real_model_lora(), **overrides)
    counts = count_policy_rollouts(trainer)
    pending: dict = {}
    lm.record_rewards(trainer, pending, G, lambda completions, rows: chat_accuracy_reward(
        completions, [r["answer"] for r in rows], [r["problem"] for r in rows]))
    evals: list[dict] = []
    max_new = task["max_completion_length"]

    def run_eval(step: int) -> None:
        state = torch.get_rng_state()
        evals.append({"step": step, "rollouts": counts["rollouts"],
                      "accuracy": evaluate(trainer.model, tokenizer, eval_rows, max_new)})
        torch.set_rng_state(state)

    budget_cb = EqualBudget(counts, budget, job["eval_every"], lambda step, spent: run_eval(step), pending=pending,
                            deadline=job.get("deadline"))
    trainer.add_callback(budget_cb)
    t0, c0 = time.perf_counter(), time.process_time()
    if job.get("base_accuracy") is not None:  # the untrained model (LoRA B = 0 is the base model), measured once
        evals.append({"step": 0, "rollouts": 0, "accuracy": job["base_accuracy"], "from_run_cache": True})
    else:
        run_eval(0)  # every run's first point
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    extra = {}
    if job.get("base_pass_rate"):  # the untrained model's sampled pass rate, measured once (by the probe run)
        with trainer.model.disable_adapter():
            extra["base_pass_rate"] = evaluate(trainer.model, tokenizer, eval_rows, max_new,
                                               temperature=overrides["temperature"], num_samples=4)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    per_step = merge_logs(budget_cb.per_step, trainer.state.log_history)
    record = {
        "method": job["method"], "seed": job["seed"], "budget": budget, "plugins": plugins, "plugin_config": options,
        "model": "smollm2", "task": "chat", "claim_metrics": {p.name: list(p.claim_metric) for p in
                                                              trainer.plugin_stack if p.claim_metric},
        "grpo_overrides": overrides, "steps": trainer.state.global_step, "rollouts": counts["rollouts"],
        "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1), "evals": evals, "per_step": per_step,
        "truncated": budget_cb.truncated, "memory": _memory_record(device, job.get("gpu_used_before_mib")),
        "config_hash": job["config_hash"], "weights_sha256": job["weights_sha256"],
        "processor": _processor(device), "date": time.strftime("%Y-%m-%d"), **extra,
    }
    path = Path(job["path"])
    if budget_cb.truncated:  # never a cached finished run: a resume re-runs it
        path = path.with_suffix(".partial.json")
    path.write_text(json.dumps(record, default=float))
    return record


def _worker(job: dict) -> tuple[dict, dict | None, str | None]:
    if job.get("deadline") is not None and time.time() >= job["deadline"]:
        return job, None, "not started: --max-minutes reached"
    try:
        return job, run_chat(job), None
    except Exception as exc:  # reported; the table lists the run as failed
        import traceback

        Path(job["path"]).with_suffix(".error").write_text(traceback.format_exc())
        return job, None, f"{type(exc).__name__}: {exc}"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _run_pool(jobs: list[dict], workers: int, deadline: float | None) -> tuple[list[dict], list[tuple]]:
    """Run ``jobs``, each in its own spawned process, ``workers`` at a time; stop waiting GRACE_SECONDS after ``deadline``
    (the pool is then terminated). Returns (records, failures)."""
    records, failed = [], []
    if deadline is not None and time.time() >= deadline:
        return records, [(j["method"], j["seed"], "not started: --max-minutes reached") for j in jobs]
    if not jobs:
        return records, failed
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(min(workers, len(jobs)), maxtasksperchild=1)  # a fresh process per run: its own peak memory
    # `kill PID` of this process stops its workers too (the finally below), as Ctrl-C does: a worker left running
    # would train on, unseen, beside the runs of the next invocation
    on_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        it = pool.imap_unordered(_worker, jobs)
        for _ in jobs:
            timeout = None if deadline is None else max(1.0, deadline + GRACE_SECONDS - time.time())
            try:
                job, rec, err = it.next(timeout=timeout)
            except (mp.TimeoutError, queue.Empty, StopIteration):
                print("  deadline passed: the runs still going are abandoned", flush=True)
                break
            label = f"  {job['method']:18s} seed {job['seed']}: "
            if err:
                failed.append((job["method"], job["seed"], err))
                print(label + "FAILED " + err, flush=True)
            else:
                records.append(rec)
                mem = rec["memory"].get("peak_mib") or rec["memory"].get("max_memory_reserved_mib")
                print(label + f"{rec['seconds']:.0f}s, {rec['steps']} steps, final acc "
                      f"{rec['evals'][-1]['accuracy']:.3f}{' (truncated)' if rec['truncated'] else ''}, "
                      f"peak {mem} MiB", flush=True)
    finally:
        pool.terminate()
        pool.join()
        signal.signal(signal.SIGTERM, on_term)
    done = {(r["method"], r["seed"]) for r in records} | {(m, s) for m, s, _ in failed}
    failed += [(j["method"], j["seed"], "not finished by the deadline") for j in jobs
               if (j["method"], j["seed"]) not in done]
    return records, failed


# ------------------------------------------------------------------------------------------------ main


def main(args, command: str) -> int:
    """The chat mode of bench_learning (``args`` from its parser)."""
    start = time.perf_counter()
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        return _write_outputs(result, args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    task = settings(args.tiny)
    grpo_config = json.loads(args.grpo_config)
    if args.lr is not None:
        grpo_config["learning_rate"] = args.lr
    methods = args.methods or (["grpo", "scope"] if args.tiny else lm.CHAT_METHODS)
    seeds = args.seeds[:1] if args.tiny and args.seeds == [0, 1, 2] else args.seeds
    budget = args.budget or task["budget"]
    eval_every = args.eval_every or task["eval_every"]
    eval_size = args.eval_size or task["eval_size"]
    task = {**task, "budget": budget, "eval_every": eval_every, "eval_size": eval_size}
    if args.model_path:
        model_path = args.model_path
    else:
        from trl_plugins.runtime.models import smollm2_path

        model_path = str(smollm2_path())
    weights = weights_hash(model_path)
    mode = "smollm2_chat_tiny" if args.tiny else "smollm2_chat"
    run_dir = Path(args.run_dir or bc.ROOT / "runs" / "bench_learning" / mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1

    base_path = run_dir / f"base__c{config_hash(task, args.device, 'grpo', grpo_config)}__w{weights[:12]}.json"
    for earlier in args.cache_from or []:  # finished runs of earlier result JSONs (another machine) into the cache
        n, data = 0, json.loads(Path(earlier).read_text())
        same = (data["weights_sha256"], data["task_settings"], data["device"], data["grpo_config"]) == (
            weights, task, args.device, grpo_config)
        if same and data["base_pass_rate"] == data["base_pass_rate"]:  # its untrained-model numbers (not NaN)
            base_path.write_text(json.dumps({k: data[k] for k in ("base_accuracy", "base_pass_rate")}))
        for r in data["runs"]:
            if not r.get("truncated") and r.get("weights_sha256") == weights:
                path = run_dir / f"{r['method']}__s{r['seed']}__c{r['config_hash']}__w{weights[:12]}.json"
                path.write_text(json.dumps(r, default=float))
                n += 1
        print(f"{n} finished runs of {earlier} put into the run cache", flush=True)

    jobs, records = [], []
    # seed-major: every method's first seed runs before any second seed, so a run cut by --max-minutes still has
    # every method
    for seed in seeds:
        for method in methods:
            chash = config_hash(task, args.device, method, grpo_config)
            path = run_dir / f"{method}__s{seed}__c{chash}__w{weights[:12]}.json"
            if path.exists() and not args.fresh:
                records.append(json.loads(path.read_text()))
                continue
            jobs.append({"method": method, "seed": seed, "budget": budget, "eval_every": eval_every,
                         "eval_size": eval_size, "device": args.device, "task": task, "grpo_config": grpo_config,
                         "model_path": model_path, "path": str(path), "deadline": deadline,
                         "config_hash": chash, "weights_sha256": weights})
    base = json.loads(base_path.read_text()) if base_path.exists() and not args.fresh else None
    print(f"chat mode on {args.device}: {len(methods)} methods x {len(seeds)} seeds, budget {budget}; "
          f"{len(records)} cached runs, {len(jobs)} to run", flush=True)

    failed: list[tuple] = []
    memory = {"probe": None, "available_mib": None, "fraction": 0.8, "cores": cores}
    cached_peaks = [r["memory"]["peak_mib"] for r in records if r.get("memory", {}).get("peak_mib")]
    if jobs and args.device == "cpu" and base is not None and cached_peaks:
        # a resumed CPU table: the cached runs' peaks are measurements of the same runs, so no probe goes alone
        memory["probe"] = {"kind": "cpu", "peak_mib": max(cached_peaks), "from_cached_runs": len(cached_peaks)}
        available = _available_mib(args.device)
        workers = args.workers_override or choose_workers(available, max(cached_peaks), cores, len(jobs))
        memory.update(available_mib=round(available, 1), peak_used_mib=max(cached_peaks), workers=workers,
                      rule="floor(available * 0.8 / peak), capped by cores and runs left"
                      + (" (overridden by --workers)" if args.workers_override else ""))
        threads = max(1, cores // workers)
        print(f"largest peak of the {len(cached_peaks)} cached runs {max(cached_peaks):.0f} MiB, {available:.0f} MiB "
              f"available, {cores} cores -> {workers} workers ({threads} torch threads each); no probe run",
              flush=True)
        recs, fails = _run_pool([{**j, "threads": threads, "base_accuracy": base["base_accuracy"]} for j in jobs],
                                workers, deadline)
        records += recs
        failed += fails
    elif jobs:
        # 1. the probe: the first run alone (and the untrained model's sampled pass rate when not cached)
        probe = {**jobs[0], "threads": cores if args.device == "cpu" else 1, "base_pass_rate": base is None,
                 "base_accuracy": None if base is None else base["base_accuracy"]}
        if args.device == "cuda":
            probe["gpu_used_before_mib"] = _cuda_used_mib()  # initialises CUDA here; measured before the probe
        print(f"probe run ({probe['method']} seed {probe['seed']}) alone to measure its peak memory", flush=True)
        recs, fails = _run_pool([probe], 1, deadline)
        records += recs
        failed += fails
        peaks = [r["memory"]["peak_mib"] for r in records if r.get("memory", {}).get("peak_mib")]
        if recs:
            memory["probe"] = recs[0]["memory"]
            if "base_pass_rate" in recs[0]:
                base = {"base_pass_rate": recs[0]["base_pass_rate"], "base_accuracy": recs[0]["evals"][0]["accuracy"]}
                base_path.write_text(json.dumps(base))
        rest = jobs[1:]
        if rest and peaks:
            available = _available_mib(args.device)
            workers = args.workers_override or choose_workers(available, max(peaks), cores, len(rest))
            memory.update(available_mib=round(available, 1), peak_used_mib=max(peaks), workers=workers,
                          rule="floor(available * 0.8 / peak), capped by cores and runs left"
                          + (" (overridden by --workers)" if args.workers_override else ""))
            threads = max(1, cores // workers) if args.device == "cpu" else 1
            print(f"peak {max(peaks):.0f} MiB per run, {available:.0f} MiB available, {cores} cores -> "
                  f"{workers} workers ({threads} torch threads each)", flush=True)
            base_accuracy = None if base is None else base["base_accuracy"]
            recs, fails = _run_pool([{**j, "threads": threads, "base_accuracy": base_accuracy} for j in rest], workers,
                                    deadline)
            records += recs
            failed += fails
        elif rest:
            why = "not started: --max-minutes reached" if deadline is not None and time.time() >= deadline else \
                "not run: the probe run failed"
            failed += [(j["method"], j["seed"], why) for j in rest]
    if base is None:
        base = {"base_pass_rate": float("nan"),
                "base_accuracy": next((r["evals"][0]["accuracy"] for r in records if r["evals"]), float("nan"))}

    # per-run peaks, so a reader can check the choice: worst run's peak x workers against what was available
    # (CUDA: a run's peak reservation plus the probe's context overhead)
    context = (memory.get("probe") or {}).get("context_mib", 0.0)
    run_peaks = [r["memory"].get("peak_mib") or r["memory"]["max_memory_reserved_mib"] + context
                 for r in records if r.get("memory")]
    memory["max_run_peak_mib"] = max(run_peaks) if run_peaks else None
    target = args.target if args.target is not None else round(base["base_accuracy"] + 0.15, 2)
    result = {
        "command": command.strip(), "mode": mode, "task": "chat", "quick": args.tiny, "machine": bc.machine_info(),
        "device": args.device, "device_name": bc.device_name(args.device) if records or args.device == "cpu" else "",
        "model": "builtin:smollm2 (SmolLM2-135M-Instruct) + LoRA", "model_path": model_path,
        "weights_sha256": weights, "lora": bc.REAL_MODEL_SETTINGS["lora"], "task_settings": task,
        "seeds": seeds, "methods": methods, "budget": budget, "eval_every": eval_every, "eval_size": eval_size,
        "batch": rollouts_per_step({**task, **grpo_config}), "num_generations": task["num_generations"],
        "max_completion_length": task["max_completion_length"], "grpo_config": grpo_config,
        "learning_rate": grpo_config.get("learning_rate", task["learning_rate"]), "target": target,
        "base_accuracy": base["base_accuracy"], "base_pass_rate": base["base_pass_rate"], "memory": memory,
        "workers": memory.get("workers", 1), "max_minutes": args.max_minutes,
        "wall_seconds": time.perf_counter() - start, "failed": failed, "runs": records,
        "truncated_runs": [(r["method"], r["seed"], r["steps"]) for r in records if r.get("truncated")],
    }
    return _write_outputs(result, args, failed)


def finished_runs(result: dict) -> list[dict]:
    """The runs that spent their whole budget: a run cut short by --max-minutes is listed, never averaged in."""
    return [r for r in result["runs"] if not r.get("truncated")]


def header(result: dict) -> str:
    t, mem = result["task_settings"], result.get("memory") or {}
    probe = mem.get("probe") or {}
    kind = "CUDA reserved + context" if probe.get("kind") == "cuda" else "RSS"
    measured = (f"the largest peak of the {probe['from_cached_runs']} runs cached before this invocation was"
                if probe.get("from_cached_runs") else "the probe run alone peaked at")
    mem_text = "" if not probe else (
        f" Workers: {measured} {probe.get('peak_mib')} MiB ({kind}), "
        f"{mem.get('available_mib')} MiB available, {mem.get('cores')} cores -> {result['workers']} workers "
        f"(floor(available x 0.8 / peak), capped by cores and runs left); the largest peak of any run was "
        f"{mem.get('max_run_peak_mib')} MiB." if mem.get("available_mib") is not None else
        f" Peak memory of the one run: {probe.get('peak_mib')} MiB ({kind}).")
    cut = result.get("truncated_runs") or []
    cut_text = (" Cut short by --max-minutes (fewer rollouts than the budget: not comparable, left out of the table "
                "and the plots): "
                + ", ".join(f"{m} seed {s} ({n} steps)" for m, s, n in cut) + "." if cut else "")
    made = sorted({(r.get("processor"), r.get("date")) for r in finished_runs(result) if r.get("processor")})
    made_text = (" Finished runs made on: " + "; ".join(
        f"{chip}, {date} ({sum(1 for r in finished_runs(result) if (r.get('processor'), r.get('date')) == (chip, date))})"
        for chip, date in made) + "." if made else "")
    return (
        f"Chat mode: {result['model']} (rank {result['lora']['r']}, all attention and MLP projections) on the bundled "
        f"chat-arithmetic task (`trl_plugins.tasks.chat_arith`: \"What is a {' / '.join(t['ops'])} b? Reply with "
        f"only the number.\", operands up to {t['max_operand']}; lenient verifier: the right number among the reply's "
        f"first words, no other number but the operands), on {result['device_name']} (weights sha256 "
        f"{result['weights_sha256']}). Seeds {result['seeds']}, rollout budget {result['budget']} per run "
        f"({result['budget'] // result['batch']} vanilla GRPO steps of {result['batch']} rollouts, G="
        f"{result['num_generations']}, at most {result['max_completion_length']} completion tokens, learning rate "
        f"{result['learning_rate']:g}), held-out greedy accuracy on {result['eval_size']} test problems every "
        f"{result['eval_every']} rollouts. Before RL: held-out greedy accuracy {result['base_accuracy']:.3f}, sampled "
        f"pass rate (T={result['task_settings']['temperature']:g}, GRPO's sampling temperature; 4 samples per problem) "
        f"{result['base_pass_rate']:.3f}. Target accuracy: "
        f"{result['target']:.2f}. {len(finished_runs(result))} finished runs; this invocation took "
        f"{result['wall_seconds'] / 60:.1f} min.{made_text}{mem_text}{cut_text}"
    )


def _write_outputs(result: dict, args, failed: list | None = None) -> int:
    finished = finished_runs(result)
    result["summary"] = lt.summarize(finished, result["base_accuracy"], result["target"])
    result["header"] = header(result)
    prefix = result["section"] = args.section or f"learning_{result['mode']}"
    md = lt.markdown(result)
    print(md)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{prefix}.json").write_text(json.dumps(result, default=float))
    (out_dir / f"{prefix}.md").write_text(f"Command: `{result['command']}`\n\n{md}\n")
    if finished:
        lt.plot(finished, result["methods"], out_dir, result["base_accuracy"], result["target"], prefix=prefix)
    if args.write_docs:
        from bench_overhead import write_docs_section

        print(f"wrote {write_docs_section(prefix, md, result['command'])}")
    return 0 if not (failed if failed is not None else result.get("failed")) else 1
