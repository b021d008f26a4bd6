"""``trl-plugins new NAME``: scaffold a third-party plugin package.

The package is a complete, installable project that passes its own tests out of the box::

    trl-plugins-NAME/
        pyproject.toml              entry point in the ``trl_plugins`` group, src layout
        README.md
        src/trl_plugins_NAME/__init__.py
        src/trl_plugins_NAME/plugin.py   a documented example plugin for the chosen stage(s)
        conftest.py                 enables the testing kit (``trl_plugins.testing``) as a pytest plugin
        tests/test_NAME.py          entry point, options, hook on a hand-made context, a hypothesis property test of
                                    the math, neutral setting == trl.GRPOTrainer, a short run stacked with
                                    the built-in ``canon`` (test extras: pytest, hypothesis)
        examples/stacked.yaml       ``trl-plugins train examples/stacked.yaml`` (``canon`` stacked with NAME)

Several stages (``--stage advantage --stage loss``) give one plugin class with each stage's example hooks, options
and helpers, and each stage's tests (suffixed with the stage name).

Each stage has its own example, chosen to show that stage's context and its rules:

* ``sampling`` — re-generate completions that hit the length limit (``RolloutContext``, the generation service,
  collective calls decided from gathered data, ``replace_row``, per-row annotations);
* ``reward`` — a bonus for successes in groups that mostly fail (``RewardContext``, the (N, K) matrix with the
  groups in view);
* ``advantage`` — separate scales for positive and negative advantages (``AdvantageContext``, global batch);
* ``loss`` — entropy-dependent token weights (``LossContext``, ``scale_tokens``, ``configure`` validation).

Every example has a neutral setting (its defaults) in which it changes nothing, which the generated tests
check against ``trl.GRPOTrainer``.
"""

from __future__ import annotations

import keyword
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

from trl_plugins.api.errors import PluginConfigError, suggest

STAGES = ("sampling", "reward", "advantage", "loss")
DEFAULT_STAGE = "advantage"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class PackageNames:
    """Names derived from the plugin name ``my_method``."""

    name: str  # my_method: what users put in `plugins: [...]`
    distribution: str  # trl-plugins-my-method: the pip name
    package: str  # trl_plugins_my_method: the import name
    cls: str  # MyMethodPlugin
    options_cls: str  # MyMethodOptions

    @classmethod
    def from_name(cls, raw: str) -> PackageNames:
        """Normalise ``raw`` (``My-Method``, ``trl-plugins-my-method`` ...) and derive the other names."""
        name = raw.strip().lower().replace("-", "_").replace(" ", "_")
        for prefix in ("trl_plugins_", "trl_plugin_"):
            if name.startswith(prefix) and len(name) > len(prefix):
                name = name[len(prefix):]
        if not _NAME.match(name) or name.endswith("_") or "__" in name:
            raise PluginConfigError(
                f"Invalid plugin name {raw!r}: use lower-case letters, digits and single underscores or hyphens, "
                "starting with a letter (e.g. 'my_method')."
            )
        if name in ("builtin", "testing") or keyword.iskeyword(name):
            raise PluginConfigError(f"Invalid plugin name {raw!r}: {name!r} is reserved.")
        camel = "".join(part.capitalize() for part in name.split("_"))
        return cls(
            name=name,
            distribution="trl-plugins-" + name.replace("_", "-"),
            package="trl_plugins_" + name,
            cls=camel + "Plugin",
            options_cls=camel + "Options",
        )


def normalise_stages(stages: str | Sequence[str]) -> tuple[str, ...]:
    """``"advantage"``, ``["advantage", "loss"]`` or ``"advantage,loss"`` -> the stages in pipeline order, checked."""
    items = [stages] if isinstance(stages, str) else list(stages)
    chosen = [part.strip() for item in items for part in str(item).split(",") if part.strip()]
    if not chosen:
        raise PluginConfigError(f"No stage given; allowed: {', '.join(STAGES)}.")
    for stage in chosen:
        if stage not in STAGES:
            raise PluginConfigError(f"Unknown stage {stage!r}; allowed: {', '.join(STAGES)}.{suggest(stage, STAGES)}")
    return tuple(stage for stage in STAGES if stage in chosen)


def render(names: PackageNames, stage: str | Sequence[str] = DEFAULT_STAGE) -> dict[str, str]:
    """The files of the package, relative path -> text (nothing is written).

    ``stage`` is one stage or several (``["advantage", "loss"]``): with several, the example plugin has the hooks,
    options and helper functions of each stage's example in one class, and the tests of each (suffixed with the
    stage)."""
    stages = normalise_stages(stage)
    from trl_plugins import __version__

    values = dict(
        name=names.name,
        dist=names.distribution,
        package=names.package,
        cls=names.cls,
        options_cls=names.options_cls,
        stage=", ".join(stages),
        stage_flags=" ".join(f"--stage {s}" for s in stages),
        stages_list=repr(list(stages)),
        stage_word="stage" if len(stages) == 1 else "stages",
        version=__version__,
        active_yaml="{" + ", ".join(_ACTIVE_YAML[s].strip("{}") for s in stages) + "}",
    )

    def sub(text: str) -> str:
        return Template(text).substitute(values)

    if len(stages) == 1:
        plugin, tests = sub(_PLUGINS[stages[0]]), sub(_TESTS[stages[0]])
    else:
        plugin = _combined_plugin(names, [sub(_PLUGINS[s]) for s in stages], stages)
        tests = "".join(re.sub(r"\ndef (test_\w+)\(", rf"\ndef \1_{s}(", sub(_TESTS[s])) for s in stages)
    return {
        "pyproject.toml": sub(_PYPROJECT),
        "README.md": sub(_README),
        f"src/{names.package}/__init__.py": sub(_INIT),
        f"src/{names.package}/plugin.py": plugin,
        "conftest.py": sub(_CONFTEST),
        f"tests/test_{names.name}.py": sub(_TESTS_HEAD) + tests,
        "examples/stacked.yaml": sub(_EXAMPLE_YAML),
    }


