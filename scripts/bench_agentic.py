"""The agentic task of ``scripts/bench_learning.py`` (``--task tools``): a multi-turn tool agent on the bundled offline
tool environment, vanilla GRPO against the agentic plugins at an equal rollout budget.

Environment: :class:`trl_plugins.tasks.tools.ToolEnvironment` through TRL's ``environment_factory`` (a search tool
over the bundled corpus of fictional towns and a calculator); questions of the ``lookup`` (one search) and ``scaled``
(a search, then the calculator) kinds. Reward: the exact verifier :func:`~trl_plugins.tasks.tools.tool_answer_reward`
on the last assistant message. Two evaluation sets, greedy episodes: *seen pairs* (the accuracy the table is about:
other draws of questions about the (place, fact) pairs of the training split, so the answer numbers are known to the
model) and *held-out pairs* ((place, fact) pairs never asked in training,
:func:`trl_plugins.tasks.tiny_tools.tool_question_split`: the answer must be read from the search result).

Model: the benchmark's warm-started tiny demo model (``bench_common.BENCH_SETTINGS``), warm-started a second time on
tool-use traces (:func:`trl_plugins.tasks.tiny_tools.tool_demo_model`, settings :func:`warm_start_settings`, cached
next to the demo model): without it the tiny model never writes a tool call. Part of its traces answer at once
without tools and wrongly (:data:`SHORTCUT_FRACTION`), so before RL it often skips the tools.
Its correct traces can vary in tool use (:data:`VARIATION`: a repeated search, a sentence before the first call), so
that the tool-use methods (``otc_po``: fewer calls; ``aspo``: an earlier first call) see correct rollouts that differ
in what they reward; the benchmark leaves it off (:data:`TRIED_VARIATION` says why). :data:`ACTION_METRICS` puts in
the table whether and how often those methods acted. Cached runs carry the warm start's key in their file names
(:func:`model_key`), so a changed warm start re-runs every method.

Methods are plugin names, stacks ``a+b`` and the named variants of :data:`VARIANTS` (``igpo_a2tgpo``: IGPO's A2TGPO
mode); a plugin's options are :data:`AGENTIC_SETTINGS`, else ``bench_common.PLUGIN_SETTINGS``, else its defaults,
so a newly registered agent plugin runs with ``--methods grpo <name>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import bench_common as bc

#: The default method list of the agentic mode.
AGENTIC_METHODS = ["grpo", "igpo", "igpo_a2tgpo", "igpo+otc_po", "igpo+aspo"]
#: Named variants usable as methods and inside stacks: name -> (plugin, options).
VARIANTS: dict[str, tuple[str, dict]] = {"igpo_a2tgpo": ("igpo", {"mode": "a2tgpo"}),
                                         "aepo_branching": ("aepo", {"branching": True})}
#: Plugin options and GRPOConfig overrides that differ on the tool task from ``bench_common.PLUGIN_SETTINGS``.
AGENTIC_SETTINGS: dict[str, tuple[dict, dict]] = {}

#: Per plugin, the logged per-step metrics that show whether it acted, each ``(key, label, neutral value)``: the table
#: reports their run mean and the fraction of steps where they differ from the neutral value (the plugin acted).
ACTION_METRICS: dict[str, list[tuple[str, str, float]]] = {
    "otc_po": [("plugins/otc_po/r_tool_mean", "otc_po tool factor r_tool on correct rollouts", 1.0)],
    "aspo": [("plugins/aspo/shaped_fraction", "aspo rows shaped", 0.0)],
}

#: The verifier's per-step mean reward in TRL's logs.
REWARD_METRIC = "rewards/tool_answer_reward/mean"
#: Task and GRPO sizes of the agentic mode (CPU, one thread per run).
TOOL_TASK: dict[str, Any] = {
    "train_size": 512,
    "eval_size": 64,
    "num_generations": 8,
    "per_device_train_batch_size": 32,
    "max_completion_length": 360,
    "max_tool_calling_iterations": 3,
    "learning_rate": 2e-4,
    "budget": 384,
    "eval_every": 128,
}


#: Variation among the warm start's correct traces (:class:`~trl_plugins.tasks.tiny_tools.ToolWarmStartSettings`):
#: none in the benchmark's model. :data:`TRIED_VARIATION` is what was tried and why it is not used.
VARIATION: dict[str, dict[str, float]] = {"redundant_search_fraction": {}, "preamble_fraction": {}}
#: A variation tried so that correct rollouts of one group differ in tool use and the tool-use methods act:
#: ``otc_po`` needs correct rollouts with different numbers of calls (a repeated search on ``lookup``; on ``scaled``
#: the extra search would not fit the completion budget), ``aspo`` correct rollouts whose first call starts at
#: different positions (a short sentence before the first call). With it (and ``lookup`` shortcuts at 20 %) the
#: warm-started model got a greedy seen-pair accuracy of 0.203 but a sampled pass rate of 0.031: 0.4-0.7 correct
#: rollouts per 32-rollout step, so groups almost never held two correct rollouts that differ -- otc_po acted on 2
#: of 36 steps (3 seeds), aspo on none -- and no method learned in 12 steps (every one ended below its start; a
#: 3-seed run on 2026-11-23). With 30 % ``lookup`` shortcuts, greedy accuracy fell to 0.031. Set ``VARIATION`` (and
#: ``SHORTCUT_FRACTION``) to these values to reproduce it.
TRIED_VARIATION: dict[str, dict[str, float]] = {
    "redundant_search_fraction": {"lookup": 0.3},
    "preamble_fraction": {"lookup": 0.2, "scaled": 0.3},
    "shortcut_fraction": {"lookup": 0.2, "scaled": 0.7},
}
#: Per question kind, the warm start's traces that answer at once without tools, wrongly (the habit RL can fix).
SHORTCUT_FRACTION: dict[str, float] = {"lookup": 0.3, "scaled": 0.7}


def warm_start_settings():
    """The tool-use warm start of the benchmark's model (:class:`ToolWarmStartSettings` defaults, pinned here)."""
    from trl_plugins.tasks.tiny_tools import ToolWarmStartSettings

    return ToolWarmStartSettings(seed=0, steps=500, lr=3e-3, batch_size=16, warmup_steps=20, train_size=512,
                                 shortcut_fraction=dict(SHORTCUT_FRACTION),
                                 redundant_search_fraction=dict(VARIATION["redundant_search_fraction"]),
                                 preamble_fraction=dict(VARIATION["preamble_fraction"]))


