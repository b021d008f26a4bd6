"""Smoke test of the benchmark scripts: each one's tiniest mode (``--tiny``: an untrained tiny model, a few
small steps) runs end to end and writes a well-formed result file. The numbers themselves are not checked."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _run(args, timeout=180):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_bench_overhead_tiny(tmp_path):
    out = tmp_path / "overhead.json"
    _run([str(SCRIPTS / "bench_overhead.py"), "--tiny", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["trainer"]["rows"]}
    assert set(rows) == {"none", "noop8"}
    for row in rows.values():
        assert row["ratio"] > 0 and row["step_cpu_s_vanilla"] > 0
        assert row["peak_tensor_mib_plugin"] > 0
    head = result["head_stats"]["rows"]
    assert {r["chunk"] for r in head} >= {64}
    assert all(r["peak_tensor_mib"] > 0 for r in head)


@pytest.mark.slow
def test_bench_overhead_tools_tiny(tmp_path):
    """--task tools --tiny: vanilla GRPOTrainer and PluginGRPOTrainer + IGPO's A2TGPO mode on the bundled tool
    environment (untrained model, short blocks); the rows record TRL's tool-loop metric, so the environment was used."""
    out = tmp_path / "overhead_agentic.json"
    proc = _run([str(SCRIPTS / "bench_overhead.py"), "--task", "tools", "--tiny", "--skip-head-stats", "--json",
                 str(out)], timeout=300)
    result = json.loads(out.read_text())
    trainer = result["trainer"]
    assert trainer["task"] == "tools" and trainer["max_tool_calling_iterations"] >= 1
    rows = {r["config"]: r for r in trainer["rows"]}
    assert set(rows) == {"none", "igpo_a2tgpo"} and not result.get("errors")
    assert rows["igpo_a2tgpo"]["plugins"] == ["igpo"]
    assert rows["igpo_a2tgpo"]["plugin_config"] == {"igpo": {"mode": "a2tgpo"}}
    for row in rows.values():
        assert row["ratio"] > 0 and row["step_cpu_s_vanilla"] > 0 and row["peak_tensor_mib_plugin"] > 0
        assert row["tool_calls_per_rollout_vanilla"] is not None and row["tool_calls_per_rollout_plugin"] is not None
    assert "tool calls / rollout vanilla / plugin" in proc.stdout


def _bench_overhead_module():
    sys.path.insert(0, str(SCRIPTS))
    import bench_overhead

    return bench_overhead


def test_bench_overhead_configurations_cover_every_builtin_plugin():
    """Each built-in plugin has an overhead configuration: the arithmetic task's (bench_common.PLUGIN_SETTINGS) or the
    tool task's (bench_overhead.AGENT_CONFIGS)."""
    bo = _bench_overhead_module()
    from trl_plugins import available_plugins

    builtins = {n for n, cls in available_plugins().items()
                if cls.distribution() == "trl-plugins (built-in)" and not cls.deprecated()}  # not the old spellings
    covered = set(bo.bc.PLUGIN_SETTINGS) | {bo.config_plugins(c, [], "tools")[0][0] for c in bo.AGENT_CONFIGS}
    assert builtins - covered == set()


def test_bench_overhead_variants_set_the_plugin_options_and_unknown_ones_are_refused():
    bo = _bench_overhead_module()
    plugins, options, _ = bo.config_plugins("laser:laser_de", [])
    assert plugins == ["laser"] and options["laser"]["variant"] == "laser_de"
    plugins, options, overrides = bo.config_plugins("dler:difficulty+rover", [])
    assert plugins == ["dler", "rover"] and options["dler"] == {"difficulty_aware": True}
    assert overrides == bo.bc.PLUGIN_SETTINGS["rover"][1]
    plugins, options, _ = bo.config_plugins("igpo_a2tgpo+otc_po", [], "tools")
    assert plugins == ["igpo", "otc_po"] and options["igpo"]["mode"] == "a2tgpo"
    with pytest.raises(ValueError, match="laser:nope"):
        bo.config_plugins("laser:nope", [])


