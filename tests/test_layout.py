"""The package layout (issue 25): ``trl_plugins/`` shows the plugin-facing API apart from the runtime, the guards,
the CLI and tools, the components, the testing kit and the bundled tasks, and the layers import downward only.

The rule, in full:

* a plugin module (every module of ``plugins/``, and the plugin module ``trl-plugins new`` writes) imports from
  ``trl_plugins`` only the plugin-facing API: ``trl_plugins.api`` (the contract: base class, hook specs, stage
  contexts, options, errors, the helpers plugins call) and its submodules, and ``trl_plugins.components`` (the
  judges, PRMs, teachers and verifier feedback plugins build on; a library on top of the API, which nothing of the
  runtime uses). Never the top-level ``trl_plugins`` (the user surface: it loads the runtime), never the runtime,
  the guards, the CLI, the testing kit or the tasks;
* ``trl_plugins.api`` imports only itself; the components import only the API and each other;
* each subpackage imports only the layers below it (:data:`MAY_IMPORT`): api < components, guards < runtime
  < tasks < cli, testing;
* the top level of ``trl_plugins/`` holds ``__init__.py`` and the subpackages, nothing else.

Imports inside functions count (AST scan of the whole source), and so do relative ones.
"""

import ast
from pathlib import Path

import pytest

from trl_plugins.cli.scaffold import STAGES, scaffold

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trl_plugins"
PLUGINS = REPO / "plugins"

