"""Overhead and memory of ``PluginGRPOTrainer`` against ``trl.GRPOTrainer``, side by side in one process.

Part 1 (trainer): for each configuration -- no plugins, eight no-op plugins implementing every hook, and each
built-in plugin alone with settings that make it act (``bench_common.PLUGIN_SETTINGS``) -- a vanilla
``trl.GRPOTrainer`` (A) and a ``PluginGRPOTrainer`` (B) are built on copies of the warm-started tiny model with
the same GRPOConfig fields, then trained in interleaved blocks A B B A A B ... (``--repeats`` blocks each). Every
block restores the initial weights, a fresh optimizer and the seed, and trains ``--steps`` optimizer steps; the
first step of a block is a warm-up and is not counted. Per block we record

* step time: CPU time of the process (``time.process_time``; one torch thread, so this is the work done, and it is
  far less sensitive than wall time to other processes on a shared machine) and wall time from ``on_step_begin``
  to ``on_step_end`` (generation, scoring, plugin stages, loss, backward and optimizer step), median over the
  block's counted steps; TRL's own ``step_time`` metric (wall time inside ``training_step``, i.e. without the
  optimizer step) is recorded too;
* peak memory, two ways: (a) the peak of live tensor bytes above the start of one extra 1-step block run under
  ``torch.profiler`` with ``profile_memory=True`` (every allocation and free of torch's CPU allocator, summed in
  time order: deterministic, but Python objects are not counted); (b) the growth of the process's peak resident
  set size during each timed block (the kernel's ``VmHWM``, reset through ``/proc/self/clear_refs`` at the start
  of the block, minus the RSS at that moment): everything the block touches, at page granularity.

The ratio of a configuration is the median over block pairs of ``median step CPU time B / median of A``
(pairs are adjacent blocks, so slow drifts of a shared machine cancel). Acting plugins change what is generated
(extra rollouts, other prompts), so their ratio is the method's cost, not only the framework's; the extra
completions each plugin requested per step (``trainer.generation_service.total``) are reported beside it.

Tool-agent mode (``--task tools``): the same A/B method on the agentic benchmark's multi-turn tool task
(``scripts/bench_agentic.py``: the tool-warm-started tiny model, the bundled ``ToolEnvironment`` through TRL's
``environment_factory``, the verifier ``tool_answer_reward``, its GRPO sizes and training questions, which carry the
``gold_calls`` and ``entities`` columns that funrl, matchtir and e_grpo read), for the agent plugins
(:data:`AGENT_CONFIGS`; options from ``bench_agentic.plugin_settings``, i.e. ``bench_common.PLUGIN_SETTINGS`` or the
plugin's defaults, and its named variants such as ``igpo_a2tgpo``). Its rows also record TRL's tool calls per rollout
(``tools/call_frequency``, a table column) and completion tokens per rollout in the counted steps
(``completions/mean_length``, in the JSON): a plugin that changes the update changes the later steps' rollouts, and
so their cost. On the arithmetic task a configuration may name a
variant of a plugin as ``plugin:variant`` (:data:`VARIANTS`, e.g. ``laser:laser_de``).

Part 2 (LM-head statistics): ``trl_plugins.runtime.head_stats.HeadStats`` with a random head of V=150,000 x d=64 and
1024 valid completion tokens computes Lp-Reg's min-p proxy log-probs and SIREN's nucleus entropy (no grad, and
with grad + backward) at chunk sizes 1024, 256 and 64; we measure the peak of live tensor bytes (profiler, as
above), the largest single allocation and the peak RSS growth, against the (T, V) float32 logits a full-logits
implementation needs (586 MiB), and run that full-logits computation for reference.

    python scripts/bench_overhead.py                 # everything (about 25-30 min on a quiet 2-core machine)
    python scripts/bench_overhead.py --quick         # none, noop8 and a few plugins, fewer repeats
    python scripts/bench_overhead.py --configs none noop8 lp_reg --repeats 12
    python scripts/bench_overhead.py --profile noop8 # cProfile of the plugin path (top entries)
    python scripts/bench_overhead.py --head-stats-only
    python scripts/bench_overhead.py --task tools --skip-head-stats   # the agent plugins on the tool task

Results go to ``docs/benchmarks/overhead.json`` (``head_stats.json`` with ``--head-stats-only``) and
(``--write-docs``) the overhead / head-stats sections of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

QUICK_PLUGINS = ["canon", "lp_reg", "hint_scaffold", "fbos_rl", "scope"]
NUM_NOOP = 8
TASKS = ("arithmetic", "tools")
#: Default configurations of ``--task tools``: the multi-turn tool-agent plugins (``igpo_a2tgpo``: IGPO's A2TGPO mode,
#: a named variant of ``bench_agentic.VARIANTS``).
AGENT_CONFIGS = ["igpo", "igpo_a2tgpo", "otc_po", "aspo", "salt", "epo", "matchtir", "e_grpo", "ikea", "funrl"]
#: Named variants of one plugin on the arithmetic task (``plugin:variant`` in ``--configs``).
VARIANTS = bc.PLUGIN_VARIANTS


# ------------------------------------------------------------------------------------------------ no-op plugins


def register_noop_plugins(n: int = NUM_NOOP) -> list[str]:
    """Register ``n`` plugins ``bench_noop_0..n-1`` that implement every hook and change nothing."""
    from trl_plugins import Plugin, hookimpl, register_plugin

    class NoopPlugin(Plugin):
        version = "0.0.0"
        paper = "none (benchmark)"
        summary = "Implements every hook and does nothing."

        @hookimpl
        def trl_plugins_configure(self, trainer, args):
            return None

        @hookimpl
        def trl_plugins_on_step_end(self, trainer, step):
            return None

        @hookimpl
        def trl_plugins_state_dict(self):
            return {}

        @hookimpl
        def trl_plugins_load_state_dict(self, state):
            return None

        @hookimpl
        def trl_plugins_reward_functions(self, args):
            return []

        @hookimpl
        def trl_plugins_transform_rewards(self, ctx):
            return None

        @hookimpl
        def trl_plugins_train_sampler(self, trainer, sampler, dataset):
            return None

        @hookimpl
        def trl_plugins_generation_prompts(self, ctx):
            return None

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            return None

        @hookimpl
        def trl_plugins_transform_advantages(self, ctx):
            return None

        @hookimpl
        def trl_plugins_loss_advantages(self, ctx):
            return None

        @hookimpl
        def trl_plugins_loss(self, ctx):
            return None

    names = []
    for i in range(n):
        cls = type(f"BenchNoop{i}", (NoopPlugin,), {"name": f"bench_noop_{i}"})
        register_plugin(cls)
        names.append(cls.name)
    return names


# ------------------------------------------------------------------------------------------------ trainer part


def config_plugins(name: str, noop_names: list[str], task: str = "arithmetic") -> tuple[list[str], dict, dict]:
    """(plugins, plugin_config, GRPOConfig overrides) of a benchmark configuration: ``none``, ``noop8``, a plugin, a
    variant (arithmetic: ``plugin:variant`` of :data:`VARIANTS`; tools: ``bench_agentic.VARIANTS``) or a stack
    ``a+b``."""
    if name == "none":
        return [], {}, {}
    if name == "noop8":
        return list(noop_names), {}, {}
    if task == "tools":
        import bench_agentic as ba

        plugins, options, overrides = [], {}, {}
        for part in name.split("+"):
            plugin, opts, over = ba.plugin_settings(part)
            plugins.append(plugin)
            if opts:
                options[plugin] = dict(opts)
            overrides.update(over)
        return plugins, options, overrides
    parts = name.split("+")
    for part in parts:
        if ":" in part and part not in VARIANTS:
            raise ValueError(f"unknown variant {part!r}; allowed: {sorted(VARIANTS)}")
    plugins = [part.split(":")[0] for part in parts]
    options, overrides = bc.stack_settings(plugins)
    for part, plugin in zip(parts, plugins):
        if part in VARIANTS:
            options[plugin] = {**options.get(plugin, {}), **VARIANTS[part]}
    return plugins, options, overrides


def task_setup(task: str, cache_dir=None, untrained: bool = False) -> dict:
    """Model, tokenizer, training set, reward functions, trainer arguments and GRPOConfig fields of ``task``.

    ``arithmetic``: the warm-started demo model on the chained-arithmetic problems (:func:`bench_common.load_model`).
    ``tools``: the agentic benchmark's set-up, built by ``scripts/bench_agentic.py`` (tool-warm-started model, training
    questions, ``environment_factory``, verifier, GRPO sizes).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if task == "tools":
        import bench_agentic as ba

        model, tokenizer = ba.load_model(cache_dir, untrained=untrained)
        train, _ = ba.datasets(ba.TOOL_TASK["train_size"], 1)
        return {"model": model, "tokenizer": tokenizer, "dataset": train, "reward_funcs": ba.reward_funcs(),
                "trainer_kwargs": ba.trainer_kwargs(), "fields": ba.grpo_fields(untrained)}
    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset

    model, tokenizer = bc.load_model(cache_dir, untrained=untrained)
    s = bc.demo_settings()
    fields = dict(bc.SMOKE_OVERRIDES) if untrained else {}
    return {"model": model, "tokenizer": tokenizer, "dataset": make_dataset(256, levels=s.levels, seed=0, split="train"),
            "reward_funcs": [accuracy_reward], "trainer_kwargs": None, "fields": fields}


