"""Release metadata in step: one version source, a changelog, the release check script that .ci/run calls.
(The build, ``twine check`` and installs themselves run in ``scripts/check_release.sh``.)"""

from pathlib import Path

import pytest

import trl_plugins

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_has_one_source():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trl_plugins.__version__"}
    assert trl_plugins.__version__.count(".") == 2


def test_changelog_names_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {trl_plugins.__version__}" in changelog and "## Unreleased" in changelog


def test_the_release_check_is_run_by_ci():
    script = ROOT / "scripts" / "check_release.sh"
    assert script.is_file() and "twine check" in script.read_text()
    assert "scripts/check_release.sh" in (ROOT / ".ci" / "run").read_text()
