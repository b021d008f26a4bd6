"""The learning benchmark's chat mode (``scripts/bench_learning.py --task chat``, scripts/bench_chat.py) end to end
on a model of SmolLM2's tokenizer and architecture family shrunk to one tiny layer (the real model's size is the
only thing mocked): a probe run alone, the worker count chosen from its measured peak memory, the run cache, the
deadline guard, and the JSON / table / plots it writes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory):
    """A 1-layer Llama with builtin:smollm2's tokenizer and chat template, saved to a folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_plugins.runtime.models import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path()))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny_smollm2")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(args, timeout=600):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_learning.py"), "--task", "chat", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def _bench_chat():
    sys.path.insert(0, str(SCRIPTS))
    import bench_chat

    return bench_chat


@pytest.mark.slow
def test_chat_mode_runs_end_to_end_and_resumes_from_its_run_cache(tiny_smollm2, tmp_path):
    args = ["--tiny", "--device", "cpu", "--model-path", str(tiny_smollm2), "--out-dir", str(tmp_path / "out"),
            "--run-dir", str(tmp_path / "runs")]
    proc = _run(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    result = json.loads((out / "learning_smollm2_chat_tiny.json").read_text())
    assert {r["method"] for r in result["summary"]} == {"grpo", "scope"} and not result["failed"]
    for run in result["runs"]:
        assert run["rollouts"] >= run["budget"] == 8 and not run["truncated"]
        assert run["evals"][0]["rollouts"] == 0 and 0.0 <= run["evals"][-1]["accuracy"] <= 1.0
        assert run["memory"]["kind"] == "cpu" and run["memory"]["peak_mib"] > 0
        assert any("rewards/chat_accuracy_reward/mean" in s for s in run["per_step"])
    assert result["runs"][0]["plugins"] in ([], ["scope"])
    # the untrained model is evaluated once (the probe run); the other run reuses that number as its first point
    firsts = [run["evals"][0] for run in result["runs"]]
    assert {f["accuracy"] for f in firsts} == {result["base_accuracy"]}
    assert sorted(bool(f.get("from_run_cache")) for f in firsts) == [False, True]
    mem = result["memory"]
    assert mem["probe"]["peak_mib"] > 0 and mem["available_mib"] > 0 and mem["workers"] == 1  # one run was left
    assert 0.0 <= result["base_pass_rate"] <= 1.0
    table = (out / "learning_smollm2_chat_tiny.md").read_text()
    assert "| grpo |" in table and "| scope |" in table and "Chat mode:" in table and "Command:" in table
    assert (out / "learning_smollm2_chat_tiny_accuracy.png").stat().st_size > 0
    cached = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert len(cached) == 3 and any(n.startswith("base__") for n in cached)  # two runs and the base numbers

    again = _run(args)  # every run is cached now: nothing is trained
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 cached runs, 0 to run" in again.stdout and "probe run" not in again.stdout
    assert json.loads((out / "learning_smollm2_chat_tiny.json").read_text())["base_pass_rate"] == \
        result["base_pass_rate"]

    # another session (an empty run cache) resumes from the first one's result JSON
    other = [a if a != str(tmp_path / "runs") else str(tmp_path / "runs2") for a in args]
    other = [a if a != str(out) else str(tmp_path / "out2") for a in other]
    third = _run([*other, "--cache-from", str(out / "learning_smollm2_chat_tiny.json")])
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "2 finished runs of" in third.stdout and "2 cached runs, 0 to run" in third.stdout
    resumed = json.loads((tmp_path / "out2" / "learning_smollm2_chat_tiny.json").read_text())
    assert resumed["base_pass_rate"] == result["base_pass_rate"] and len(resumed["runs"]) == 2

    # a resumed CPU table with runs left: the cached runs' peaks choose the workers, no probe goes alone
    scope_run = next((tmp_path / "runs2").glob("scope__s0__*.json"))
    scope_run.unlink()
    fourth = _run(other)
    assert fourth.returncode == 0, fourth.stdout[-3000:] + fourth.stderr[-3000:]
    assert "1 cached runs, 1 to run" in fourth.stdout and "no probe run" in fourth.stdout
    assert "probe run (" not in fourth.stdout
    again_mem = json.loads((tmp_path / "out2" / "learning_smollm2_chat_tiny.json").read_text())["memory"]
    grpo_peak = next(r for r in resumed["runs"] if r["method"] == "grpo")["memory"]["peak_mib"]
    assert again_mem["probe"] == {"kind": "cpu", "peak_mib": grpo_peak, "from_cached_runs": 1}
    assert again_mem["workers"] == 1 and scope_run.exists()


@pytest.mark.slow
def test_chat_mode_past_its_deadline_writes_what_it_has(tiny_smollm2, tmp_path):
    proc = _run(["--tiny", "--device", "cpu", "--model-path", str(tiny_smollm2), "--out-dir", str(tmp_path),
                 "--run-dir", str(tmp_path / "runs"), "--max-minutes", "0"])
    assert proc.returncode == 1  # nothing finished: reported as failed, but the outputs are written
    result = json.loads((tmp_path / "learning_smollm2_chat_tiny.json").read_text())
    assert not result["runs"] and {m for m, _, _ in result["failed"]} == {"grpo", "scope"}
    assert all("--max-minutes reached" in why for _, _, why in result["failed"])
    assert (tmp_path / "learning_smollm2_chat_tiny.md").exists()


def test_worker_count_follows_the_measured_peak_and_is_capped_by_cores_and_runs_left():
    bc = _bench_chat()
    assert bc.choose_workers(10_000, 1_000, cores=16, jobs_left=32) == 8
    assert bc.choose_workers(80_000, 2_000, cores=16, jobs_left=32) == 16
    assert bc.choose_workers(80_000, 2_000, cores=16, jobs_left=3) == 3
    assert bc.choose_workers(500, 2_000, cores=16, jobs_left=3) == 1
    with pytest.raises(ValueError, match="positive"):
        bc.choose_workers(500, 0, cores=2, jobs_left=3)


def test_run_cache_key_changes_with_the_method_settings_the_task_and_the_device():
    bc = _bench_chat()
    task = bc.settings(tiny=False)
    key = bc.config_hash(task, "cuda", "grpo", {})
    assert key == bc.config_hash(dict(task), "cuda", "grpo", {})
    assert len({key, bc.config_hash(task, "cpu", "grpo", {}), bc.config_hash(task, "cuda", "scope", {}),
                bc.config_hash({**task, "budget": 640}, "cuda", "grpo", {}),
                bc.config_hash(task, "cuda", "grpo", {"learning_rate": 3e-4})}) == 5


def test_a_table_built_over_several_sessions_names_the_chips_and_dates_of_its_runs():
    """Each finished run records its chip and date; the header counts the finished runs per (chip, date), and says
    nothing when no run recorded one (tables made before the field existed)."""
    bc = _bench_chat()
    result = json.loads((ROOT / "docs" / "benchmarks" / "learning_smollm2_chat.json").read_text())
    assert "made on" not in bc.header(result)
    for k, r in enumerate(result["runs"][:5]):
        r.update(processor="AMD EPYC" if k < 2 else "Intel Xeon (AMX bf16)", date="2026-11-28" if k < 4 else "2026-11-29")
    result["runs"][0]["truncated"] = True  # a cut run is not a finished run
    text = bc.header(result)
    assert ("Finished runs made on: AMD EPYC, 2026-11-28 (1); Intel Xeon (AMX bf16), 2026-11-28 (2); "
            "Intel Xeon (AMX bf16), 2026-11-29 (1).") in text
    assert isinstance(bc._processor("cpu"), str) and bc._processor("cpu")


def test_guidance_methods_get_the_columns_they_read():
    bc = _bench_chat()
    row = next(iter(bc.datasets(bc.settings(tiny=True), 4)[0]))
    for method in ("hint_scaffold", "scope", "luffy"):
        plugins, options, _ = bc.method_settings(method)
        opts = options.get(method, {})
        for key in ("solution_column", "demonstration_column", "problem_column"):
            assert opts.get(key, "solution" if key != "problem_column" else "problem") in row
    assert bc.method_settings("scope")[1]["scope"]["min_prefix_steps"] == 0


def test_runs_cut_short_by_the_deadline_are_listed_but_never_averaged_in(tmp_path):
    """The committed GPU table (docs/benchmarks/learning_smollm2_chat.json, 33 finished runs) with three runs marked
    as cut by --max-minutes: re-rendered, its rows average only the runs that spent their whole budget."""
    source = json.loads((ROOT / "docs" / "benchmarks" / "learning_smollm2_chat.json").read_text())
    cut = {("lp_reg", 2), ("dars", 1), ("scope", 0)}
    for r in source["runs"]:
        if (r["method"], r["seed"]) in cut:
            r["truncated"] = True
    source["truncated_runs"] = [(r["method"], r["seed"], r["steps"]) for r in source["runs"] if r.get("truncated")]
    assert len(source["truncated_runs"]) == len(cut)
    marked = tmp_path / "marked.json"
    marked.write_text(json.dumps(source))
    proc = _run(["--from-json", str(marked), "--out-dir", str(tmp_path)], timeout=300)
    assert proc.returncode == (1 if source["failed"] else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "learning_smollm2_chat.json").read_text())
    finished = [r for r in result["runs"] if not r.get("truncated")]
    table = (tmp_path / "learning_smollm2_chat.md").read_text()
    assert f"{len(finished)} finished runs" in table and "left out of the table" in table
    for row in result["summary"]:
        seeds = sum(1 for r in finished if r["method"] == row["method"])
        assert f"| {row['method']} |" in table
        assert any(line.startswith(f"| {row['method']} |") and f"/{seeds} |" in line for line in table.splitlines())


@pytest.mark.slow
def test_killing_the_chat_mode_stops_its_workers(tiny_smollm2, tmp_path):
    """`kill PID` (SIGTERM) of the benchmark stops the runs it spawned: none trains on, unseen, as an orphan."""
    import contextlib
    import os
    import signal
    import time

    import psutil

    workers: list = []
    cmd = [sys.executable, str(SCRIPTS / "bench_learning.py"), "--task", "chat", "--tiny", "--device", "cpu",
           "--model-path", str(tiny_smollm2), "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        main = psutil.Process(proc.pid)
        until = time.time() + 300
        while not workers and time.time() < until and proc.poll() is None:
            for child in main.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):  # (a child may end between listing and reading)
                    line = " ".join(child.cmdline())
                    if "spawn_main" in line and "resource_tracker" not in line:
                        workers.append(child)
            time.sleep(0.2)
        assert workers, "no worker process was spawned"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        _gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"workers still running after the benchmark was killed: {[w.pid for w in alive]}"
    finally:  # nothing of this test outlives it, whatever failed
        for process in [*workers, proc]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.kill()