class _StepTimer:
    """TrainerCallback recording wall time per optimizer step (built lazily: transformers import is slow)."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def __init__(self):
                self.times: list[float] = []  # wall seconds
                self.cpu_times: list[float] = []  # CPU seconds of this process
                self._t0 = self._c0 = None

            def on_step_begin(self, args, state, control, **kwargs):
                self._t0, self._c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter() - self._t0)
                self.cpu_times.append(time.process_time() - self._c0)

        return StepTimer()


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_block(trainer, timer, init_state: dict, steps: int, seed: int) -> dict:
    """Train ``steps`` steps from the initial weights; step times (first dropped), peak RSS growth, rollouts."""
    from transformers import set_seed

    trainer.model.load_state_dict(init_state)
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.args.max_steps = steps
    timer.times.clear()
    timer.cpu_times.clear()
    service = getattr(trainer, "generation_service", None)
    extra0 = service.total if service is not None else 0
    _release_memory()
    set_seed(seed)
    bc.reset_peak_rss()
    rss0 = bc.rss_mib()
    trainer.train()
    peak = bc.peak_rss_mib()
    extra = (service.total - extra0) if service is not None else 0
    trl_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    # TRL's tool-loop metric (tool calls per rollout), logged when the trainer has tools
    calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    # completion tokens per rollout (TRL's metric): a plugin that changes the update changes the later steps' rollouts
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history[1:] if "completions/mean_length" in h]
    return {
        "step_s": bc.median(timer.times[1:]),
        "step_cpu_s": bc.median(timer.cpu_times[1:]),
        "trl_step_s": bc.median(trl_times[1:]),
        "peak_rss_growth_mib": None if peak is None or rss0 is None else max(0.0, peak - rss0),
        "extra_rollouts_per_step": extra / max(1, steps),
        "tool_calls_per_rollout": bc.median(calls) if calls else None,
        "completion_tokens_counted_steps": bc.median(lengths) if lengths else None,
    }


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return bc.median(values) if values else None


def bench_config(name: str, noop_names, setup: dict, repeats: int, steps: int, seed: int,
                 task: str = "arithmetic") -> dict:
    """One configuration's A/B blocks on ``setup`` (:func:`task_setup`); the row of the table."""
    model, tokenizer, dataset = setup["model"], setup["tokenizer"], setup["dataset"]
    plugins, options, overrides = config_plugins(name, noop_names, task)
    overrides = {**setup["fields"], **overrides}
    out_dir = tempfile.mkdtemp(prefix="bench_overhead_")
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainers, timers = {}, {}

    def build(kind):
        trainers[kind] = bc.make_trainer(
            kind, copy.deepcopy(model), tokenizer, dataset, setup["reward_funcs"], out_dir,
            plugins=plugins, plugin_config=options, seed=seed, trainer_kwargs=setup["trainer_kwargs"], **overrides,
        )
        timers[kind] = _StepTimer.make()
        trainers[kind].add_callback(timers[kind])

    for kind in ("vanilla", "plugin"):
        build(kind)
    # A plugin that replaces the training sampler keeps per-run state tied to that sampler: such a trainer is
    # rebuilt before each block (construction is not timed) instead of calling train() on it again.
    rebuild = trainers["plugin"].plugin_stack.has("trl_plugins_train_sampler") and name != "noop8"
    blocks = {"vanilla": [], "plugin": []}
    for r in range(repeats):
        order = ("vanilla", "plugin") if r % 2 == 0 else ("plugin", "vanilla")
        for kind in order:
            if rebuild and kind == "plugin" and r > 0:
                build(kind)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                blocks[kind].append(run_block(trainers[kind], timers[kind], init_state, steps, seed))
    memory = {}
    for kind in ("vanilla", "plugin"):  # one profiled block each: peak of live tensor bytes (deterministic)
        if rebuild and kind == "plugin":
            build(kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            memory[kind] = bc.profiled_peak_mib(
                lambda: run_block(trainers[kind], timers[kind], init_state, 1, seed)
            )
    trainers.clear()
    timers.clear()
    _release_memory()
    ratios = [b["step_cpu_s"] / a["step_cpu_s"] for a, b in zip(blocks["vanilla"], blocks["plugin"])]
    wall_ratios = [b["step_s"] / a["step_s"] for a, b in zip(blocks["vanilla"], blocks["plugin"])]
    trl_ratios = [b["trl_step_s"] / a["trl_step_s"] for a, b in zip(blocks["vanilla"], blocks["plugin"])]
    mem_a = [b["peak_rss_growth_mib"] for b in blocks["vanilla"] if b["peak_rss_growth_mib"] is not None]
    mem_b = [b["peak_rss_growth_mib"] for b in blocks["plugin"] if b["peak_rss_growth_mib"] is not None]
    return {
        "config": name,
        "plugins": plugins if name != "noop8" else [f"{NUM_NOOP} no-op plugins"],
        "plugin_config": options,
        "grpo_overrides": overrides,
        "repeats": repeats,
        "steps_per_block": steps,
        "step_s_vanilla": bc.median([b["step_s"] for b in blocks["vanilla"]]),
        "step_s_plugin": bc.median([b["step_s"] for b in blocks["plugin"]]),
        "step_cpu_s_vanilla": bc.median([b["step_cpu_s"] for b in blocks["vanilla"]]),
        "step_cpu_s_plugin": bc.median([b["step_cpu_s"] for b in blocks["plugin"]]),
        "wall_ratio": bc.median(wall_ratios),
        "ratio": bc.median(ratios),
        "ratio_q25": bc.quantile(ratios, 0.25),
        "ratio_q75": bc.quantile(ratios, 0.75),
        "trl_step_time_ratio": bc.median(trl_ratios),
        "peak_rss_growth_mib_vanilla": bc.median(mem_a),
        "peak_rss_growth_mib_plugin": bc.median(mem_b),
        "extra_rollouts_per_step": bc.median([b["extra_rollouts_per_step"] for b in blocks["plugin"]]),
        "tool_calls_per_rollout_vanilla": _median_or_none([b.get("tool_calls_per_rollout") for b in blocks["vanilla"]]),
        "tool_calls_per_rollout_plugin": _median_or_none([b.get("tool_calls_per_rollout") for b in blocks["plugin"]]),
        "completion_tokens_vanilla": _median_or_none([b.get("completion_tokens_counted_steps")
                                                      for b in blocks["vanilla"]]),
        "completion_tokens_plugin": _median_or_none([b.get("completion_tokens_counted_steps")
                                                     for b in blocks["plugin"]]),
        "peak_tensor_mib_vanilla": memory["vanilla"]["peak_mib"],
        "peak_tensor_mib_plugin": memory["plugin"]["peak_mib"],
        "blocks": blocks,
    }


def profile_config(name: str, noop_names, setup: dict, steps: int, seed: int, top: int,
                   task: str = "arithmetic") -> str:
    """cProfile of plugin-trainer blocks; top entries by cumulative time inside trl_plugins and the plugins."""
    import cProfile
    import io
    import pstats

    model, tokenizer, dataset = setup["model"], setup["tokenizer"], setup["dataset"]
    plugins, options, overrides = config_plugins(name, noop_names, task)
    overrides = {**setup["fields"], **overrides}
    out_dir = tempfile.mkdtemp(prefix="bench_profile_")
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = []
    for kind in ("vanilla", "plugin"):
        trainer = bc.make_trainer(kind, copy.deepcopy(model), tokenizer, dataset, setup["reward_funcs"], out_dir,
                                  plugins=plugins, plugin_config=options, seed=seed,
                                  trainer_kwargs=setup["trainer_kwargs"], **overrides)
        timer = _StepTimer.make()
        trainer.add_callback(timer)
        run_block(trainer, timer, init_state, 1, seed)  # warm-up
        prof = cProfile.Profile(time.process_time)  # CPU time: robust on a shared machine
        prof.enable()
        run_block(trainer, timer, init_state, steps, seed)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
        # self time (tottime) of Python frames in the framework, plugin and pluggy files: the layer's own Python work
        layer_dirs = ("/trl_plugins/", "/plugins/", "/pluggy/")
        layer = {k: v for k, v in stats.stats.items() if any(p in k[0] for p in layer_dirs)}
        layer_self = sum(v[2] for v in layer.values())
        total = stats.total_tt
        buf.write(f"profiled CPU time {total:.3f}s; self time in trl_plugins/ + plugins/ + pluggy frames "
                  f"{layer_self:.4f}s "
                  f"({100 * layer_self / total:.2f}% of the profiled steps)\n")
        top_self = sorted(layer.items(), key=lambda kv: -kv[1][2])[:15]
        buf.write("top self-time entries of the plugin layer:\n")
        for (fname, line, func), v in top_self:
            buf.write(f"  {v[2]:8.4f}s self  {v[3]:8.4f}s cum  {v[1]:6d} calls  {fname.split('/work/main/')[-1]}:{line}"
                      f"({func})\n")
        stats.print_stats(r"trl_plugins|plugins/|grpo_trainer", top)
        report.append(f"===== {kind} ({name}), {steps} steps =====\n" + buf.getvalue())
    return "\n".join(report)


# ------------------------------------------------------------------------------------------------ head stats part


def _measure(fn) -> dict:
    """Peak RSS growth and wall time of one call, then the peak of live tensor bytes of a profiled call."""
    _release_memory()
    bc.reset_peak_rss()
    rss0 = bc.rss_mib()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = bc.peak_rss_mib()
    _release_memory()
    prof = bc.profiled_peak_mib(fn)
    return {
        "peak_tensor_mib": round(prof["peak_mib"], 1),
        "largest_tensor_mib": round(prof["largest_mib"], 1),
        "peak_rss_growth_mib": None if peak is None or rss0 is None else round(peak - rss0, 1),
        "seconds": round(seconds, 2),
    }


def bench_head_stats(vocab: int, dim: int, tokens: int, chunks: list[int], seed: int = 0) -> dict:
    import torch

    from trl_plugins.runtime.head_stats import HeadStats

    torch.manual_seed(seed)
    B = 8
    C = tokens // B
    L = C + 17  # a short prompt before the completion
    weight = torch.randn(vocab, dim) / dim**0.5
    hidden_base = torch.randn(B, L, dim)
    mask = torch.ones(B, C, dtype=torch.long)
    labels = torch.randint(0, vocab, (B, C))
    full_logits_mib = tokens * vocab * 4 / 2**20
    rows = []

    def stats(chunk, with_grad=False):
        hidden = hidden_base.clone().requires_grad_(with_grad)
        return hidden, HeadStats(hidden, C, mask, weight, chunk_size=chunk)

    for chunk in chunks:
        budget_mib = min(chunk, tokens) * vocab * 4 / 2**20

        def lp_reg():
            _, hs = stats(chunk)
            hs.min_p_logprob(labels, kappa=0.02)

        def siren_nograd():
            _, hs = stats(chunk)
            hs.top_p_entropy(0.8, k_max=2048, mode="siren")

        def siren_grad():
            hidden, hs = stats(chunk, with_grad=True)
            hs.top_p_entropy_with_grad(0.8, k_max=2048, mode="siren").sum().backward()

        for stat, fn in (("lp_reg min_p_logprob", lp_reg), ("siren top_p_entropy (no grad)", siren_nograd),
                         ("siren top_p_entropy_with_grad + backward", siren_grad)):
            m = _measure(fn)
            m.update(statistic=stat, chunk=chunk, chunk_block_mib=round(budget_mib, 1),
                     peak_over_chunk_block=round(m["peak_tensor_mib"] / budget_mib, 2))
            rows.append(m)
            print(f"  head stats  chunk {chunk:5d}  {stat:42s} peak tensors {m['peak_tensor_mib']:8.1f} MiB  "
                  f"largest {m['largest_tensor_mib']:7.1f} MiB  peak RSS +{m['peak_rss_growth_mib']} MiB  "
                  f"({m['seconds']:.1f}s)", flush=True)

    def full_logits():  # what a full-logits implementation of the min-p proxy would do
        with torch.no_grad():
            h = hidden_base[:, -(C + 1):-1].reshape(-1, dim)
            z = h @ weight.t()  # (T, V) float32
            keep = z >= z.amax(-1, keepdim=True) + torch.log(torch.tensor(0.02))
            lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), -1)
            _ = z.gather(-1, labels.reshape(-1, 1)).squeeze(-1) - lse

    ref = _measure(full_logits)
    ref.update(statistic="full (T, V) logits, min-p proxy (reference)", chunk=None, chunk_block_mib=None,
               peak_over_chunk_block=None)
    rows.append(ref)
    print(f"  full logits reference: peak tensors {ref['peak_tensor_mib']} MiB, largest {ref['largest_tensor_mib']} "
          f"MiB, peak RSS +{ref['peak_rss_growth_mib']} MiB", flush=True)
    return {"vocab": vocab, "dim": dim, "valid_tokens": tokens, "full_logits_fp32_mib": round(full_logits_mib, 1),
            "rows": rows}


