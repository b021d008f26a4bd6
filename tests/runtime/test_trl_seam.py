"""One seam to TRL's internals: ``trl_plugins/runtime/trl_seam.py`` is the only module of ``trl_plugins/`` and
``plugins/`` that names a private member of ``trl.GRPOTrainer`` or ``transformers.Trainer``, so a TRL upgrade is a
change to that file plus the reduction tests.

TRL's private names are found by introspection of the installed TRL (not listed by hand): every single-underscore
name the classes of ``GRPOTrainer``'s MRO define, plus every single-underscore attribute their source assigns on
``self`` (instance attributes). The checker reads the code's AST, so comments and docstrings that mention
``_generate_single_turn`` are fine; it flags attribute access (``trainer._metrics``, ``super()._generate(...)``),
``getattr``-family calls with the name as a string, and methods of that name defined in a trainer subclass
(overrides). A class that is not a trainer (its bases' names do not end in ``Trainer``) may use the same names for
its own members on ``self`` / ``cls`` / ``super()``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path

import pytest
import trl
from transformers import Trainer

from trl_plugins.runtime import trl_seam
from trl_plugins.runtime.trainer import PluginGRPOTrainer

REPO = Path(__file__).resolve().parents[2]
SEAM = Path("trl_plugins/runtime/trl_seam.py")
SCANNED = ("trl_plugins", "plugins")
GETATTR_FAMILY = ("getattr", "setattr", "hasattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trl_classes() -> list[type]:
    return [k for k in trl.GRPOTrainer.__mro__ if k.__module__.split(".")[0] in ("trl", "transformers")]


def _self_assignments(klass: type) -> set[str]:
    """Attribute names ``klass``'s source assigns on ``self`` (anywhere in its methods)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError):  # pragma: no cover - a class without source
        return set()
    return {
        node.attr for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    }


@functools.cache
def trl_private_names() -> frozenset[str]:
    """Private members of TRL's trainer: class-level names and instance attributes of GRPOTrainer's MRO; plus those of
    accelerate's ``GradientState``, whose ``_set_sync_gradients`` transformers' own loop calls (as does the seam's
    replay update)."""
    from accelerate.state import GradientState

    assert Trainer in trl.GRPOTrainer.__mro__
    names: set[str] = {n for n in ("_set_sync_gradients",) if n in vars(GradientState)}
    for klass in _trl_classes():
        names |= {n for n in vars(klass) if _is_private(n)}
        names |= {n for n in _self_assignments(klass) if _is_private(n)}
    return frozenset(names)


@functools.cache
def trl_public_names() -> frozenset[str]:
    """Public members of TRL's trainer (class-level and instance attributes), which the seam must not shadow."""
    names = {n for n in dir(trl.GRPOTrainer) if not n.startswith("_")}
    for klass in _trl_classes():
        names |= {n for n in _self_assignments(klass) if not n.startswith("_")}
    return frozenset(names)


def _is_trainer_class(node: ast.ClassDef) -> bool:
    return any(ast.unparse(base).split(".")[-1].endswith("Trainer") for base in node.bases)


