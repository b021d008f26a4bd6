"""Shared pieces of ``scripts/bench_overhead.py`` and ``scripts/bench_learning.py``.

* the warm-started tiny model of the demo (cached on disk, see :func:`trl_plugins.tasks.tiny.demo_model`), built
  with the pinned :data:`BENCH_SETTINGS`;
* :data:`PLUGIN_SETTINGS`: per built-in plugin, the plugin options and GRPOConfig fields under which it *acts*
  on the bundled arithmetic task (rule-based judge, programmatic PRM, reference solutions: nothing external);
* trainer construction for ``trl.GRPOTrainer`` and ``PluginGRPOTrainer`` from the same settings;
* process memory helpers (peak resident set size via ``/proc/self/status``, resettable on Linux);
* what a result records of where it ran: :func:`machine_info`, :func:`device_name`, and :func:`weights_sha256` (which
  warm-started model it measured).

Nothing here downloads anything.
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

DEFAULT_CACHE = ROOT / "runs" / "bench_cache"

# Per plugin: (plugin options, GRPOConfig overrides) that make it act on the arithmetic task with the tiny model.
# The GRPOConfig overrides are applied to the vanilla baseline as well, so a ratio isolates the plugin's own cost.
PLUGIN_SETTINGS: dict[str, tuple[dict, dict]] = {
    # the arithmetic rows have no options column: acre re-asks nothing there (reasked_fraction 0); its cost is the
    # per-row check only
    "acre": ({}, {}),
    "adaptive_sampler": ({}, {}),
    "aepo": ({}, {}),
    # the bundled task has one reference solution per prompt: it is the (single) teacher's solution
    "ampo": ({"solutions_column": "solution"}, {}),
    # ARES's trigger words are natural-language reasoning words, which the character tokenizer never forms: the digits
    # open the windows here; the KL half scales TRL's reference KL (ARES's kl_coef 0.01) and its controller updates
    # every micro-batch (official: every 100th)
    "ares": ({"trigger_words": list("0123456789"), "kl_update_interval": 1}, {"beta": 0.01}),
    # the encoder is the warm-started demo model (mean-pooled hidden states); the answer follows "Answer:"
    "armed": ({"embedder": "hf", "embedder_model": "(set below: demo_model_dir())", "answer_pattern": r"Answer:\s*(\S+)"},
              {}),
    # the agent plugins act on multi-turn tool rollouts only (trl_plugins.tasks.tools); on the arithmetic task they
    # run their hooks and leave the batch as it is (no tool calls: IGPO is GRPO, OTC's coefficient and ASPO's term 0,
    # SALT's graph has one step per rollout). EPO acts on any rollout (its entropy bonus; one turn on this task).
    # funrl, e_grpo and matchtir are not listed: they read dataset columns the arithmetic task lacks (gold_calls,
    # entities). ikea acts without tools too: no retrievals, so a correct answer earns its full 0.6.
    "aspo": ({}, {}),
    # arpo branches from tool boundaries only (the tool-episode seam): without tools it leaves the batch as it is
    "arpo": ({}, {}),
    # search_r2 cuts and regenerates tool trajectories (the tool-episode seam) and rewards the retrieved evidence's
    # density (per-call environment rewards): without tools its refiner has no step to cut and the density is 0
    "search_r2": ({}, {}),
    "canon": ({}, {"loss_type": "dr_grpo"}),
    # a wide covariance window and a larger ratio so that tokens are picked in every micro-batch
    "clip_cov": ({"lb": -100.0, "ub": 100.0, "ratio": 0.02}, {}),
    # CLPO: the policy rewrites hard / medium problems into later batches (refill rounds count in the budget)
    "clpo": ({}, {}),
    "critique_grpo": ({"critique_type": "simple_gt"}, {"scale_rewards": "none", "loss_type": "dr_grpo"}),
    # character-level tokenizer: every token is one character
    "cure": ({"branches_per_response": 3, "min_token_chars": 1}, {}),
    "dagrpo": ({"scorer": "prm"}, {}),
    # refill plugins: the refill rollouts count in the rollout budget (max_refill_rounds: the PluginGRPOConfig default)
    "dars": ({"n_max": 16}, {}),
    # the scripted verifier-backed judge gives each line of a completion a ternary verdict (no model)
    "data_prm": ({"genrm": "scripted", "step_separator": "\n"}, {}),
    "dcpo": ({}, {}),
    "decs": ({}, {}),
    # the scripted verifier-backed generative judge (no model)
    "deepseek_grm": ({"genrm": "scripted"}, {}),
    "disco": ({}, {"loss_type": "grpo"}),
    "dler": ({}, {}),
    # the scripted verifier-backed pairwise judge as the preference oracle (no model)
    "dno": ({"genrm": "scripted"}, {}),
    "dynamic_sampling": ({}, {}),
    "empo": ({}, {}),
    "epo": ({}, {}),
    # label-free majority vote; ETMR trees of 1 + 3 * 1 = 4 rollouts (two per group of 8, one in the smoke's 4)
    # instead of the paper's 12 trees of 1 + 2 * 2 = 5 in a group of 60
    "ettrl": ({"fork_points": 1, "branches": 3}, {}),
    "fbos_rl": ({"feedback": "task"}, {}),
    "fleming_r1": ({}, {}),
    "gtpo": ({"entropy_threshold": None}, {"loss_type": "grpo"}),
    "hapo": ({}, {}),
    # the paper's budgets (512-2560 tokens) exceed the 40-token completions: four sub-groups of 2 rollouts instead
    "hbpo": ({"budgets": [10, 20, 30, 40]}, {}),
    # the default lexicon targets natural-language reasoning; the arithmetic completions say "Answer"
    "hicra": ({"phrases": ["answer"]}, {}),
    "hint_scaffold": ({}, {}),
    "igpo": ({}, {}),
    "ikea": ({}, {}),
    # the teacher is the warm-started demo model itself (distillation pulls successful rollouts toward it; its hints
    # for all-fail groups are what a tiny model writes); gated on the accuracy column
    "kepo": ({"teacher_model": "(set below: demo_model_dir())", "teacher_max_tokens": 24}, {}),
    # the warm-started tiny model as the frozen listener (it shares the benchmark policy's character tokenizer)
    "listener": ({"teacher_model": "(set below: demo_model_dir())"}, {}),
    # RaPO's previous-task policy: the warm-started demo model the benchmark policy starts from (a second task)
    "rapo_retention": ({"teacher_model": "(set below: demo_model_dir())"}, {}),
    "kl_cov": ({"ratio": 0.02}, {}),
    "laser": ({}, {}),
    # the official lookahead windows (20, 30, 50 tokens of 1-8k-token completions) scaled to the 40-token completions
    "latr": ({"pruning_steps": [10, 20]}, {}),
    # the scripted verifier-backed judge's binary correctness verdict (no model), beside the task's reward
    "libra_rm": ({"genrm": "scripted"}, {}),
    # the official width 8 and depth 64 (16k-token completions) scaled to the 40-token completions and G = 8: 4 steps
    # of 10 tokens, width 2, a node budget of 4 G
    "deepsearch": ({"expansion_width": 2, "max_depth": 4, "node_budget": 32}, {}),
    "llds": ({}, {}),
    # the arithmetic rows have no constraints column: one constraint for every row, and no thinking block
    "light_if": ({"constraints_column": None, "constraints": [{"type": "word_count", "max": 20}], "think_end": None},
                 {}),
    # the official wo_tokenrm recipe: +-1 rewards, leave-one-out, every row, per-sign normalisation on dapo (no KL:
    # TRL beta 0, official 0.01)
    # the bench task's two levels as two cascade stages (level 1 first, then level 2)
    "nemotron_cascade": ({"stages": ["1", "2"], "stage_steps": [5], "domain_column": "level"}, {}),
    "oreal": ({}, {"loss_type": "dapo"}),
    # the 40-token completions never pass the official 100-token bonus constraint; the ladder by the task's level
    "observe_r1": ({"bonus_constraint": 0, "ladder_column": "level"}, {}),
    "lp_reg": ({"rho": 0.05}, {}),
    # the official recipe trains Dr.GRPO; thresholds and the Adam step model are the recipe's
    "capo": ({}, {"loss_type": "dr_grpo"}),
    "otc_po": ({}, {}),
    # one reference solution per group of 8 (the official 7 + 1); demonstrations are teacher rollouts, not policy
    # rollouts: the metric plugins/luffy/teacher_rollouts counts them per generation batch
    "luffy": ({}, {"scale_rewards": "none", "loss_type": "dr_grpo"}),
    # the paper's reward differences: TRL's group mean cancels in A_i - A_j, the std is kept out
    "p3o": ({}, {"scale_rewards": "none"}),
    "pear": ({}, {}),
    # sets of 2: the paper's 4 of N = 8 would be the whole group at the smoke runs' num_generations=4 (same ratio)
    "polychromic": ({"set_size": 2}, {}),
    "posterior_grpo": ({"prm": "programmatic"}, {}),
    "reasonflux_prm": ({"prm": "programmatic"}, {}),
    # short completions: steps of 8 tokens instead of the paper's 256; a smaller eta so that the process term shows
    "prl": ({"step_len": 8, "eta": 20.0}, {}),
    # the arithmetic task has no paraphrase column: two rewording templates give each group three variants
    "ps_grpo": ({"paraphrase_column": None, "templates": ["Please solve: {question}", "{question} Show each step."]},
                {}),
    "r3l": ({"reflection_source": "task_feedback"}, {}),
    # the arithmetic task has no paraphrase column: two rewording templates give each group three variants
    "ic_grpo": ({"paraphrase_column": None, "templates": ["Please solve: {question}", "{question} Show each step."]},
                {}),
    "replay": ({}, {}),
    "rec": ({}, {"scale_rewards": "none", "loss_type": "bnpo"}),
    "reg_grpo": ({}, {}),
    "repexp": ({}, {}),
    # fewer meta-prover answers and episodes than the recipe: (episodes + 1) * prover_samples generations per rollout
    "mrt": ({"prover_samples": 2, "max_episodes": 3}, {}),
    # SLATE: steps are lines (the programmatic PRM's steps), k = 2 candidates per step, G / 2 steps per group
    "slate": ({"prm": "programmatic", "k": 2, "step_stops": ["\n"], "answer_stops": []}, {}),
    # two Monte-Carlo continuations per cut point and at most three cut points: (cuts * 2) generations per rollout
    "spo": ({"mc_samples": 2, "max_cutpoints": 3}, {}),
    # one on-policy pass is plain GRPO: the second micro-step of each generation batch is off-policy
    "r2vpo": ({}, {"steps_per_generation": 2}),
    # two arithmetic problems chained into one prompt; the chained verifier wants boxed answers
    "r_horizon": ({}, {}),
    "remax": ({}, {}),
    # the arithmetic answers are "Answer: N" lines, not <answer> tags: a failed rollout is cut before that line; a
    # probe phrase without the '<think> ' tag (the task's prompts do not use it)
    "rex_rag": ({"answer_pattern": "(?i)answer:", "probe_prefix": ""}, {}),
    "riskpo": ({"bundle_size": 2}, {}),
    # the reference solution is the demonstration (official: a teacher trace)
    "rl_plus": ({}, {"scale_rewards": "none", "loss_type": "dr_grpo"}),
    "rlpr": ({}, {}),
    # plain text: the reference solutions are the documents (cut into a context prompt and the next word; the other
    # columns are copied, so the task's verifier still scores the rows)
    "rlp": ({"text_column": "solution", "min_context_words": 1}, {"loss_type": "grpo"}),
    # the arithmetic completions end with "Answer: N" (no \\boxed); c scaled from the paper's 1000 (reasoning of
    # thousands of characters) to the 40-token completions
    "rlsp": ({"answer_pattern": "Answer:", "length_penalty": 2.0}, {}),
    # steps_per_generation=2 with one accumulation step: the second micro-step is off-policy, so U is computed
    "rover": ({}, {"steps_per_generation": 2}),
    "ruscarl": ({"judge": "rule"}, {}),
    "salt": ({}, {}),
    "scope": ({"mode": "reference_suffix", "prm": "programmatic"}, {"scale_rewards": "none", "loss_type": "dr_grpo"}),
    "seed_grpo": ({}, {}),
    "seele": ({}, {}),
    "siren": ({}, {}),
    "siri": ({}, {}),
    "steer": ({}, {}),
    # the benchmark's only reward is the binary verifier: the tiers are 0 (wrong) and alpha (right)
    "sweet_spot": ({}, {}),
    # the scripted judge; the official pairwise advantages replace TRL's, so the accuracy column is weighted 0 (the
    # judge reads correctness itself)
    "think_rm": ({"genrm": "scripted"}, {"reward_weights": [0.0]}),
    "thr": ({}, {}),
    # the arithmetic rows have no urpo_kind column: every group is open-ended, the policy judges it (max_unparsable
    # 1: the small policy rarely writes a well-formed <scores> list, its groups then get a neutral advantage); no judge
    # rows, so no urpo_judge column
    "urpo": ({"default_kind": "open", "max_unparsable": 1.0, "judge_weight": 0.0}, {}),
    # stride scaled from the script's 40 to the short benchmark completions
    "verl_erank": ({"stride": 4}, {}),
}


# The learning benchmark's real-model mode (``bench_learning.py --model smollm2``): SmolLM2-135M-Instruct with LoRA on
# the one-operation problems (level 0; it solves none of level 1's two-operation chains) with the format spelled out in
# the prompt (``make_dataset(..., instruction=...)``).
REAL_MODEL_SETTINGS: dict[str, Any] = {
    "levels": (0,),
    "num_generations": 8,
    "per_device_train_batch_size": 64,
    "max_completion_length": 64,
    "temperature": 1.0,
    "learning_rate": 1e-4,
    "train_size": 1024,
    "eval_size": 128,
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}
# Options that only made sense for the character-level tokenizer (every token one character): defaults instead.
REAL_MODEL_PLUGIN_SETTINGS: dict[str, tuple[dict, dict]] = {
    "cure": ({}, {}),
}


def real_model_grpo_fields(device: str) -> dict:
    """GRPOConfig fields of the real-model mode on ``device`` ("cuda": bf16 autocast; "cpu": float32)."""
    r = REAL_MODEL_SETTINGS
    return dict(num_generations=r["num_generations"], per_device_train_batch_size=r["per_device_train_batch_size"],
                max_completion_length=r["max_completion_length"], temperature=r["temperature"],
                learning_rate=r["learning_rate"], use_cpu=device == "cpu", bf16=device == "cuda")


def load_real_model(device: str):
    """``(path, tokenizer)`` of ``builtin:smollm2`` (converted once into the cache), the tokenizer padded on the left
    for batched generation."""
    from transformers import AutoTokenizer

    from trl_plugins.runtime.models import smollm2_path

    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # transformers < 5.2x leaves the converted GGUF tokenizer without one
        tokenizer.pad_token = tokenizer.eos_token
    return path, tokenizer


def real_model_lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **REAL_MODEL_SETTINGS["lora"])


# Smaller steps for the smoke modes (--tiny): they check the plumbing, not the numbers.
SMOKE_OVERRIDES = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 12}


def stack_settings(names: list[str]) -> tuple[dict, dict]:
    """Merged plugin options and GRPOConfig overrides of a stack (later plugins win on a GRPOConfig clash)."""
    options, overrides = {}, {}
    for name in names:
        opts, over = PLUGIN_SETTINGS.get(name, ({}, {}))
        if opts:
            options[name] = dict(opts)
        overrides.update(over)
    return options, overrides


def set_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


# The benchmarks pin the demo's settings (warm start and GRPO run) as they were when the published numbers were
# taken, so that tuning ``DemoSettings`` for the demo does not silently change what the benchmarks measure. With these
# the warm-started model's sampled pass rate (T=1) on held-out level-1/2 problems is about 15 %.
BENCH_SETTINGS: dict[str, Any] = {
    "seed": 0,
    "levels": (1, 2),
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 256,
    "warm_start_steps": 600,
    "warm_start_lr": 3e-3,
    "warm_start_batch_size": 32,
    "warm_start_informal_fraction": {1: 0.2, 2: 0.7},
    "grpo_learning_rate": 5e-5,
    "num_generations": 8,
    "per_device_train_batch_size": 64,
    "max_completion_length": 40,
    "temperature": 1.0,
    "train_size": 1024,
    "eval_size": 128,
}


def demo_settings():
    """``DemoSettings`` with the benchmark's pinned values (:data:`BENCH_SETTINGS`)."""
    import dataclasses

    from trl_plugins.tasks.tiny import DemoSettings

    names = {f.name for f in dataclasses.fields(DemoSettings)}
    return dataclasses.replace(DemoSettings(), **{k: v for k, v in BENCH_SETTINGS.items() if k in names})