# ------------------------------------------------------------------------------------------------ report


def markdown(result: dict, part: str) -> str:
    """Markdown of one part of the result: ``"trainer"`` or ``"head_stats"``."""
    lines = []
    info = result["machine"]
    lines.append(f"Measured {info['time']} on {info['cpu_count']} CPU cores (torch threads: {info['torch_threads']}), "
                 f"load average at start {info['loadavg_1_5_15']}, at end {result.get('loadavg_end')}; "
                 f"torch {info['torch']}, Python {info['python']}.")
    lines.append("")
    if part == "trainer" and result.get("trainer"):
        t = result["trainer"]
        if t.get("task") == "tools":
            model = ("an untrained tiny model (smoke run)" if t.get("untrained") else
                     "the tiny model warm-started on arithmetic and then on tool-use traces")
            w = t.get("tool_warm_start")
            if w and not t.get("untrained"):
                model += (f" ({w['steps']} supervised steps of {w['batch_size']} traces, shortcut fractions "
                          f"{w['shortcut_fraction']})")
            setting = (f"multi-turn tool task of `scripts/bench_agentic.py` ({model}; bundled `ToolEnvironment` through TRL's `environment_factory`, "
                       "verifier `tool_answer_reward`; both trainers of a pair get the same environment and reward), "
                       f"G={t['num_generations']}, {t['batch']} rollouts per step, max {t['max_completion_length']} "
                       f"completion tokens (tool results included), at most {t['max_tool_calling_iterations']} tool turns; "
                       "tool calls / rollout = TRL's `tools/call_frequency`, median over blocks")
        else:
            setting = (f"tiny warm-started model, G={t['num_generations']}, {t['batch']} completions per step, max "
                       f"{t['max_completion_length']} completion tokens")
        lines.append(f"Trainer overhead: interleaved block pairs (A B B A ...; count per row), "
                     f"{t['steps']} steps per block (first step of each block not counted), {setting}. Step time = CPU time of the process for one optimizer step (one torch "
                     "thread, so "
                     "this is the work done; on a shared machine it is far less noisy than wall time, which is given "
                     "too); ratio = median over block pairs of (plugin / vanilla) median step CPU time, with its "
                     "interquartile range. Peak tensor memory = "
                     "peak of live tensor bytes (torch's CPU allocator, via `torch.profiler(profile_memory=True)`) "
                     "above the start of a 1-step block: deterministic, Python objects not counted. Peak RSS growth = "
                     "growth of the process's peak resident set during a block (median over blocks; noisier: "
                     "allocator caching and page granularity).")
        lines.append("")
        tools = t.get("task") == "tools"
        lines.append("| configuration | pairs | vanilla step CPU (s) | plugin step CPU (s) | ratio (CPU) | IQR | "
                     "wall-time ratio | TRL step_time ratio (wall) | "
                     "extra rollouts / step | " + ("tool calls / rollout vanilla / plugin | " if tools else "")
                     + "peak tensor MiB vanilla / plugin | peak RSS growth MiB vanilla / plugin | load after |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if tools else ""))
        for row in t["rows"]:
            name = {"none": "no plugins", "noop8": f"{NUM_NOOP} no-op plugins (every hook)"}.get(row["config"],
                                                                                              row["config"])
            load = row.get("loadavg_after")
            lines.append(
                f"| {name} | {row['repeats']} | {row['step_cpu_s_vanilla']:.3f} | {row['step_cpu_s_plugin']:.3f} | "
                f"**{row['ratio']:.3f}** | {row['ratio_q25']:.3f}-{row['ratio_q75']:.3f} | {row['wall_ratio']:.3f} | "
                f"{row['trl_step_time_ratio']:.3f} | "
                f"{row['extra_rollouts_per_step']:.1f} | "
                + (f"{_fmt(row.get('tool_calls_per_rollout_vanilla'))} / "
                   f"{_fmt(row.get('tool_calls_per_rollout_plugin'))} | " if tools else "")
                + f"{row['peak_tensor_mib_vanilla']:.1f} / "
                f"{row['peak_tensor_mib_plugin']:.1f} | {row['peak_rss_growth_mib_vanilla']:.1f} / "
                f"{row['peak_rss_growth_mib_plugin']:.1f} | {load[0] if load else '-'} |"
            )
        if result.get("errors"):
            lines.append("")
            lines.append("Configurations that failed: " + "; ".join(f"{k}: {v}" for k, v in result["errors"].items()))
        if result.get("previous_commands"):
            lines.append("")
            machines = result.get("previous_machine") or [None] * len(result["previous_commands"])
            lines.append("Rows kept from earlier runs of this script (`--append`), listed first: " + "; ".join(
                f"`{c}`" + (f" (measured {m['time']}, load average at start {m['loadavg_1_5_15']})" if m else "")
                for c, m in zip(result["previous_commands"], machines) if c))
        lines.append("")
    if part == "head_stats" and result.get("head_stats"):
        h = result["head_stats"]
        lines.append(f"LM-head statistics (`HeadStats`): random head V={h['vocab']:,} x d={h['dim']}, "
                     f"{h['valid_tokens']} valid completion tokens; the (T, V) float32 logits a full-logits "
                     f"implementation holds are {h['full_logits_fp32_mib']} MiB. Peak tensors = peak of live tensor "
                     "bytes above the start of the call (torch profiler, `profile_memory=True`); chunk block = "
                     "chunk x V float32; peak RSS growth = the process's peak resident set during the call.")
        lines.append("")
        lines.append("| statistic | chunk | chunk block (MiB) | peak tensors (MiB) | peak / chunk block | "
                     "largest tensor (MiB) | peak RSS growth (MiB) | time (s) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in h["rows"]:
            lines.append(
                f"| {r['statistic']} | {r['chunk'] or '-'} | {r['chunk_block_mib'] or '-'} | "
                f"{r['peak_tensor_mib']} | {r['peak_over_chunk_block'] or '-'} | {r['largest_tensor_mib']} | "
                f"{r['peak_rss_growth_mib']} | {r['seconds']} |"
            )
        lines.append("")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_docs_section(section: str, body: str, command: str) -> Path:
    path = bc.ROOT / "docs" / "benchmarks.md"
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n" + f"{begin}\n{end}\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    block = f"{begin}\nCommand: `{command}`\n\n{body}\n{end}"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + block + tail)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"none, noop8 and {', '.join(QUICK_PLUGINS)}; 4 repeats")
    p.add_argument("--task", choices=TASKS, default="arithmetic",
                   help="arithmetic: the tiny demo model on the arithmetic task; tools: the agentic benchmark's "
                   f"multi-turn tool task (scripts/bench_agentic.py), default configurations none and "
                   f"{', '.join(AGENT_CONFIGS)}")
    p.add_argument("--tiny", action="store_true",
                   help="smoke mode: untrained model, none + noop8, 1 repeat, 2 steps, small head")
    p.add_argument("--configs", nargs="*", default=None,
                   help="configurations: none, noop8, plugin names, or stacks a+b (default: all)")
    p.add_argument("--repeats", type=int, default=None, help="block pairs per configuration (default 8; quick 4)")
    p.add_argument("--baseline-repeats", type=int, default=None,
                   help="block pairs for none and noop8 (default 16; quick 8)")
    p.add_argument("--steps", type=int, default=4, help="steps per block; the first is not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--cache-dir", default=None, help="warm-started model cache (default runs/bench_cache)")
    p.add_argument("--head-stats-only", action="store_true")
    p.add_argument("--skip-head-stats", action="store_true")
    p.add_argument("--head-vocab", type=int, default=150_000)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--head-tokens", type=int, default=1024)
    p.add_argument("--head-chunks", type=int, nargs="*", default=[1024, 256, 64])
    p.add_argument("--profile", default=None, metavar="CONFIG", help="cProfile one configuration and exit")
    p.add_argument("--json", default=None,
                   help="result file (default docs/benchmarks/overhead.json; head_stats.json with --head-stats-only)")
    p.add_argument("--write-docs", action="store_true", help="rewrite the overhead section of docs/benchmarks.md")
    p.add_argument("--render-only", action="store_true", help="only render --json into markdown (and the docs)")
    p.add_argument("--section", default="overhead",
                   help="docs/benchmarks.md section the trainer table goes to (another name: a second table beside "
                   "the first, e.g. for plugins added later, measured with its own command)")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --json for configurations not measured in this invocation")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_overhead.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    bc.set_threads(args.threads)
    result = {"command": command.strip(), "machine": bc.machine_info()}
    if args.json is None:
        name = "head_stats.json" if args.head_stats_only else "overhead.json"
        args.json = str(bc.ROOT / "docs" / "benchmarks" / name)
    tools = args.task == "tools"
    if args.tiny:
        configs, repeats, base_repeats, steps = ["none", "igpo_a2tgpo"] if tools else ["none", "noop8"], 1, 1, 2
        args.head_vocab, args.head_tokens, args.head_chunks = 20_000, 128, [64]
    elif tools:
        configs, repeats, base_repeats, steps = ["none", *AGENT_CONFIGS], 8, 16, args.steps
    elif args.quick:
        configs, repeats, base_repeats, steps = ["none", "noop8", *QUICK_PLUGINS], 4, 8, args.steps
    else:
        configs, repeats, base_repeats, steps = ["none", "noop8", *bc.PLUGIN_SETTINGS], 8, 16, args.steps
    if args.configs:
        configs = args.configs
    repeats = args.repeats or repeats
    base_repeats = args.baseline_repeats or (args.repeats or base_repeats)

    if args.render_only:  # re-render the docs sections from an earlier (possibly partial) result file
        result = json.loads(Path(args.json).read_text())
        for part, section in (("trainer", args.section), ("head_stats", "head_stats")):
            if result.get(part) and result[part].get("rows"):
                t = result[part]
                if part == "trainer" and "steps" not in t:
                    t.update(steps=t["rows"][0]["steps_per_block"], num_generations=bc.demo_settings().num_generations,
                             batch=bc.demo_settings().per_device_train_batch_size,
                             max_completion_length=bc.demo_settings().max_completion_length)
                md = markdown(result, part)
                print(md)
                if args.write_docs:
                    print(f"wrote {write_docs_section(section, md, result['command'])}")
        return 0
    if not args.head_stats_only or args.profile:
        noop_names = register_noop_plugins()
        setup = task_setup(args.task, args.cache_dir, untrained=args.tiny)
        s = bc.demo_settings()
        if args.profile:
            print(profile_config(args.profile, noop_names, setup, max(2, args.steps), args.seed, top=40,
                                 task=args.task))
            return 0
        fields = setup["fields"]
        meta = {  # the settings of the table, recorded with every (partial) result
            "repeats": repeats, "baseline_repeats": base_repeats, "steps": steps, "task": args.task,
            "untrained": bool(args.tiny),
            "num_generations": fields.get("num_generations", s.num_generations),
            "batch": fields.get("per_device_train_batch_size", s.per_device_train_batch_size),
            "max_completion_length": fields.get("max_completion_length", s.max_completion_length),
        }
        if tools:  # the agentic benchmark's own record of its settings (tool warm start included)
            import bench_agentic as ba

            meta.update(ba.result_fields(args.tiny))
        rows = []
        errors: dict[str, str] = {}
        previous = {}
        if args.append and Path(args.json).exists():
            old = json.loads(Path(args.json).read_text())
            previous = {r["config"]: r for r in (old.get("trainer") or {}).get("rows", [])}
            result["previous_commands"] = old.get("previous_commands", []) + [old.get("command")]
            result["previous_machine"] = old.get("previous_machine", []) + [old.get("machine")]
        for name in configs:
            previous.pop(name, None)  # measured again now
            reps = base_repeats if name in ("none", "noop8") else repeats
            t0 = time.perf_counter()
            try:
                row = bench_config(name, noop_names, setup, reps, steps, args.seed, task=args.task)
            except Exception as exc:  # noqa: BLE001 -- reported in the table, the other configurations go on
                import traceback

                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {exc}"
                result["errors"] = errors
                continue
            rows.append(row)
            print(f"{name:18s} CPU/step vanilla {row['step_cpu_s_vanilla']:.3f}s  "
                  f"plugin {row['step_cpu_s_plugin']:.3f}s  "
                  f"ratio {row['ratio']:.3f} [{row['ratio_q25']:.3f}, {row['ratio_q75']:.3f}]  wall ratio "
                  f"{row['wall_ratio']:.3f}  "
                  f"trl step_time ratio {row['trl_step_time_ratio']:.3f}  extra/step "
                  f"{row['extra_rollouts_per_step']:.1f}  peak RSS +{row['peak_rss_growth_mib_vanilla']:.1f} / "
                  f"+{row['peak_rss_growth_mib_plugin']:.1f} MiB  tensors {row['peak_tensor_mib_vanilla']:.1f} / "
                  f"{row['peak_tensor_mib_plugin']:.1f} MiB  tool calls/rollout "
                  f"{_fmt(row['tool_calls_per_rollout_vanilla'])} / {_fmt(row['tool_calls_per_rollout_plugin'])}  "
                  f"completion tokens (counted steps) {_fmt(row['completion_tokens_vanilla'])} / "
                  f"{_fmt(row['completion_tokens_plugin'])}  "
                  f"({time.perf_counter() - t0:.0f}s, "
                  f"load {bc.machine_info()['loadavg_1_5_15'][0]})", flush=True)
            row["loadavg_after"] = bc.machine_info()["loadavg_1_5_15"]
            partial = {**result, "trainer": {**meta, "rows": list(previous.values()) + rows, "partial": True}}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(partial, indent=1, default=str))
        rows = list(previous.values()) + rows  # configurations measured before and not asked for now come first
        result["trainer"] = {**meta, "rows": rows}
    if not args.skip_head_stats:
        result["head_stats"] = bench_head_stats(args.head_vocab, args.head_dim, args.head_tokens, args.head_chunks,
                                                args.seed)
    result["loadavg_end"] = bc.machine_info()["loadavg_1_5_15"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    for part, section in (("trainer", args.section), ("head_stats", "head_stats")):
        if result.get(part):
            md = markdown(result, part)
            print(md)
            if args.write_docs:
                print(f"wrote {write_docs_section(section, md, result['command'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
