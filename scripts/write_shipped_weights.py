"""Maintainer entry point: remake the learning benchmarks' two shipped models.

``python scripts/write_shipped_weights.py`` warm-starts the benchmarks' tiny model (``bench_common.demo_settings``,
the pinned ``BENCH_SETTINGS``) and, on top of it, their tool-use model (``bench_agentic.warm_start_settings``) on this
machine and writes both as shipped weights (:data:`trl_plugins.tasks.tiny.SHIPPED_WEIGHTS`), so every machine
measures the same two models. Run it when a recipe changes; every learning table must then be re-measured.
(The demo's own shipped model: ``python -m trl_plugins.tasks.tiny --write-shipped``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_agentic as ba  # noqa: E402
import bench_common as bc  # noqa: E402


def write_shipped_bench_weights() -> list[Path]:
    """Warm-start the benchmarks' tiny model and their tool-use model; write both as shipped weights (their paths)."""
    from trl_plugins.tasks.tiny import write_shipped_weights
    from trl_plugins.tasks.tiny_tools import write_shipped_tool_weights

    return [write_shipped_weights(bc.demo_settings()),
            write_shipped_tool_weights(bc.demo_settings(), ba.warm_start_settings())]


if __name__ == "__main__":
    if sys.argv[1:]:
        raise SystemExit("usage: python scripts/write_shipped_weights.py")
    for written in write_shipped_bench_weights():
        print(written)
