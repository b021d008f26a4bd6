"""What a release must hold (run by ``scripts/check_release.sh``).

``python scripts/check_release_contents.py DIST`` checks the built files in ``DIST``: one wheel and one sdist whose
version is ``trl_plugins.__version__`` of this checkout; the wheel holds the framework, every built-in plugin
module (as ``trl_plugins_builtin``), an entry point per built-in and the ``trl-plugins`` script, and nothing from
``tests/``; the sdist holds the README, the changelog and the sources.

``python scripts/check_release_contents.py --installed VENV`` (run from outside the checkout with VENV's python)
checks that the installed copy is imported from VENV, not from a checkout, and that every requirement of the
distribution is satisfied by the installed versions.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail(message: str) -> None:
    print(f"check_release_contents: {message}", file=sys.stderr)
    raise SystemExit(1)


def checkout_version() -> str:
    tree = ast.parse((ROOT / "trl_plugins" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return node.value.value
    fail("trl_plugins/__init__.py has no __version__")


def check_dist(dist: Path) -> None:
    version = checkout_version()
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
    wheel, sdist = wheels[0], sdists[0]
    if f"-{version}-" not in wheel.name or not sdist.name.endswith(f"-{version}.tar.gz"):
        fail(f"the built files {wheel.name}, {sdist.name} do not carry the version {version} of trl_plugins")
    names = zipfile.ZipFile(wheel).namelist()
    plugins = sorted(p.name for p in (ROOT / "plugins").glob("*.py"))
    missing = [p for p in plugins if f"trl_plugins_builtin/{p}" not in names]
    if missing:
        fail(f"the wheel lacks the built-in plugin modules {missing}")
    framework = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "trl_plugins").rglob("*.py"))
    missing = [p for p in framework if p not in names]
    if missing:
        fail(f"the wheel lacks framework modules {missing}")
    shipped = [f"trl_plugins/tasks/weights/{w.name}" for w in (ROOT / "trl_plugins" / "tasks" / "weights").glob("*")]
    missing = [w for w in shipped if w not in names]
    if missing:
        fail(f"the wheel lacks the shipped model weights {missing} (pyproject.toml [tool.setuptools.package-data])")
    leaked = [n for n in names if n.startswith(("tests/", "scripts/")) or "/tests/" in n or "conftest" in n]
    if leaked:
        fail(f"the wheel holds files from tests/ or scripts/: {leaked[:5]}")
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(wheel).read(info).decode()
    builtins = [p[:-3] for p in plugins if not p.startswith("_")]
    missing = [b for b in builtins if f"trl_plugins_builtin.{b}:" not in entry_points]
    if missing or "trl-plugins = trl_plugins.cli:main" not in entry_points:
        fail(f"entry points missing for {missing or 'the trl-plugins script'}")
    members = tarfile.open(sdist).getnames()
    for needed in ("README.md", "CHANGELOG.md", "pyproject.toml", "trl_plugins/cli/commands.py", "plugins/lp_reg.py"):
        if not any(m.endswith("/" + needed) for m in members):
            fail(f"the sdist lacks {needed}")
    print(f"contents ok: {wheel.name} ({len(names)} files, {len(builtins)} built-in plugins), {sdist.name}")


def check_installed(venv: Path) -> None:
    from importlib import metadata

    from packaging.requirements import Requirement

    import trl_plugins
    import trl_plugins_builtin

    for module in (trl_plugins, trl_plugins_builtin):
        where = Path(module.__file__).resolve()
        if venv.resolve() not in where.parents:
            fail(f"{module.__name__} is imported from {where}, not from the environment under test {venv}")
    if metadata.version("trl-plugins") != trl_plugins.__version__:
        fail(f"installed metadata says {metadata.version('trl-plugins')}, the package {trl_plugins.__version__}")
    problems = []
    for text in metadata.requires("trl-plugins") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req} (installed {installed})")
    if problems:
        fail("unsatisfied requirements: " + "; ".join(problems))
    print(f"installed ok: trl-plugins {trl_plugins.__version__} from {Path(trl_plugins.__file__).parent}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--installed":
        check_installed(Path(sys.argv[2]))
    elif len(sys.argv) == 2:
        check_dist(Path(sys.argv[1]))
    else:
        fail("usage: check_release_contents.py DIST | --installed VENV")
