"""README.md stays in step with the code: catalogue table and the two commands."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("update_readme_catalogue", ROOT / "scripts/update_readme_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalogue_lists_every_builtin_plugin_as_the_code_says():
    script = _load_script()
    text = (ROOT / "README.md").read_text()
    assert script.render(text) == text, "README catalogue is stale: run python scripts/update_readme_catalogue.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -q torch==2.13.0 -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile -m "not slow"'
    assert command in readme
    assert command in (ROOT / ".ci/run").read_text()


def test_ci_runs_every_trl_plugins_command_of_the_readme():
    """Each `trl-plugins ...` command in the README's bash blocks runs in .ci/run (with cheap extra settings)."""
    import re

    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            code = line.split("#", 1)[0]
            commands += [m.strip() for m in re.findall(r"(trl-plugins [^&|]+)", code)]
    assert commands, "no trl-plugins command found in the README"
    for command in commands:
        assert command in ci, f"README command {command!r} is not run by .ci/run"
