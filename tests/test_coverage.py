"""docs/coverage.md, the reading list's coverage, stays true to the built-in plugins."""

import re
from collections import Counter
from pathlib import Path

from trl_plugins.runtime.manager import _builtin_plugins

COVERAGE = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
STATUSES = {"covered", "partly", "native", "not"}


def _rows() -> list[list[str]]:
    rows = []
    for line in COVERAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and re.fullmatch(r"[A-Z]{3}-\d\d", cells[0]):
            rows.append(cells)
    return rows


def _named(cell: str) -> set[str]:
    return set(re.findall(r"\[`([a-z0-9_]+)`\]", cell))


def test_every_row_has_a_known_status_and_feasibility():
    rows = _rows()
    assert len(rows) == 99
    assert len({r[0] for r in rows}) == len(rows), "a catalogue id appears twice"
    for r in rows:
        assert r[3] in STATUSES, r
        assert r[2] in {"3", "4", "5"}, r
        assert bool(_named(r[4])) == (r[3] in {"covered", "partly"}), f"{r[0]}: status {r[3]} with plugin cell {r[4]}"


def test_summary_line_counts_the_table():
    counts = Counter(r[3] for r in _rows())
    summary = re.search(r"<!-- coverage:summary -->\*\*(\d+) covered, (\d+) partly, (\d+) native in TRL, (\d+) not "
                        r"covered\*\* \(of (\d+)\)", COVERAGE.read_text())
    assert summary, "summary line missing"
    assert [int(g) for g in summary.groups()] == [counts["covered"], counts["partly"], counts["native"], counts["not"],
                                                 sum(counts.values())]


def test_every_plugin_named_is_a_builtin_and_every_builtin_is_named():
    builtins = set(_builtin_plugins())
    named = set().union(*(_named(line) for line in COVERAGE.read_text().splitlines()))
    assert named - builtins == set(), "docs/coverage.md names plugins that do not exist"
    assert builtins - named == set(), "built-in plugins missing from docs/coverage.md"
    for name in named:
        assert (COVERAGE.parent / "plugins" / f"{name}.md").is_file(), name