def _section(text: str, start: str, end: str) -> str:
    i = text.index(start) + len(start)
    return text[i : text.index(end, i)]


def _combined_plugin(names: PackageNames, modules: list[str], stages: Sequence[str]) -> str:
    """One plugin module from the single-stage examples ``modules``: their docstrings' example paragraphs, imports,
    constants, option fields, helper functions and hooks, in one class (``configure`` bodies merged)."""
    docs, imports, constants, fields, helpers, configure, hooks = [], set(), [], [], [], [], []
    for stage, text in zip(stages, modules):
        doc = _section(text, "The code below is a complete ", '"""\n')
        docs.append(f"**{stage.capitalize()} stage.** " + doc.split("example to start from. ", 1)[1].strip())
        imports.update(n.strip() for n in _section(text, "from trl_plugins.api import ", "\n").split(","))
        constants.append(_section(text, imports_line(text), "@dataclass").strip())
        body = _section(text, f"class {names.options_cls}(PluginOptions):\n", "\n\n\n")
        fields.append(body.split('"""', 2)[2].strip("\n"))
        helpers.append(_section(text, body + "\n\n\n", f"class {names.cls}(Plugin):").strip())
        class_hooks = text.split(f"    Options = {names.options_cls}\n", 1)[1]
        for block in re.split(r"\n(?=    @hookimpl\n)", class_hooks):
            if "def trl_plugins_configure(" in block:
                configure.append(block.split(") -> None:\n", 1)[1].rstrip())
            elif block.strip():
                hooks.append(block.rstrip())
    stage_text = ", ".join(stages)
    merged_configure = (
        "    @hookimpl\n    def trl_plugins_configure(self, trainer, args) -> None:\n" + "\n".join(configure) + "\n\n"
        if configure else ""
    )
    parts = [
        f'"""{names.name}: <one line on what your method does> (<paper title>, arXiv:0000.00000).\n\n'
        f"<Describe the method here, top to bottom: this docstring is the \"Method\" section of `trl-plugins show "
        f"{names.name}`\nand of generated docs pages. State the defaults the paper gives and the details it leaves "
        "open.>\n\n" + textwrap.fill(
            f"The code below is a complete example with hooks at several stages ({stage_text}), one class, to start "
            "from. Each stage's part is the single-stage example of `trl-plugins new --stage <stage>`; its defaults "
            "are its neutral setting, so the plugin as a whole changes nothing until an option is set.", 115)
        + "\n\n" + "\n\n".join(docs) + '\n"""\n\n',
        "from __future__ import annotations\n\nfrom dataclasses import dataclass\n\nimport torch\n"
        "from trl_plugins.api import (\n" + "".join(f"    {n},\n" for n in sorted(imports)) + ")\n",
        *["\n" + c + "\n" for c in constants if c],
        f"\n@dataclass\nclass {names.options_cls}(PluginOptions):\n"
        f'    """Options of ``{names.name}`` (``plugin_config: {{{names.name}: {{...}}}}``), validated when the trainer '
        'is built."""\n\n' + "\n".join(fields) + "\n\n",
        *[f"\n{h}\n\n" for h in helpers],
        f"\nclass {names.cls}(Plugin):\n    \"\"\"Template example with hooks at the {stage_text} stages.\"\"\"\n\n"
        f'    name = "{names.name}"\n    version = "0.1.0"\n    paper = "<paper title>, arXiv:0000.00000"\n'
        f'    summary = "Template example with hooks at the {stage_text} stages."\n    Options = {names.options_cls}\n\n'
        + merged_configure + "\n\n".join(hooks) + "\n",
    ]
    return "".join(parts)


def imports_line(text: str) -> str:
    """The line of a template module that imports the plugin API (the module constants follow it)."""
    start = text.index("from trl_plugins.api import ")
    return text[start : text.index("\n", start) + 1]