def _is_own_receiver(value: ast.expr) -> bool:
    """``self`` / ``cls`` / ``super()``: a class's own members."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def private_uses(source: str, names: frozenset[str] | set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every place ``source`` names one of ``names`` (sorted)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_other_class: bool) -> None:
        if isinstance(node, ast.ClassDef):
            in_other_class = not _is_trainer_class(node)
            for child in node.body:  # a method of that name: an override in a trainer subclass
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name in names \
                        and not in_other_class:
                    found.append((child.lineno, child.name))
        elif isinstance(node, ast.Attribute) and node.attr in names:
            if not (in_other_class and _is_own_receiver(node.value)):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETATTR_FAMILY \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            found.append((node.lineno, node.args[1].value))
        for child in ast.iter_child_nodes(node):
            visit(child, in_other_class)

    visit(ast.parse(source), False)
    return sorted(found)


def _scanned_files() -> list[Path]:
    files = sorted(p.relative_to(REPO) for folder in SCANNED for p in (REPO / folder).rglob("*.py"))
    assert len(files) > 60 and SEAM in files  # the framework, the components, the tasks and the built-in plugins
    return files


# ------------------------------------------------------------------------------------------ the rule
def test_trl_private_names_are_introspected_from_the_installed_trl():
    names = trl_private_names()
    expected = {  # a sample of what the framework needs (methods, properties, instance attributes, Trainer's own)
        "_generate_and_score_completions", "_generate", "_generate_single_turn", "_tool_call_loop",
        "_calculate_rewards", "_compute_loss", "_get_per_token_logps_and_entropies", "_tokenize_prompts",
        "_metrics", "_logs", "_pending_extra_logs", "_step", "_tokenizer", "_sync_tool_dicts",
        "_save_checkpoint", "_load_optimizer_and_scheduler", "_get_train_sampler", "_get_output_dir",
    }
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("__") for n in names)


def test_only_the_seam_names_trl_private_members():
    names = trl_private_names()
    offenders = [
        f"{path}:{line}: {name}"
        for path in _scanned_files() if path != SEAM
        for line, name in private_uses((REPO / path).read_text(encoding="utf-8"), names)
    ]
    assert not offenders, (
        "These modules name private members of TRL's trainer; reach them through the public override points and "
        "accessors of trl_plugins/runtime/trl_seam.py (add one there if needed):\n" + "\n".join(offenders)
    )


def test_every_private_name_the_seam_uses_exists_in_the_installed_trl():
    """A TRL upgrade that renames or drops a private member fails here, naming it (the seam's overrides would
    otherwise never be called, and its accessors would fail at run time)."""
    tree = ast.parse((REPO / SEAM).read_text(encoding="utf-8"))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_private(n.attr)}
    seam_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrlSeamTrainer")
    used |= {n.name for n in seam_class.body if isinstance(n, ast.FunctionDef) and _is_private(n.name)}
    used |= set(trl_seam.REPLACEABLE_METHODS.values()) | set(trl_seam.OVERRIDE_POINTS)
    assert len(used) > 15
    assert used <= trl_private_names(), f"not in the installed TRL {trl.__version__}: {sorted(used - trl_private_names())}"
    for name in trl_seam.OVERRIDE_POINTS:  # each override forwards TRL's method to its override point
        assert name in vars(trl_seam.TrlSeamTrainer), name


def test_the_seams_public_names_shadow_nothing_of_trl():
    added = set(trl_seam.OVERRIDE_POINTS.values()) | set(trl_seam.ACCESSORS) | set(trl_seam.REPLACEABLE_METHODS)
    assert added <= set(vars(trl_seam.TrlSeamTrainer)), sorted(added - set(vars(trl_seam.TrlSeamTrainer)))
    assert not added & trl_public_names(), sorted(added & trl_public_names())
    # the plugin trainer's own public names, too
    own = {n for n in vars(PluginGRPOTrainer) if not n.startswith("_")} | {
        "plugin_stack", "generation_service", "policy_probe", "plugin_services", "held_reward_errors",
        "uses_sampling_stage", "refill_stage", "reference_copy",
    }
    assert not own & trl_public_names() - {"train"}, sorted(own & trl_public_names() - {"train"})


def test_the_plugin_trainer_overrides_only_override_points():
    """PluginGRPOTrainer reaches TRL's pipeline through the seam: it defines no method of a TRL private name."""
    overridden = {n for n in vars(PluginGRPOTrainer) if n in trl_private_names()}
    assert not overridden, sorted(overridden)
    assert issubclass(PluginGRPOTrainer, trl_seam.TrlSeamTrainer)


# ------------------------------------------------------------------------------------------ the checker itself
PLANTED = '''
import trl

# trainer._metrics in a comment, and in a string: "_metrics"
class Helper:
    """Mentions trainer._generate_single_turn in a docstring."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._step = 0                                    # a helper's own member: fine

    def _generate(self):                                  # a helper's own method: fine
        return self._generate

    def log(self, value):
        self.trainer._metrics["train"]["x"].append(value)  # line 16: flagged

def reach(trainer):
    getattr(trainer, "_pending_extra_logs")               # line 19: flagged
    return trainer._step, trainer.state                   # line 20: flagged (_step only)

class Sub(trl.GRPOTrainer):
    def _compute_loss(self, model, inputs):               # line 23: flagged (an override)
        self._logs["x"] = 1                               # line 24: flagged (a trainer's private state)
        return super()._compute_loss(model, inputs)       # line 25: flagged
'''


def test_the_checker_flags_planted_violations_and_nothing_else():
    uses = private_uses(PLANTED, trl_private_names())
    assert uses == [(16, "_metrics"), (19, "_pending_extra_logs"), (20, "_step"), (23, "_compute_loss"),
                    (24, "_logs"), (25, "_compute_loss")]


def test_the_scan_fails_on_a_planted_violation_in_a_framework_module():
    source = (REPO / "trl_plugins/runtime/refill.py").read_text(encoding="utf-8")
    assert private_uses(source, trl_private_names()) == []
    planted = source + "\n\ndef _peek(trainer):\n    return trainer._pending_extra_logs\n"
    assert private_uses(planted, trl_private_names()) == [(source.count("\n") + 4, "_pending_extra_logs")]


# ------------------------------------------------------------------------------------------ no monkey-patching
def test_counting_policy_rollouts_replaces_nothing_on_the_trainer():
    from trl_plugins.cli.equal_budget import count_policy_rollouts
    from trl_plugins.testing import make_tiny_trainer

    trainer = make_tiny_trainer()
    before = dict(vars(trainer))
    counts = count_policy_rollouts(trainer)
    assert dict(vars(trainer)).keys() == before.keys()
    assert all(vars(trainer)[k] is v for k, v in before.items())
    assert dict(counts) == {"rollouts": 0, "tokens": 0}
    trainer.generation_service.count_rollouts(3, 17)  # the service counts what is sampled while training
    assert dict(counts) == {"rollouts": 3, "tokens": 17}
    trainer.model.eval()
    trainer.generation_service.count_rollouts(5, 9)  # not in evaluation mode
    assert dict(counts) == {"rollouts": 3, "tokens": 17}
    with pytest.raises(TypeError, match="PluginGRPOTrainer"):
        count_policy_rollouts(object())


def test_replace_trl_method_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="generate_single_turn"):
        trl_seam.replace_trl_method(object(), "compute_loss", lambda: None)
