#!/usr/bin/env python
"""GPU smoke test: every built-in plugin, and the recommended stacks, for a few steps in bf16 and QLoRA.

Offline by construction (GPU machines here reach nothing outside): the model is the bundled character-level tiny
Llama, built and saved locally, then **loaded by path** exactly as a hub model is loaded by name (4-bit NF4 through
bitsandbytes for QLoRA). Components that would be external (judge, PRM, teacher, encoder) use their offline backends
(rule judge, programmatic PRM, reference teacher) or the policy's own base model loaded by path (teachers, generative
RMs, encoder).

``--model smollm2`` runs the same on the offline real model ``builtin:smollm2`` (SmolLM2-135M-Instruct, BPE
tokenizer, chat template) instead, with the chat-message arithmetic dataset.

Runs (each a fresh trainer, ``--steps`` optimizer steps), for every setting in ``--settings``:

* ``<setting>/<plugin>``: each built-in plugin alone;
* ``<setting>/<stack>``: the recommended stacks (``STACKS``).

Settings: ``qlora`` (4-bit NF4 base through bitsandbytes, LoRA adapters, bf16 compute), ``lora`` (bf16 base, LoRA
adapters), ``bf16`` (full fine-tuning in bf16), ``fp32`` (full fine-tuning in float32, the CPU dry run), and
``vllm`` (LoRA in bf16 with ``use_vllm=True, vllm_mode="colocate"``; every run of it is recorded as "not run" with
the reason when the ``vllm`` package is not installed). ``--merge`` joins the JSON reports of several invocations
(e.g. one process per setting, run side by side on one GPU) into one matrix.

For each run the JSON records: ``status`` ("ok"; "refused" when the trainer refused the plugin at construction, with
the reason; "error" with the traceback tail; "bad" when a loss is not finite or
fewer steps ran), seconds, the losses, whether trainable weights changed (a ``note`` when they did not: an untrained
tiny model can give a method no learning signal in a few steps), the ``plugins/...`` metrics logged, and peak GPU
memory. The summary lists the runs that failed; the exit status is 1 when there is any. ``--matrix`` (default
``gpu_smoke_matrix.md``) gets the compatibility matrix: one row per plugin or stack, one column per setting, each cell
ok / refused with its reason / failed with its error.

Usage (on a machine with a CUDA GPU and bitsandbytes)::

    python scripts/gpu_smoke.py --out gpu_smoke.json                 # qlora, lora and bf16; 3 steps each
    python scripts/gpu_smoke.py --only lp_reg,scope --steps 5        # a subset
    python scripts/gpu_smoke.py --settings lora --model smollm2      # the real model, LoRA
    python scripts/gpu_smoke.py --merge a.json b.json --matrix m.md  # one matrix from several reports
    python scripts/gpu_smoke.py --device cpu --settings fp32 --steps 1   # dry run of the configs on CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

#: Options that let a plugin run offline on the bundled tasks (everything else: the plugin's defaults).
SMOKE_CONFIG: dict[str, dict[str, Any]] = {
    "ruscarl": {"judge": "rule"},
    "scope": {"mode": "reference_suffix", "prm": "programmatic", "min_prefix_steps": 0},
    "posterior_grpo": {"prm": "programmatic"},
    "hint_scaffold": {"success_threshold": 0.9},
    "lp_reg": {"kappa": 0.45, "rho": 0.5},
    # the teacher is the policy's own base model, loaded by path (it shares the tokenizer by construction)
    "kepo": {"teacher_model": "<policy model>", "success_column": "digit_fraction_reward", "success_threshold": 0.0},
    # the listener is the policy's own base model too (it reads the reasoning, shares the tokenizer)
    "listener": {"teacher_model": "<policy model>"},
    # RaPO's previous-task policy is the policy's own base model (a second task starting from it)
    "rapo_retention": {"teacher_model": "<policy model>"},
    "luffy": {},
    # the tasks' one reference solution per problem stands in for the teachers' solutions
    "ampo": {"solutions_column": "solution"},
    # ARMed's encoder is the policy's own base model, local (mean-pooled hidden states, as in its CPU tests)
    "armed": {"embedder": "hf", "embedder_model": "<policy model>", "answer_pattern": r"Answer:\s*(\S+)"},
    # the generative RMs judge through the local HF backend with the policy's own base model; an untrained model's
    # verdicts rarely parse, and those rows get their group's mean (a neutral column) instead of failing the step
    **{name: {"genrm": "hf", "genrm_model": "<policy model>", "genrm_max_tokens": 16, "genrm_max_unparsable": 1.0}
       for name in ("data_prm", "libra_rm", "think_rm")},
    "deepseek_grm": {"genrm": "hf", "genrm_model": "<policy model>", "genrm_max_tokens": 16,
                     "genrm_max_unparsable": 1.0, "k": 2},
    "reasonflux_prm": {"prm": "programmatic"},
    # tree searches and step candidates sized to G = 4 and 32-token completions (tests/test_smollm2_e2e.py)
    "deepsearch": {"expansion_width": 2, "max_depth": 4, "node_budget": 8},
    "ettrl": {"fork_points": 1, "branches": 1, "fork_tokens": "distinct"},
    "slate": {"prm": "programmatic", "k": 2, "step_stops": ["\n"], "answer_stops": []},
    # the tasks' rows carry no paraphrases, constraints or documents: rewordings from a template, constraints for
    # every row, and the reference solutions as the documents (tests/test_smollm2_e2e.py)
    "ic_grpo": {"paraphrase_column": None, "templates": ["Please solve: {question}"]},
    "ps_grpo": {"paraphrase_column": None, "templates": ["Please solve: {question}"]},
    "light_if": {"constraints_column": None, "think_end": None,
                 "constraints": [{"type": "word_count", "max": 12}, {"type": "keyword", "word": "Answer"}]},
    "rlp": {"text_column": "solution", "min_context_words": 1},
}
#: Placeholder in SMOKE_CONFIG for the path of the model under test.
POLICY_MODEL = "<policy model>"
#: Run settings a plugin requires (refused at construction otherwise).
SMOKE_ARGS: dict[str, dict[str, Any]] = {
    "disco": {"loss_type": "grpo"},
    "oreal": {"loss_type": "dapo"},  # its official normalisation sits on top of the dapo loss
    # think_rm's official pairwise advantages replace TRL's: the task's own reward columns weigh 0
    "think_rm": {"reward_weights": [0.0, 0.0]},
}
#: Recommended stacks (one plugin per stage where possible).
STACKS: dict[str, list[str]] = {
    "hint_scaffold+canon+lp_reg": ["hint_scaffold", "canon", "lp_reg"],
    "scope+lp_reg": ["scope", "lp_reg"],
    "ruscarl+kl_cov": ["ruscarl", "kl_cov"],
    "adaptive_sampler+laser+clip_cov": ["adaptive_sampler", "laser", "clip_cov"],
    # the tool-agent stacks of tests/test_smollm2_e2e.py (on the tool task, below)
    "igpo+otc_po+e_grpo+funrl+aspo": ["igpo", "otc_po", "e_grpo", "funrl", "aspo"],
    "salt+epo": ["salt", "epo"],
    "ikea+matchtir": ["ikea", "matchtir"],
}
#: Plugins that act on multi-turn tool rollouts (or read the tool task's ``gold_calls`` / ``entities`` columns):
#: they, and every stack holding one, run on the bundled tool task (``trl_plugins.tasks.tools``: TRL's tool loop
#: through ``environment_factory=ToolEnvironment``), with each question's gold trace scripted as the completion
#: (``trl_plugins.testing.script_generation``) so that the tool turns exist on an untrained policy; the loss,
#: advantage and reward stages then run on the GPU in the run's precision as in any run.
TOOL_PLUGINS = frozenset({"igpo", "otc_po", "aspo", "salt", "epo", "matchtir", "e_grpo", "ikea", "funrl"})
#: Plugin options of the tool-task runs (the stacks' options of tests/test_smollm2_e2e.py).
TOOL_SMOKE_CONFIG: dict[str, dict[str, Any]] = {"igpo": {"mode": "a2tgpo"}, "epo": {"entropy_coef": 0.01}}


def environment(device: str) -> dict:
    import torch
    import transformers
    import trl

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "device": device,
    }
    if device == "cuda":
        info.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0),
                    bf16_supported=torch.cuda.is_bf16_supported())
    try:
        import bitsandbytes

        info["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        info["bitsandbytes"] = None
    return info


def build_model(root: Path, hidden_size: int, num_layers: int) -> Path:
    from trl_plugins.tasks.tiny import build_and_save

    return build_and_save(root / "tiny-llama", hidden_size=hidden_size, num_layers=num_layers,
                          num_heads=max(1, hidden_size // 32))


#: setting -> (precision, base quantisation, LoRA adapters, vLLM colocate)
SETTINGS: dict[str, tuple[str, str, bool, bool]] = {
    "qlora": ("bf16", "4bit", True, False),
    "lora": ("bf16", "none", True, False),
    "bf16": ("bf16", "none", False, False),
    "fp32": ("fp32", "none", False, False),
    "vllm": ("bf16", "none", True, True),
}


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def build_trainer(name: str, plugins: list[str], *, setting: str, model_path: Path, model_kind: str, out_dir: Path,
                  steps: int, device: str):
    """The trainer of one run (construction only; a :class:`~trl_plugins.PluginError` here is a refusal): the
    plugins' SMOKE_CONFIG / SMOKE_ARGS, the tool task for TOOL_PLUGINS, else the arithmetic task."""
    import torch
    from transformers import AutoTokenizer

    from trl_plugins import PluginGRPOTrainer
    from trl_plugins.tasks.arithmetic import accuracy_reward, make_dataset
    from trl_plugins.testing import digit_fraction_reward, tiny_config, tiny_dataset

    precision, quant, lora, vllm = SETTINGS[setting]
    tools = bool(TOOL_PLUGINS & set(plugins))
    overrides: dict[str, Any] = {"loss_type": "dr_grpo"}
    if vllm:
        overrides.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    for p in plugins:
        overrides.update(SMOKE_ARGS.get(p, {}))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    options = {**SMOKE_CONFIG, **TOOL_SMOKE_CONFIG} if tools else SMOKE_CONFIG
    if tools:
        overrides.update(loss_type="grpo")
    args = tiny_config(
        output_dir=str(out_dir / name.replace("/", "_")), plugins=plugins,
        plugin_config={p: {k: str(model_path) if v == POLICY_MODEL else v for k, v in options[p].items()}
                       for p in plugins if p in options},
        max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=128 if tools else 32,
        learning_rate=1e-3 if lora else 1e-4, use_cpu=device == "cpu", bf16=precision == "bf16",
        log_level="error", model_init_kwargs={"dtype": "bfloat16" if precision == "bf16" else "float32"},
        **overrides,
    )
    kwargs: dict[str, Any] = {}
    if quant == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    if lora:
        kwargs["peft_config"] = _lora_config()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tools:
        from trl_plugins.tasks.tools import (
            ToolEnvironment, enable_tool_calling, gold_trace_script, make_tool_dataset, tool_answer_reward,
        )
        from trl_plugins.testing import script_generation

        dataset = make_tool_dataset(64, kinds=("lookup",))
        trainer = PluginGRPOTrainer(
            model=str(model_path), reward_funcs=[tool_answer_reward], args=args, train_dataset=dataset,
            processing_class=enable_tool_calling(tokenizer), environment_factory=ToolEnvironment, **kwargs,
        )
        script_generation(trainer, gold_trace_script(dataset))
        return trainer
    dataset = (make_dataset(64, levels=(1, 2), seed=0, split="train") if model_kind == "smollm2"
               else tiny_dataset(64, levels=(1, 2)))
    return PluginGRPOTrainer(
        model=str(model_path), reward_funcs=[accuracy_reward, digit_fraction_reward], args=args,
        train_dataset=dataset, processing_class=tokenizer, **kwargs,
    )