def scaffold(
    name: str, directory: str | Path | None = None, stage: str | Sequence[str] = DEFAULT_STAGE, *,
    check_taken: bool = True,
) -> Path:
    """Write the package for plugin ``name`` into ``directory`` (default ``./trl-plugins-<name>``).

    ``stage``: one stage or several (see :func:`render`). Refuses an invalid name, a name an available plugin
    already uses (``check_taken``), and a directory that exists and is not empty. Returns the package directory.
    """
    names = PackageNames.from_name(name)
    if check_taken:
        from trl_plugins.runtime.manager import available_plugins

        taken = available_plugins().get(names.name)
        if taken is not None:
            raise PluginConfigError(
                f"A plugin named {names.name!r} already exists ({taken.distribution()}); choose another name."
            )
    files = render(names, stage)
    root = Path(directory) if directory is not None else Path.cwd() / names.distribution
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise PluginConfigError(f"{root} already exists and is not an empty directory; choose another --dir.")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def next_steps(root: Path, names: PackageNames) -> str:
    """What to run after scaffolding (printed by ``trl-plugins new``)."""
    return (
        f"Created {names.distribution} in {root} (plugin {names.name!r}, class {names.cls}).\n"
        "Next:\n"
        f"  pip install -e {root} && python -m pytest {root}    # install (entry point) and run its tests\n"
        f"  trl-plugins train {root / 'examples' / 'stacked.yaml'}    # a short run stacked with the built-in canon\n"
        f"Then edit {root / 'src' / names.package / 'plugin.py'}: the paper, the method, its options."
    )


# ================================================================================================ templates
_PYPROJECT = '''\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "${dist}"
version = "0.1.0"
description = "${name}: a trl-plugins plugin (${stage} ${stage_word}) for TRL's GRPOTrainer"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["trl-plugins>=${version}"]

[project.optional-dependencies]
test = ["pytest>=8", "hypothesis>=6"]  # what tests/ imports: pip install -e ".[test]"

# This line is what makes `plugins: [${name}]` work once the package is installed.
[project.entry-points.trl_plugins]
${name} = "${package}.plugin:${cls}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
filterwarnings = ["ignore::DeprecationWarning", "ignore::FutureWarning"]
'''

_INIT = '''\
"""${name}: a trl-plugins plugin (see plugin.py)."""

from .plugin import ${options_cls}, ${cls}

__all__ = ["${options_cls}", "${cls}"]
'''

_CONFTEST = '''\
"""Enables the trl-plugins testing kit as a pytest plugin: fixtures tiny_tokenizer, tiny_model, tiny_dataset,
make_trainer and temporary_plugin (a tiny model and tasks built offline, CPU-friendly).

pytest only accepts ``pytest_plugins`` in a top-level conftest.py, hence this file at the project root."""

pytest_plugins = ["trl_plugins.testing"]
'''

_README = '''\
# ${dist}

`${name}` is a [trl-plugins](https://pypi.org/project/trl-plugins/) plugin for TRL's `GRPOTrainer`, at the
**${stage}** ${stage_word}. It was generated by `trl-plugins new ${name} ${stage_flags}`. The code in
`src/${package}/plugin.py` is a working example to replace with your method.

## Install, test, run

```bash
pip install -e ".[test]"                      # registers `${name}` under the `trl_plugins` entry points
python -m pytest                              # the tests in tests/ (uses trl_plugins.testing)
trl-plugins list                              # ${name} is listed with its distribution, ${dist}
trl-plugins train examples/stacked.yaml       # a short run of ${name} stacked with the built-in `canon`
```

## Use

```python
from trl_plugins import PluginGRPOConfig, PluginGRPOTrainer

args = PluginGRPOConfig(output_dir="out", plugins=["canon", "${name}"],
                        plugin_config={"${name}": {...}})   # its options: `trl-plugins show ${name}`
trainer = PluginGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)
```

## Before publishing

- Fill in `paper` (with its arXiv id), `summary` and the module docstring: `trl-plugins show ${name}` prints them.
- Give every option a `help` text, and mark details the paper does not state with `reconstructed=True`.
- Keep a neutral setting (the method switched off) and its test against `trl.GRPOTrainer`
  (`assert_reduces_to_vanilla` in `tests/test_${name}.py`).
- `trl-plugins docs --plugin ${name}` writes its reference page (`docs/plugins/${name}.md`) from the code.
- `python -m build` then `twine upload dist/*`.
'''

_EXAMPLE_YAML = '''\
# trl-plugins train examples/stacked.yaml
# ${name} stacked with the built-in `canon` (advantage stage) on the bundled tiny model and arithmetic tasks,
# offline on a CPU. Every GRPOConfig field can be set here; `--field value` on the command line overrides.
# bf16 is left unset on purpose: on a CPU without AMX bf16 units trl-plugins then trains in float32 (bf16 autocast
# is no faster there, and TRL's default stops a GPU-less machine), elsewhere TRL's default (bf16) applies. `model_name_or_path: builtin:smollm2` trains
# the offline real model (SmolLM2-135M-Instruct) instead of the tiny one.
model_name_or_path: builtin:tiny
dataset_name: builtin:arithmetic
reward_funcs: [accuracy]
output_dir: runs/${name}
max_steps: 10
per_device_train_batch_size: 8
num_generations: 8
max_completion_length: 48
learning_rate: 5.0e-5
logging_steps: 1
report_to: none
save_strategy: "no"
loss_type: dr_grpo
plugins: [canon, ${name}]   # canon recomputes the advantages from the rewards: it runs first in that chain
plugin_config:
  ${name}: ${active_yaml}
'''

_ACTIVE_YAML = {
    "sampling": "{max_retries: 1}",
    "reward": "{bonus: 0.5}",
    "advantage": "{positive_scale: 1.5, negative_scale: 0.5}",
    "loss": "{power: 1.0}",
}