def model_key() -> str:
    """Cache key of the tool-warm-started model (demo settings and :func:`warm_start_settings`); it names the folder
    of :func:`load_model` and is part of every cached run's file name, so a changed warm start re-runs every method."""
    return warm_start_settings().cache_key(bc.demo_settings().cache_key())


def model_dir(cache_dir=None):
    """The folder of the tool-warm-started model (exists once :func:`load_model` built it)."""
    from pathlib import Path

    return Path(cache_dir or bc.DEFAULT_CACHE) / f"tiny-tools-{model_key()}"


def action_numbers(per_step: list[dict], plugins: list[str]) -> list[tuple[str, float, float]]:
    """``[(label, run mean, fraction of steps where it acted)]`` of the :data:`ACTION_METRICS` of ``plugins``."""
    out = []
    for plugin in plugins:
        for key, label, neutral in ACTION_METRICS.get(plugin, []):
            values = [r[key] for r in per_step if key in r and r[key] == r[key]]
            if values:
                acted = sum(abs(v - neutral) > 1e-9 for v in values) / len(values)
                out.append((label, sum(values) / len(values), acted))
    return out


def plugin_settings(name: str) -> tuple[str, dict, dict]:
    """``(plugin, options, GRPOConfig overrides)`` of one method component on the tool task."""
    plugin, variant_options = VARIANTS.get(name, (name, {}))
    opts, over = AGENTIC_SETTINGS.get(plugin, bc.PLUGIN_SETTINGS.get(plugin, ({}, {})))
    return plugin, {**opts, **variant_options}, dict(over)


def load_model(cache_dir=None, untrained: bool = False):
    """``(model, tokenizer)``: the tool-warm-started demo model, or (``untrained``: smoke runs) a fresh one; the
    tokenizer has the tiny tool chat template."""
    from trl_plugins.tasks.tools import enable_tool_calling

    if untrained:
        model, tokenizer = bc.load_model(cache_dir, untrained=True)
        return model, enable_tool_calling(tokenizer)
    from trl_plugins.tasks.tiny_tools import tool_demo_model

    return tool_demo_model(cache_dir or bc.DEFAULT_CACHE, bc.demo_settings(), warm_start_settings())