#: The plugins of PLUGIN_SETTINGS that act on multi-turn tool rollouts only (see the comment there): on the
#: arithmetic task they equal vanilla GRPO, so the learning benchmark's arithmetic modes leave them out (they are in
#: its ``--task tools`` mode and in the overhead benchmark).
#: Named variants of one plugin on the arithmetic task (``plugin:variant`` in the benchmarks' method / configuration
#: lists): the plugin with these options on top of its ``PLUGIN_SETTINGS``.
PLUGIN_VARIANTS: dict[str, dict] = {
    "laser:laser_de": {"variant": "laser_de"},
    "dler:difficulty": {"difficulty_aware": True},
    "ares:branching": {"branch_rollouts": 4},
    "polychromic:vines": {"rollout_states": 1, "vines": 4},
    # SPO-tree: a 3-3 tree of 16-token segments per prompt (9 leaves for G = 8; the official 6-6-6 is 258 segments)
    "spo:tree": {"mode": "tree", "branch_factors": [3, 3], "segment_tokens": 16},
    # SPEAR's replay batch, scaled to the learning table's 40 steps of 64 rollouts: the gate at one step's rollouts
    # (official 2048, a buffer the run never fills), the coefficient ramp over half the run (official 300 steps)
    "replay:spear": {"advantage": "spear_baseline", "gate_capacity": 64, "replay_coef_warmup_steps": 20},
}
TOOL_ONLY_PLUGINS = ("arpo", "aspo", "igpo", "otc_po", "salt", "search_r2")


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`load_demo_model` caches the warm-started tiny model (kepo's local teacher in the benchmarks: the
    only model they have; the folder exists once the demo model was built)."""
    return Path(cache_dir or DEFAULT_CACHE) / f"tiny-{demo_settings().cache_key()}"


def load_demo_model(cache_dir: str | Path | None = None, verbose: bool = False):
    """``(model, tokenizer)``: the demo's warm-started tiny model (built once, then loaded from the cache)."""
    from trl_plugins.tasks.tiny import demo_model

    return demo_model(cache_dir or DEFAULT_CACHE, demo_settings(), verbose=verbose)


