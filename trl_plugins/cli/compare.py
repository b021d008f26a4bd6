"""``trl-plugins compare``: which plugin stack helps on *your* task, at the same budget of policy rollouts?

    trl-plugins compare config.yaml --stacks grpo scope lp_reg,canon --seeds 3 --rollouts 2560
    trl-plugins compare --demo                      # the bundled task and tiny model, a few minutes on a CPU

Each stack (``grpo`` = no plugins; plugins joined by ``,`` or ``+``) is trained from the same YAML ``trl-plugins
train`` takes (model, dataset, rewards, every GRPOConfig field; ``plugins`` is replaced by the stack, its
``plugin_config`` entries are kept for the stack's plugins) once per seed, each run stopping when it has generated
``--rollouts`` policy rollouts (TRL's generation plus every extra or refill rollout a plugin asks for:
:mod:`trl_plugins.cli.equal_budget`). Every ``--eval-every`` rollouts the policy is scored on held-out prompts: greedy
completions scored by ``--eval-metric`` (default: the config's first reward function, the verifier) on the dataset's
``--eval-split`` when it has one, else on ``--eval-size`` rows held out from the training split (not trained on).

Written to ``--output-dir``: ``compare.md`` (the table: score mean ± std per stack, difference to the first stack,
rollouts to reach ``--target``, optimizer steps, wall time, each plugin's claim metric), ``compare.json`` (the table
and every run's evaluations and per-step metrics), ``score.png`` (held-out score against rollouts) and
``entropy.png``. Finished runs are kept under ``runs/`` and not redone when the command is run again (``--fresh``
redoes them), so an interrupted comparison resumes; a run's key holds a hash of the whole config and the evaluation
settings, so an edited config is trained again. Configs with ``tools`` / ``environment_factory`` run them exactly as
``trl-plugins train`` does (one builder, :func:`trl_plugins.cli.train.build_trainer`); their held-out score comes from
rollouts with the tools (TRL's evaluation, sampled as in training), scored by the run's own reward function.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from trl_plugins.cli.equal_budget import (
    EqualBudget,
    count_policy_rollouts,
    fmt_mean_std,
    held_out_score,
    mean_std,
    merge_logs,
    rollouts_to_target,
    run_mean,
)
from trl_plugins.api.errors import PluginConfigError

DEMO_STACKS = ["grpo", "hint_scaffold,lp_reg"]


def parse_stack(text: str) -> list[str]:
    """``"grpo"`` -> ``[]``; ``"lp_reg,canon"`` or ``"lp_reg+canon"`` -> ``["lp_reg", "canon"]``."""
    names = [n.strip() for n in text.replace("+", ",").split(",") if n.strip()]
    if not names:
        raise PluginConfigError(f"Empty stack {text!r}; give plugin names joined by ',' or 'grpo' for no plugins.")
    return [] if names == ["grpo"] else names


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trl-plugins compare`` (also rendered in ``docs/configuration.md``)."""
    p = argparse.ArgumentParser(prog="trl-plugins compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="The YAML file of `trl-plugins train` (not with --demo).")
    p.add_argument("--demo", action="store_true", help="The bundled task: warm-started tiny model, arithmetic "
                   f"problems, exact verifier; default stacks {' '.join(DEMO_STACKS)}.")
    p.add_argument("--stacks", nargs="+", default=None, help="Stacks to compare: 'grpo' (no plugins) or plugin "
                   "names joined by ',' (default with --demo: %s)." % " ".join(DEMO_STACKS))
    p.add_argument("--seeds", type=int, default=None, help="Runs per stack, seeds 0..N-1 (default 3; --demo 2).")
    p.add_argument("--rollouts", type=int, default=None, help="Policy rollouts per run (default: the rollouts of 40 "
                   "vanilla GRPO steps; --demo: of 10).")
    p.add_argument("--eval-every", type=int, default=None, help="Rollouts between held-out evaluations "
                   "(default: a quarter of --rollouts).")
    p.add_argument("--eval-size", type=int, default=64, help="Held-out prompts (default %(default)s).")
    p.add_argument("--eval-split", default="test", help="Dataset split to evaluate on when the dataset has it "
                   "(default %(default)s); otherwise --eval-size rows are held out of the training split.")
    p.add_argument("--eval-metric", default=None, help="Reward function scoring the held-out greedy completions: "
                   "'accuracy' or a dotted path (default: the config's first reward function).")
    p.add_argument("--target", type=float, default=None, help="Held-out score whose rollouts-to-reach is reported "
                   "(default: the score before training + 0.05).")
    p.add_argument("--output-dir", default="runs/compare", help="Where the table, plots, JSON and runs go.")
    p.add_argument("--fresh", action="store_true", help="Redo finished runs instead of reusing them.")
    p.add_argument("--verbose", action="store_true", help="Print every step's whole metrics dict.")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.demo == bool(args.config):
        p.error("give a config file or --demo (one of the two)")
    for flag, value in (("--seeds", args.seeds), ("--rollouts", args.rollouts), ("--eval-every", args.eval_every),
                        ("--eval-size", args.eval_size)):
        if value is not None and value < 1:  # 0 used to mean "the default", silently
            raise PluginConfigError(f"{flag} must be an integer >= 1 (leave it out for the default); got {value}.")
    if args.target is not None and not math.isfinite(args.target):
        raise PluginConfigError(f"--target must be a finite number; got {args.target}.")
    return args


def config_key(base: dict, args: argparse.Namespace) -> str:
    """Short hash of everything a finished run depends on besides its stack, seed and budget: the whole config
    file and the evaluation settings. Part of every run's resume key, so an edited config is trained again instead
    of reusing runs of the old one."""
    payload = {"config": base, "eval_split": args.eval_split, "eval_metric": args.eval_metric}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:10]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_record(path: Path) -> dict | None:
    """A finished run's record, or None (with a warning) when the file is damaged: that run is redone."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        warnings.warn(f"Run record {path} cannot be read ({exc}); the run is done again.", stacklevel=2)
        return None
    if not isinstance(record, dict) or "evals" not in record:
        warnings.warn(f"Run record {path} is not a run record; the run is done again.", stacklevel=2)
        return None
    return record


# ------------------------------------------------------------------------------------------------ configuration
def demo_config(out: Path) -> dict:
    """The bundled task as a `trl-plugins train` mapping (the demo's tuned GRPO settings)."""
    from trl_plugins.tasks.tiny import DemoSettings

    s = DemoSettings()
    fields = s.grpo_config_fields(str(out), seed=0)
    fields = {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, list)) or v is None}
    return {"model_name_or_path": "builtin:tiny", "dataset_name": "builtin:arithmetic", "reward_funcs": ["accuracy"],
            "task_levels": list(s.levels), "task_size": s.train_size, **fields}


