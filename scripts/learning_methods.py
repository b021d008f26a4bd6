"""The learning benchmark's methods: what each method of ``scripts/bench_learning.py`` (and of its chat mode,
``scripts/bench_chat.py``) trains with, and what every run records per step.

* the method lists of each mode (:data:`QUICK_METHODS`, :data:`ALL_METHODS`, :data:`REAL_METHODS`,
  :data:`CHAT_METHODS`, :data:`TOKEN_METHODS`, :data:`TOOL_TOKEN_METHODS`), the recommended :data:`STACKS`, the
  :data:`CONTROLS` and the named :data:`VARIANTS`;
* each method's family (:func:`family`, :data:`FAMILIES`), the summary table's grouping;
* :func:`method_settings`: a method's plugins, plugin options and GRPOConfig overrides (``bench_common.PLUGIN_SETTINGS``
  overridden by :data:`LEARNING_SETTINGS`; the agentic mode's from ``bench_agentic``);
* :func:`record_rewards`: the per-group statistics every run records per training step (distinct completions per group,
  correct rollouts, groups with a success).
"""

from __future__ import annotations

import functools

import bench_agentic as ba
import bench_common as bc

from trl_plugins.runtime.trl_seam import replace_trl_method

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
# With --task tools: the agent methods that re-generate tool episodes from a turn (the tool-episode seam).
TOOL_TOKEN_METHODS = ["grpo", "arpo", "aepo_branching", "search_r2"]
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


# ------------------------------------------------------------------------------------------------ per-step records


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

