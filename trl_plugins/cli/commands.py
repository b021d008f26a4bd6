"""The ``trl-plugins`` command: ``list``, ``show NAME``, ``train CONFIG.yaml``, ``demo``, ``compare``, ``new NAME``,
``docs``."""

from __future__ import annotations

import argparse
import sys
import textwrap

from trl_plugins.api.errors import PluginError


def cmd_list(_args: argparse.Namespace) -> int:
    """One line per available plugin: name, version, stages, paper, distribution."""
    from trl_plugins.runtime.manager import available_plugins, load_errors

    plugins = available_plugins()
    rows = [("NAME", "VERSION", "STAGES", "PAPER", "DISTRIBUTION")]
    for name, cls in plugins.items():
        rows.append((name, cls.version, ",".join(cls.stages()) or "-", cls.paper, cls.distribution()))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4])
    for name, error in load_errors().items():
        print(f"! {name}: failed to load ({error})")
    return 0


def describe_plugin(name: str) -> str:
    """The ``trl-plugins show`` text: summary, paper, stages, stacking notes, options with defaults and help."""
    from trl_plugins.runtime.manager import get_plugin_class

    cls = get_plugin_class(name)
    lines = [f"{cls.name} {cls.version}  ({cls.distribution()})", ""]
    if cls.summary:
        lines += [cls.summary, ""]
    lines.append(f"Paper:   {cls.paper or '-'}")
    from trl_plugins.api.faithfulness import VERDICTS, OfficialSource

    if isinstance(cls.official, OfficialSource):
        lines.append(f"Official code: {cls.official.citation} ({VERDICTS[cls.official.verdict]})")
    lines.append(f"Stages:  {', '.join(cls.stages()) or '-'}")
    lines.append(f"Hooks:   {', '.join(cls.hook_names())}")
    from trl_plugins.cli.docs import moved_lines, stacking_notes

    if cls.moved:
        lines.append(f"Deprecated spellings (kept for one release; built under the name {cls.name}):")
        for line in moved_lines(cls, link=str, code=str):
            lines += textwrap.wrap(line, 100, initial_indent="  - ", subsequent_indent="    ")
    head_note = "Uses chunked LM-head statistics (at most chunk_size x V logits at a time, gradient path included)."
    notes = [head_note] if cls.needs_head_stats else []
    if cls.needs_hidden_states:
        notes.append("Reads per-token hidden states (ctx.hidden_states): an extra no-grad forward per call, reduced "
                     "chunk by chunk.")
    notes += stacking_notes(cls, code=str)
    lines.append("Stacking:")
    for note in notes:
        lines += textwrap.wrap(note, 100, initial_indent="  - ", subsequent_indent="    ")
    if cls.reconstructed:
        lines.append("Reconstructed (not stated by the paper; documented defaults):")
        lines += [f"  - {r}" for r in cls.reconstructed]
    lines += ["", "Options:"]
    infos = cls.Options.describe()
    if not infos:
        lines.append("  (none)")
    for info in infos:
        flag = "  [reconstructed]" if info.reconstructed else ""
        extra = []
        if info.choices:
            extra.append("choices: " + ", ".join(repr(c) for c in info.choices))
        if info.range_text():
            extra.append(f"range: {info.range_text()}")
        lines.append(f"  {info.name} ({info.type}, default {info.default!r}){flag}")
        for chunk in textwrap.wrap(info.help, 90):
            lines.append(f"      {chunk}")
        if extra:
            lines.append(f"      {'; '.join(extra)}")
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    if doc:
        lines += ["", "Method:", textwrap.indent(doc, "  ")]
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    print(describe_plugin(args.name))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from trl_plugins.cli.train import main as train_main

    return train_main(["--config", args.config, *args.overrides])


def cmd_demo(args: argparse.Namespace) -> int:
    from trl_plugins.cli.demo import main as demo_main

    return demo_main(args.demo_args)


def cmd_compare(args: argparse.Namespace) -> int:
    from trl_plugins.cli.compare import main as compare_main

    return compare_main(args.compare_args)