PLUGIN_SETTINGS["kepo"][0]["teacher_model"] = str(demo_model_dir())
PLUGIN_SETTINGS["listener"][0]["teacher_model"] = str(demo_model_dir())
PLUGIN_SETTINGS["rapo_retention"][0]["teacher_model"] = str(demo_model_dir())
PLUGIN_SETTINGS["armed"][0]["embedder_model"] = str(demo_model_dir())


def load_model(cache_dir: str | Path | None = None, untrained: bool = False):
    """The warm-started demo model, or (``untrained``) a freshly initialised one of the same shape (smoke runs)."""
    if not untrained:
        return load_demo_model(cache_dir)
    from trl_plugins.tasks.tiny import build_tiny_model, build_tokenizer

    s = demo_settings()
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=s.seed, hidden_size=s.hidden_size, num_layers=s.num_layers,
                             num_heads=s.num_heads, intermediate_size=s.intermediate_size)
    return model, tokenizer


def base_config_fields(output_dir: str, seed: int = 0, **overrides: Any) -> dict:
    """GRPOConfig fields of the demo's GRPO run (``DemoSettings.grpo_config_fields``), quiet; 4 steps by default."""
    fields = demo_settings().grpo_config_fields(output_dir, seed=seed)
    fields.update(max_steps=4, disable_tqdm=True, log_level="error")
    fields.update(overrides)
    return fields