SUBPACKAGES = {"api", "components", "guards", "runtime", "tasks", "cli", "testing"}
#: Which subpackages a module of each subpackage may import (its own included). The top-level ``__init__``
#: (the user surface) re-exports the API, the manager's functions and the trainer and config.
MAY_IMPORT = {
    "api": {"api"},
    "components": {"api", "components"},
    "guards": {"api", "guards"},
    "runtime": {"api", "components", "guards", "runtime"},
    "tasks": {"api", "components", "guards", "runtime", "tasks"},
    "cli": {"api", "components", "guards", "runtime", "tasks", "cli"},
    "testing": {"api", "components", "guards", "runtime", "tasks", "testing"},
    "": {"api", "guards", "runtime"},
}
#: What a plugin module may import from trl_plugins (with their submodules).
PLUGIN_FACING = ("trl_plugins.api", "trl_plugins.components")


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the module ``module``) imports, absolute, relative ones resolved; for
    ``from X import a`` both ``X`` and ``X.a`` (``a`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
    return found


def framework_names(imports: set[str]) -> set[str]:
    return {name for name in imports if name == "trl_plugins" or name.startswith("trl_plugins.")}


def plugin_violations(source: str, module: str) -> list[str]:
    """The import statements of a plugin module that reach ``trl_plugins`` outside :data:`PLUGIN_FACING`
    (``from trl_plugins import X`` included: the top-level package is the user surface, and it loads the runtime)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            sources = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = {alias.name for alias in node.names}
            facing = names <= {"api", "components"}
            sources = ["trl_plugins.api"] if node.module == "trl_plugins" and facing else [node.module or ""]
        else:
            continue  # relative imports stay inside the plugin's own package
        for name in sources:
            if name in ("trl_plugins", "trl_plugins.api") or name.startswith("trl_plugins."):
                if not any(name == ok or name.startswith(ok + ".") for ok in PLUGIN_FACING):
                    bad.append(f"{module}:{node.lineno} imports {name}")
    return bad


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in SUBPACKAGES) else ""


def layer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of ``module`` (a framework module) that run against :data:`MAY_IMPORT`."""
    own = _subpackage(module)
    allowed = MAY_IMPORT[own]
    bad = []
    for name in sorted(framework_names(imported_modules(source, module, is_package))):
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in SUBPACKAGES:
            continue  # `trl_plugins` itself, or a name imported from it (`from trl_plugins import __version__`)
        if parts[1] not in allowed:
            bad.append(f"{module} ({own or 'top level'}) imports {name} ({parts[1]})")
    return bad


def _module_name(path: Path) -> str:
    parts = ["trl_plugins", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def framework_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


# ---------------------------------------------------------------------------------------------------------------
# (a) plugins import only the API
# ---------------------------------------------------------------------------------------------------------------


def test_built_in_plugins_import_only_the_plugin_facing_api():
    modules = sorted(PLUGINS.glob("*.py"))
    assert len(modules) > 50
    bad = [v for p in modules
           for v in plugin_violations(p.read_text(encoding="utf-8"), f"trl_plugins_builtin.{p.stem}")]
    assert bad == [], "plugins may import only trl_plugins.api and trl_plugins.components:\n" + "\n".join(bad)


@pytest.mark.parametrize("stage", [*STAGES, ("advantage", "loss")],
                         ids=lambda s: s if isinstance(s, str) else "+".join(s))
def test_scaffolded_plugin_imports_only_the_api(stage, tmp_path):
    root = scaffold("layout_probe", tmp_path / "pkg", stage, check_taken=False)
    plugin = root / "src" / "trl_plugins_layout_probe" / "plugin.py"
    source = plugin.read_text(encoding="utf-8")
    assert "trl_plugins.api" in source
    bad = plugin_violations(source, "trl_plugins_layout_probe.plugin")
    assert bad == [], "the scaffolded plugin imports outside the API:\n" + "\n".join(bad)


@pytest.mark.parametrize("statement", [
    "from trl_plugins import Plugin",
    "from trl_plugins.runtime.loss import compute_loss_with_plugins",
    "from trl_plugins.testing import make_rollout_context",
    "from trl_plugins.tasks.arithmetic import verify",
    "import trl_plugins.runtime.head_stats",
    "def f():\n    from trl_plugins.guards.tool_guard import ToolError",
])
def test_the_plugin_check_catches_an_import_outside_the_api(statement):
    assert plugin_violations(statement + "\n", "trl_plugins_builtin.probe")


def test_the_plugin_check_accepts_the_api():
    source = ("from trl_plugins.api import Plugin, hookimpl\n"
              "from trl_plugins.components.teacher import shared_teacher\n"
              "import trl_plugins.api.success\nfrom ._length import x\n")
    assert plugin_violations(source, "trl_plugins_builtin.probe") == []


# ---------------------------------------------------------------------------------------------------------------
# (b) the layers import downward; the API is the bottom
# ---------------------------------------------------------------------------------------------------------------


def test_every_module_imports_only_the_layers_below_it():
    modules = framework_modules()
    assert {"trl_plugins.api.plugin", "trl_plugins.runtime.trainer", "trl_plugins.cli.commands"} <= set(modules)
    bad = [v for name, path in sorted(modules.items())
           for v in layer_violations(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")]
    assert bad == [], "imports against the layering (tests/test_layout.py MAY_IMPORT):\n" + "\n".join(bad)


def test_the_api_imports_nothing_but_itself():
    """Stated separately from the table: no module of ``api/`` imports the runtime, the guards, the CLI, the
    testing kit, the tasks or the components."""
    for name, path in framework_modules().items():
        if name.startswith("trl_plugins.api"):
            outside = {n for n in framework_names(imported_modules(path.read_text(encoding="utf-8"), name,
                                                                   path.name == "__init__.py"))
                       if n.split(".")[1:2] and n.split(".")[1] in SUBPACKAGES - {"api"}}
            assert outside == set(), f"{name} imports {sorted(outside)}"


@pytest.mark.parametrize("module, statement", [
    ("trl_plugins.api.plugin", "from trl_plugins.runtime.loss import SUPPORTED_LOSS_TYPES"),
    ("trl_plugins.api.contexts", "def f():\n    from ..runtime import trainer"),
    ("trl_plugins.api.success", "from trl_plugins.components.steps import split_steps"),
    ("trl_plugins.components.teacher_logprobs", "from trl_plugins.runtime.policy_probe import prompt_completion_batch"),
    ("trl_plugins.guards.tool_guard", "from trl_plugins.runtime.config import PluginGRPOConfig"),
    ("trl_plugins.runtime.trainer", "from trl_plugins.cli.train import main"),
    ("trl_plugins.runtime.trainer", "from trl_plugins.testing import make_tiny_trainer"),
])
def test_the_layer_check_catches_an_upward_import(module, statement):
    assert layer_violations(statement + "\n", module)


# ---------------------------------------------------------------------------------------------------------------
# (c) the top level shows the structure
# ---------------------------------------------------------------------------------------------------------------


def test_the_top_level_holds_only_the_subpackages():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == SUBPACKAGES | {"__init__.py"}, (
        f"trl_plugins/ holds {sorted(entries - SUBPACKAGES - {'__init__.py'})} beside its subpackages; a module "
        "belongs in one of them (tests/test_layout.py)"
    )
    for sub in SUBPACKAGES:
        assert (PACKAGE / sub / "__init__.py").is_file(), f"trl_plugins/{sub}/ is not a package"


def test_pyproject_ships_every_subpackage():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    missing = [sub for sub in sorted(SUBPACKAGES) if f'"trl_plugins.{sub}"' not in text]
    assert missing == [], f"pyproject.toml [tool.setuptools] packages lacks trl_plugins.{missing}"