# ------------------------------------------------------------------------------------------------ advantage
_PLUGIN_ADVANTAGE = '''\
"""${name}: <one line on what your method does> (<paper title>, arXiv:0000.00000).

<Describe the method here, top to bottom: this docstring is the "Method" section of `trl-plugins show ${name}`
and of generated docs pages. State the defaults the paper gives and the details it leaves open.>

The code below is a complete **advantage-stage** example to start from. It rescales positive and negative
advantages separately::

    A <- positive_scale * A   where A > 0
    A <- negative_scale * A   where A < 0

as methods that weigh reinforcing correct answers against penalising wrong ones do. With both scales at 1.0
(the defaults) it changes nothing: that is its neutral setting, which tests/test_${name}.py checks against
``trl.GRPOTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl_plugins.api import AdvantageContext, Plugin, PluginOptions, hookimpl, option


@dataclass
class ${options_cls}(PluginOptions):
    """Options of ``${name}`` (``plugin_config: {${name}: {...}}``), validated when the trainer is built."""

    positive_scale: float = option(1.0, min=0.0, help="Multiplier of positive advantages (1.0 leaves them unchanged).")
    negative_scale: float = option(1.0, min=0.0, help="Multiplier of negative advantages (1.0 leaves them unchanged).")


def rescale_advantages(advantages: torch.Tensor, positive_scale: float, negative_scale: float) -> torch.Tensor:
    """The method's math, testable without a trainer.

    Args:
        advantages: (N,) advantages, one per row, or (N, T) per token.
    Returns:
        A tensor of the same shape: positive entries times ``positive_scale``, negative ones times
        ``negative_scale`` (zeros stay zero).
    """
    return torch.where(advantages > 0, advantages * positive_scale, advantages * negative_scale)


class ${cls}(Plugin):
    """Separate scales for positive and negative advantages (advantage stage)."""

    name = "${name}"
    version = "0.1.0"
    paper = "<paper title>, arXiv:0000.00000"
    summary = "Rescales positive and negative advantages separately (template example)."
    Options = ${options_cls}

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext) -> None:
        # ctx.advantages: (N,) TRL's advantages over the *global* batch (every process sees all N rows), or what
        # the plugin before this one in `plugins` left. Rows g*G .. g*G+G-1 form group g (ctx.group_ids); compute
        # group-level quantities here: the loss stage sees shuffled micro-batches, never whole groups.
        o = self.options
        ctx.advantages = rescale_advantages(ctx.advantages, o.positive_scale, o.negative_scale)
        # logged as plugins/${name}/positive_fraction in every report_to backend
        ctx.log_metric("positive_fraction", (ctx.advantages > 0).float().mean().item())
'''

# ------------------------------------------------------------------------------------------------ reward
_PLUGIN_REWARD = '''\
"""${name}: <one line on what your method does> (<paper title>, arXiv:0000.00000).

<Describe the method here, top to bottom: this docstring is the "Method" section of `trl-plugins show ${name}`
and of generated docs pages. State the defaults the paper gives and the details it leaves open.>

The code below is a complete **reward-stage** example to start from. It transforms the gathered reward matrix
with the groups in view: a successful row (reward above ``success_threshold`` in reward column ``column``) gets
a bonus proportional to how often its group failed::

    r_i <- r_i + bonus * (1 - success_rate(group of i))     for successful rows i

so rare successes on hard prompts count more. TRL's reward weights, advantages and reward metrics all see
the transformed values. With ``bonus = 0`` (the default) it changes nothing: that is its neutral setting, which
tests/test_${name}.py checks against ``trl.GRPOTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl_plugins.api import Plugin, PluginConfigError, PluginOptions, RewardContext, hookimpl, option


@dataclass
class ${options_cls}(PluginOptions):
    """Options of ``${name}`` (``plugin_config: {${name}: {...}}``), validated when the trainer is built."""

    bonus: float = option(0.0, min=0.0, help="Bonus of a success in a group that always fails otherwise (0 = off).")
    success_threshold: float = option(0.5, help="A row succeeds when its reward in `column` is above this value.")
    column: int = option(0, min=0, help="Index of the reward column (reward function) read and shaped.")


def rarity_bonus(rewards: torch.Tensor, group_size: int, bonus: float, threshold: float) -> torch.Tensor:
    """The method's math, testable without a trainer.

    Args:
        rewards: (N,) one reward column, groups of ``group_size`` contiguous rows (NaN = not applicable, never
            a success).
    Returns:
        (N,) the bonus of each row: ``bonus * (1 - success rate of its group)`` on successes, 0 elsewhere.
    """
    success = (rewards > threshold).view(-1, group_size).float()
    rate = success.mean(dim=1, keepdim=True)
    return (bonus * (1.0 - rate) * success).view(-1)


class ${cls}(Plugin):
    """A bonus for rare successes within a group (reward stage)."""

    name = "${name}"
    version = "0.1.0"
    paper = "<paper title>, arXiv:0000.00000"
    summary = "Adds a bonus to successes in groups that mostly fail (template example)."
    Options = ${options_cls}

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext) -> None:
        # ctx.rewards_per_func: (N, K) gathered rewards, one column per reward function (ctx.reward_func_names),
        # identical on every process; rows g*G .. g*G+G-1 are group g.
        o = self.options
        if o.bonus == 0.0:
            return  # neutral setting: the matrix is left untouched
        K = ctx.rewards_per_func.size(1)
        if o.column >= K:
            raise PluginConfigError(
                f"Option 'column' of plugin '${name}' got {o.column}; the run has {K} reward functions "
                f"({', '.join(ctx.reward_func_names)})."
            )
        column = ctx.rewards_per_func[:, o.column]
        extra = rarity_bonus(column, ctx.num_generations, o.bonus, o.success_threshold)
        ctx.rewards_per_func[:, o.column] = column + extra  # in place; assigning a new (N, K) tensor works too
        # logged as plugins/${name}/mean_bonus in every report_to backend
        ctx.log_metric("mean_bonus", extra.mean().item())
'''