def run_config(base: dict, plugins: list[str], seed: int, output_dir: Path, max_steps: int) -> dict:
    """The YAML mapping of one run: the stack's plugins and their options from ``base``, the seed, the budget."""
    options = {name: opts for name, opts in (base.get("plugin_config") or {}).items() if name in plugins}
    config = {k: v for k, v in base.items() if k not in ("plugins", "plugin_config")}
    config.update(plugins=plugins, plugin_config=options, seed=seed, output_dir=str(output_dir), max_steps=max_steps,
                  save_strategy="no", report_to=base.get("report_to", "none"))
    return config


def check_run_config(base: dict, out: Path) -> Any:
    """The training arguments of ``base`` as ``trl-plugins train`` parses them (a :class:`PluginConfigError` for a
    wrong-typed or invalid field, an unknown key, a reward function, tool or environment factory that does not import
    ...), checked before the first run."""
    import tempfile

    import yaml
    from trl import ModelConfig, TrlParser

    from trl_plugins.runtime.config import PluginGRPOConfig
    from trl_plugins.cli.train import TrainScriptArguments, parse_config

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".check-", dir=out) as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(run_config(base, [], 0, Path(tmp) / "run", 1)))
        parser = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig))
        script_args, training_args, _ = parse_config(parser, ["--config", str(path)])
    from trl_plugins.cli.train import load_environment_factory, load_reward_funcs, load_tools

    # what `trl-plugins train` checks before the model loads: reward names, tools, the environment factory
    load_reward_funcs(script_args.reward_funcs)
    load_tools(script_args.tools)
    load_environment_factory(script_args.environment_factory)
    return training_args


