"""Docs discipline: every hook documented, every option with help, every plugin citing its arXiv paper, the
generated reference pages in docs/ identical to what the code generates now (regenerate them with
``python -m trl_plugins.cli.docs`` whenever a plugin, a hook spec or a context changes), and the examples of
docs/writing-a-plugin.md run."""

import re
from pathlib import Path

import pytest

from trl_plugins.api import hookspecs
from trl_plugins.cli.docs import GENERATED, builtin_plugins, check, main, render_all, write

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GUIDE = DOCS / "writing-a-plugin.md"
ARXIV_ID = re.compile(r"arXiv:\d{4}\.\d{4,5}")
REGENERATE = "regenerate them with `python -m trl_plugins.cli.docs` (or `trl-plugins docs`) and commit docs/"


@pytest.fixture(scope="module")
def plugins():
    return builtin_plugins()


def test_every_hook_spec_is_known_and_documented():
    specs = {name for name, value in vars(hookspecs).items() if callable(value) and hasattr(value, "trl_plugins_spec")}
    assert specs == set(hookspecs.HOOK_STAGES), "every hook spec needs a stage in HOOK_STAGES (and vice versa)"
    undocumented = [name for name in sorted(specs) if not (getattr(hookspecs, name).__doc__ or "").strip()]
    assert not undocumented, f"hook specs without a docstring: {undocumented}"


def test_every_option_has_help(plugins):
    missing = [f"{name}.{info.name}" for name, cls in plugins.items() for info in cls.Options.describe()
               if not (info.help or "").strip()]
    assert not missing, f"options with an empty help text: {missing}"


def test_every_plugin_cites_an_arxiv_id(plugins):
    missing = {name: cls.paper for name, cls in plugins.items() if not ARXIV_ID.search(cls.paper or "")}
    assert not missing, f"plugins whose `paper` has no arXiv id (arXiv:NNNN.NNNNN): {missing}"


def test_generated_pages_are_up_to_date():
    problems = check(DOCS)
    assert not problems, f"docs/ is out of date with the code ({'; '.join(problems)}): {REGENERATE}."


def test_catalogue_and_pages_cover_every_builtin(plugins):
    pages = render_all(plugins)
    index = pages["plugins/index.md"]
    for name, cls in plugins.items():
        assert f"[`{name}`]({name}.md)" in index
        page = pages[f"plugins/{name}.md"]
        assert page.startswith(GENERATED) and f"# `{name}`" in page
        for info in cls.Options.describe():
            assert f"| `{info.name}` |" in page
        for hook in cls.hook_names():
            assert f"`{hook}`" in page
        for item in cls.reconstructed:
            assert item.replace("|", "\\|").splitlines()[0][:40] in page
    for hook in hookspecs.HOOK_STAGES:
        assert f"### `{hook}(" in pages["hooks.md"]


def test_pages_render_metadata_of_a_plugin():
    from dataclasses import dataclass
    from typing import Literal

    from trl_plugins import Plugin, PluginOptions, hookimpl, option

    @dataclass
    class Opts(PluginOptions):
        mode: Literal["a", "b"] = option("a", help="Which | mode.")
        rate: float = option(0.1, min=0.0, max=1.0, help="A rate.", reconstructed=True)

    class Documented(Plugin):
        """A plugin."""

        name = "documented"
        paper = "Some Paper, arXiv:2501.01234; Other, arXiv:2502.00001"
        summary = "Does things."
        Options = Opts
        conflicts_with = ("other",)
        conflict_reason = "both do things"
        reconstructed = ("a detail",)
        needs_head_stats = True

        @hookimpl
        def trl_plugins_loss(self, ctx):
            pass

    pages = render_all({"documented": Documented})
    page = pages["plugins/documented.md"]
    assert "[arXiv:2501.01234](https://arxiv.org/abs/2501.01234)" in page
    assert "| `mode` | str | `'a'` | `'a'`, `'b'` | Which \\| mode. |" in page
    assert "| `rate` | float | `0.1` | [0.0, 1.0] | A rate. *(reconstructed: not stated by the paper)* |" in page
    assert "Cannot be stacked with `other`: both do things." in page and "LM-head statistics" in page
    assert "- a detail" in page and "option `rate`" in page
    assert "plugin_config:\n  documented:\n    mode: a\n    rate: 0.1" in page
    assert "`trl_plugins_loss` (loss)" in page
    assert "| [`documented`](documented.md) | loss | Does things. |" in pages["plugins/index.md"]


