"""Every built-in plugin states which official repository @ commit it was checked against (or that none was reachable
and what is reconstructed) in its structured ``official`` metadata; the metadata is refused when inconsistent; the
generated docs/faithfulness.md lists every plugin with its source, verdict and deviating options."""

import pytest

from trl_plugins import OfficialSource, Plugin, PluginOptions, option
from trl_plugins.cli.docs import GENERATED, builtin_plugins, render_all
from trl_plugins.api.faithfulness import VERDICTS, faithfulness_page, official_source_problems


@pytest.fixture(scope="module")
def plugins():
    return {name: cls for name, cls in builtin_plugins().items() if not cls.deprecated()}


def test_every_builtin_plugin_declares_its_official_source(plugins):
    problems = [p for cls in plugins.values() for p in official_source_problems(cls)]
    assert not problems, "\n".join(problems)


def test_a_plugin_without_an_official_source_is_reported():
    class Undeclared(Plugin):
        name = "undeclared_demo"

    assert official_source_problems(Undeclared) == [
        "undeclared_demo: no `official = OfficialSource(...)` (which official repository @ commit it was checked "
        "against, or OfficialSource(None, verdict='reconstructed', note=...) when none was reachable)"
    ]


def test_options_named_by_the_metadata_must_exist_and_equal_means_nothing_reconstructed():
    from dataclasses import dataclass

    @dataclass
    class Opts(PluginOptions):
        k: int = option(3, help="k", reconstructed=True)

    class Named(Plugin):
        name = "named_demo"
        Options = Opts
        official = OfficialSource("owner/repo", "abcdef1", verdict="faithful", variants=("kk",))

    class Equal(Plugin):
        name = "equal_demo"
        Options = Opts
        official = OfficialSource("owner/repo", "abcdef1", verdict="equal")

    assert official_source_problems(Named) == [
        "named_demo: official names the option 'kk', which the plugin does not have"]
    assert "verdict 'equal' but the plugin declares reconstructed details (['k'])" in official_source_problems(Equal)[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(repository=None, verdict="faithful", note="x"), "must be 'reconstructed'"),
    (dict(repository=None, verdict="reconstructed"), "note must say which parts are reconstructed"),
    (dict(repository="owner/repo", commit="main"), "commit='main' for owner/repo; expected 7 to 40 lower-case hex"),
    (dict(repository="owner/repo", commit=""), "commit=''"),
    (dict(repository="https://github.com/owner/repo", commit="abcdef1"), "expected 'owner/name'"),
    (dict(repository="owner/repo", commit="abcdef1", verdict="same"), "verdict='same'; allowed: equal, faithful"),
    (dict(repository="owner/repo", commit="abcdef1", verdict="equal", variants=("x",)), "use verdict='faithful'"),
    (dict(repository=None, commit="abcdef1", verdict="reconstructed", note="x"), "without a repository"),
])
def test_inconsistent_metadata_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OfficialSource(**kwargs)


def test_the_page_lists_every_plugin_with_its_source_and_verdict(plugins):
    page = render_all()["faithfulness.md"]
    assert page.startswith(GENERATED)
    for name, cls in plugins.items():
        source = cls.official
        row = next(line for line in page.splitlines() if line.startswith(f"| [`{name}`](plugins/{name}.md) |"))
        assert source.citation in row and f"| {VERDICTS[source.verdict]} |" in row
        for variant in source.variants:
            assert f"`{variant}` (variant values" in row
        for opt in source.non_official_defaults:
            assert f"`{opt}` (default" in row
    assert "length_shaping" not in page  # deprecated spellings are not plugins of their own


def test_the_page_marks_a_plugin_without_metadata():
    class Undeclared(Plugin):
        name = "undeclared_demo"

    assert "| [`undeclared_demo`](plugins/undeclared_demo.md) | **not declared** |" in faithfulness_page(
        {"undeclared_demo": Undeclared}, GENERATED)


def test_the_plugin_page_names_the_official_code(plugins):
    pages = render_all()
    assert "| Official code | `yangzhch6/DARS@9b21b71` (faithful with documented options;" in pages["plugins/dars.md"]
    assert "| Official code | `no official code reachable` (reconstructed;" in pages["plugins/dler.md"]


def test_show_names_the_official_code():
    from trl_plugins.cli.commands import describe_plugin

    assert "Official code: pixas/DECS@0d12e53 (faithful with documented options)" in describe_plugin("decs")
    assert "Official code: no official code reachable (reconstructed)" in describe_plugin("salt")


def test_every_builtin_docstring_names_its_official_code_or_says_it_is_reconstructed():
    """Issue 28, item 3: the module docstring (what a reader opens first) states the repository @ commit the plugin
    was checked against, as its ``official`` metadata records it, or that no official code was reachable."""
    import sys

    from trl_plugins.runtime.manager import available_plugins

    missing = []
    for name, cls in sorted(available_plugins().items()):
        if cls.deprecated() or not cls.__module__.startswith("trl_plugins_builtin"):
            continue
        source = cls.official
        doc = (sys.modules[cls.__module__].__doc__ or "") + (cls.__doc__ or "")
        if source.repository:
            if source.repository not in doc or (source.commit or "")[:7] not in doc:
                missing.append(f"{name}: {source.repository}@{(source.commit or '')[:7]}")
        elif "reconstructed" not in doc.lower():
            missing.append(f"{name}: says neither its official code nor that it is reconstructed")
    assert not missing, missing
