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
