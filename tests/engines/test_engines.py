"""Training under FSDP1, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, launched as users launch them, against DDP.

One ``accelerate launch`` per engine (2 CPU processes, gloo; the shipped configs of ``docs/accelerate/`` with
``--num_processes 2 --mixed_precision no``) runs every phase of ``engine_worker.PHASES``: tiny trainers from the same
seed, real HF generation, stacks of plugins (a softcapped head included, uneven per-rank work included). Each phase's
final parameters must equal the DDP launch's within float tolerance, and no phase may raise. The CPU workaround
(``cpu_engines.py``) lives in this folder only. The results also generate the engine x plugin matrix of
``docs/reliability.md`` (``python -m trl_plugins.cli.docs``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "engine_worker.py"
LAUNCH_TIMEOUT = 420  # seconds per launch; a hang would otherwise wait for gloo's 30 minutes
#: ZeRO-3 gathers and re-partitions every step: summation order differs from DDP's all-reduce
TOLERANCE = {"ddp": 0.0, "fsdp1": 1e-5, "fsdp2": 1e-5, "zero2": 1e-5, "zero3": 1e-4}


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu_engines = _load_module("trl_plugins_cpu_engines", HERE / "cpu_engines.py")


def _phases() -> tuple[dict[str, tuple[list[str], dict, dict]], int]:
    # the worker installs the CPU patch on import: run only its upper-case constant assignments instead
    import ast

    tree = ast.parse(WORKER.read_text())
    constants = [node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 and all(isinstance(t, ast.Name) and t.id.isupper()
                         for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
                 and not isinstance(node.value, ast.Call)]
    namespace: dict = {}
    exec(compile(ast.Module(body=constants, type_ignores=[]), str(WORKER), "exec"), namespace)
    return namespace["PHASES"], namespace["PER_DEVICE"]


def phases_of(engine: str) -> list[str]:
    """The phases launched under ``engine``: all under DDP (the reference), else those not limited to other engines."""
    return [p for p, (_plugins, _config, options) in PHASE_SPECS.items()
            if engine == "ddp" or engine in options.get("engines", cpu_engines.ENGINES)]


PHASE_SPECS, PER_DEVICE = _phases()
PHASES = list(PHASE_SPECS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine: str, out: Path, phases: list[str]) -> tuple[int, str]:
    """``accelerate launch`` the worker under ``engine``; returns (exit status, log). Kills the launch on timeout."""
    config = REPO / "docs" / "accelerate" / cpu_engines.CONFIG_FILES[engine]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--mixed_precision", "no", "--main_process_port", str(_free_port()), str(WORKER), str(out), engine, *phases]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the {engine} launch did not finish in {LAUNCH_TIMEOUT}s (a hang):\n{log[-4000:]}")
    return proc.returncode, log


#: launches run side by side where the machine has the cores (each launch: 2 processes, 1 thread each)
PARALLEL_LAUNCHES = max(1, min(len(cpu_engines.ENGINES), (os.cpu_count() or 2) // 3))


def _deepspeed_missing(engine: str) -> bool:
    return engine.startswith("zero") and importlib.util.find_spec("deepspeed") is None


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """engine -> output folder of its launch. The first use launches every engine (in parallel where the machine
    has cores for it: ``PARALLEL_LAUNCHES``), once per session."""
    from concurrent.futures import ThreadPoolExecutor

    runs: dict[str, Path] = {}

    def run(engine: str) -> None:
        out = tmp_path_factory.mktemp(engine)
        _rc, log = launch(engine, out, phases_of(engine))
        (out / "launch.log").write_text(log)
        runs[engine] = out

    def get(engine: str) -> Path:
        if _deepspeed_missing(engine):
            pytest.skip("deepspeed is not installed (pip install -e '.[dev]')")
        if not runs:
            todo = [e for e in cpu_engines.ENGINES if not _deepspeed_missing(e)]
            with ThreadPoolExecutor(PARALLEL_LAUNCHES) as pool:
                list(pool.map(run, todo))  # a launch past its timeout fails the test here
        return runs[engine]

    return get


def _record(out: Path, phase: str, rank: int) -> dict:
    path = out / f"{phase}-rank{rank}.json"
    if not path.exists():
        log = (out / "launch.log").read_text() if (out / "launch.log").exists() else ""
        pytest.fail(f"{path.name} was not written (the launch died):\n{log[-4000:]}")
    return json.loads(path.read_text())


def _max_diff(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    assert common and all(k in common for k in a if not k.endswith("lm_head.weight")), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in common)


@pytest.mark.parametrize("engine", [e for e in cpu_engines.ENGINES if e != "ddp"])
def test_engine_trains_like_ddp(engine, engine_runs):
    ddp, out = engine_runs("ddp"), engine_runs(engine)
    failures = []
    for phase in phases_of(engine):
        records = [_record(out, phase, r) for r in (0, 1)]
        refused = PHASE_SPECS[phase][2].get("refused", {})
        if engine in refused:  # refused at construction on every process, naming plugin and engine
            for r in records:
                error = r.get("error", "")
                assert error.startswith("IncompatiblePluginsError") and refused[engine] in error and engine in error, (
                    f"{phase}: expected a refusal under {engine}, got {error or 'none'}")
            continue
        for r in records:
            if "error" in r:
                failures.append(f"{phase} rank {r['rank']}: {r['error']}\n{r['traceback'][-1500:]}")
                break
        else:
            assert records[0]["engine"] == engine, records[0]["engine"]  # the CPU patch did not fall back to DDP
            reference = torch.load(ddp / f"{phase}-params.pt")
            initial = torch.load(ddp / f"{phase}-initial.pt")
            moved = _max_diff(reference, initial)
            if moved <= 10 * max(TOLERANCE[engine], 1e-6):
                failures.append(f"{phase}: training did not move the parameters (update {moved:.3g})")
                continue
            diff = _max_diff(torch.load(out / f"{phase}-params.pt"), reference)
            if diff > TOLERANCE[engine]:
                failures.append(f"{phase}: final parameters differ from DDP by {diff:.3g} (update size {moved:.3g})")
    assert not failures, "\n\n".join(failures)


def test_ddp_reference_runs_every_phase(engine_runs):
    out = engine_runs("ddp")
    assert phases_of("ddp") == PHASES
    for phase in PHASES:
        for rank in (0, 1):
            record = _record(out, phase, rank)
            assert "error" not in record, f"{phase}: {record['error']}\n{record['traceback']}"
            assert record["engine"] == "ddp" and record["steps"] >= 1


#: phase -> the metric that must be positive in its launch's logs: the replay actually happened
REPLAY_METRICS = {"replay_update": "plugins/framework/replay_update_rows",
                  "replay_batch": "plugins/framework/replay_update_rows",
                  "tool_replay": "plugins/replay/replayed_group_fraction"}


@pytest.mark.parametrize("engine", cpu_engines.ENGINES)
def test_the_replay_phases_replay_on_every_engine(engine, engine_runs):
    """A replay update (scheduled rows, SPEAR's replay batch) and a replayed tool episode run on both ranks."""
    out = engine_runs(engine)
    for phase, metric in REPLAY_METRICS.items():
        if phase not in phases_of(engine):
            continue
        for rank in (0, 1):
            record = _record(out, phase, rank)
            assert "error" not in record, f"{phase}: {record['error']}"
            assert record["logs"].get(metric, 0) > 0, (phase, rank, metric)  # the last step's value: the replay step


@pytest.mark.parametrize("engine", cpu_engines.ENGINES)
def test_uneven_policy_forwards_finish_on_every_engine(engine, engine_runs):
    """Rank 0 scores rows with ctx.policy_logprobs / policy_entropies, rank 1 none: a collective forward each time."""
    out = engine_runs(engine)
    r0, r1 = _record(out, "uneven_probes", 0), _record(out, "uneven_probes", 1)
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["probes"] and all(len(p["logprobs"]) == len(p["entropies"]) == 3 and p["finite"] for p in r0["probes"])
    assert len(r1["probes"]) == len(r0["probes"]) and all(p["logprobs"] == [] for p in r1["probes"])


@pytest.mark.parametrize("engine", [e for e in cpu_engines.ENGINES if "uneven_refill" in phases_of(e)])
def test_refill_on_one_rank_finishes_on_every_engine(engine, engine_runs):
    """dynamic_sampling rejects rank 0's groups only, at every step: rank 0 alone regenerates and rescores them (one
    refill round), rank 1 joins the collectives with nothing to do; both finish every step with the same batch."""
    from collections import Counter

    out = engine_runs(engine)
    r0, r1 = _record(out, "uneven_refill", 0), _record(out, "uneven_refill", 1)
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    steps = PHASE_SPECS["uneven_refill"][2]["steps"]
    assert r0["steps"] == r1["steps"] == steps
    # scorings per step: rank 0 the flat first one, then its refilled rows; rank 1 its own rows once
    assert Counter(step for step, _rows in r0["scored"]) == {s: 2 for s in range(steps)}, r0["scored"]
    assert Counter(step for step, _rows in r1["scored"]) == {s: 1 for s in range(steps)}, r1["scored"]
    assert all(rows == PER_DEVICE for _step, rows in r0["scored"] + r1["scored"])
    for r in (r0, r1):  # the last step's refill, as every process logged it: rank 0's two groups, one round
        logs = r["logs"]
        assert (logs["plugins/framework/refill_rounds"], logs["plugins/framework/rejected_groups"],
                logs["plugins/framework/refill_rollouts"]) == (1.0, 2.0, float(PER_DEVICE)), logs


# ------------------------------------------------------------------------------------------ the docs' matrix
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- engines:begin -->", "<!-- engines:end -->"
ENGINE_COLUMNS = ("fsdp1", "fsdp2", "zero2", "zero3")


def _outcome(out: Path, phase: str, engine: str) -> str:
    if phase not in phases_of(engine):
        return "not run"
    records = [_record(out, phase, r) for r in (0, 1)]
    errors = [r.get("error", "") for r in records]
    if any(e.startswith("IncompatiblePluginsError") for e in errors):
        return "refused"
    return "fail" if any(errors) else "ok"


def render_matrix(outcomes: dict[tuple[str, str], str]) -> str:
    """The engine x plugin table of docs/reliability.md from ``{(phase, engine): "ok" | "refused" | "fail"}``."""
    rows = {}
    for phase, (plugins, _config, _options) in PHASE_SPECS.items():
        for plugin in plugins or ["(no plugin)"]:
            if not plugin.startswith("test_"):
                rows.setdefault(plugin, []).append(phase)
    mark = {"ok": "yes", "refused": "refused", "fail": "**fails**", "not run": "-"}
    lines = [BEGIN, "", "| plugin | phase | " + " | ".join(ENGINE_COLUMNS) + " |",
             "|---|---|" + "---|" * len(ENGINE_COLUMNS)]
    for plugin in sorted(rows, key=lambda n: (n != "(no plugin)", n)):
        for phase in rows[plugin]:
            cells = [mark[outcomes[(phase, e)]] for e in ENGINE_COLUMNS]
            lines.append(f"| {plugin} | `{phase}` | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", END])


def test_the_docs_matrix_is_what_the_launches_show(engine_runs):
    """docs/reliability.md's engine table equals the launches' outcomes (TRL_PLUGINS_WRITE_DOCS=1 rewrites it)."""
    outcomes = {(phase, engine): _outcome(engine_runs(engine), phase, engine)
                for engine in ENGINE_COLUMNS for phase in PHASES}
    table = render_matrix(outcomes)
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC.name} has no {BEGIN} ... {END} block"
    current = text[text.index(BEGIN):text.index(END) + len(END)]
    if os.environ.get("TRL_PLUGINS_WRITE_DOCS") == "1":
        DOC.write_text(text.replace(current, table))
        return
    assert current == table, (f"{DOC.name}'s engine matrix is stale; rerun with TRL_PLUGINS_WRITE_DOCS=1:\n{table}")