def make_trainer(
    kind: str,
    model,
    tokenizer,
    train_dataset,
    reward_funcs: list,
    output_dir: str,
    plugins: list[str] | None = None,
    plugin_config: dict | None = None,
    seed: int = 0,
    peft_config=None,
    trainer_kwargs: dict | None = None,
    **overrides: Any,
):
    """``kind="vanilla"``: ``trl.GRPOTrainer`` + ``GRPOConfig``; ``kind="plugin"``: ``PluginGRPOTrainer``.

    The model is used as given (pass a copy, or a path). ``peft_config`` goes to the trainer (LoRA);
    ``trainer_kwargs`` are further trainer arguments (TRL's ``tools`` / ``environment_factory``). Console
    printing of logs is switched off.
    """
    import warnings

    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_plugins import PluginGRPOConfig, PluginGRPOTrainer

    fields = base_config_fields(output_dir, seed=seed, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "vanilla":
            args = GRPOConfig(**fields)
            trainer = GRPOTrainer(
                model=model, reward_funcs=list(reward_funcs), args=args, train_dataset=train_dataset,
                processing_class=tokenizer, peft_config=peft_config, **(trainer_kwargs or {}),
            )
        elif kind == "plugin":
            args = PluginGRPOConfig(
                plugins=list(plugins or []), plugin_config=copy.deepcopy(plugin_config or {}), **fields
            )
            trainer = PluginGRPOTrainer(
                model=model, reward_funcs=list(reward_funcs), args=args, train_dataset=train_dataset,
                processing_class=tokenizer, peft_config=peft_config, **(trainer_kwargs or {}),
            )
        else:
            raise ValueError(f"kind must be 'vanilla' or 'plugin', got {kind!r}")
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    return trainer


# ------------------------------------------------------------------------------------------------ memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mib() -> float | None:
    """Current resident set size of this process (MiB), from ``/proc/self/status`` (Linux)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_rss_mib() -> float | None:
    """Peak resident set size (``VmHWM``, MiB) since the last :func:`reset_peak_rss`."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB, never reset
    return kib / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def profiled_peak_mib(fn) -> dict:
    """Run ``fn()`` under ``torch.profiler`` with ``profile_memory=True``; peak of live tensor bytes (MiB).

    Every tensor allocation and free of torch's CPU allocator is an event (``[memory]``, signed bytes); their
    running sum in time order, from 0 at the start of ``fn``, peaks at the returned ``peak_mib``.
    ``largest_mib`` is the largest single allocation. Python objects are not counted.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    cur = peak = largest = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
        largest = max(largest, n)
    return {"peak_mib": peak / 2**20, "largest_mib": largest / 2**20, "net_mib": cur / 2**20}


def machine_info() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def device_name(device: str) -> str:
    """The accelerator's name for a result's header (``cuda``: the first GPU's), else "CPU"."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return "CPU"


def weights_sha256(model_dir: Path) -> str | None:
    """First 16 hex digits of the SHA-256 of the warm-started model's weights file. The warm start is deterministic on
    one machine but not bit-identical across machines (CPU kernels), so this tells which model a table was measured
    with."""
    import hashlib

    path = model_dir / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def median(values: list[float]) -> float:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    n = len(vals)
    return vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])


def quantile(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    pos = q * (len(vals) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)