def test_compatibility_page_renders_conflicts_replacements_and_loss_types():
    from trl_plugins import Plugin, hookimpl

    class Base(Plugin):
        paper = "arXiv:2501.01234"

    class Narrow(Base):
        name = "narrow"
        replaces = ("the advantages",)
        loss_types = ("grpo",)
        loss_types_reason = "a per-response mean"
        conflicts_with = {"wide": "both rewrite the advantages"}

        @hookimpl
        def trl_plugins_loss(self, ctx):
            pass

    class Wide(Base):
        name = "wide"

        @hookimpl
        def trl_plugins_transform_rewards(self, ctx):
            pass

    class Trio(Base):
        conflicts_with = ("t1", "t2", "t3")
        conflict_reason = "all three do it"

    plugins = {"narrow": Narrow, "wide": Wide}
    plugins.update({n: type(n, (Trio,), {"name": n}) for n in ("t1", "t2", "t3")})
    page = render_all(plugins)["compatibility.md"]
    assert page.startswith(GENERATED)
    assert "| `narrow` + `wide` | both rewrite the advantages |" in page  # declared by one side only
    assert "| any two of `t1`, `t2`, `t3` | all three do it |" in page
    assert "| [`narrow`](plugins/narrow.md) | loss | the advantages | `grpo` only: a per-response mean |" in page
    assert "| [`wide`](plugins/wide.md) | reward | - | any |" in page
    assert "## GPU and vLLM validation" in page and "scripts/gpu_smoke.py" in page
    narrow_page = render_all(plugins)["plugins/narrow.md"]
    assert "- Replaces the advantages." in narrow_page and "- Loss types: `grpo` only: a per-response mean." in narrow_page
    assert "- Cannot be stacked with `wide`: both rewrite the advantages." in narrow_page


def test_compatibility_page_lists_every_builtin_and_every_pick_one_pair(plugins):
    page = render_all(plugins)["compatibility.md"]
    for name in plugins:
        assert f"| [`{name}`](plugins/{name}.md) |" in page
    for name, cls in plugins.items():
        for other, reason in cls.conflicts().items():
            assert reason in page and f"`{other}`" in page
    assert "[compatibility](../compatibility.md)" in render_all(plugins)["plugins/index.md"]
    assert "(docs/compatibility.md)" in (REPO / "README.md").read_text()


def test_hook_conflicts_and_deprecated_spellings_are_rendered(plugins):
    pages = render_all(plugins)
    reason = plugins["hbpo"].conflicts_with_hooks["trl_plugins_reject_groups"]
    assert f"| `hbpo` + any plugin with `trl_plugins_reject_groups` (`clpo`, `dars`, `decs`, `dler`, `dynamic_sampling`, `rlpr`) | {reason} |" in \
        pages["compatibility.md"]
    assert "Cannot be stacked with any plugin implementing `trl_plugins_reject_groups`" in pages["plugins/hbpo.md"]
    legacy = pages["plugins/length_shaping.md"]
    assert "## Deprecated spellings" in legacy and "Every value of `mode` moved" in legacy
    assert "- `mode: hbpo` builds [`hbpo`](hbpo.md); renamed options: `hbpo_budgets` -> `budgets`" in legacy
    assert "These values of `schedule` moved" in pages["plugins/hint_scaffold.md"]
    assert "## Deprecated spellings" not in pages["plugins/laser.md"]


# Documents that are not in the repository (the project's design notes and method specs are not shipped).
UNSHIPPED = re.compile(
    r"catalog(ue)? section|catalog [A-Z]{3}-\d|specs/|methods_\w+\.md|DESIGN\.md|test_loss_equivalence|[Ii]nvariant \d"
)


def test_code_docs_and_messages_cite_only_what_the_repository_has():
    roots = ["trl_plugins", "plugins", "docs", "scripts", "tests", "README.md", "pyproject.toml"]
    files = [p for r in roots for p in ([REPO / r] if (REPO / r).is_file() else (REPO / r).rglob("*"))
             if p.suffix in (".py", ".md", ".toml", ".yaml") and p.resolve() != Path(__file__).resolve()]
    cited = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}" for p in files
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if UNSHIPPED.search(line)]
    assert not cited, "references to documents that are not in the repository:\n" + "\n".join(cited)


def test_write_check_and_stale_pages(tmp_path, plugins):
    assert main(["--out", str(tmp_path)]) == 0
    assert check(tmp_path) == []
    assert main(["--out", str(tmp_path), "--check"]) == 0
    some = tmp_path / "plugins" / f"{next(iter(plugins))}.md"
    some.write_text(some.read_text() + "edited\n")
    (tmp_path / "plugins" / "gone.md").write_text(GENERATED + "\n# `gone`\n")
    (tmp_path / "plugins" / "handwritten.md").write_text("# notes kept by hand\n")
    problems = check(tmp_path)
    assert any("out of date" in p for p in problems)
    assert "plugins/gone.md is stale (no such plugin any more)" in problems
    assert main(["--out", str(tmp_path), "--check"]) == 1
    changed = write(tmp_path)
    assert "plugins/gone.md" in changed and not (tmp_path / "plugins" / "gone.md").exists()
    assert (tmp_path / "plugins" / "handwritten.md").exists()  # only generated pages are managed
    assert check(tmp_path) == []


def test_writing_guide_walks_through_every_context_and_the_three_commands():
    text = GUIDE.read_text()
    for context in ("PromptContext", "RolloutContext", "RewardContext", "AdvantageContext", "LossContext"):
        assert re.search(rf"^## \d\. `{context}`", text, flags=re.M), context
    for command in ("trl-plugins new ", "python -m pytest", "trl-plugins train "):
        assert command in text