def build_run(config_path: Path) -> tuple[Any, Any, Any]:
    """``(trainer, script_args, training_args)`` of one run, built by ``trl-plugins train``'s own
    :func:`~trl_plugins.cli.train.build_trainer` (reward functions, ``tools``, ``environment_factory``, dataset, model,
    tool-calling template)."""
    from trl import ModelConfig, TrlParser

    from trl_plugins.runtime.config import PluginGRPOConfig
    from trl_plugins.cli.train import TrainScriptArguments, build_trainer, parse_config

    parser = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parse_config(parser, ["--config", str(config_path)])
    return build_trainer(script_args, training_args, model_args), script_args, training_args


def uses_tools(trainer: Any) -> bool:
    """Whether the run's rollouts are multi-turn tool episodes (TRL ``tools`` / ``environment_factory``)."""
    return bool(getattr(trainer, "tools", None)) or getattr(trainer, "environment_factories", None) is not None


def tool_held_out_score(trainer: Any, held: Any, metric: Any) -> float:
    """Mean of the reward function ``metric`` (one of the run's own) over rollouts of the held-out rows generated as
    training generates them -- TRL's evaluation, so the tool loop, the environments and the tool guard run exactly as in
    ``trl-plugins train``. Each row gets ``num_generations_eval`` rollouts (the eval batch is made one group, so any
    ``per_device_eval_batch_size`` works); they are sampled as in training, not greedy."""
    names = list(trainer.reward_func_names)
    name = getattr(metric, "__name__", None)
    if name not in names:
        raise PluginConfigError(
            f"--eval-metric {name!r}: with tools / environment_factory the held-out rollouts are scored by the run's "
            f"own reward functions; choose one of {names}."
        )
    args = trainer.args
    saved, training = args.per_device_eval_batch_size, trainer.model.training
    control = getattr(trainer, "control", None)
    flags = None if control is None else (control.should_log, control.should_evaluate, control.should_save)
    args.per_device_eval_batch_size = trainer.num_generations_eval  # whole groups on every process
    try:
        metrics = trainer.evaluate(eval_dataset=held)
    finally:
        args.per_device_eval_batch_size = saved
        # called between steps (EqualBudget.on_step_end): the step's own log still follows, as a training log
        trainer.model.train(training)
        if flags is not None:
            trainer.control.should_log, trainer.control.should_evaluate, trainer.control.should_save = flags
    return float(metrics[f"eval_rewards/{name}/mean"])


def split_held_out(script_args: Any, train_dataset: Any, eval_split: str, eval_size: int) -> tuple[Any, Any, str]:
    """``(train dataset, held-out dataset, where it came from)``: the bundled tasks' test split, the dataset's
    ``eval_split``, or the last ``eval_size`` rows of the training split (removed from training)."""
    if script_args.dataset_name == "builtin:arithmetic":
        from trl_plugins.tasks.arithmetic import make_dataset

        held = make_dataset(eval_size, levels=tuple(script_args.task_levels), seed=1, split="test")
        return train_dataset, held, "the bundled tasks' test split"
    if script_args.dataset_name == "builtin:tools":
        import json as _json

        from trl_plugins.tasks.tools import make_tool_dataset

        seen = {_json.dumps(p, sort_keys=True) for p in train_dataset["prompt"]}
        drawn = make_tool_dataset(4 * eval_size + 8, seed=1)  # another draw; questions trained on are left out
        keep = [i for i, p in enumerate(drawn["prompt"]) if _json.dumps(p, sort_keys=True) not in seen][:eval_size]
        if not keep:
            raise PluginConfigError("builtin:tools: no held-out question differs from the training questions.")
        return train_dataset, drawn.select(keep), "bundled tool questions of another draw (none trained on)"
    from datasets import load_dataset

    try:
        held = load_dataset(script_args.dataset_name, name=script_args.dataset_config, split=eval_split)
        return train_dataset, held.select(range(min(eval_size, len(held)))), f"split {eval_split!r}"
    except (ValueError, KeyError):
        if len(train_dataset) <= eval_size:
            raise PluginConfigError(
                f"Dataset {script_args.dataset_name!r} has no split {eval_split!r} and only {len(train_dataset)} "
                f"training rows, too few to hold out --eval-size {eval_size}."
            ) from None
        n = len(train_dataset) - eval_size
        return (train_dataset.select(range(n)), train_dataset.select(range(n, len(train_dataset))),
                f"the last {eval_size} rows of the training split (not trained on)")