@pytest.mark.slow
def test_bench_learning_tiny(tmp_path):
    _run([str(SCRIPTS / "bench_learning.py"), "--tiny", "--workers", "1", "--fresh", "--out-dir", str(tmp_path),
          "--run-dir", str(tmp_path / "runs")])
    result = json.loads((tmp_path / "learning_tiny.json").read_text())
    assert {r["method"] for r in result["summary"]} == {"grpo", "hint_scaffold"}
    for run in result["runs"]:
        assert run["rollouts"] >= run["budget"]
        assert run["evals"] and 0.0 <= run["evals"][-1]["accuracy"] <= 1.0
        assert any("entropy" in s for s in run["per_step"])


def test_bench_learning_real_model_summarize_only_reuses_the_recorded_base_numbers(tmp_path):
    """--summarize-only --base-from: nothing is trained or evaluated; missing runs are listed as not run, and the
    table's header carries the recorded device, format instruction and untrained-model numbers."""
    earlier = ROOT / "docs" / "benchmarks" / "learning_smollm2.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_learning.py"), "--model", "smollm2", "--summarize-only",
         "--base-from", str(earlier), "--run-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path),
         "--methods", "grpo", "--seeds", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # the one asked-for run is missing
    result = json.loads((tmp_path / "learning_smollm2.json").read_text())
    recorded = json.loads(earlier.read_text())
    assert result["failed"] == [["grpo", 0, "not run"]]
    assert result["device_name"] == recorded["device_name"] and result["instruction"] == recorded["instruction"]
    assert result["base_accuracy"] == recorded["base_accuracy"]
    assert "Real-model mode: builtin:smollm2" in proc.stdout and recorded["device_name"] in proc.stdout


def _script(name: str):
    """The module ``name`` of scripts/ (bench_learning's methods and tables: learning_methods, learning_tables)."""
    import importlib

    sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def test_bench_learning_tables_list_grpo_first_and_leave_tool_only_plugins_out_of_arithmetic_modes():
    """GRPO, the baseline, is also the agentic methods' first entry: it keeps the first place in every table; the
    plugins that act on tool rollouts only are not run on the arithmetic task."""
    lm, lt, bc = _script("learning_methods"), _script("learning_tables"), _script("bench_common")

    def record(method):
        return {"method": method, "seed": 0, "steps": 2, "rollouts": 128, "seconds": 1.0,
                "plugins": [] if method == "grpo" else method.split("+"), "per_step": [{"reward": 0.1}],
                "evals": [{"rollouts": 0, "accuracy": 0.2}, {"rollouts": 128, "accuracy": 0.3}]}

    rows = lt.summarize([record("scope"), record("igpo"), record("grpo")], base_acc=0.2, target=0.25)
    assert [r["method"] for r in rows] == ["grpo", "scope", "igpo"]
    assert not set(bc.TOOL_ONLY_PLUGINS) & set(lm.ALL_METHODS)
    assert set(bc.PLUGIN_SETTINGS) - set(bc.TOOL_ONLY_PLUGINS) <= set(lm.ALL_METHODS)


def test_the_benchmarks_models_are_shipped_and_load_without_a_warm_start(tmp_path, monkeypatch):
    """The tiny model and the tool-use model the learning tables measure ship as weights: a fresh cache folder gets
    the same bytes on every load (the weights hash in every table header and run-cache name), no warm start runs."""
    import hashlib

    bc, ba = _script("bench_common"), _script("bench_agentic")
    from trl_plugins.tasks import tiny, tiny_tools

    monkeypatch.setattr(tiny, "warm_start", lambda *a, **k: pytest.fail("the benchmark model must not be warm-started"))
    monkeypatch.setattr(tiny_tools, "warm_start_tools", lambda *a, **k: pytest.fail("nor its tool-use model"))
    assert tiny.shipped_weights(bc.demo_settings()) is not None
    hashes = []
    for cache in (tmp_path / "a", tmp_path / "b"):
        bc.load_demo_model(cache)
        ba.load_model(cache)
        hashes.append((bc.weights_sha256(bc.demo_model_dir(cache)), bc.weights_sha256(ba.model_dir(cache))))
    assert hashes[0] == hashes[1] and None not in hashes[0]
    shipped = tiny_tools.shipped_tool_weights(ba.model_key())
    assert shipped is not None and shipped.stat().st_size < 2_000_000
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() != hashlib.sha256(
        tiny.shipped_weights(bc.demo_settings()).read_bytes()).hexdigest()


