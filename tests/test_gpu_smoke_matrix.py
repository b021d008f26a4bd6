"""scripts/gpu_smoke.py's compatibility matrix: one row per plugin / stack, one column per setting, cells ok /
refused with the reason / failed with the error; on a CPU it says it has not run on a GPU."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts/gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matrix_cells_and_gpu_note():
    result = {
        "environment": {"device": "cpu", "torch": "2", "transformers": "5", "trl": "1.16", "bitsandbytes": None},
        "settings": {"steps": 1},
        "runs": [
            {"name": "qlora/canon", "status": "ok"},
            {"name": "qlora/disco", "status": "refused",
             "error": "IncompatiblePluginsError: disco needs loss_type='grpo' | got 'dr_grpo'\nmore"},
            {"name": "qlora/scope", "status": "error", "error": "RuntimeError: boom"},
            {"name": "bf16/canon", "status": "ok", "note": "trainable weights unchanged"},
        ],
    }
    text = _script().compatibility_matrix(result)
    lines = text.splitlines()
    assert "| plugin / stack | qlora | bf16 |" in lines
    assert "| `canon` | ok | ok (trainable weights unchanged) |" in lines
    assert "| `disco` | refused: IncompatiblePluginsError: disco needs loss_type='grpo' \\| got 'dr_grpo' | not run |" in lines
    assert "| `scope` | failed: RuntimeError: boom | not run |" in lines
    assert "not yet run on a GPU" in text


def test_not_run_and_no_update_cells_and_merged_steps():
    script = _script()
    tiny = {"environment": {"device": "cuda", "gpu": "H100", "torch": "2", "transformers": "5", "trl": "1.16"},
            "settings": {"steps": 3, "model": "tiny"},
            "runs": [{"name": "vllm/canon", "status": "not run", "error": "vllm not installed"},
                     {"name": "lora/disco", "status": "ok", "note": "no update"}]}
    smol = {"environment": tiny["environment"], "settings": {"steps": 2, "model": "smollm2"},
            "runs": [{"name": "smollm2 lora/canon", "status": "ok"}]}
    merged = script.merge_reports([tiny, smol])
    assert len(merged["runs"]) == 3
    text = script.compatibility_matrix(merged)
    lines = text.splitlines()
    assert "| plugin / stack | vllm | lora | smollm2 lora |" in lines
    assert "| `canon` | not run: vllm not installed | not run | ok |" in lines
    assert "| `disco` | not run | ok (no update) | not run |" in lines
    assert "3 step(s) (tiny), 2 step(s) (smollm2)" in lines[0]
    assert "(`disco`)" in text and "not yet run on a GPU" not in text
    # merging a merged report keeps every part's settings
    assert script.merge_reports([merged])["merged_settings"] == merged["merged_settings"]


def test_write_report_exit_status(tmp_path):
    script = _script()
    base = {"environment": {"device": "cuda", "gpu": "H100", "torch": "2", "transformers": "5", "trl": "1.16"},
            "settings": {"steps": 1}}
    ok = dict(base, runs=[{"name": "lora/canon", "status": "ok"},
                          {"name": "vllm/canon", "status": "not run", "error": "vllm not installed"}])
    assert script.write_report(ok, str(tmp_path / "a.json"), str(tmp_path / "a.md")) == 0
    bad = dict(base, runs=[{"name": "lora/canon", "status": "error", "error": "RuntimeError: boom"}])
    assert script.write_report(bad, str(tmp_path / "b.json"), str(tmp_path / "b.md")) == 1
    assert "failed: RuntimeError: boom" in (tmp_path / "b.md").read_text()


def test_stacks_option_and_time_guard(tmp_path, capsys):
    """--stacks picks recommended stacks by name (unknown ones refused with the allowed names); --max-minutes 0 starts
    no run and records each as 'not run' with the reason; the tool plugins and tool stacks are in the lists."""
    import pytest

    script = _script()
    assert {"igpo+otc_po+e_grpo+funrl+aspo", "salt+epo", "ikea+matchtir"} <= set(script.STACKS)
    assert all(script.TOOL_PLUGINS & set(script.STACKS[s]) for s in ("salt+epo", "ikea+matchtir"))
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--settings", "fp32", "--only", "canon", "--stacks", "nope"])
    assert "unknown stacks: ['nope']" in capsys.readouterr().err
    out, matrix = tmp_path / "r.json", tmp_path / "m.md"
    code = script.main(["--device", "cpu", "--settings", "fp32", "--only", "canon", "--stacks", "salt+epo",
                        "--max-minutes", "0", "--hidden-size", "32", "--num-layers", "1",
                        "--out", str(out), "--matrix", str(matrix)])
    assert code == 0
    import json

    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["fp32/canon", "fp32/salt+epo"]
    assert all(r["status"] == "not run" and "--max-minutes 0.0 reached" in r["error"] for r in runs)


def test_tool_plugins_are_not_run_on_the_tiny_model(tmp_path):
    script = _script()
    record = script.run_one("fp32/salt", ["salt"], setting="fp32", model_path=tmp_path, model_kind="tiny",
                            out_dir=tmp_path, steps=1, device="cpu")
    assert record["status"] == "not run" and record["task"] == "tools"
    assert "builtin:smollm2" in record["error"]


def _overhead():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("gpu_overhead", ROOT / "scripts/gpu_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_overhead_table_and_argument_checks(capsys):
    import pytest

    script = _overhead()
    assert script.DEFAULT_CONFIGS[0] == "none" and "salt+epo" not in script.DEFAULT_CONFIGS
    row = {"config": "none", "step_s_vanilla": 1.0, "step_s_plugin": 1.1, "ratio": 1.1, "ratio_min": 1.05,
           "ratio_max": 1.2, "peak_growth_mib_vanilla": 500.0, "peak_growth_mib_plugin": 510.0,
           "extra_rollouts_per_step": 0.0}
    result = {"environment": {"gpu": "H100", "torch": "2", "transformers": "5", "trl": "1.16"},
              "settings": {"model": "smollm2", "setting": "lora", "repeats": 2, "steps": 3},
              "rows": [row], "errors": {"scope+lp_reg": "RuntimeError: boom"}, "not_run": ["ruscarl+kl_cov"]}
    lines = script.markdown(result).splitlines()
    assert "| `none` | 1.000 | 1.100 | 1.10 (1.05-1.20) | 500 / 510 | 0.0 |" in lines
    assert any(line.startswith("| `scope+lp_reg` | failed: RuntimeError: boom") for line in lines)
    assert any(line.startswith("| `ruscarl+kl_cov` | not run") for line in lines)
    for bad, message in ((["--configs", "nope"], "unknown configurations ['nope']"),
                         (["--configs", "salt+epo"], "tool-agent stacks are not measured here"),
                         (["--steps", "1"], "--steps >= 2")):
        with pytest.raises(SystemExit):
            script.main(["--device", "cpu", *bad])
        assert message in capsys.readouterr().err
