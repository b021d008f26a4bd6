"""Worker of the two-process fault test (``test_fault_multiprocess.py``); not collected by pytest.

Run under ``accelerate launch`` with 2 CPU processes (gloo). Each phase fails on rank 1 only; every rank records what
it raised (``PHASE-rank{R}.json``: error class and message) and goes on to the next phase -- which only works when
neither rank was left inside a collective. Phases:

``refill_differs``
    A refill plugin rejects group 0 in round 0 on rank 1 only (a decision from process-local state).
``reset_fails``
    The bundled tool environment, whose ``reset`` raises on rank 1 for its first row.
``probe_fails``
    A plugin whose ``trl_plugins_configure`` probes a teacher endpoint that answers on rank 0 and is down on rank 1
    (the probe of ``teacher_probe``, failing at construction).
``kepo_probe_fails``
    The real thing: kepo distilling from a teacher endpoint (``teacher_probe``: one echo request at construction). On
    rank 0 the endpoint is a loopback server with the tiny teacher; on rank 1 it is down.
``gold_fails``
    matchtir on multi-turn tool rollouts; the gold tool-call traces of rank 1's rows cannot be read (streamed rows
    the construction check could not see).

Usage: ``python fault_worker.py OUT_DIR [PHASE ...]``.
"""

from __future__ import annotations

import json
import os
import sys
import time

GLOBAL_ROWS = 6
G = 2
PHASES = ("refill_differs", "reset_fails", "probe_fails", "kepo_probe_fails", "gold_fails")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class ResetFailsOnRank1:
    """The bundled tool environment; its reset raises on rank 1."""

    def __init__(self):
        from trl_plugins.tasks.tools import ToolEnvironment

        self._env = ToolEnvironment()

    def reset(self, **row):
        if rank() == 1:
            raise FileNotFoundError("/data/towns.db: no such file on this node")
        return self._env.reset(**row)

    def search(self, query: str) -> str:
        """Search the encyclopedia of towns.

        Args:
            query: words to look for.
        """
        return self._env.search(query)


def _register():
    from trl_plugins import Plugin, hookimpl, register_plugin
    from trl_plugins.components.client import EndpointError

    class RejectOnRank1(Plugin):
        name = "test_reject_on_rank1"

        @hookimpl
        def trl_plugins_reject_groups(self, ctx):
            if ctx.round == 0 and rank() == 1:
                ctx.reject([0])

    class TeacherProbe(Plugin):
        name = "test_teacher_probe"

        @hookimpl
        def trl_plugins_configure(self, trainer, args):
            if rank() == 1:
                raise EndpointError("teacher endpoint http://10.0.0.7:8000/v1/completions did not answer the "
                                    "log-prob probe (ConnectionRefusedError)")

    for cls in (RejectOnRank1, TeacherProbe):
        register_plugin(cls)


_SERVERS: list = []


def _teacher_url() -> str:
    """Rank 0: a loopback OpenAI-compatible server answering echo log-prob requests with the tiny teacher; rank 1: the
    URL of a port nothing listens on."""
    import socket

    if rank() == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    from trl_plugins.components.local_server import serve_openai_compatible
    from trl_plugins.components.teacher import HFTeacher
    from trl_plugins.components.teacher_logprobs import teacher_logprob_handler
    from trl_plugins.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    server = serve_openai_compatible(teacher_logprob_handler(HFTeacher(model=tiny_model(tok, seed=3), tokenizer=tok)))
    url = server.__enter__()
    _SERVERS.append(server)
    return url


def build(phase: str, out_dir: str, world: int):
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, make_tool_trainer, tiny_dataset

    out = os.path.join(out_dir, phase)
    per_device = GLOBAL_ROWS // world
    tiny = dict(reward_funcs=[digit_fraction_reward], dataset=tiny_dataset(12), output_dir=out,
                per_device_train_batch_size=per_device, num_generations=G, max_steps=1, max_completion_length=8,
                log_level="error")
    if phase == "refill_differs":
        return make_tiny_trainer(plugins=["test_reject_on_rank1"], **tiny)
    if phase == "probe_fails":
        return make_tiny_trainer(plugins=["test_teacher_probe"], **tiny)
    if phase == "kepo_probe_fails":
        kepo = {"distill": "kl_penalty", "teacher": "endpoint", "teacher_model": "teacher", "teacher_max_retries": 0,
                "teacher_base_url": _teacher_url()}
        return make_tiny_trainer(plugins=["kepo"], plugin_config={"kepo": kepo}, **tiny)
    tools = dict(n=12, per_device_train_batch_size=per_device, num_generations=G, max_steps=1, output_dir=out)
    if phase == "reset_fails":
        trainer = make_tool_trainer(**tools)
        trainer.environment_factories = {None: ResetFailsOnRank1}
        trainer._environment_pool = {None: []}
        return trainer
    if phase == "gold_fails":
        trainer = make_tool_trainer(plugins=["matchtir"], **tools)
        original = trainer._generate_and_score_completions

        def unreadable_gold_on_rank1(inputs):
            if rank() == 1:
                inputs = [{**row, "gold_calls": '[{"name": "search", "arguments": '} for row in inputs]
            return original(inputs)

        trainer._generate_and_score_completions = unreadable_gold_on_rank1
        return trainer
    raise ValueError(f"unknown phase {phase!r}")


def main(argv: list[str]) -> None:
    import warnings

    warnings.simplefilter("ignore")
    out_dir = argv[0]
    _register()
    for phase in argv[1:] or PHASES:
        start = time.monotonic()
        try:
            build(phase, out_dir, int(os.environ.get("WORLD_SIZE", "1"))).train()
            record = {"error": None}
        except Exception as exc:
            record = {"error": type(exc).__name__, "message": str(exc)}
        finally:
            while _SERVERS:  # the loopback teacher's thread would keep this process alive
                _SERVERS.pop().__exit__(None, None, None)
        record["seconds"] = time.monotonic() - start
        with open(os.path.join(out_dir, f"{phase}-rank{rank()}.json"), "w") as f:
            json.dump(record, f)
        print(f"rank {rank()} {phase}: {record}", file=sys.stderr, flush=True)
    _leave_together()


def _leave_together() -> None:
    """Both ranks leave at once and close the process group first: a rank exiting while the other still tears down
    its gloo threads aborted the survivor at interpreter exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