# ------------------------------------------------------------------------------------------------ one run
def run_one(config_path: Path, budget: int, eval_every: int, args: argparse.Namespace, base_path: Path) -> dict:
    """Train one (stack, seed) to the rollout budget, evaluating on held-out data; returns its record."""
    from trl_plugins.cli.console import install
    from trl_plugins.cli.train import load_reward_funcs

    trainer, script_args, training_args = build_run(config_path)
    train, held, source = split_held_out(script_args, trainer.train_dataset, args.eval_split, args.eval_size)
    trainer.train_dataset = train
    metric_name = args.eval_metric or script_args.reward_funcs[0]
    (metric,) = load_reward_funcs([metric_name])
    tokenizer = trainer.processing_class

    tools = uses_tools(trainer)
    if tools:
        source += "; rollouts with the run's tools, scored as training scores them"

    def score() -> float:
        import torch

        state = torch.get_rng_state()
        if tools:  # multi-turn: TRL's own evaluation runs the tool loop exactly as training does
            value = tool_held_out_score(trainer, held, metric)
        else:
            value = held_out_score(trainer.model, tokenizer, held, metric, training_args.max_completion_length)
        torch.set_rng_state(state)
        return value

    if not base_path.exists():  # every run starts from the same model: its score before training, once
        write_atomically(base_path, json.dumps({"score": score(), "metric": metric_name, "held_out": source}))
    evals: list[dict] = []
    counts = count_policy_rollouts(trainer)
    budget_cb = EqualBudget(counts, budget, eval_every,
                            lambda step, rollouts: evals.append({"step": step, "rollouts": rollouts, "score": score()}))
    trainer.add_callback(budget_cb)
    plugins = [p.name for p in trainer.plugin_stack]
    install(trainer, verbose=args.verbose, desc=f"{'+'.join(plugins) or 'grpo'} seed {training_args.seed}",
            summary=False, leave=False)
    start = time.perf_counter()
    trainer.train()
    return {
        "plugins": plugins, "seed": training_args.seed, "budget": budget, "rollouts": counts["rollouts"],
        "steps": trainer.state.global_step, "seconds": round(time.perf_counter() - start, 1), "evals": evals,
        "per_step": merge_logs(budget_cb.per_step, trainer.state.log_history),
        "claim_metrics": {p.name: list(p.claim_metric) for p in trainer.plugin_stack if p.claim_metric},
    }


