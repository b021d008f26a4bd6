"""The learning benchmark's analysis: from the run records of ``scripts/bench_learning.py`` (and of its chat mode,
``scripts/bench_chat.py``) to its tables and plots.

* :func:`summarize`: one row per method (accuracies, rollouts to the target, per-step means, the paper's quantity of
  :data:`CLAIM_METRICS` or the plugin's own ``claim_metric``);
* :func:`markdown`: a mode's table (the full mode: one table per family); :func:`summary_markdown` and
  :func:`write_summary`: the summary table of every built-in plugin in docs/benchmarks.md;
* :func:`plot`: accuracy, entropy and gradient-norm curves against the budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import bench_agentic as ba
import bench_common as bc
import learning_methods as lm

from trl_plugins.cli.equal_budget import mean_std as _mean_std
from trl_plugins.cli.equal_budget import rollouts_to_target
from trl_plugins.cli.equal_budget import run_mean as _run_mean
from trl_plugins.cli.equal_budget import tail_mean as _tail_mean


# What each paper claims, and the per-step quantity that measures it here.
CLAIM_METRICS = {
    "fbos_rl": ("plugins/fbos_rl/rescued_group_fraction", "groups rescued by feedback round"),
    "scope": ("plugins/scope/rectified_fraction", "rollouts salvaged (rectified)"),
    "scope+lp_reg": ("plugins/scope/rectified_fraction", "rollouts salvaged (rectified)"),
    "hint_scaffold": ("plugins/hint_scaffold/rescued_group_fraction", "all-fail groups rescued by hints"),
    "hint_scaffold+seed_grpo": ("plugins/hint_scaffold/rescued_group_fraction", "all-fail groups rescued by hints"),
    "lp_reg": ("plugins/lp_reg/regularised_token_fraction", "tokens regularised"),
    "critique_grpo": ("plugins/critique_grpo/refinement_success_rate", "refinement success rate"),
    "dagrpo": ("plugins/dagrpo/anchored_group_fraction", "groups anchored with the reference"),
    "cure": ("plugins/cure/critical_token_entropy", "entropy at the critical tokens"),
    "r3l": ("plugins/r3l/retry_improved_fraction", "retries that beat the first attempt"),
    "ruscarl": ("plugins/ruscarl/rubric_score_clipped", "rubric score"),
    "empo": ("plugins/empo/answered_fraction", "completions with an answer"),
    "hicra": ("plugins/hicra/planning_token_fraction", "amplified (planning) tokens"),
    "gtpo": ("plugins/gtpo/conflict_token_fraction", "conflict tokens"),
    "siren": ("plugins/siren/peak_token_fraction", "tokens regularised"),
    "rlpr": ("plugins/rlpr/answer_probability", "reference-answer probability"),
    "seed_grpo": ("plugins/seed_grpo/semantic_entropy", "semantic entropy"),
    "fbos_rl+canon": ("plugins/fbos_rl/rescued_group_fraction", "groups rescued by feedback round"),
    "clip_cov": ("plugins/clip_cov/clipped_token_fraction", "tokens clipped"),
    "kl_cov": ("plugins/kl_cov/selected_token_fraction", "tokens penalised"),
    "llds": ("plugins/llds/regularised_token_fraction", "tokens regularised"),
    "steer": ("plugins/steer/reweighted_token_fraction", "tokens reweighted"),
    "adaptive_sampler": ("plugins/adaptive_sampler/pruned_fraction", "prompts pruned"),
    "laser": ("plugins/laser/bonus", "length bonus"),
    "posterior_grpo": ("plugins/posterior_grpo/paid_fraction", "rollouts paid a process reward"),
    "disco": ("plugins/disco/mixed_group_fraction", "groups with both signs"),
}

# Rows a plugin takes from a teacher or a dataset's demonstration instead of the policy: reported apart from the
# policy-rollout budget (the metric is the count per generation batch).
TEACHER_ROLLOUT_METRICS = ("plugins/luffy/teacher_rollouts", "plugins/rl_plus/demonstration_rows",
                           "plugins/ampo/injected_rows")


def _claim_metric(method: str, plugins: list[str], recorded: dict | None = None) -> tuple[str | None, str | None]:
    """The table's per-step quantity of a method: CLAIM_METRICS, else the first plugin's ``claim_metric`` as its run
    recorded it (``recorded``: a plugin may claim another quantity under some options), else the class's."""
    if method in CLAIM_METRICS:
        return CLAIM_METRICS[method]
    from trl_plugins.runtime.manager import get_plugin_class

    for name in plugins:
        metric = (recorded or {}).get(name) or get_plugin_class(name).claim_metric
        if metric:
            return f"plugins/{name}/{metric[0]}", metric[1]
    return None, None


