"""Regenerate the plugin catalogue table in README.md from the plugins' metadata.

Usage: ``python scripts/update_readme_catalogue.py`` (``--check`` exits 1 when README.md is out of date).
The table sits between the ``<!-- catalogue:start -->`` and ``<!-- catalogue:end -->`` markers.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"


def catalogue_table() -> str:
    from trl_plugins.runtime.manager import _builtin_plugins

    lines = ["| plugin | stages | method | paper |", "|---|---|---|---|"]
    for name, cls in sorted(_builtin_plugins().items()):
        ids = ", ".join(re.findall(r"arXiv:\s?\d{4}\.\d{4,5}", cls.paper))
        summary = cls.summary.replace("|", "\\|")
        lines.append(f"| `{name}` | {', '.join(cls.stages())} | {summary} | {ids} |")
    return "\n".join(lines)


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{catalogue_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = render(text)
    if "--check" in argv:
        return 0 if new == text else 1
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