# ------------------------------------------------------------------------------------------------ report
def summarize(stacks: list[str], records: dict[str, list[dict]], base: float, target: float) -> list[dict]:
    """One row per stack: final held-out score, rollouts to target, steps, wall time, claim metrics."""
    rows = []
    for stack in stacks:
        runs = records.get(stack, [])
        finals = [r["evals"][-1]["score"] if r["evals"] else float("nan") for r in runs]
        to_target = [rollouts_to_target(r["evals"], base, target, key="score") for r in runs]
        reached = [v for v in to_target if v == v]
        claims = {}
        for run in runs[:1]:
            for plugin, (metric, label) in run["claim_metrics"].items():
                values = [run_mean(r["per_step"], f"plugins/{plugin}/{metric}") for r in runs]
                claims[f"{plugin}: {label}"] = mean_std(values)
        rows.append({
            "stack": stack, "runs": len(runs), "score": mean_std(finals), "rollouts_to_target": mean_std(reached),
            "reached": f"{len(reached)}/{len(runs)}", "steps": mean_std([r["steps"] for r in runs]),
            "rollouts": mean_std([r["rollouts"] for r in runs]), "seconds": mean_std([r["seconds"] for r in runs]),
            "entropy_last": mean_std([run_mean(r["per_step"][-5:], "entropy") for r in runs]), "claims": claims,
        })
    return rows