def _teacher_rollouts(per_step: list[dict]) -> float:
    return sum(r.get(key, 0.0) for r in per_step for key in TEACHER_ROLLOUT_METRICS if r.get(key) == r.get(key))


def summarize(records: list[dict], base_acc: float, target: float) -> list[dict]:
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    rows = []
    for method, runs in by_method.items():
        finals = [r["evals"][-1]["accuracy"] if r["evals"] else float("nan") for r in runs]
        best = [max(e["accuracy"] for e in r["evals"]) if r["evals"] else float("nan") for r in runs]
        to_target = [rollouts_to_target(r["evals"], base_acc, target) for r in runs]
        reached = [v for v in to_target if v == v]
        claim_key, claim_label = _claim_metric(method, runs[0]["plugins"], runs[0].get("claim_metrics"))
        row = {
            "method": method,
            "seeds": sorted(r["seed"] for r in runs),
            "steps": _mean_std([r["steps"] for r in runs])[0],
            "rollouts": _mean_std([r["rollouts"] for r in runs])[0],
            "tokens": _mean_std([r.get("tokens", float("nan")) for r in runs]),
            "final_acc": _mean_std(finals),
            "best_acc": _mean_std(best),
            "rollouts_to_target": _mean_std(reached) if reached else (float("nan"), float("nan")),
            "reached_target": f"{len(reached)}/{len(runs)}",
            "train_reward_last5": _mean_std([_tail_mean(r["per_step"], _REWARD_METRIC[r.get("task", "arithmetic")])
                                             for r in runs]),
            "entropy_first5": _mean_std([sum(v[:5]) / max(1, len(v[:5])) for v in
                                         ([x["entropy"] for x in r["per_step"] if "entropy" in x] for r in runs)]),
            "entropy_last5": _mean_std([_tail_mean(r["per_step"], "entropy") for r in runs]),
            "grad_norm_mean": _mean_std([_run_mean(r["per_step"], "grad_norm") for r in runs]),
            "distinct_per_group": _mean_std([_run_mean(r["per_step"], "distinct_per_group") for r in runs]),
            "correct_rollouts_per_step": _mean_std([_run_mean(r["per_step"], "correct_rollouts") for r in runs]),
            "seconds": _mean_std([r["seconds"] for r in runs])[0],
            "teacher_rollouts": _mean_std([_teacher_rollouts(r["per_step"]) for r in runs]),
        }
        if claim_key:
            row["claim"] = (claim_label, _mean_std([_run_mean(r["per_step"], claim_key) for r in runs]))
        if any("tool_use" in e for r in runs for e in r["evals"]):  # agentic mode
            for key in ("tool_use", "held_out_accuracy", "held_out_tool_use"):
                row[f"final_{key}"] = _mean_std([r["evals"][-1].get(key, float("nan")) for r in runs])
            row["tool_calls_per_rollout"] = _mean_std([_run_mean(r["per_step"], "tools/call_frequency") for r in runs])
            actions = [ba.action_numbers(r["per_step"], r["plugins"]) for r in runs]
            row["actions"] = [(label, _mean_std([a[i][1] for a in actions]), _mean_std([a[i][2] for a in actions]))
                              for i, (label, _, _) in enumerate(actions[0])] if all(actions) else []
        rows.append(row)
    order = {m: i for i, m in enumerate(dict.fromkeys([*lm.ALL_METHODS, *ba.AGENTIC_METHODS]))}  # first place wins
    rows.sort(key=lambda r: order.get(r["method"], 999))
    return rows


# The verifier's per-step mean reward in TRL's logs, per task.
_REWARD_METRIC = {"arithmetic": "rewards/accuracy_reward/mean", "tools": ba.REWARD_METRIC,
                  "chat": "rewards/chat_accuracy_reward/mean"}