def test_writing_guide_examples_run():
    """Every ```python block of the guide runs, in order, in one namespace (```py blocks are not run)."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6
    namespace = {"__name__": "writing_a_plugin"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name}[python block {i}]", "exec"), namespace)


def test_testing_kit_page_examples_run(tmp_path):
    """docs/testing-kit.md: every ```python block runs in one namespace, then every test function it defines passes
    (with a fresh ``tmp_path`` when it takes one), the example plugin registered by name as a test would."""
    import inspect

    from trl_plugins.testing import temporary_plugin

    page = DOCS / "testing-kit.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    namespace = {"__name__": "testing_kit_page"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[python block {i}]", "exec"), namespace)
    tests = {name: fn for name, fn in namespace.items() if name.startswith("test_") and callable(fn)}
    assert len(tests) >= 6, sorted(tests)
    with temporary_plugin(namespace["ScalePositives"]):
        for name, fn in tests.items():
            kwargs = {"tmp_path": tmp_path / name} if "tmp_path" in inspect.signature(fn).parameters else {}
            fn(**kwargs)


def test_the_index_links_every_page_and_the_readme_links_the_index():
    index = (DOCS / "index.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    missing = [page for page in pages if f"]({page})" not in index]
    assert not missing, f"docs/index.md does not link {missing}"
    assert "](plugins/index.md)" in index
    for target in re.findall(r"\]\(([^)#]+)\)", index):
        assert (DOCS / target).is_file(), f"docs/index.md links {target}, which does not exist"
    assert "(docs/index.md)" in (REPO / "README.md").read_text()


def test_configuration_reference_has_every_field_option_and_variable(plugins):
    import dataclasses

    from trl_plugins.cli.compare import build_parser
    from trl_plugins.cli.train import TrainScriptArguments

    page = render_all(plugins)["configuration.md"]
    for name in ("plugins", "plugin_config", "offpolicy_shaping_gamma", "plugin_generation_budget"):
        assert f"| `{name}` |" in page
    for f in dataclasses.fields(TrainScriptArguments):
        assert f"| `{f.name}` |" in page
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert f"| `{', '.join(action.option_strings)}` |" in page
    for variable in ("TRL_PLUGINS_DISABLE_AUTOLOAD", "TRL_PLUGINS_LOAD", "TRL_PLUGINS_CACHE"):
        assert f"| `{variable}` |" in page
    for name, cls in plugins.items():
        for info in cls.Options.describe():
            assert f"| [`{name}`](plugins/{name}.md) | `{info.name}` |" in page


def test_a_generated_section_is_replaced_between_its_markers_and_a_stale_one_is_reported(tmp_path):
    from trl_plugins.cli.docs import _section_updates, replace_section, section_markers

    begin, end = section_markers("table", "tests/t.py")
    text = f"# Page\n\nprose\n\n{begin}\n| old |\n{end}\n\nmore prose\n"
    new = replace_section(text, "table", "tests/t.py", "| new |\n")
    assert new == f"# Page\n\nprose\n\n{begin}\n| new |\n{end}\n\nmore prose\n"
    assert replace_section("# no markers\n", "table", "tests/t.py", "x") is None
    (tmp_path / "page.md").write_text(text)
    updated, problems = _section_updates(tmp_path, {"page.md": {"table": ("tests/t.py", "| new |")}})
    assert problems == [] and updated["page.md"] == new  # check() compares this with the file: stale
    (tmp_path / "page.md").write_text("# markers removed by hand\n")
    _, problems = _section_updates(tmp_path, {"page.md": {"table": ("tests/t.py", "| new |")}})
    assert problems and "lacks the markers of generated section 'table'" in problems[0]


def test_the_bad_input_table_in_reliability_md_is_the_test_tables_rendering():
    from trl_plugins.cli.docs import render_sections, replace_section

    ((source, body),) = render_sections()["reliability.md"].values()
    text = (DOCS / "reliability.md").read_text()
    assert replace_section(text, "bad-inputs", source, body) == text, "regenerate: python -m trl_plugins.cli.docs"
    assert "| `reward-nan-in-a-row` | refused at the first row that carries it |" in body
    assert "| `state-planted-pickle` |" in body or "| refused when the checkpoint is loaded |" in body


def test_a_plugin_counts_as_run_on_a_gpu_only_where_a_cell_of_its_own_row_is_ok():
    from trl_plugins.cli.docs import _trained_in

    matrices = "\n".join([
        "| plugin / stack | bf16 | lora |",
        "|---|---|---|",
        "| `acre` | ok | refused: PluginConfigError: x |",
        "| `armed` | refused: PluginConfigError: needs embedder_base_url | failed: OSError: offline |",
        "| `observe_r1` | ok (no update) | not run |",
        "| `hint_scaffold+canon+lp_reg` | ok | ok |",
    ])
    assert _trained_in(matrices, "acre") and _trained_in(matrices, "observe_r1")
    assert not _trained_in(matrices, "armed")
    assert not _trained_in(matrices, "canon")  # a stack's row does not count for its members
    assert not _trained_in(matrices, "dno")  # no row at all