def test_bench_learning_families_and_the_summary_table_cover_every_builtin_plugin():
    """Each method has one family; the summary table has one row per measured method and a row saying why for every
    built-in plugin that no run measured; a plugin that beats GRPO by more than two standard errors reads better."""
    lm, lt = _script("learning_methods"), _script("learning_tables")
    from trl_plugins.runtime.manager import available_plugins

    assert lm.family("grpo") == lm.family("grpo_drgrpo") == "baseline"
    assert lm.family("scope+lp_reg") == "stack" and lm.family("igpo") == "agentic"
    assert lm.family("lp_reg") == "loss" and lm.family("dynamic_sampling") == "sampling"
    assert all(lm.family(m) in lm.FAMILIES for m in lm.ALL_METHODS)

    def row(method, mean, sd):
        return {"method": method, "final_acc": (mean, sd), "reached_target": "3/3",
                "rollouts_to_target": (640.0, 0.0)}

    full = {"warm_start_sha256": "abc", "budget": 2560, "seeds": [0, 1, 2], "command": "python x.py", "runs": [],
            "summary": [row("grpo", 0.30, 0.01), row("scope", 0.40, 0.01), row("lp_reg", 0.31, 0.05)]}
    lines = lt.summary_markdown(full, None).splitlines()
    by_name = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert "| better |" in by_name["scope"] and "| ≈ |" in by_name["lp_reg"]
    assert "+0.100" in by_name["scope"]
    assert set(available_plugins()) <= set(by_name)
    assert "not measured on the shipped model yet" in by_name["dynamic_sampling"]


