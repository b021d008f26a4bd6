"""bf16 on a CPU: which setting a run gets when the user did not choose, and the warning when bf16 is set there.

TRL's ``GRPOConfig`` leaves ``bf16`` unset and turns it on (unless ``fp16``). On a GPU that is right. On a CPU,
training in bf16 means autocast to bf16, and on a CPU without AMX bf16 units (every x86 CPU before Intel Sapphire
Rapids, AMD EPYC / Ryzen including those with AVX512-BF16, most ARM servers) that brings no speed: measured with
``scripts/bench_cpu_precision.py`` (docs/benchmarks.md, section 5), see :data:`MEASURED_COST`. And on a machine with
no GPU at all, TRL's default stops before training with "Your setup doesn't support bf16/gpu".

So :class:`~trl_plugins.PluginGRPOConfig` (and with it ``trl-plugins train``, the demo and every YAML file we ship)
does this when the run trains on a CPU (``use_cpu=True``, or no GPU / XPU / NPU / MPS device present):

* ``bf16`` not set (and not ``fp16``): ``bf16=False`` (float32) without AMX bf16 units; with them, TRL's
  ``bf16=True`` and ``use_cpu=True`` when no accelerator exists (so TRL's bf16/gpu check passes);
* ``bf16=True`` set by the user without AMX bf16 units: kept, with a :class:`SlowCpuPrecisionWarning` that gives the
  measured cost and the fix.
"""

from __future__ import annotations

import logging
import os
import warnings
from functools import lru_cache

logger = logging.getLogger(__name__)

# docs/benchmarks.md, section 5: SmolLM2-135M-Instruct with LoRA on a shared 2-core AMD EPYC (AVX512-BF16, no AMX)
MEASURED_COST = (
    "152 s per GRPO step against 102 s with bf16=False, 1 torch thread, same CPU time (11.5 s against 12.5 s); "
    "100-200 s against about 12 s seen with 2 threads on the same machine"
)


class SlowCpuPrecisionWarning(UserWarning):
    """``bf16=True`` on a CPU without AMX bf16 units: correct, but no faster and measured slower than float32."""


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from ``/proc/cpuinfo`` (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_is_native() -> bool:
    """True when the CPU has AMX bf16 tile units (``amx_bf16``), where bf16 autocast training is fast.

    AVX512-BF16 alone (e.g. AMD Zen 4) is not counted: the steps measured in docs/benchmarks.md ran on such a CPU.
    ``TRL_PLUGINS_CPU_BF16=1`` / ``0`` overrides the detection.
    """
    forced = os.environ.get("TRL_PLUGINS_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return "amx_bf16" in cpu_flags()


def accelerator_available() -> bool:
    """A CUDA / ROCm, XPU, NPU or MPS device is present (what transformers would train on without ``use_cpu``)."""
    import torch

    if torch.cuda.is_available():
        return True
    for name in ("xpu", "npu", "mps"):
        backend = getattr(torch, name, None) or getattr(torch.backends, name, None)
        try:
            if backend is not None and backend.is_available():
                return True
        except Exception:  # noqa: BLE001 - a half-installed backend is no device
            continue
    return False


def trains_on_cpu(use_cpu: bool) -> bool:
    return bool(use_cpu) or not accelerator_available()


def slow_bf16_message() -> str:
    return (
        "bf16=True while training on a CPU without AMX bf16 units: bf16 runs as autocast there, with no speed gain and "
        f"a longer step (SmolLM2-135M with LoRA, measured: {MEASURED_COST}; docs/benchmarks.md). Set bf16=False "
        "(YAML `bf16: false`, command line `--bf16 false`), or leave bf16 unset and trl-plugins picks float32 on such "
        "a CPU."
    )


def choose_cpu_precision(args, bf16_was_set: bool) -> None:
    """Set ``args.bf16`` / ``args.use_cpu`` before ``TrainingArguments.__post_init__`` (see the module doc).

    ``args`` is a (Plugin)GRPOConfig whose ``bf16`` is still as the user gave it (``None`` when unset).
    """
    if not trains_on_cpu(args.use_cpu):
        return
    native = cpu_bf16_is_native()
    if not bf16_was_set:
        if args.fp16:
            return
        args.bf16 = native
        if native and not accelerator_available():
            args.use_cpu = True
        logger.info("Training on a CPU %s AMX bf16 units: bf16=%s.", "with" if native else "without", args.bf16)
    elif args.bf16 and not native:
        warnings.warn(slow_bf16_message(), SlowCpuPrecisionWarning, stacklevel=4)