# ------------------------------------------------------------------------------------------------ sampling
_PLUGIN_SAMPLING = '''\
"""${name}: <one line on what your method does> (<paper title>, arXiv:0000.00000).

<Describe the method here, top to bottom: this docstring is the "Method" section of `trl-plugins show ${name}`
and of generated docs pages. State the defaults the paper gives and the details it leaves open.>

The code below is a complete **sampling-stage** example to start from. After generation it re-generates, within
the step, the completions that used the whole length budget (``max_completion_length`` tokens: most likely cut
off), up to ``max_retries`` rounds, through the trainer's generation service, and replaces them in place (the
group keeps exactly G rows). Replaced rows are annotated ``retry=<round>`` in TRL's completions table. With
``max_retries = 0`` (the default) it changes nothing: that is its neutral setting, which tests/test_${name}.py
checks against ``trl.GRPOTrainer``. (Re-sampling only long completions biases the policy gradient; it is here to
show the API.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl_plugins.api import Plugin, PluginOptions, RolloutContext, hookimpl, option


@dataclass
class ${options_cls}(PluginOptions):
    """Options of ``${name}`` (``plugin_config: {${name}: {...}}``), validated when the trainer is built."""

    max_retries: int = option(0, min=0, help="Rounds of re-generation of length-limited completions (0 = off).")


def hit_length_limit(completion_ids: list[list[int]], max_length: int) -> list[int]:
    """Local rows whose completion used the whole length budget (``len == max_length``)."""
    return [i for i, ids in enumerate(completion_ids) if len(ids) >= max_length]


class ${cls}(Plugin):
    """Re-generate completions that hit the length limit (sampling stage)."""

    name = "${name}"
    version = "0.1.0"
    paper = "<paper title>, arXiv:0000.00000"
    summary = "Re-generates completions cut at the length limit, within the step (template example)."
    Options = ${options_cls}

    @hookimpl
    def trl_plugins_configure(self, trainer, args) -> None:
        # called once the trainer is built: read what the hooks need, refuse settings the method cannot work with
        self._max_length = args.max_completion_length
        self._device = trainer.accelerator.device

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext) -> None:
        # ctx holds this process's B rows: ctx.completion_ids (B lists of token ids), ctx.completions (decoded),
        # ctx.training_prompts, ctx.group_ids / ctx.index_in_group (from the global position). What the run offers
        # comes through ctx as well (ctx.tokenizer, ctx.run, ctx.gather_padded, ctx.policy_entropies ...).
        retried = 0
        for attempt in range(1, self.options.max_retries + 1):
            rows = hit_length_limit(ctx.completion_ids, self._max_length)
            # The generation service is collective: every process must call it the same number of times (maybe
            # with no prompt). So decide whether to go on from gathered data, never from local rows alone.
            if ctx.gather(torch.tensor([len(rows)], device=self._device)).sum().item() == 0:
                break
            completions = ctx.service.generate(prompts=[ctx.training_prompts[i] for i in rows])
            for i, completion in zip(rows, completions):
                # sampled by the current policy from the row's own training prompt: on-policy, no prompt swap
                ctx.replace_row(i, completion.completion_ids, logprobs=completion.logprobs, prompt_swapped=False)
                ctx.annotations[i]["retry"] = attempt  # a column of TRL's completions table (log_completions)
            retried += len(rows)
        if self.options.max_retries:
            # logged as plugins/${name}/retried_rows in every report_to backend
            ctx.log_metric("retried_rows", retried)
'''

