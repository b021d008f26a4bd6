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