def datasets(train_size: int, eval_size: int):
    """``(train, {"seen": ..., "held_out": ...})``: training questions (seed 0) and the two evaluation sets (seed 1;
    questions about training pairs, and about held-out pairs)."""
    from trl_plugins.tasks.tiny_tools import make_tool_split

    return make_tool_split(train_size, "train", seed=0), {"seen": make_tool_split(eval_size, "train", seed=1),
                                                          "held_out": make_tool_split(eval_size, "test", seed=1)}


def grpo_fields(untrained: bool = False) -> dict:
    """GRPOConfig fields of the agentic mode (the smoke mode: ``bench_common.SMOKE_OVERRIDES``, short episodes)."""
    t = TOOL_TASK
    fields = {k: t[k] for k in ("num_generations", "per_device_train_batch_size", "max_completion_length",
                                "max_tool_calling_iterations", "learning_rate")}
    if untrained:
        fields.update(bc.SMOKE_OVERRIDES, max_completion_length=48, max_tool_calling_iterations=1)
    return fields


def trainer_kwargs() -> dict:
    from trl_plugins.tasks.tools import ToolEnvironment

    return {"environment_factory": ToolEnvironment}


def reward_funcs() -> list:
    from trl_plugins.tasks.tools import tool_answer_reward

    return [tool_answer_reward]


def correct(completions: list, inputs: list[dict]) -> list[float]:
    from trl_plugins.tasks.tools import tool_answer_reward

    return tool_answer_reward(completions, [r["answer"] for r in inputs])


def completion_text(completion: Any) -> str:
    """A multi-turn completion as one string (for counting distinct completions per group)."""
    if isinstance(completion, str):
        return completion
    return "\x1e".join(f"{m.get('role')}:{m.get('content')}:{m.get('tool_calls')}" for m in completion or [])


def evaluate(model, tokenizer, eval_sets: dict, max_completion_length: int, temperature: float = 0.0,
             num_samples: int = 1) -> dict[str, float]:
    """``{"accuracy", "tool_use", "held_out_accuracy", "held_out_tool_use"}`` on the seen-pair and held-out-pair
    sets of :func:`datasets`: greedy episodes (or sampled ones, averaged over ``num_samples`` seeds)."""
    from trl_plugins.tasks.tiny_tools import evaluate_tool_accuracy

    out = {}
    for name, prefix in (("seen", ""), ("held_out", "held_out_")):
        runs = [evaluate_tool_accuracy(model, tokenizer, eval_sets[name], max_completion_length,
                                       temperature=temperature, seed=seed) for seed in range(num_samples)]
        out.update({prefix + k: sum(r[k] for r in runs) / len(runs) for k in runs[0]})
    return out


def base_numbers(cache_dir, eval_size: int, untrained: bool, max_completion_length: int) -> dict:
    """The model before RL: greedy accuracy and tool use on both evaluation sets (:func:`evaluate`), and the sampled
    (T=1, 2 samples) pass rate and tool use on the seen pairs."""
    model, tokenizer = load_model(cache_dir, untrained)
    _, eval_sets = datasets(8, eval_size)
    greedy = evaluate(model, tokenizer, eval_sets, max_completion_length)
    sampled = evaluate(model, tokenizer, eval_sets, max_completion_length, temperature=1.0, num_samples=2)
    return {**greedy, "pass_rate": sampled["accuracy"], "sampled_tool_use": sampled["tool_use"]}


def _sha(sha: str | None) -> str:
    return f" (weights sha256 {sha})" if sha else ""


def _variation_text(w: dict) -> str:
    """The warm start's variation among correct traces, in words (empty without any)."""
    parts = []
    if w.get("redundant_search_fraction"):
        parts.append(", ".join(f"{v:.0%} of {k}" for k, v in w["redundant_search_fraction"].items())
                     + " correct traces repeat their search once (one call more than needed)")
    if w.get("preamble_fraction"):
        parts.append(", ".join(f"{v:.0%} of {k}" for k, v in w["preamble_fraction"].items())
                     + " correct traces write a short sentence before the first call (a later first call)")
    return "; " + "; ".join(parts) + ", so that correct rollouts differ in tool use" if parts else ""