# ------------------------------------------------------------------------------------------------ loss
_PLUGIN_LOSS = '''\
"""${name}: <one line on what your method does> (<paper title>, arXiv:0000.00000).

<Describe the method here, top to bottom: this docstring is the "Method" section of `trl-plugins show ${name}`
and of generated docs pages. State the defaults the paper gives and the details it leaves open.>

The code below is a complete **loss-stage** example to start from. It weights every token of the surrogate by
its (detached) entropy relative to the micro-batch mean::

    w_t = min((H_t / mean_H) ** power, max_weight)

so high-entropy "forking" tokens drive the update more. Weights of several plugins multiply; additive terms
(``ctx.add_token_loss``, ``ctx.add_loss``) add. With ``power = 0`` (the default) every weight is 1: that is its
neutral setting, which tests/test_${name}.py checks against ``trl.GRPOTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl_plugins.api import IncompatiblePluginsError, LossContext, Plugin, PluginOptions, hookimpl, option

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class ${options_cls}(PluginOptions):
    """Options of ``${name}`` (``plugin_config: {${name}: {...}}``), validated when the trainer is built."""

    power: float = option(0.0, min=0.0, help="Exponent of the relative entropy in a token's weight (0 = weights 1).")
    max_weight: float = option(5.0, min=1.0, help="Upper clamp of a token's weight.")


def entropy_weights(entropies: torch.Tensor, mask: torch.Tensor, power: float, max_weight: float) -> torch.Tensor:
    """The method's math, testable without a trainer.

    Args:
        entropies: (B, T) per-token entropies (detached here: the weights carry no gradient).
        mask: (B, T) loss mask; the mean entropy is taken over it.
    Returns:
        (B, T) weights ``min((H / mean H) ** power, max_weight)``.
    """
    h = entropies.detach()
    mean = (h * mask).sum() / mask.sum().clamp(min=1)
    return ((h / mean.clamp(min=1e-8)) ** power).clamp(max=max_weight)


class ${cls}(Plugin):
    """Entropy-dependent token weights on the surrogate (loss stage)."""

    name = "${name}"
    version = "0.1.0"
    paper = "<paper title>, arXiv:0000.00000"
    summary = "Weights surrogate tokens by their relative entropy (template example)."
    Options = ${options_cls}

    @hookimpl
    def trl_plugins_configure(self, trainer, args) -> None:
        # refuse, at construction, settings the method cannot work with (never at step 500)
        if args.loss_type not in SUPPORTED_LOSS_TYPES:
            raise IncompatiblePluginsError(
                f"${name} weights TRL's clipped surrogate; loss_type={args.loss_type!r} is not supported "
                f"(use one of {', '.join(SUPPORTED_LOSS_TYPES)})."
            )

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext) -> None:
        # ctx holds one shuffled micro-batch (B rows, T tokens): ctx.per_token_logps (with grad),
        # ctx.entropies, ctx.advantages, ctx.mask, ctx.per_token_loss (the base surrogate) ...
        o = self.options
        if o.power == 0.0:
            return  # neutral setting: no contribution at all
        weights = entropy_weights(ctx.entropies, ctx.mask, o.power, o.max_weight)
        ctx.scale_tokens(weights)
        # logged as plugins/${name}/mean_weight in every report_to backend (a collective: every process calls it)
        ctx.log_metric("mean_weight", ctx.global_masked_mean(weights))
'''

_PLUGINS = {
    "sampling": _PLUGIN_SAMPLING,
    "reward": _PLUGIN_REWARD,
    "advantage": _PLUGIN_ADVANTAGE,
    "loss": _PLUGIN_LOSS,
}

# ------------------------------------------------------------------------------------------------ tests
_TESTS_HEAD = '''\
"""Tests of ${name}, written with the trl-plugins testing kit (``trl_plugins.testing``; conftest.py enables
its fixtures; reference: the kit's page docs/testing-kit.md in trl-plugins) and hypothesis for property tests of
the method's math. They run offline on a CPU in well under a minute: a tiny Llama and the bundled arithmetic tasks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl_plugins import PluginConfigError, available_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, build_stack, digit_fraction_reward, run_hook

from ${package}.plugin import ${cls}

NAME = "${name}"


def test_registered_through_the_entry_point():
    """`pip install` registered the plugin in the `trl_plugins` entry-point group, with its distribution."""
    cls = available_plugins()[NAME]
    assert cls is ${cls}
    assert cls.distribution().startswith("${dist} ")
    assert cls.stages() == ${stages_list}
    assert "arXiv:" in cls.paper


def _merged_logs(trainer) -> dict:
    merged = {}
    for log in trainer.state.log_history:
        merged.update(log)
    return merged

'''

_TESTS_ADVANTAGE = '''\

def test_options_are_validated():
    with pytest.raises(PluginConfigError, match="positive_scale"):
        build_stack(NAME, {NAME: {"positive_scale": -1.0}})
    with pytest.raises(PluginConfigError, match="Did you mean 'negative_scale'"):
        build_stack(NAME, {NAME: {"negative_scal": 0.5}})


def test_hook_on_a_hand_made_context():
    from trl_plugins.testing import assert_group_sizes, make_advantage_context

    ctx = make_advantage_context([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], num_generations=4)
    before = ctx.advantages.clone()  # TRL's group-normalised advantages
    run_hook(NAME, "transform_advantages", ctx, options={"positive_scale": 2.0, "negative_scale": 0.5})
    torch.testing.assert_close(ctx.advantages, torch.where(before > 0, 2.0 * before, 0.5 * before))
    assert ctx.metrics[f"plugins/{NAME}/positive_fraction"] == [pytest.approx(4 / 8)]
    assert_group_sizes(ctx)


def test_neutral_setting_reduces_to_vanilla(tmp_path):
    # the kit's default checks all four loss types of the reduction invariant (LOSS_TYPES); two keep this quick
    assert_reduces_to_vanilla(NAME, {"positive_scale": 1.0, "negative_scale": 1.0}, loss_types=("grpo", "dapo"),
                              output_dir=str(tmp_path))


def test_trains_stacked_with_a_builtin(make_trainer):
    trainer = make_trainer(plugins=["canon", NAME], plugin_config={NAME: {"positive_scale": 1.5}},
                           reward_funcs=[digit_fraction_reward], loss_type="dr_grpo", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _merged_logs(trainer)
    assert f"plugins/{NAME}/positive_fraction" in logs and "plugins/canon/lam" in logs
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=16), st.floats(0, 3), st.floats(0, 3))
def test_rescaling_keeps_signs_and_is_neutral_at_one(values, positive_scale, negative_scale):
    from ${package}.plugin import rescale_advantages

    a = torch.tensor(values)
    out = rescale_advantages(a, positive_scale, negative_scale)
    assert torch.all(out * a >= 0)  # never flips a sign
    assert torch.equal(rescale_advantages(a, 1.0, 1.0), a)  # the neutral setting
'''