def markdown(rows: list[dict], info: dict) -> str:
    first = rows[0]["score"][0] if rows else float("nan")
    lines = [
        f"Held-out score: {info['metric']} of greedy completions on {info['held_out']} ({info['eval_size']} "
        f"prompts); before training {info['base']:.3f}; target {info['target']:.3f}. Budget: {info['rollouts']} "
        f"policy rollouts per run (extra and refill rollouts included), seeds {info['seeds']}.",
        "",
        "| stack | runs | final score (mean ± std) | Δ vs first | rollouts to target | reached | steps | "
        "wall time (s) | entropy (last 5 steps) | plugins' claim metrics (mean over the run) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        claims = "; ".join(f"{k} {fmt_mean_std(v)}" for k, v in r["claims"].items()) or "-"
        delta = r["score"][0] - first
        lines.append(
            f"| {r['stack']} | {r['runs']} | {fmt_mean_std(r['score'])} | "
            f"{'-' if math.isnan(delta) else f'{delta:+.3f}'} | {fmt_mean_std(r['rollouts_to_target'], 0)} | "
            f"{r['reached']} | {r['steps'][0]:.1f} | {r['seconds'][0]:.0f} | {fmt_mean_std(r['entropy_last'])} | "
            f"{claims} |"
        )
    return "\n".join(lines)


def plot(stacks: list[str], records: dict[str, list[dict]], base: float, target: float, out: Path) -> list[Path]:
    """``score.png`` (held-out score against rollouts) and ``entropy.png``: mean over seeds, ± one std shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    for key, ylabel, fname in (("score", "held-out score", "score.png"), ("entropy", "policy entropy", "entropy.png")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for stack in stacks:
            runs = records.get(stack, [])
            if not runs:
                continue
            grid = np.linspace(0, max(r["rollouts"] for r in runs), 40)
            ys = []
            for r in runs:
                if key == "score":
                    xs, vs = [0] + [e["rollouts"] for e in r["evals"]], [base] + [e["score"] for e in r["evals"]]
                else:
                    pts = [(x["rollouts"], x[key]) for x in r["per_step"] if x.get(key) == x.get(key) and key in x]
                    if not pts:
                        continue
                    xs, vs = zip(*pts)
                ys.append(np.interp(grid, xs, vs, right=np.nan))
            if not ys:
                continue
            mean, sd = np.nanmean(ys, 0), np.nanstd(ys, 0)
            (line,) = ax.plot(grid, mean, label=stack)
            ax.fill_between(grid, mean - sd, mean + sd, alpha=0.15, color=line.get_color())
        if key == "score":
            ax.axhline(target, ls=":", color="grey", lw=1)
        ax.set_xlabel("policy rollouts")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=90)
        plt.close(fig)
        paths.append(out / fname)
    return paths


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    from trl_plugins.cli.train import working_directory_last

    with working_directory_last():  # a matplotlib.py where the command runs must not replace matplotlib
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    import yaml
    from tqdm.auto import tqdm

    from trl_plugins.cli.console import table

    args = parse_args(argv)
    out = Path(args.output_dir)
    if args.demo:
        base_config = demo_config(out)
        stacks = args.stacks or DEMO_STACKS
        seeds, steps_budget = args.seeds or 2, 10
    else:
        from trl_plugins.cli.train import read_config

        base_config = read_config(args.config)
        plugins = base_config.get("plugins")
        if plugins and not isinstance(plugins, (list, dict)):
            raise PluginConfigError(f"plugins in {args.config!r} must be a list of plugin names; got {plugins!r}.")
        stacks = args.stacks or ["grpo"] + (["+".join(plugins)] if plugins else [])
        seeds, steps_budget = args.seeds or 3, 40
    stack_plugins = {stack: parse_stack(stack) for stack in stacks}
    from trl_plugins.runtime.manager import build_plugins

    for stack, plugins in stack_plugins.items():  # every mistake before the first (minutes-long) run
        options = {n: o for n, o in (base_config.get("plugin_config") or {}).items() if n in plugins}
        build_plugins(plugins, options)
    key = config_key(base_config, args)
    checked = check_run_config(base_config, out)  # wrong-typed or invalid fields, as `trl-plugins train` reads them
    batch = checked.per_device_train_batch_size * checked.gradient_accumulation_steps
    budget = args.rollouts or steps_budget * batch
    eval_every = args.eval_every or max(1, budget // 4)
    max_steps = math.ceil(budget / max(1, batch)) * 4  # the budget callback stops earlier; this only bounds it
    runs_dir = out / "runs"
    if args.fresh and runs_dir.exists():
        shutil.rmtree(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    base_path = runs_dir / f"base__c{key}__n{args.eval_size}.json"  # the score before training, of this config
    jobs = [(stack, seed) for stack in stacks for seed in range(seeds)]
    records: dict[str, list[dict]] = {}
    bar = tqdm(total=len(jobs), desc="compare", unit="run", dynamic_ncols=True)
    for stack, seed in jobs:
        tag = (f"{'+'.join(stack_plugins[stack]) or 'grpo'}__s{seed}__r{budget}__e{eval_every}__n{args.eval_size}"
               f"__c{key}")
        record_path = runs_dir / f"{tag}.json"
        record = read_record(record_path) if record_path.exists() else None
        if record is None:
            run_dir = runs_dir / tag
            run_dir.mkdir(exist_ok=True)
            config_path = run_dir / "config.yaml"
            config_path.write_text(yaml.safe_dump(run_config(base_config, stack_plugins[stack], seed, run_dir,
                                                             max_steps)))
            bar.set_postfix_str(f"{stack} seed {seed}")
            record = run_one(config_path, budget, eval_every, args, base_path)
            write_atomically(record_path, json.dumps(record, default=float))
        records.setdefault(stack, []).append(record)
        bar.update(1)
    bar.close()
    base_info = json.loads(base_path.read_text())
    base = base_info["score"]
    target = args.target if args.target is not None else round(base + 0.05, 3)
    rows = summarize(stacks, records, base, target)
    info = {"metric": base_info["metric"], "held_out": base_info["held_out"], "eval_size": args.eval_size,
            "base": base, "target": target, "rollouts": budget, "seeds": list(range(seeds))}
    md = markdown(rows, info)
    write_atomically(out / "compare.md", md + "\n")
    write_atomically(out / "compare.json", json.dumps({**info, "summary": rows, "runs": records}, default=float,
                                                      indent=1))
    plots = plot(stacks, records, base, target, out)
    console_rows = [("stack", "final score", "rollouts to target", "steps", "seconds")]
    console_rows += [(r["stack"], fmt_mean_std(r["score"]), f"{fmt_mean_std(r['rollouts_to_target'], 0)} "
                      f"({r['reached']})", f"{r['steps'][0]:.1f}", f"{r['seconds'][0]:.0f}") for r in rows]
    print(f"Held-out {info['metric']} before training: {base:.3f} (target {target:.3f}); {budget} rollouts per run.")
    print("\n".join(table(console_rows)))
    for r in rows:
        for claim, value in r["claims"].items():
            print(f"  {r['stack']}: {claim} {fmt_mean_std(value)}")
    print(f"Table: {out / 'compare.md'}   JSON: {out / 'compare.json'}   Plots: {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
