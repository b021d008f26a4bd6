"""Module layering: the framework and the plugins never load the bundled demo tasks, and no two modules of
``trl_plugins`` (or of the built-in plugins) import each other, directly or through others, even inside functions."""

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"trl_plugins": REPO / "trl_plugins", "trl_plugins_builtin": REPO / "plugins"}

LOADED_TASKS = """
import importlib, json, sys
from trl_plugins.runtime.manager import BUILTIN_PACKAGE, builtin_modules
names = ["trl_plugins.runtime.generation", "trl_plugins.runtime.trainer"]
names += [f"{BUILTIN_PACKAGE}.{m}" for m in builtin_modules()]
culprits = []
for name in names:
    importlib.import_module(name)
    if "trl_plugins.tasks" in sys.modules:
        culprits.append(name)
        break
print(json.dumps({"imported": names, "culprits": culprits}))
"""


def test_framework_and_plugin_modules_do_not_import_the_bundled_tasks():
    done = subprocess.run([sys.executable, "-c", LOADED_TASKS], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["imported"]) > 2 + 20  # the generation service, the trainer and every built-in plugin
    assert report["culprits"] == [], f"{report['culprits'][0]} imports trl_plugins.tasks (the demo task family)"


#: The only modules outside ``trl_plugins.tasks`` that may import it: the entry points that run the demo task
#: itself (``trl-plugins demo`` / ``compare`` / ``train`` with its built-in datasets) and the testing kit (tiny
#: trainers on the demo data). Everything else names a registered oracle (:mod:`trl_plugins.api.registry`).
TASK_IMPORTERS = {"trl_plugins.cli.demo", "trl_plugins.cli.compare", "trl_plugins.cli.train", "trl_plugins.testing"}


def test_no_production_module_imports_the_bundled_tasks():
    """AST scan, imports inside functions included: no module of the framework (but the demo / CLI entry points
    and the testing kit above) and no built-in plugin imports ``trl_plugins.tasks``; the task is a leaf."""
    graph = import_graph()
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not module.startswith("trl_plugins.tasks") and module not in TASK_IMPORTERS
        for target in targets
        if target == "trl_plugins.tasks" or target.startswith("trl_plugins.tasks.")
    )
    assert offenders == [], "the bundled task is imported by production code: " + "; ".join(offenders)
    assert {"trl_plugins.tasks.arithmetic", "trl_plugins.tasks.tiny"} <= graph["trl_plugins.cli.demo"]  # the scan sees


def test_the_task_scan_catches_an_import(tmp_path):
    """The scan sees ``from ..tasks import x`` inside a function, as production code once wrote it."""
    assert "trl_plugins.tasks.arithmetic" in graph_of_source("trl_plugins.components.x", "def f():\n    from "
                                                             "..tasks.arithmetic import Problem\n")


def graph_of_source(name: str, source: str) -> set[str]:
    """The two packages' modules that ``source`` (module ``name``) imports, as :func:`import_graph` resolves them."""
    files = {_module_name(pkg, root, p) for pkg, root in PACKAGES.items() for p in root.rglob("*.py")}
    return {t for t in _imported(name.rpartition(".")[0], ast.parse(source), files) if t in files}


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the two packages it imports anywhere in its source (top level or in functions)."""
    files = {_module_name(pkg, root, p): p for pkg, root in PACKAGES.items() for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = _imported(package, ast.parse(path.read_text(encoding="utf-8")), files)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _imported(package: str, tree: ast.AST, files) -> set[str]:
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            for alias in node.names:  # `from . import x` / `from .a import b` where b is a module
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
    return targets


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_no_import_cycle_inside_the_packages():
    graph = import_graph()
    assert "trl_plugins.tasks.arithmetic" in graph["trl_plugins.cli.demo"]  # the graph sees imports inside functions
    assert "trl_plugins.api.text" in graph["trl_plugins.tasks.arithmetic"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
