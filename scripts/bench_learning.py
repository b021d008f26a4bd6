"""Learning efficiency of the built-in plugins against vanilla GRPO at an equal rollout budget.

Task: the bundled chained-arithmetic task at the demo's levels (1, 2), with the demo's warm-started tiny model
(settings pinned in ``bench_common.BENCH_SETTINGS``): its sampled pass rate at temperature 1 is about 15 % (greedy
held-out accuracy about 23 %). Training: ``PluginGRPOTrainer`` with the demo's GRPO settings (G=8, 64 completions
per step, lr 5e-5, constant schedule, beta 0, at most 40 completion tokens) and the exact verifier
``accuracy_reward``; "grpo" is the same trainer with no plugins (identical to ``trl.GRPOTrainer``, ``tests/runtime/test_reduction.py``).
Plugin options and GRPOConfig fields per method: ``bench_common.PLUGIN_SETTINGS`` (overridden by
``LEARNING_SETTINGS`` below); they are each paper's recommended settings where the task allows.

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

Runs are cached as JSON under ``--run-dir`` (``--fresh`` discards them), so an interrupted table resumes.
Outputs: ``docs/benchmarks/learning.json`` and ``learning_*.png`` (``learning_full*`` without ``--quick``) and
(``--write-docs``) the ``learning`` (``learning_full``) section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import functools
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

from trl_plugins.cli.equal_budget import EqualBudget, count_policy_rollouts, merge_logs, rollouts_to_target  # noqa: E402
from trl_plugins.cli.equal_budget import mean_std as _mean_std  # noqa: E402
from trl_plugins.cli.equal_budget import run_mean as _run_mean  # noqa: E402
from trl_plugins.cli.equal_budget import tail_mean as _tail_mean  # noqa: E402
from trl_plugins.runtime.trl_seam import replace_trl_method  # noqa: E402

STACKS = ["scope+lp_reg", "hint_scaffold+seed_grpo", "fbos_rl+canon", "laser+canon"]
# Options a plugin takes in one stack only: canon recomputes the advantages, so fbos_rl re-centres canon's advantages
# within its sub-groups instead of recomputing them too (two plugins that both recompute one quantity are refused).
STACK_OPTIONS: dict[str, dict[str, dict]] = {"fbos_rl+canon": {"fbos_rl": {"advantage": "recentre"}}}
# Named variants of one plugin (``plugin:variant`` in --methods): the plugin with these options on top of its settings.
VARIANTS = bc.PLUGIN_VARIANTS
# Token mode (--budget-unit tokens): the methods that generate through the branching seam (continuations, forks,
# trees sharing prefixes), at an equal budget of generated tokens (a shared prefix is paid for once).
TOKEN_METHODS = ["grpo", "latr", "ettrl", "spo", "spo:tree", "deepsearch", "slate", "rex_rag", "ares:branching",
                 "polychromic:vines"]
# GRPO's tokens at the rollout budget on the shipped model (2560 rollouts x about 30 tokens: 76,000-76,600 in the
# full-mode runs of seeds 0-2), and the evaluation interval in tokens.
TOKEN_BUDGET, TOKEN_EVAL_EVERY = 76800, 19200
# With --task tools: the agent methods that re-generate tool episodes from a turn (the tool-episode seam), and GRPO's
# sampled tokens at the agentic rollout budget (384 rollouts: 25,365 tokens for seed 0 on the shipped tool model).
TOOL_TOKEN_METHODS = ["grpo", "arpo", "aepo_branching", "search_r2"]
TOOL_TOKEN_BUDGET, TOOL_TOKEN_EVAL_EVERY = 25600, 8533
QUICK_METHODS = ["grpo", "grpo_drgrpo", "fbos_rl", "scope", "lp_reg", "hint_scaffold"]
# Vanilla GRPO with the loss settings that scope / canon / critique_grpo recommend (a control for those rows).
CONTROLS = {"grpo_drgrpo": {"loss_type": "dr_grpo", "scale_rewards": "none"}}
# Second forms of a plugin whose default is another paper's (replay: RAPO's splice; replay:spear: SPEAR's replay batch).
FULL_VARIANTS = ["replay:spear"]
ALL_METHODS = ["grpo", *CONTROLS, *(p for p in bc.PLUGIN_SETTINGS if p not in bc.TOOL_ONLY_PLUGINS), *FULL_VARIANTS,
               *STACKS]
# Real-model mode: the plugins whose method needs a capable policy, and the recommended stacks.
# The guidance plugins learn from the bundled task's reference solutions; kepo is left out: its teacher must share the
# policy's tokenizer, and no stronger SmolLM2 is available offline (the policy's own base model teaches nothing).
# The chat mode (--task chat, scripts/bench_chat.py): the methods that can act on a 135M model's one-line replies.
CHAT_METHODS = ["grpo", "dynamic_sampling", "dars", "lp_reg", "clip_cov", "kl_cov", "hint_scaffold", "scope", "luffy",
                "rec", "remax"]
REAL_METHODS = ["grpo", "critique_grpo", "r3l", "ruscarl", "scope", "fbos_rl", "hint_scaffold", "cure",
                "dynamic_sampling", "replay", "dars", "luffy", "rl_plus", "ampo", "oreal", "rec",
                "hint_scaffold+canon+lp_reg", "scope+lp_reg", "ruscarl+kl_cov"]

# The summary table's family of a method: its paper's family in the catalogue (docs/coverage.md: SMP sampling, RWD
# reward, ADV advantage, LOS loss, AGT agentic); a plugin outside that table, the first training stage it hooks
# (``Plugin.stages``); stacks of several plugins "stack".
FAMILIES = ("baseline", "sampling", "reward", "advantage", "loss", "agentic", "stack")
FAMILY_TITLES = {"baseline": "Baselines", "sampling": "Sampling and data", "reward": "Rewards",
                 "advantage": "Advantage and credit", "loss": "Loss and objective", "agentic": "Agent methods",
                 "stack": "Recommended stacks"}
_CATALOGUE_FAMILIES = {"SMP": "sampling", "RWD": "reward", "ADV": "advantage", "LOS": "loss", "AGT": "agentic"}


@functools.lru_cache(maxsize=1)
def _catalogue_families() -> dict[str, str]:
    """Plugin name -> family of the first catalogue row of docs/coverage.md that links it (read once per process)."""
    import re

    families: dict[str, str] = {}
    for line in (bc.ROOT / "docs" / "coverage.md").read_text().splitlines():
        m = re.match(r"\| ([A-Z]{3})-\d+ \|.*?\[`(\w+)`\]", line)
        if m and m.group(1) in _CATALOGUE_FAMILIES:
            families.setdefault(m.group(2), _CATALOGUE_FAMILIES[m.group(1)])
    return families


def family(method: str) -> str:
    """The family of a learning-benchmark method (one of :data:`FAMILIES`)."""
    if method == "grpo" or method in CONTROLS:
        return "baseline"
    if "+" in method:
        return "stack"
    plugin = ba.VARIANTS.get(method, (method.split(":")[0],))[0]
    catalogue = _catalogue_families()
    if plugin in catalogue:
        return catalogue[plugin]
    from trl_plugins.runtime.manager import get_plugin_class

    stages = get_plugin_class(plugin).stages()
    return stages[0] if stages and stages[0] in FAMILIES else "loss"


# Overhead settings force some plugins to act on every micro-batch; for learning, use the papers' defaults.
LEARNING_SETTINGS: dict[str, tuple[dict, dict]] = {
    "clip_cov": ({}, {}),
    "kl_cov": ({}, {}),
    "lp_reg": ({}, {}),
    "gtpo": ({}, {"loss_type": "grpo"}),
    # one compression-expansion cycle over the quick budget's 30 steps (default period: 100 steps)
    "siri": ({"period": 30}, {}),
}


def method_settings(method: str, real_model: bool = False, task: str = "arithmetic") -> tuple[list[str], dict, dict]:
    if method == "grpo":
        return [], {}, {}
    if method in CONTROLS:
        return [], {}, dict(CONTROLS[method])
    if task == "tools":
        return _agentic_method_settings(method)
    names = method.split("+")
    options, overrides = {}, {}
    for variant in names:
        name = variant.split(":")[0]
        if variant != name and variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; allowed: {sorted(VARIANTS)}")
        opts, over = LEARNING_SETTINGS.get(name, bc.PLUGIN_SETTINGS.get(name, ({}, {})))
        if real_model and name in bc.REAL_MODEL_PLUGIN_SETTINGS:
            opts, over = bc.REAL_MODEL_PLUGIN_SETTINGS[name]
        opts = {**opts, **VARIANTS.get(variant, {}), **STACK_OPTIONS.get(method, {}).get(name, {})}
        if opts:
            options[name] = dict(opts)
        overrides.update(over)
    return [n.split(":")[0] for n in names], options, overrides


def _agentic_method_settings(method: str) -> tuple[list[str], dict, dict]:
    """Plugins, options and GRPOConfig overrides of an agentic-mode method (variants: ``bench_agentic.VARIANTS``)."""
    plugins, options, overrides = [], {}, {}
    for name in method.split("+"):
        plugin, opts, over = ba.plugin_settings(name)
        plugins.append(plugin)
        opts = {**opts, **STACK_OPTIONS.get(method, {}).get(plugin, {})}
        if opts:
            options[plugin] = opts
        overrides.update(over)
    return plugins, options, overrides


# ------------------------------------------------------------------------------------------------ one run


def _distinct_fraction(completions: list, G: int, text=None) -> float:
    from trl_plugins.tasks.arithmetic import completion_text

    texts = [(text or completion_text)(c) for c in completions]
    groups = [texts[i : i + G] for i in range(0, len(texts) - G + 1, G)]
    return sum(len(set(g)) / G for g in groups) / max(1, len(groups))


def record_rewards(trainer, pending: dict, G: int, correct, text=None) -> None:
    """Wrap ``trainer``'s reward computation: per training generation batch, ``pending`` gets the distinct completions
    per group, the correct rollouts (``correct(completions, rows) -> list[float]``) and the fraction of groups with a
    success."""
    import torch

    def recording_rewards(inputs, prompts, completions, completion_ids_list):
        rewards = original_rewards(inputs, prompts, completions, completion_ids_list)
        if trainer.model.training:
            pending["distinct_per_group"] = _distinct_fraction(completions, G, text)
            acc = torch.tensor(correct(completions, inputs))
            pending["correct_rollouts"] = float(acc.sum())
            if len(acc) % G == 0:
                pending["groups_with_success"] = float((acc.view(-1, G).amax(1) > 0).float().mean())
        return rewards

    original_rewards = replace_trl_method(trainer, "calculate_rewards", recording_rewards)


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
    plugins, options, overrides = method_settings(method, real_model=real, task=job.get("task", "arithmetic"))
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

    record_rewards(trainer, pending, G, ba.correct if agentic else
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


# ------------------------------------------------------------------------------------------------ analysis


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
    order = {m: i for i, m in enumerate(dict.fromkeys([*ALL_METHODS, *ba.AGENTIC_METHODS]))}  # first place wins
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
        baseline = [r for r in rows if family(r["method"]) == "baseline"]
        for fam in FAMILIES:
            members = [r for r in rows if family(r["method"]) == fam]
            if members and fam != "baseline":
                out += ["", f"**{FAMILY_TITLES[fam]}**"]
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
            out.append(f"| {label} | {family(r['method'])} | {task} | {_fmt(r['final_acc'])} | "
                       f"{'-' if r is grpo else f'{delta:+.3f}'} | {verdict} | {r['reached_target']} | "
                       f"{_fmt(r['rollouts_to_target'], 0)} | {claim} |")
    for name in sorted(set(available_plugins()) - seen):
        if name in bc.PLUGIN_SETTINGS or name in bc.TOOL_ONLY_PLUGINS:
            why = "not measured on the shipped model yet"
        else:
            why = "no benchmark setting (an alias or a plugin that needs something the offline tasks lack)"
        out.append(f"| {name} | {family(name) if name in bc.PLUGIN_SETTINGS else '-'} | - | - | - | - | - | - | "
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
    if agentic and agentic.get("tool_warm_start_sha256") != _weights_sha256(ba.model_dir()):
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
    panels = [p if all(c in p for c in CONTROLS if c in methods) else [*p, *[c for c in CONTROLS if c in methods]]
              for p in panels]

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
                if m in CONTROLS:
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


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"methods {', '.join(QUICK_METHODS)}; budget 1920")
    p.add_argument("--tiny", action="store_true",
                   help="smoke mode: untrained tiny model, grpo + hint_scaffold, 1 seed, 2 steps (with --task tools: "
                   "grpo + igpo, 1 step of 8 rollouts)")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: the warm-started character-level model; smollm2: the real-model mode "
                   f"(builtin:smollm2 with LoRA; methods {', '.join(REAL_METHODS)}; budget 1536)")
    p.add_argument("--task", choices=["arithmetic", "tools", "chat"], default="arithmetic",
                   help="arithmetic: the chained-arithmetic task; tools: the agentic mode, a multi-turn tool agent on "
                   f"the bundled tool environment (tiny model; methods {', '.join(ba.AGENTIC_METHODS)}; budget "
                   f"{ba.TOOL_TASK['budget']}; see scripts/bench_agentic.py); chat: the real-model mode with signal, "
                   "builtin:smollm2 + LoRA on the bundled chat-arithmetic task (implies --model smollm2; methods "
                   f"{', '.join(CHAT_METHODS)}; see scripts/bench_chat.py)")
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
                        f"methods {', '.join(TOKEN_METHODS)}; budget {TOKEN_BUDGET}, evaluations every "
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
        print(f"wrote {write_summary(Path(args.out_dir), command.strip(), args.section or 'learning_full')}")
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
        methods, budget, eval_every, eval_size, seeds = REAL_METHODS, 1536, 512, 128, args.seeds
        gain = 0.15
    elif args.quick:
        methods, budget, eval_every, eval_size, seeds = QUICK_METHODS, 1920, 640, 128, args.seeds
        gain = 0.08
    else:
        methods, budget, eval_every, eval_size, seeds = ALL_METHODS, 2560, 640, 128, args.seeds
        gain = 0.12
    tokens = args.budget_unit == "tokens"
    if tokens and (real or args.tiny or args.quick):
        print("--budget-unit tokens runs the full arithmetic mode or the agentic mode only (the tiny models, no "
              "--quick / --tiny / --model smollm2)", file=sys.stderr)
        return 2
    if tokens:
        methods, budget, eval_every = ((TOOL_TOKEN_METHODS, TOOL_TOKEN_BUDGET, TOOL_TOKEN_EVAL_EVERY) if agentic else
                                       (TOKEN_METHODS, TOKEN_BUDGET, TOKEN_EVAL_EVERY))
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
        model_tag = f"__w{_weights_sha256(ba.model_dir(args.cache_dir))}"
    elif not real and not args.tiny:
        model_tag = f"__w{_weights_sha256(bc.demo_model_dir(args.cache_dir))}"
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
    summary = summarize(records, base_acc, target)
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
        "warm_start_sha256": None if real or args.tiny else _weights_sha256(bc.demo_model_dir(args.cache_dir)),
    }
    if agentic:
        result.update(ba.result_fields(args.tiny), base_tool_use=base_tool["tool_use"],
                      tool_warm_start_sha256=None if args.tiny else _weights_sha256(ba.model_dir(args.cache_dir)),
                      base_sampled_tool_use=base_tool["sampled_tool_use"],
                      base_held_out_accuracy=base_tool["held_out_accuracy"],
                      base_held_out_tool_use=base_tool["held_out_tool_use"],
                      learning_rate=grpo_config.get("learning_rate", ba.grpo_fields(args.tiny)["learning_rate"]))
    if real:
        r = bc.REAL_MODEL_SETTINGS
        device_name = earlier["device_name"] if earlier else _device_name(args.device)
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
    md = markdown(result)
    print(md)
    (out_dir / f"{prefix}.json").write_text(json.dumps(result, default=float))
    if mode not in ("tiny", "agentic_tiny") and records:
        plot(records, methods, out_dir, base_acc, target, prefix=prefix, unit=args.budget_unit)
    if args.write_docs:
        from bench_overhead import write_docs_section

        print(f"wrote {write_docs_section(prefix, md, result['command'])}")
    return 0 if not failed else 1


def _weights_sha256(model_dir: Path) -> str | None:
    """First 16 hex digits of the SHA-256 of the warm-started model's weights file. The warm start is deterministic on
    one machine but not bit-identical across machines (CPU kernels), so this tells which model a table was measured
    with."""
    import hashlib

    path = model_dir / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def _run_error(path: Path) -> str:
    """The last line of a failed run's traceback (``<run>.error``), or "not run"."""
    error = path.with_suffix(".error")
    if not error.exists():
        return "not run"
    lines = [line for line in error.read_text().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "failed"


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return "CPU"


if __name__ == "__main__":
    raise SystemExit(main())