# Extra table columns of the agentic mode.
_AGENTIC_COLUMNS = ("tool use (final) | tool calls / rollout (training) | held-out-pair acc (final) | "
                    "held-out-pair tool use (final) | ")


def _fmt(ms: tuple[float, float], digits: int = 3, scale: float = 1.0) -> str:
    m, sd = ms
    if m != m:
        return "-"
    return f"{m * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def _instruction_pilot_text(result: dict) -> str:
    pilot = result.get("instruction_pilot")
    if not pilot:
        return ""
    rates = ", ".join(f"{k}: {v:.3f}" for k, v in pilot["sampled_pass_rate"].items())
    return f" (chosen before training by the untrained model's sampled pass rate on 64 training problems: {rates})"


def _real_model_header(result: dict) -> str:
    pilot = result.get("lr_pilot")
    pilot_text = "" if not pilot else (
        f" Learning rate {result['learning_rate']:g}, chosen by a pilot of vanilla GRPO only (seed 0, full budget, "
        f"final held-out accuracy per learning rate: "
        + ", ".join(f"{lr:g}: {acc:.3f}" for lr, acc in sorted(pilot["final_accuracy"].items())) + ").")
    return (
        f"Real-model mode: {result['model']} (rank {result['lora']['r']}, all attention and MLP projections), "
        f"level-{'/'.join(map(str, result['levels']))} problems with the format instruction "
        f"`{result['instruction']}` appended to each question{_instruction_pilot_text(result)}, "
        f"on {result['device_name']}. Seeds {result['seeds']}, rollout budget {result['budget']} per run "
        f"({result['budget'] // result['batch']} vanilla GRPO steps of {result['batch']} rollouts, G="
        f"{result['num_generations']}, at most {result['max_completion_length']} completion tokens), held-out greedy "
        f"accuracy on {result['eval_size']} test problems every {result['eval_every']} rollouts. Before RL: held-out "
        f"greedy accuracy {result['base_accuracy']:.3f}, sampled pass rate (T=1) {result['base_pass_rate']:.3f}. "
        f"Target accuracy: {result['target']:.2f}.{pilot_text} {len(result['runs'])} runs; this invocation took "
        f"{result['wall_seconds'] / 60:.1f} min with {result['workers']} worker processes sharing the device."
    )


def _tokens_header(result: dict) -> str:
    """The header of the token mode's table (``--budget-unit tokens``)."""
    info = result["machine"]
    return (
        f"Token mode: seeds {result['seeds']}, a budget of {result['budget']} generated tokens per run (tokens sampled "
        "from the policy while training: TRL's rounds and every continuation or fork a plugin asks for; a prefix "
        "that several rows of a tree share is generated, and paid for, once; `GenerationService.policy_tokens`); "
        f"vanilla GRPO spends about this in 2560 rollouts. Held-out greedy accuracy on {result['eval_size']} test "
        f"problems every {result['eval_every']} tokens. Warm-started model before RL{_weights_text(result)}: "
        f"held-out greedy accuracy {result['base_accuracy']:.3f}, sampled pass rate (T=1) "
        f"{result['base_pass_rate']:.3f}. Target accuracy: {result['target']:.2f} (rollouts to target in rollouts). "
        f"Measured {info['time']}, {info['cpu_count']} cores, load average at start {info['loadavg_1_5_15']}. "
        f"{len(result['runs'])} runs; this invocation took {result['wall_seconds'] / 60:.1f} min with "
        f"{result['workers']} worker processes (runs found in the run cache are not re-run)."
    )


def _weights_text(result: dict) -> str:
    sha = result.get("warm_start_sha256")
    return f" (weights sha256 {sha})" if sha else ""