def run_one(name: str, plugins: list[str], *, setting: str, model_path: Path, model_kind: str, out_dir: Path,
            steps: int, device: str) -> dict:
    import torch

    from trl_plugins import PluginError

    precision, quant, lora, vllm = SETTINGS[setting]
    record: dict[str, Any] = {"name": name, "plugins": plugins, "setting": setting, "model": model_kind,
                              "quant": quant, "precision": precision, "lora": lora, "vllm_colocate": vllm}
    if vllm and importlib.util.find_spec("vllm") is None:
        record.update(status="not run", error="vllm not installed")
        return record
    tools = bool(TOOL_PLUGINS & set(plugins))
    record["task"] = "tools" if tools else "arithmetic"
    if tools and model_kind != "smollm2":
        record.update(status="not run", error="tool plugins run on builtin:smollm2 (its ChatML tool template)")
        return record
    start = time.monotonic()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    phase = "construction"
    try:
        trainer = build_trainer(name, plugins, setting=setting, model_path=model_path, model_kind=model_kind,
                                out_dir=out_dir, steps=steps, device=device)
        if quant == "4bit":
            import bitsandbytes as bnb

            record["linear4bit_modules"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        phase = "training"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        after = {n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}
        logs: dict[str, Any] = {}
        for entry in trainer.state.log_history:
            logs.update(entry)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        record.update(
            status="ok",
            steps=trainer.state.global_step,
            losses=losses,
            losses_finite=all(math.isfinite(x) for x in losses),
            trainable_changed=any(not torch.equal(before[n], after[n]) for n in before),
            trainable_parameters=sum(v.numel() for v in before.values()),
            plugin_metrics={k: v for k, v in logs.items() if k.startswith("plugins/")},
            reward=logs.get("reward"),
            tool_calls_per_rollout=logs.get("tools/call_frequency"),
        )
        if not record["losses_finite"] or record["steps"] != steps:
            record["status"] = "bad"
        elif not record["trainable_changed"]:  # e.g. zero advantages everywhere on an untrained model: not an error
            record["note"] = "no update"
        del trainer
    except Exception as exc:  # one broken run must not hide the others
        if isinstance(exc, PluginError) and phase == "construction":
            # refused at construction with a reason (a setting the plugin does not support): not a failure
            record.update(status="refused", error=f"{type(exc).__name__}: {exc}")
        else:
            record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc()[-4000:])
    record["seconds"] = round(time.monotonic() - start, 2)
    if device == "cuda":
        record["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        torch.cuda.empty_cache()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_smoke.json", help="Where to write the JSON result.")
    parser.add_argument("--matrix", default="gpu_smoke_matrix.md",
                        help="Where to write the compatibility matrix (markdown: plugin x setting, ok / refused with "
                        "reason / failed); copy it into docs/compatibility.md with the date and hardware.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--settings", default="qlora,lora,bf16",
                        help=f"Comma-separated settings, each run for every plugin and stack; from {sorted(SETTINGS)}.")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: the character-level model built locally; smollm2: builtin:smollm2 (the real "
                        "offline model, fetched and converted once).")
    parser.add_argument("--only", default=None, help="Comma-separated plugins (default: every built-in).")
    parser.add_argument("--no-stacks", action="store_true", help="Skip the recommended-stack runs.")
    parser.add_argument("--stacks", default=None,
                        help="Comma-separated recommended stacks to run (names of STACKS, or 'all'); default: all "
                        "without --only, else those made only of the --only plugins.")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="Stop starting runs after this many minutes; the runs not started are recorded as "
                        "'not run' (the report is also rewritten after every run, so a killed invocation leaves "
                        "its finished runs).")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="Only join these JSON reports into --out and --matrix (no runs).")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    args = parser.parse_args(argv)

    if args.merge:
        result = merge_reports([json.loads(Path(f).read_text()) for f in args.merge])
        return write_report(result, args.out, args.matrix)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown or not settings:
        parser.error(f"unknown settings: {unknown or settings}; allowed: {sorted(SETTINGS)}")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --settings fp32 for a CPU dry run")
    from trl_plugins.runtime.manager import available_plugins

    builtins = sorted(n for n, cls in available_plugins().items()
                      if cls.distribution() == "trl-plugins (built-in)" and not cls.deprecated())
    selected = builtins if args.only is None else [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(selected) - set(builtins))
    if unknown:
        parser.error(f"unknown built-in plugins: {unknown}; built-ins: {builtins}")
    if args.stacks is not None:
        names = list(STACKS) if args.stacks.strip() == "all" else [n.strip() for n in args.stacks.split(",")
                                                                      if n.strip()]
        unknown = sorted(set(names) - set(STACKS))
        if unknown:
            parser.error(f"unknown stacks: {unknown}; allowed: {sorted(STACKS)} or 'all'")
        stacks = {name: STACKS[name] for name in names}
    else:
        stacks = {name: stack for name, stack in STACKS.items() if args.only is None or set(stack) <= set(selected)}
    if args.no_stacks:
        stacks = {}

    result: dict[str, Any] = {"environment": environment(args.device), "settings": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="trl_plugins_gpu_smoke_") as tmp:
        root = Path(tmp)
        if args.model == "smollm2":
            from trl_plugins.runtime.models import smollm2_path

            model_path = smollm2_path()
        else:
            model_path = build_model(root, args.hidden_size, args.num_layers)
        common = dict(model_path=model_path, model_kind=args.model, out_dir=root / "runs", steps=args.steps,
                      device=args.device)
        prefix = "" if args.model == "tiny" else f"{args.model} "
        deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
        for setting in settings:
            subjects = [(p, [p]) for p in selected] + list(stacks.items())
            for subject, plugins in subjects:
                name = f"{prefix}{setting}/{subject}"
                if deadline is not None and time.monotonic() > deadline:
                    record = {"name": name, "plugins": plugins, "setting": setting, "model": args.model,
                              "status": "not run", "error": f"--max-minutes {args.max_minutes} reached"}
                else:
                    record = run_one(name, plugins, setting=setting, **common)
                result["runs"].append(record)
                print(f"{record['name']:<48} {record['status']:<8} {record.get('seconds', 0):>7.1f}s", flush=True)
                Path(args.out).write_text(json.dumps(result, indent=2, default=str))  # partial report
    return write_report(result, args.out, args.matrix)