def cmd_new(args: argparse.Namespace) -> int:
    """Scaffold a third-party plugin package (``trl_plugins.cli.scaffold``)."""
    from trl_plugins.cli.scaffold import DEFAULT_STAGE, PackageNames, next_steps, scaffold

    root = scaffold(args.name, args.dir, args.stage or [DEFAULT_STAGE])
    print(next_steps(root, PackageNames.from_name(args.name)))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    """Regenerate (or, with --check, verify) the reference pages (``trl_plugins.cli.docs``); ``--plugin NAME``: the page
    of one installed plugin, e.g. a third-party one, for its own repository."""
    from trl_plugins.cli.docs import main as docs_main

    plugins = [arg for name in args.plugin or [] for arg in ("--plugin", name)]
    return docs_main((["--out", args.out] if args.out else []) + (["--check"] if args.check else []) + plugins)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-plugins", description="Research methods for RL on LLMs as stackable plugins for TRL's GRPOTrainer."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="List available plugins (name, version, stages, paper, distribution).")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("show", help="Show a plugin's documentation and options.")
    p.add_argument("name")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("train", help="Train from a YAML config (GRPOConfig fields + plugins + plugin_config).")
    p.add_argument("config")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="Extra --field value overrides, as in TRL's CLI.")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("demo", help="Warm-start a tiny model offline, train it with GRPO + plugins on CPU.")
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="Options of the demo (see `trl-plugins demo --help`).")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("compare", help="Train plugin stacks at an equal rollout budget on your config (or --demo) "
                       "and compare their held-out scores (table, plots, JSON; resumable).")
    p.add_argument("compare_args", nargs=argparse.REMAINDER,
                   help="Config and options of the comparison (see `trl-plugins compare --help`).")
    p.set_defaults(func=cmd_compare)
    from trl_plugins.cli.scaffold import DEFAULT_STAGE, STAGES

    p = sub.add_parser(
        "new", help="Scaffold a plugin package (entry point, example plugin, tests with the testing kit, README)."
    )
    p.add_argument("name", help="Plugin name, e.g. my_method (the package is trl-plugins-my-method).")
    p.add_argument("--dir", default=None, help="Directory to create (default: ./trl-plugins-<name>); new or empty.")
    p.add_argument(
        "--stage", action="append", metavar="STAGE",
        help=f"Stage of the example plugin: {', '.join(STAGES)} (default: {DEFAULT_STAGE}). Repeat it (or give "
        "a comma-separated list) for a method with hooks at several stages: --stage advantage --stage loss.",
    )
    p.set_defaults(func=cmd_new)
    p = sub.add_parser("docs", help="Generate the plugin reference pages (docs/plugins/*.md, docs/hooks.md).")
    p.add_argument("--out", default=None, help="Docs directory (default: the checkout's docs/).")
    p.add_argument("--check", action="store_true", help="Only check that the pages are up to date (exit 1 if not).")
    p.add_argument("--plugin", action="append", metavar="NAME",
                   help="Only the reference page of this installed plugin, third-party ones included, written to "
                   "OUT/plugins/NAME.md (OUT default ./docs); repeatable.")
    p.set_defaults(func=cmd_docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `demo`, `compare` and `train` forward their own --options to the demo's / comparison's / TRL's parser
    if argv and argv[0] in ("demo", "train", "compare"):
        args, rest = parser.parse_known_args(argv[:2] if argv[0] == "train" else argv[:1])
        if argv[0] == "demo":
            args.demo_args = argv[1:]
        elif argv[0] == "compare":
            args.compare_args = argv[1:]
        else:
            args.overrides = argv[2:]
    else:
        args = parser.parse_args(argv)
    from trl_plugins.cli.train import working_directory_last

    try:
        with working_directory_last():  # modules of the working directory never shadow installed packages
            return int(args.func(args) or 0)
    except PluginError as exc:
        print(f"trl-plugins: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