def _table(rows: list[dict], grpo: dict | None, agentic: bool, tokens: bool = False) -> list[str]:
    """The markdown lines of one learning table (header, separator, a row per method); ``tokens``: a column of the
    rollouts and generated tokens per run (token mode)."""
    # a column for rows taken from a teacher / demonstrations, when a method of the table has any
    teacher = any(r.get("teacher_rollouts", (0.0, 0.0))[0] > 0 for r in rows)
    out = [
        "",
        "| method | steps | " + ("policy + teacher rollouts / run | " if teacher else "")
        + ("rollouts / generated tokens per run | " if tokens else "")
        + "final acc (mean ± std) | Δ final vs GRPO | best acc | rollouts to target | reached | "
        "train reward (last 5 steps) | entropy first 5 → last 5 steps | grad norm | distinct / group | "
        "correct rollouts / step | " + (_AGENTIC_COLUMNS if agentic else "") + "paper's quantity |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if teacher else "") + ("---|" if tokens else "")
        + ("---|" * _AGENTIC_COLUMNS.count("|") if agentic else ""),
    ]
    for r in rows:
        delta = r["final_acc"][0] - grpo["final_acc"][0] if grpo else float("nan")
        claim = "-"
        if "claim" in r:
            claim = f"{r['claim'][0]}: {_fmt(r['claim'][1], 3)}"
        for label, value, acted in r.get("actions", []):  # agentic mode: did the tool-use plugins act?
            claim = ("" if claim == "-" else claim + "; ") + (
                f"{label}: {_fmt(value, 3)} (steps acted {_fmt(acted, 2)})")
        out.append(
            f"| {r['method']} | {r['steps']:.0f} | "
            + (f"{r['rollouts']:.0f} + {r.get('teacher_rollouts', (0.0, 0.0))[0]:.0f} | " if teacher else "")
            + (f"{r['rollouts']:.0f} / {r['tokens'][0]:.0f} | " if tokens else "")
            + f"{_fmt(r['final_acc'])} | {delta:+.3f} | {_fmt(r['best_acc'])} | "
            f"{_fmt(r['rollouts_to_target'], 0)} | {r['reached_target']} | {_fmt(r['train_reward_last5'])} | "
            f"{r['entropy_first5'][0]:.3f} → {r['entropy_last5'][0]:.3f} | {_fmt(r['grad_norm_mean'], 3)} | "
            f"{_fmt(r['distinct_per_group'], 3)} | {_fmt(r['correct_rollouts_per_step'], 1)} | "
            + (f"{_fmt(r['final_tool_use'], 2)} | {_fmt(r['tool_calls_per_rollout'], 2)} | "
               f"{_fmt(r['final_held_out_accuracy'])} | {_fmt(r['final_held_out_tool_use'], 2)} | " if agentic else "")
            + f"{claim} |"
        )
    return out


def markdown(result: dict) -> str:
    rows, base, target = result["summary"], result["base_accuracy"], result["target"]
    grpo = next((r for r in rows if r["method"] == "grpo"), None)
    info = result["machine"]
    agentic = result.get("task") == "tools"
    out = [result["header"]] if result.get("header") else [ba.header(result)] if agentic else [
        _real_model_header(result)] if result.get("model") else [_tokens_header(result)] if result["mode"] == "tokens" else [
        f"{'Quick mode' if result['quick'] else 'Full mode'}: seeds {result['seeds']}, rollout budget "
        f"{result['budget']} per run ({result['budget'] // result['batch']} vanilla GRPO steps of {result['batch']} "
        "rollouts), held-out greedy "
        f"accuracy on {result['eval_size']} test problems every {result['eval_every']} rollouts. Warm-started model "
        f"before RL{_weights_text(result)}: held-out greedy accuracy {base:.3f}, sampled pass rate (T=1) "
        f"{result['base_pass_rate']:.3f}. "
        f"Target accuracy: {target:.2f}. Measured {info['time']}, {info['cpu_count']} cores, load average at start "
        f"{info['loadavg_1_5_15']}. {len(result['runs'])} runs; the sum of their wall times is "
        f"{sum(r['seconds'] for r in result['runs']) / 60:.1f} min (each run shared 2 cores with other processes), "
        f"this invocation took {result['wall_seconds'] / 60:.1f} min with {result['workers']} worker processes "
        "(runs found in the run cache are not re-run).",
    ]
    if result["mode"] == "full":  # one table per family, each with the baseline rows for reference
        baseline = [r for r in rows if lm.family(r["method"]) == "baseline"]
        for fam in lm.FAMILIES:
            members = [r for r in rows if lm.family(r["method"]) == fam]
            if members and fam != "baseline":
                out += ["", f"**{lm.FAMILY_TITLES[fam]}**"]
                out += _table(baseline + members, grpo, agentic)
    else:
        out += _table(rows, grpo, agentic, tokens=result.get("budget_unit") == "tokens")
    out.append("")
    prefix = result.get("section") or ("learning" if result["mode"] == "quick" else f"learning_{result['mode']}")
    out.append(f"Plots: `docs/benchmarks/{prefix}_accuracy.png` ({'seen-pair' if agentic else 'held-out'} accuracy "
               f"against {'generated tokens' if result.get('budget_unit') == 'tokens' else 'rollouts'}), "
               f"`docs/benchmarks/{prefix}_entropy.png`, `docs/benchmarks/{prefix}_grad_norm.png`"
               + (f", `docs/benchmarks/{prefix}_tool_calls.png` (tool calls per rollout)" if agentic else "")
               + " (mean over seeds; shaded: ± one std).")
    if result.get("failed"):
        out.append("")
        out.append("Failed or missing runs: " + "; ".join(
            f"{m} seed {s}: {e.split('. ')[0][:120]}" for m, s, e in result["failed"]))
    return "\n".join(out)