_TESTS_REWARD = '''\

def test_options_are_validated():
    with pytest.raises(PluginConfigError, match="bonus"):
        build_stack(NAME, {NAME: {"bonus": -1.0}})
    with pytest.raises(PluginConfigError, match="Did you mean 'success_threshold'"):
        build_stack(NAME, {NAME: {"success_treshold": 0.5}})


def test_hook_on_a_hand_made_context():
    from trl_plugins.testing import assert_group_sizes, make_reward_context

    # group 0: one success out of 4 (rate 1/4); group 1: three out of 4 (rate 3/4); column 1 is left alone
    rewards = [[1.0, 7.0], [0.0, 7.0], [0.0, 7.0], [0.0, 7.0], [1.0, 7.0], [1.0, 7.0], [0.0, 7.0], [1.0, 7.0]]
    ctx = make_reward_context(rewards, num_generations=4)
    run_hook(NAME, "transform_rewards", ctx, options={"bonus": 1.0})
    expected = torch.tensor([1.75, 0.0, 0.0, 0.0, 1.25, 1.25, 0.0, 1.25])
    torch.testing.assert_close(ctx.rewards_per_func[:, 0], expected)
    assert torch.equal(ctx.rewards_per_func[:, 1], torch.full((8,), 7.0))
    assert ctx.metrics[f"plugins/{NAME}/mean_bonus"] == [pytest.approx(1.5 / 8)]
    assert_group_sizes(ctx)


def test_neutral_setting_reduces_to_vanilla(tmp_path):
    # the kit's default checks all four loss types of the reduction invariant (LOSS_TYPES); two keep this quick
    assert_reduces_to_vanilla(NAME, {"bonus": 0.0}, loss_types=("grpo", "dapo"), output_dir=str(tmp_path))


def test_trains_stacked_with_a_builtin(make_trainer):
    # a threshold every random completion passes, so the bonus applies on the untrained tiny model
    trainer = make_trainer(plugins=["canon", NAME], plugin_config={NAME: {"bonus": 0.5, "success_threshold": -1.0}},
                           reward_funcs=[digit_fraction_reward], loss_type="dr_grpo", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _merged_logs(trainer)
    assert f"plugins/{NAME}/mean_bonus" in logs and "plugins/canon/lam" in logs
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4).map(lambda g: g * 2), st.floats(0, 2))
def test_bonus_is_paid_to_successes_only_and_bounded(rewards, bonus):
    from ${package}.plugin import rarity_bonus

    r = torch.tensor(rewards)
    extra = rarity_bonus(r, 4, bonus, 0.5)
    assert torch.all(extra[r <= 0.5] == 0)  # failures get nothing
    assert torch.all((extra >= 0) & (extra <= bonus + 1e-6))
'''