def merge_reports(reports: list[dict]) -> dict:
    """One report from several: the first one's environment, every run, the settings of each."""
    return {"environment": reports[0]["environment"], "settings": reports[0]["settings"],
            "merged_settings": [s for r in reports for s in r.get("merged_settings") or [r["settings"]]], "runs": [run for r in reports for run in r["runs"]]}


def write_report(result: dict, out: str, matrix: str) -> int:
    """Write the JSON report and the matrix; print the summary; exit status 1 when any run failed."""
    runs = result["runs"]
    failed = [r["name"] for r in runs if r["status"] not in ("ok", "refused", "not run")]
    ok = sum(r["status"] == "ok" for r in runs)
    result["summary"] = {"runs": len(runs), "ok": ok, "not_ok": failed,
                         "refused": [r["name"] for r in runs if r["status"] == "refused"],
                         "not_run": [r["name"] for r in runs if r["status"] == "not run"]}
    Path(out).write_text(json.dumps(result, indent=2, default=str))
    Path(matrix).write_text(compatibility_matrix(result))
    print(f"{ok}/{len(runs)} runs ok; failed: {failed or 'none'}; wrote {out} and the matrix {matrix}")
    return 1 if failed else 0


def _cell(record: dict) -> str:
    if record["status"] == "ok":
        return "ok" + (f" ({record['note']})" if record.get("note") else "")
    reason = str(record.get("error") or record["status"]).splitlines()[0].replace("|", "\\|")[:160]
    label = {"refused": "refused: ", "not run": "not run: "}.get(record["status"], "failed: ")
    return label + reason