def _verdict(row: dict, grpo: dict, n: int) -> str:
    """``better`` / ``worse`` when the final accuracies' difference exceeds two standard errors of it (``n`` seeds per
    method, seed standard deviations), else ``≈``; ``-`` with fewer than 2 seeds."""
    (m, sd), (g, gsd) = row["final_acc"], grpo["final_acc"]
    if m != m or g != g or n < 2:
        return "-"
    se = math.sqrt((sd * sd + gsd * gsd) / max(1, n))
    return "better" if m - g > 2 * se else "worse" if g - m > 2 * se else "≈"


def summary_markdown(full: dict, agentic: dict | None) -> str:
    """The summary table: every built-in plugin and the recommended stacks, one row each, from the full-mode result
    (arithmetic task) and the agentic-mode result (tool task); a plugin in neither run gets a row saying so."""
    from trl_plugins.runtime.manager import available_plugins

    runs = [("arithmetic", full)] + ([("tools", agentic)] if agentic else [])
    out = [
        "Every built-in plugin and the recommended stacks, one row each. Arithmetic rows: the full-mode run "
        f"(`{full['command']}`; shipped tiny model, weights sha256 {full.get('warm_start_sha256')}, "
        f"{full['budget']} rollouts per run, seeds {full['seeds']}, {len(full['runs'])} runs); tool rows: the "
        "agentic run"
        + (f" (shipped tool model, weights sha256 {agentic.get('tool_warm_start_sha256')}, {agentic['budget']} "
           f"rollouts per run, seeds {agentic['seeds']}, `{agentic['command']}`)" if agentic
           else " (not measured on the shipped model yet)")
        + ". Δ is the final held-out accuracy minus vanilla GRPO's in the same run (tool rows: seen-pair accuracy); "
        "*vs GRPO* says `better` / `worse` where the difference exceeds two standard errors over the seeds, else `≈`. "
        "Compare rows within one task; the per-family tables below give every measured quantity.",
        "",
        "| method | family | task | final acc (mean ± std) | Δ vs GRPO | vs GRPO | reached target | "
        "rollouts to target | paper's quantity |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seen: set[str] = set()
    for task, result in runs:
        rows = result["summary"]
        grpo = next((r for r in rows if r["method"] == "grpo"), None)
        for r in rows:
            label = r["method"] if r["method"] not in seen else f"{r['method']} ({task} task)"
            seen.add(r["method"])
            seen.update(r["method"].split("+"))
            claim = f"{r['claim'][0]}: {_fmt(r['claim'][1], 3)}" if "claim" in r else "-"
            for action, value, acted in r.get("actions", []):
                claim = ("" if claim == "-" else claim + "; ") + f"{action}: {_fmt(value, 3)}"
            delta = r["final_acc"][0] - grpo["final_acc"][0] if grpo else float("nan")
            seeds = min(len(r.get("seeds", result["seeds"])), len(grpo.get("seeds", result["seeds"]))) if grpo else 0
            verdict = "-" if r is grpo or grpo is None else _verdict(r, grpo, seeds)
            out.append(f"| {label} | {lm.family(r['method'])} | {task} | {_fmt(r['final_acc'])} | "
                       f"{'-' if r is grpo else f'{delta:+.3f}'} | {verdict} | {r['reached_target']} | "
                       f"{_fmt(r['rollouts_to_target'], 0)} | {claim} |")
    for name in sorted(set(available_plugins()) - seen):
        if name in bc.PLUGIN_SETTINGS or name in bc.TOOL_ONLY_PLUGINS:
            why = "not measured on the shipped model yet"
        else:
            why = "no benchmark setting (an alias or a plugin that needs something the offline tasks lack)"
        out.append(f"| {name} | {lm.family(name) if name in bc.PLUGIN_SETTINGS else '-'} | - | - | - | - | - | - | "
                   f"{why} |")
    return "\n".join(out)


def write_summary(out_dir: Path, command: str, full_name: str = "learning_full") -> Path:
    """Write the ``learning_summary`` block of docs/benchmarks.md from ``out_dir``'s ``<full_name>.json`` (the
    full-mode result) and, when present, ``learning_agentic.json``."""
    from bench_overhead import write_docs_section

    full = json.loads((out_dir / f"{full_name}.json").read_text())
    agentic_path = out_dir / "learning_agentic.json"
    agentic = json.loads(agentic_path.read_text()) if agentic_path.exists() else None
    ba.load_model()  # the shipped tool-use model, copied into the benchmark cache on first use
    if agentic and agentic.get("tool_warm_start_sha256") != bc.weights_sha256(ba.model_dir()):
        agentic = None  # measured on another tool-use model: not a row of this table
    return write_docs_section("learning_summary", summary_markdown(full, agentic), command)


def plot(records: list[dict], methods: list[str], out_dir: Path, base_acc: float, target: float,
         prefix: str = "learning", unit: str = "rollouts") -> list[Path]:
    """Accuracy, entropy and gradient-norm curves against the budget's unit (``rollouts`` or ``tokens``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    methods = [m for m in methods if m in by_method]
    per_panel = 6
    panels = [methods[i : i + per_panel] for i in range(0, len(methods), per_panel)]
    # keep GRPO in every panel as the reference
    panels = [p if "grpo" in p or "grpo" not in methods else ["grpo", *p] for p in panels]
    panels = [p if all(c in p for c in lm.CONTROLS if c in methods)
              else [*p, *[c for c in lm.CONTROLS if c in methods]] for p in panels]

    def curves(key: str, ylabel: str, fname: str, from_evals: bool):
        ncols = min(3, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            for m in panel:
                runs = by_method[m]
                grid = np.linspace(0, max(r[unit] for r in runs), 40)
                ys = []
                for r in runs:
                    if from_evals:
                        xs = [0] + [e[unit] for e in r["evals"]]
                        vs = [base_acc] + [e["accuracy"] for e in r["evals"]]
                    else:
                        pts = [(x[unit], x[key]) for x in r["per_step"] if key in x and x[key] == x[key]]
                        if not pts:
                            continue
                        xs, vs = zip(*pts)
                        k = 3  # moving average over 3 steps: per-step values are noisy
                        vs = [sum(vs[max(0, i - k + 1) : i + 1]) / len(vs[max(0, i - k + 1) : i + 1])
                              for i in range(len(vs))]
                    ys.append(np.interp(grid, xs, vs, right=np.nan))
                if not ys:
                    continue
                ys = np.array(ys)
                mean, sd = np.nanmean(ys, 0), np.nanstd(ys, 0)
                style = {"color": "black", "lw": 2, "zorder": 10} if m == "grpo" else {}
                if m in lm.CONTROLS:
                    style = {"color": "grey", "lw": 1.5, "ls": "--", "zorder": 9}
                line, = ax.plot(grid, mean, label=m, **style)
                ax.fill_between(grid, mean - sd, mean + sd, alpha=0.12, color=line.get_color())
            if from_evals:
                ax.axhline(target, ls=":", color="grey", lw=1)
            ax.set_xlabel("policy rollouts" if unit == "rollouts" else "generated tokens")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    agentic = any(r.get("task") == "tools" for r in records)
    curves("accuracy", "seen-pair greedy accuracy" if agentic else "held-out greedy accuracy",
           f"{prefix}_accuracy.png", True)
    curves("entropy", "policy entropy (nats/token, 3-step mean)", f"{prefix}_entropy.png", False)
    curves("grad_norm", "gradient norm (3-step mean)", f"{prefix}_grad_norm.png", False)
    if any("tools/call_frequency" in x for r in records for x in r["per_step"]):  # agentic mode
        curves("tools/call_frequency", "tool calls per rollout (3-step mean)", f"{prefix}_tool_calls.png", False)
    return paths
