"""Run accelerate's real FSDP1 / FSDP2 / DeepSpeed code paths on a CPU-only machine (test harness only).

accelerate 1.15 refuses FSDP and DeepSpeed when ``use_cpu=True`` (the ``MULTI_CPU`` distributed type). Under
``accelerate launch`` with one of the shipped configs (``docs/accelerate/*.yaml``), :func:`install` makes each process
report its distributed type as ``MULTI_GPU`` with the ``gloo`` backend while ``ACCELERATE_TORCH_DEVICE=cpu`` pins the
device to the CPU. Everything after that (FSDP wrapping, DeepSpeed engines and ZeRO partitioning, TRL's own handling
of them) is the unchanged library code a GPU user runs. DeepSpeed additionally needs ``DS_ACCELERATOR=cpu`` (set by
the launching test) and builds its CPU communication op once, just in time.

This module is imported by the engine worker only; nothing in ``trl_plugins`` knows about it.
"""

from __future__ import annotations

import os

ENGINES = ("ddp", "fsdp1", "fsdp2", "zero2", "zero3")
#: engine -> shipped accelerate config (docs/accelerate/)
CONFIG_FILES = {"ddp": "multi_gpu.yaml", "fsdp1": "fsdp1.yaml", "fsdp2": "fsdp2.yaml", "zero2": "zero2.yaml",
                "zero3": "zero3.yaml"}


def install() -> None:
    """Patch ``PartialState._prepare_backend`` so that a launched process on a CPU machine is ``MULTI_GPU``/gloo.

    Only when the trainer's ``use_cpu`` is off: the DDP reference runs as ``MULTI_CPU`` (``use_cpu=True``), accelerate's
    own CPU path, because torch's DDP refuses the CUDA ``device_ids`` accelerate passes under ``MULTI_GPU``."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_cpu_engines", False):
        return
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    if os.environ.get("FSDP_VERSION") == "1":
        # FSDP1's sync_module_states asks the accelerator for its current device (CUDA, XPU, ...), which a CPU has not;
        # every rank builds the same seeded model, so there is nothing to broadcast (cpu_ram_efficient_loading needs it)
        os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_GPU
        return original(self, cpu, sagemaker_dp, backend)

    _prepare_backend._cpu_engines = True
    PartialState._prepare_backend = _prepare_backend


def engine_name(accelerator) -> str:
    """The engine an ``Accelerator`` actually runs (checked by the tests: the patch must not fall back to DDP)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    if state.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if state.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        return "ddp"
    return str(state.distributed_type)