_TESTS_SAMPLING = '''\

def test_options_are_validated():
    with pytest.raises(PluginConfigError, match="max_retries"):
        build_stack(NAME, {NAME: {"max_retries": -1}})
    with pytest.raises(PluginConfigError, match="Did you mean 'max_retries'"):
        build_stack(NAME, {NAME: {"max_retry": 1}})


def test_hook_on_a_hand_made_context():
    from trl_plugins.testing import (
        StubGenerationService,
        assert_group_sizes,
        assert_offpolicy_logprobs_nan,
        make_rollout_context,
    )

    # max_completion_length=4: "abcd" and "wxyz" hit the limit; the stub service answers "ok"
    service = StubGenerationService(respond=lambda prompt, j: "ok")
    ctx = make_rollout_context([["abcd", "ab"], ["a", "wxyz"]], service=service)
    run_hook(NAME, "after_generation", ctx, options={"max_retries": 2}, max_completion_length=4)
    assert len(service.calls) == 1  # the second round found nothing left to retry (on any process)
    assert [len(prompts) for prompts in service.calls] == [2]
    assert ctx.changed == {0, 3}
    assert [ctx.completions[i][-1]["content"] for i in range(4)] == ["ok", "ab", "a", "ok"]
    assert ctx.annotations == [{"retry": 1}, {}, {}, {"retry": 1}]
    assert ctx.metrics[f"plugins/{NAME}/retried_rows"] == [2.0]
    assert_group_sizes(ctx)
    assert_offpolicy_logprobs_nan(ctx)


def test_every_process_calls_the_service_equally():
    """Process 0 has nothing to retry, process 1 has: both must call the (collective) service once per round."""
    from trl_plugins.testing import StubGenerationService, make_rollout_context, run_on_processes

    stack = build_stack(NAME, {NAME: {"max_retries": 2}}, max_completion_length=4)

    def process(rank, gather):
        texts = [["ab", "ab"]] if rank == 0 else [["abcd", "ab"]]
        ctx = make_rollout_context(texts, service=StubGenerationService(respond=lambda p, j: "ok"),
                                   process_index=rank, gather=gather)
        run_hook(stack, "after_generation", ctx)
        return ctx

    ranks = run_on_processes(2, process)
    assert [len(ctx.service.calls) for ctx in ranks] == [1, 1]
    assert ranks[0].service.calls == [[]] and not ranks[0].changed
    assert ranks[1].changed == {0}


def test_neutral_setting_reduces_to_vanilla(tmp_path):
    # the kit's default checks all four loss types of the reduction invariant (LOSS_TYPES); two keep this quick
    assert_reduces_to_vanilla(NAME, {"max_retries": 0}, loss_types=("grpo", "dapo"), output_dir=str(tmp_path))


def test_trains_stacked_with_a_builtin(make_trainer):
    # the untrained tiny model rarely stops before max_completion_length: most rows are re-generated
    trainer = make_trainer(plugins=["canon", NAME], plugin_config={NAME: {"max_retries": 1}},
                           reward_funcs=[digit_fraction_reward], loss_type="dr_grpo", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _merged_logs(trainer)
    assert f"plugins/{NAME}/retried_rows" in logs and "plugins/canon/lam" in logs
    assert logs["plugins/framework/extra_rollouts"] == logs[f"plugins/{NAME}/retried_rows"]
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=8), max_size=8), st.integers(1, 8))
def test_length_limit_rows_are_exactly_the_full_ones(completion_ids, max_length):
    from ${package}.plugin import hit_length_limit

    rows = hit_length_limit(completion_ids, max_length)
    assert rows == [i for i, ids in enumerate(completion_ids) if len(ids) >= max_length]
'''

_TESTS_LOSS = '''\

def test_options_are_validated():
    with pytest.raises(PluginConfigError, match="max_weight"):
        build_stack(NAME, {NAME: {"max_weight": 0.5}})
    with pytest.raises(PluginConfigError, match="Did you mean 'power'"):
        build_stack(NAME, {NAME: {"powr": 1.0}})


def test_refuses_unsupported_loss_type():
    from trl_plugins import IncompatiblePluginsError

    with pytest.raises(IncompatiblePluginsError, match="cispo"):
        build_stack(NAME, {NAME: {"power": 1.0}}, loss_type="cispo")


def test_hook_on_a_hand_made_context():
    from trl_plugins.testing import loss_from_context, make_loss_context

    entropies = torch.tensor([[1.0, 3.0, 2.0], [2.0, 2.0, 2.0]])  # mean 2
    ctx = make_loss_context(shape=(2, 3), entropies=entropies)
    base = loss_from_context(ctx)
    run_hook(NAME, "loss", ctx, options={"power": 2.0, "max_weight": 2.0})
    (weights,) = ctx.token_weights
    torch.testing.assert_close(weights, torch.tensor([[0.25, 2.0, 1.0], [1.0, 1.0, 1.0]]))  # 2.25 clamped to 2
    expected = (ctx.per_token_loss * weights * ctx.mask).sum() / ctx.mask.sum()  # loss_type="dapo"
    torch.testing.assert_close(loss_from_context(ctx), expected)
    assert not torch.equal(loss_from_context(ctx), base)
    assert ctx.metrics[f"plugins/{NAME}/mean_weight"] == [pytest.approx(6.25 / 6)]


def test_neutral_setting_reduces_to_vanilla(tmp_path):
    # the kit's default checks all four loss types of the reduction invariant (LOSS_TYPES); two keep this quick
    assert_reduces_to_vanilla(NAME, {"power": 0.0}, loss_types=("grpo", "dapo"), output_dir=str(tmp_path))


def test_trains_stacked_with_a_builtin(make_trainer):
    trainer = make_trainer(plugins=["canon", NAME], plugin_config={NAME: {"power": 1.0}},
                           reward_funcs=[digit_fraction_reward], loss_type="dr_grpo", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _merged_logs(trainer)
    assert f"plugins/{NAME}/mean_weight" in logs and "plugins/canon/lam" in logs
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 5), min_size=6, max_size=6), st.floats(0, 3), st.floats(1, 5))
def test_weights_are_positive_clamped_and_one_at_power_zero(entropies, power, max_weight):
    from ${package}.plugin import entropy_weights

    h, mask = torch.tensor(entropies).view(2, 3), torch.ones(2, 3)
    w = entropy_weights(h, mask, power, max_weight)
    assert torch.all((w > 0) & (w <= max_weight + 1e-6))
    assert torch.equal(entropy_weights(h, mask, 0.0, max_weight), torch.ones(2, 3))
'''

_TESTS = {
    "sampling": _TESTS_SAMPLING,
    "reward": _TESTS_REWARD,
    "advantage": _TESTS_ADVANTAGE,
    "loss": _TESTS_LOSS,
}
