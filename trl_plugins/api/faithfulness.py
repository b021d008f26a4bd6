"""Which official code a plugin was checked against: :class:`OfficialSource` (a plugin's ``official`` attribute), the
checks every built-in plugin passes (:func:`official_source_problems`) and the generated page ``docs/faithfulness.md``.

Faithful to the paper means: the official code's behaviour is the default; a deliberate variant is an option,
documented as such; details the official code or paper does not give are reconstructed and marked. A plugin states
it in one structured field::

    class DarsPlugin(Plugin):
        official = OfficialSource(
            "yangzhch6/DARS", "9b21b71", verdict="faithful", files=("verl/verl/trainer/ppo/ray_dars_trainer.py",),
            variants=("extra_rounding",),
        )

or, where no official code was reachable, ``OfficialSource(None, verdict="reconstructed", note="what is
reconstructed and from what")``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: verdict key -> the words docs/faithfulness.md uses
VERDICTS: dict[str, str] = {
    "equal": "equal",
    "faithful": "faithful with documented options",
    "reconstructed": "reconstructed",
}
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
_REPOSITORY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class OfficialSource:
    """The official code a plugin was compared with, and the verdict of that comparison.

    Attributes:
        repository: ``owner/name`` of the GitHub repository compared with; None: no official code was reachable (the
            plugin then follows the paper's text, and ``note`` says which parts are reconstructed).
        commit: the commit compared with (7 to 40 lower-case hex digits; required with a repository).
        verdict: ``"equal"`` (same results as the official code, to float precision, with the default options),
            ``"faithful"`` (the official behaviour is the default; options or documented details deviate), or
            ``"reconstructed"`` (no official code, or main parts of the method rebuilt from the paper).
        files: the official files the comparison read (paths in the repository).
        note: what else the reader needs: a near-official source (a fork), a second repository, the reconstructed
            parts.
        variants: names of options whose non-default values are documented variants, not the official behaviour.
        non_official_defaults: ``{option: official value and why it differs}`` for options whose default here is
            not the official value (e.g. scaled down for small models).
    """

    repository: str | None
    commit: str = ""
    verdict: str = "faithful"
    files: tuple[str, ...] = ()
    note: str = ""
    variants: tuple[str, ...] = ()
    non_official_defaults: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"OfficialSource: verdict={self.verdict!r}; allowed: {', '.join(VERDICTS)}.")
        if self.repository is None:
            if self.commit:
                raise ValueError(f"OfficialSource: commit={self.commit!r} without a repository.")
            if self.verdict != "reconstructed" or not self.note.strip():
                raise ValueError(
                    f"OfficialSource without a repository (no official code reachable): verdict={self.verdict!r} "
                    "must be 'reconstructed' and note must say which parts are reconstructed."
                )
        else:
            if not _REPOSITORY.match(self.repository):
                raise ValueError(f"OfficialSource: repository={self.repository!r}; expected 'owner/name'.")
            if not _COMMIT.match(self.commit):
                raise ValueError(
                    f"OfficialSource: commit={self.commit!r} for {self.repository}; expected 7 to 40 lower-case hex "
                    "digits."
                )
        if self.verdict == "equal" and (self.variants or self.non_official_defaults):
            raise ValueError("OfficialSource: verdict='equal' with options that deviate; use verdict='faithful'.")
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "non_official_defaults", dict(self.non_official_defaults))

    @property
    def citation(self) -> str:
        """``owner/name@commit``, or the words saying that no official code was reachable."""
        return f"{self.repository}@{self.commit}" if self.repository else "no official code reachable"


def official_source_problems(cls: type) -> list[str]:
    """What is missing or inconsistent in a plugin class's :class:`OfficialSource` (empty: nothing)."""
    name = getattr(cls, "name", cls.__name__)
    source = getattr(cls, "official", None)
    if not isinstance(source, OfficialSource):
        return [f"{name}: no `official = OfficialSource(...)` (which official repository @ commit it was checked "
                "against, or OfficialSource(None, verdict='reconstructed', note=...) when none was reachable)"]
    problems = []
    options = {info.name: info for info in cls.Options.describe()}
    for option in (*source.variants, *source.non_official_defaults):
        if option not in options:
            problems.append(f"{name}: official names the option {option!r}, which the plugin does not have")
    reconstructed_options = [n for n, info in options.items() if getattr(info, "reconstructed", False)]
    if source.verdict == "equal" and (getattr(cls, "reconstructed", ()) or reconstructed_options):
        problems.append(f"{name}: verdict 'equal' but the plugin declares reconstructed details "
                        f"({list(getattr(cls, 'reconstructed', ())) + reconstructed_options}); use 'faithful'")
    return problems


# ------------------------------------------------------------------------------------------------ the page
def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _deviating_options(cls: type, source: OfficialSource) -> str:
    infos = {info.name: info for info in cls.Options.describe()}
    parts = [f"`{name}` (variant values; default `{infos[name].default!r}` is official)" for name in source.variants
             if name in infos]
    parts += [f"`{name}` (default `{infos[name].default!r}`; official: {why})"
              for name, why in source.non_official_defaults.items() if name in infos]
    parts += [f"`{name}` [reconstructed]" for name, info in infos.items() if getattr(info, "reconstructed", False)
              and name not in source.variants and name not in source.non_official_defaults]
    return "; ".join(parts) or "-"


def faithfulness_page(plugins: Mapping[str, type], generated_marker: str) -> str:
    """``docs/faithfulness.md``: per built-in plugin the official source, the verdict and the deviating options."""
    counts = {key: 0 for key in VERDICTS}
    rows = []
    for name, cls in plugins.items():
        if cls.deprecated():
            continue
        source = getattr(cls, "official", None)
        if not isinstance(source, OfficialSource):
            rows.append(f"| [`{name}`](plugins/{name}.md) | **not declared** | - | - | - | - |")
            continue
        counts[source.verdict] += 1
        where = f"[`{source.citation}`](https://github.com/{source.repository}/tree/{source.commit})" \
            if source.repository else source.citation
        files = ", ".join(f"`{f}`" for f in source.files)
        detail = "; ".join(x for x in (files, _cell(source.note)) if x) or "-"
        reconstructed = "; ".join(_cell(item) for item in getattr(cls, "reconstructed", ())) or "-"
        rows.append(f"| [`{name}`](plugins/{name}.md) | {where} | {VERDICTS[source.verdict]} | {detail} | "
                    f"{_deviating_options(cls, source)} | {reconstructed} |")
    summary = ", ".join(f"{counts[key]} {VERDICTS[key]}" for key in VERDICTS)
    lines = [
        generated_marker, "", "# Faithfulness to the official code", "",
        "Which official repository @ commit each built-in plugin was compared with (line by line, running the "
        "plugin's functions next to a transcription of the official ones), the verdict, and what deviates from the "
        "official defaults. Generated from each plugin's `official` metadata (`trl_plugins.api.faithfulness."
        "OfficialSource`); the evidence of the comparisons is kept with the project's audits.", "",
        "Verdicts: **equal** -- the same results as the official code to float precision with the default options; "
        "**faithful with documented options** -- the official behaviour is the default, and options (or documented "
        "details) deviate; **reconstructed** -- no official code was reachable, or main parts of the method are "
        "rebuilt from the paper's text. Deviating options: *variant values* are options whose default is the "
        "official behaviour and whose other values are documented variants; *official: ...* marks a default that "
        "is not the official value; *[reconstructed]* marks an option whose value the official code or paper does "
        "not give.", "",
        f"{summary}.", "",
        "| plugin | official source | verdict | files compared, notes | options deviating from the official default "
        "| reconstructed details |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines).rstrip() + "\n"