def _steps_text(result: dict) -> str:
    """"3 step(s)", or, for merged reports of different step counts, "3 step(s) (tiny), 2 step(s) (smollm2)"."""
    parts = result.get("merged_settings") or [result["settings"]]
    texts = list(dict.fromkeys(f"{p['steps']} step(s)" + (f" ({p['model']})" if "model" in p else "") for p in parts))
    counts = {p["steps"] for p in parts}
    return f"{counts.pop()} step(s)" if len(counts) == 1 else ", ".join(texts)


def compatibility_matrix(result: dict) -> str:
    """Markdown: one row per plugin or stack, one column per setting (``qlora``, ``bf16``, ...), each cell ok /
    refused (the construction error: a setting the plugin does not support) / failed (the error)."""
    env = result["environment"]
    hardware = env.get("gpu") or f"CPU ({platform.processor() or platform.machine()}), no GPU"
    settings: list[str] = []
    rows: dict[str, dict[str, str]] = {}
    for record in result["runs"]:
        setting, subject = record["name"].split("/", 1)
        settings += [setting] if setting not in settings else []
        rows.setdefault(subject, {})[setting] = _cell(record)
    notes = sorted({subject for r in result["runs"] if r.get("note")
                    for subject in [r["name"].split("/", 1)[1]]})
    lines = [
        f"Compatibility matrix, {time.strftime('%Y-%m-%d')}, {hardware}; torch {env['torch']}, "
        f"transformers {env['transformers']}, trl {env['trl']}, bitsandbytes {env.get('bitsandbytes')}; "
        f"{_steps_text(result)} per run (`python scripts/gpu_smoke.py`).",
        "",
        "| plugin / stack | " + " | ".join(settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for subject, cells in rows.items():
        lines.append(f"| `{subject}` | " + " | ".join(cells.get(s, "not run") for s in settings) + " |")
    if notes:
        lines += ["", "*ok (no update)*: the run finished with finite losses, but no trainable weight changed: every "
                  "advantage or loss weight was zero in these steps (" + ", ".join(f"`{n}`" for n in notes) + ")."]
    if env["device"] != "cuda":
        lines += ["", "Run on a CPU (dry run of the configurations): not yet run on a GPU."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