def header(result: dict) -> str:
    """First paragraph of the agentic section of ``docs/benchmarks.md``."""
    w, info = result["tool_warm_start"], result["machine"]
    cpu = sorted(r["cpu_seconds"] for r in result["runs"]) or [0.0]
    wall = sorted(r["seconds"] for r in result["runs"]) or [0.0]
    shortcut = ", ".join(f"{v:.0%} of {k}" for k, v in w["shortcut_fraction"].items())
    model = (
        "an untrained tiny model (smoke run: plumbing only)" if result["mode"] == "agentic_tiny" else
        f"the benchmark's warm-started tiny demo model{_sha(result.get('warm_start_sha256'))}, warm-started again on "
        f"tool-use traces{_sha(result.get('tool_warm_start_sha256'))} ({w['steps']} supervised steps of "
        f"{w['batch_size']} traces; {shortcut} traces answer at once without tools and wrongly, so that RL has a tool "
        f"habit to learn{_variation_text(w)}; without this warm start the tiny model never writes a tool call)"
    )
    return (
        f"Agentic mode: a multi-turn tool agent on the bundled offline tool environment (`ToolEnvironment` through "
        f"TRL's `environment_factory`: search over the bundled corpus of fictional towns, calculator), `lookup` and "
        f"`scaled` questions (one or two tool calls), verifier `tool_answer_reward`. Greedy episodes every "
        f"{result['eval_every']} {'generated tokens' if result.get('budget_unit') == 'tokens' else 'rollouts'} on two sets of {result['eval_size']} questions: *seen pairs* (new draws of "
        f"questions about the (place, fact) pairs of the training split: accuracy, target and plots are on this "
        f"set) and *held-out pairs* (pairs never asked in training: the answer must be read from the search "
        f"result). Model: {model}. GRPO: G={result['num_generations']}, {result['batch']} rollouts per step, lr "
        f"{result['learning_rate']:g}, at most {result['max_completion_length']} completion tokens (tool results "
        f"included) and {result['max_tool_calling_iterations']} tool turns. Seeds {result['seeds']}, "
        + (f"a budget of {result['budget']} generated tokens per run (tokens the policy sampled: its turns, not the "
           "tool results; a re-generated episode pays only for its new turns; vanilla GRPO spends about this in 384 "
           "rollouts). Before RL: "
           if result.get("budget_unit") == "tokens" else
           f"rollout budget {result['budget']} per run ({result['budget'] // result['batch']} vanilla GRPO steps). "
           "Before RL: ")
        + f"greedy accuracy {result['base_accuracy']:.3f} on seen pairs (tool use {result['base_tool_use']:.2f}), "
        f"{result['base_held_out_accuracy']:.3f} on held-out pairs (tool use {result['base_held_out_tool_use']:.2f}); "
        f"sampled (T=1) pass rate on seen pairs {result['base_pass_rate']:.3f} (tool use "
        f"{result['base_sampled_tool_use']:.2f}). Target accuracy: {result['target']:.2f}. Measured {info['time']}, "
        f"{info['cpu_count']} cores, load average at start {info['loadavg_1_5_15']}. {len(result['runs'])} runs of "
        f"{cpu[0]:.0f}-{cpu[-1]:.0f} CPU seconds each ({wall[0] / 60:.1f}-{wall[-1] / 60:.1f} min wall on the shared "
        f"machine); this invocation took {result['wall_seconds'] / 60:.1f} min with {result['workers']} worker "
        "processes (runs found in the run cache are not re-run)."
    )


def result_fields(untrained: bool) -> dict:
    """Settings recorded in the result JSON of the agentic mode."""
    fields = grpo_fields(untrained)
    return {"task": "tools", "tool_warm_start": dataclasses.asdict(warm_start_settings()),
            "batch": fields["per_device_train_batch_size"], "num_generations": fields["num_generations"],
            "max_completion_length": fields["max_completion_length"],
            "max_tool_calling_iterations": fields["max_tool_calling_iterations"]}