@pytest.mark.slow
def test_bench_learning_token_mode_stops_every_run_at_the_same_generated_tokens(tmp_path):
    """--budget-unit tokens: each run stops at the first step whose generated tokens reach the budget; latr's tree
    rows share prefixes, so it trains on more rollouts than it pays tokens for."""
    _run([str(SCRIPTS / "bench_learning.py"), "--budget-unit", "tokens", "--methods", "grpo", "latr", "--seeds", "0",
          "--budget", "1500", "--eval-every", "1500", "--eval-size", "4", "--workers", "1", "--fresh",
          "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / "runs")])
    result = json.loads((tmp_path / "learning_tokens.json").read_text())
    assert result["budget_unit"] == "tokens" and {r["method"] for r in result["summary"]} == {"grpo", "latr"}
    for run in result["runs"]:
        last, before = run["per_step"][-1], run["per_step"][:-1]
        assert last["tokens"] == run["tokens"] >= 1500 and all(s["tokens"] < 1500 for s in before)
        assert run["evals"][-1]["tokens"] == run["tokens"]
    table = _script("learning_tables").markdown(result)
    assert table.startswith("Token mode:") and "| rollouts / generated tokens per run |" in table


def test_bench_learning_variants_set_the_plugin_options_and_unknown_ones_are_refused():
    lm = _script("learning_methods")
    plugins, options, _ = lm.method_settings("siri")
    assert plugins == ["siri"] and options["siri"]["period"] == 30  # the learning benchmark's shorter cycle
    plugins, options, _ = lm.method_settings("laser:laser_de+canon")
    assert plugins == ["laser", "canon"] and options["laser"]["variant"] == "laser_de"
    with pytest.raises(ValueError, match="laser:nope"):
        lm.method_settings("laser:nope")


def test_bench_learning_claim_metric_falls_back_to_the_plugins_own():
    lt = _script("learning_tables")
    from trl_plugins.runtime.manager import get_plugin_class

    metric, label = get_plugin_class("remax").claim_metric
    assert lt._claim_metric("remax", ["remax"]) == (f"plugins/remax/{metric}", label)
    assert lt._claim_metric("scope", ["scope"]) == lt.CLAIM_METRICS["scope"]
    assert lt._claim_metric("grpo", []) == (None, None)


def test_bench_agentic_reports_whether_the_tool_use_plugins_acted_and_keys_runs_by_the_warm_start(monkeypatch):
    ba = _script("bench_agentic")

    per_step = [{"plugins/otc_po/r_tool_mean": 1.0, "plugins/aspo/shaped_fraction": 0.0},
                {"plugins/otc_po/r_tool_mean": 0.9, "plugins/aspo/shaped_fraction": 0.25},
                {"plugins/otc_po/r_tool_mean": 0.8}, {}]
    (label, mean, acted), = ba.action_numbers(per_step, ["igpo", "otc_po"])
    assert "otc_po" in label and mean == pytest.approx(0.9) and acted == pytest.approx(2 / 3)
    (_, mean, acted), = ba.action_numbers(per_step, ["aspo"])
    assert mean == pytest.approx(0.125) and acted == pytest.approx(0.5)
    assert ba.action_numbers(per_step, ["igpo"]) == []
    # the warm start's variation is in the model key (the run cache's file names) and in the table's header
    plain = ba.warm_start_settings()
    assert plain.redundant_search_fraction == {} and plain.preamble_fraction == {}  # the benchmark's model: none
    assert ba._variation_text(dataclasses.asdict(plain)) == ""
    key = ba.model_key()
    for field in ("redundant_search_fraction", "preamble_fraction"):
        monkeypatch.setitem(ba.VARIATION, field, ba.TRIED_VARIATION[field])
    varied = ba.warm_start_settings()
    assert varied.redundant_search_fraction == {"lookup": 0.3}
    assert ba.model_key() != key and ba.model_dir().name == f"tiny-tools-{ba.model_key()}"
    assert "repeat their search once" in ba._variation_text(dataclasses.asdict(varied))


@pytest.mark.slow
def test_bench_learning_counts_luffys_demonstrations_as_teacher_rollouts(tmp_path):
    """luffy's demonstration slots are not policy rollouts: its run takes more steps for the same policy budget, and
    the table gets a policy + teacher rollouts column."""
    proc = _run([str(SCRIPTS / "bench_learning.py"), "--tiny", "--workers", "1", "--fresh", "--out-dir",
                 str(tmp_path), "--run-dir", str(tmp_path / "runs"), "--methods", "grpo", "luffy"], timeout=300)
    result = json.loads((tmp_path / "learning_tiny.json").read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert runs["luffy"]["rollouts"] >= runs["luffy"]["budget"] and runs["grpo"]["rollouts"] >= runs["grpo"]["budget"]
    assert runs["luffy"]["steps"] > runs["grpo"]["steps"]
    rows = {r["method"]: r for r in result["summary"]}
    assert rows["luffy"]["teacher_rollouts"][0] > 0 and rows["grpo"]["teacher_rollouts"][0] == 0
    assert "policy + teacher rollouts / run" in proc.stdout
def test_bench_learning_agentic_tiny(tmp_path):
    """--task tools --tiny: one step of 8 tool-environment rollouts per method (untrained model), a plugin stack with a
    named variant included; the runs record the agentic task's numbers (held-out tool use, TRL's tool-call rate)."""
    _run([str(SCRIPTS / "bench_learning.py"), "--task", "tools", "--tiny", "--workers", "1", "--fresh",
          "--methods", "grpo", "igpo_a2tgpo+otc_po", "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / "runs")])
    result = json.loads((tmp_path / "learning_agentic_tiny.json").read_text())
    assert result["task"] == "tools" and not result["failed"]
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"grpo", "igpo_a2tgpo+otc_po"}
    assert runs["igpo_a2tgpo+otc_po"]["plugins"] == ["igpo", "otc_po"]
    assert runs["igpo_a2tgpo+otc_po"]["plugin_config"]["igpo"]["mode"] == "a2tgpo"
    for run in runs.values():
        assert run["steps"] == 1 and run["rollouts"] >= run["budget"]
        final = run["evals"][-1]
        for key in ("accuracy", "tool_use", "held_out_accuracy", "held_out_tool_use"):
            assert 0.0 <= final[key] <= 1.0
        assert "tools/call_frequency" in run["per_step"][0]
    assert all("final_tool_use" in row for row in result["summary"])
