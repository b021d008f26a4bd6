"""Testing kit for plugin authors (and this project's own tests).

Usable as a pytest plugin (``pytest -p trl_plugins.testing`` or ``pytest_plugins = ["trl_plugins.testing"]``):
it provides the fixtures ``tiny_tokenizer``, ``tiny_model``, ``tiny_dataset``, ``make_trainer`` and
``temporary_plugin``. Everything is built offline in seconds on a CPU: a character-level tokenizer, a tiny
Llama and the bundled arithmetic tasks.

Helpers:
    :func:`make_tiny_trainer` builds a ``PluginGRPOTrainer`` (or ``trl.GRPOTrainer``) on the tiny model.
    :func:`record_run` trains a few steps and records, per generation batch and optimizer step, the
    completions, rewards, advantages, losses and gradients, so two runs can be compared exactly.
    :func:`assert_runs_equal` compares two such records (the reduction-to-vanilla check).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .manager import register_plugin, unregister_plugin


def tiny_tokenizer():
    """The bundled character-level tokenizer (with chat template)."""
    from .tasks.tiny import build_tokenizer

    return build_tokenizer()


def tiny_model(tokenizer=None, seed: int = 0, hidden_size: int = 32, num_layers: int = 2):
    """A freshly initialised tiny Llama matching ``tokenizer``."""
    from .tasks.tiny import build_tiny_model

    return build_tiny_model(tokenizer or tiny_tokenizer(), seed=seed, hidden_size=hidden_size, num_layers=num_layers)


def tiny_dataset(n: int = 8, levels=(1,), seed: int = 0):
    """``n`` arithmetic problems with every column the built-in plugins use."""
    from .tasks.arithmetic import make_dataset

    return make_dataset(n, levels=levels, seed=seed)


def default_reward_funcs() -> list[Callable]:
    from .tasks.arithmetic import accuracy_reward

    return [accuracy_reward]


def tiny_config(output_dir: str | None = None, config_cls=None, **overrides):
    """A ``PluginGRPOConfig`` sized for seconds-long CPU runs; ``overrides`` set any field."""
    from .config import PluginGRPOConfig

    config_cls = config_cls or PluginGRPOConfig
    values = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="trl_plugins_test_"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        temperature=1.0,
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    values.update(overrides)
    if config_cls is not PluginGRPOConfig:
        values.pop("plugins", None)
        values.pop("plugin_config", None)
    return config_cls(**values)


def make_tiny_trainer(
    trainer_cls=None, model=None, tokenizer=None, dataset=None, reward_funcs=None, seed: int = 0, **config
):
    """A trainer on the tiny model and tasks. ``trainer_cls`` defaults to ``PluginGRPOTrainer``;
    pass ``trl.GRPOTrainer`` for the vanilla baseline (its config is then a plain ``GRPOConfig``)."""
    from trl import GRPOConfig, GRPOTrainer

    from .trainer import PluginGRPOTrainer

    trainer_cls = trainer_cls or PluginGRPOTrainer
    tokenizer = tokenizer or tiny_tokenizer()
    model = model if model is not None else tiny_model(tokenizer, seed=seed)
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else None
    args = tiny_config(config_cls=config_cls, seed=seed, **config)
    return trainer_cls(
        model=model,
        reward_funcs=reward_funcs if reward_funcs is not None else default_reward_funcs(),
        args=args,
        train_dataset=dataset if dataset is not None else tiny_dataset(),
        processing_class=tokenizer,
    )


@dataclass
class RunRecord:
    """What :func:`record_run` saw. Lists are per generation batch / per micro-step / per optimizer step."""

    completion_ids: list[torch.Tensor] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    logs: list[dict] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def record_run(trainer, steps: int | None = None) -> RunRecord:
    """Train ``trainer`` (``steps`` overrides ``max_steps``) and record completions, rewards, advantages,
    per-micro-step losses, per-optimizer-step gradients and the final parameters."""
    from transformers import TrainerCallback

    record = RunRecord()
    if steps is not None:
        trainer.args.max_steps = steps
    original_gen = trainer._generate_and_score_completions
    original_loss = trainer.compute_loss
    original_rewards = trainer._calculate_rewards

    def gen(inputs):
        out = original_gen(inputs)
        record.completion_ids.append(out["completion_ids"].detach().cpu().clone())
        record.advantages.append(out["advantages"].detach().cpu().clone())
        return out

    def rewards(*args, **kwargs):
        value = original_rewards(*args, **kwargs)
        record.rewards.append(value.detach().cpu().clone())
        return value

    def loss(*args, **kwargs):
        value = original_loss(*args, **kwargs)
        record.losses.append(float(value.detach()))
        return value

    class GradRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record.grads.append(
                {n: p.grad.detach().cpu().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            record.logs.append(dict(logs or {}))

    trainer._generate_and_score_completions = gen
    trainer.compute_loss = loss
    trainer._calculate_rewards = rewards
    trainer.add_callback(GradRecorder())
    try:
        trainer.train()
    finally:
        trainer._generate_and_score_completions = original_gen
        trainer.compute_loss = original_loss
        trainer._calculate_rewards = original_rewards
    record.params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    return record


def assert_runs_equal(a: RunRecord, b: RunRecord, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Assert two recorded runs are identical (completions exactly; the rest within ``atol``/``rtol``)."""
    assert len(a.completion_ids) == len(b.completion_ids) > 0, "no generation batch recorded"
    for x, y in zip(a.completion_ids, b.completion_ids):
        assert torch.equal(x, y), "completions differ"
    for name in ("rewards", "advantages"):
        xs, ys = getattr(a, name), getattr(b, name)
        assert len(xs) == len(ys) > 0, f"no {name} recorded"
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol, equal_nan=True, msg=f"{name} differ")
    assert len(a.losses) == len(b.losses) > 0, "no loss recorded"
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(b.losses), atol=atol, rtol=rtol)
    assert len(a.grads) == len(b.grads) > 0, "no gradient recorded"
    for ga, gb in zip(a.grads, b.grads):
        assert ga.keys() == gb.keys()
        for key in ga:
            torch.testing.assert_close(ga[key], gb[key], atol=atol, rtol=rtol, msg=f"gradient of {key} differs")
    for key in a.params:
        torch.testing.assert_close(a.params[key], b.params[key], atol=atol, rtol=rtol, msg=f"parameter {key} differs")


@contextlib.contextmanager
def temporary_plugin(cls) -> Iterator[type]:
    """Register a plugin class by name for the duration of the block."""
    register_plugin(cls)
    try:
        yield cls
    finally:
        unregister_plugin(cls.name)


# ------------------------------------------------------------------------------------------ pytest fixtures
try:
    import pytest
except ImportError:  # pragma: no cover - the kit's helpers work without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(name="tiny_tokenizer")
    def _tiny_tokenizer_fixture():
        return tiny_tokenizer()

    @pytest.fixture(name="tiny_model")
    def _tiny_model_fixture(tiny_tokenizer):
        return tiny_model(tiny_tokenizer)

    @pytest.fixture(name="tiny_dataset")
    def _tiny_dataset_fixture():
        return tiny_dataset()

    @pytest.fixture(name="make_trainer")
    def _make_trainer_fixture(tmp_path):
        def factory(**kwargs):
            kwargs.setdefault("output_dir", str(tmp_path / "out"))
            return make_tiny_trainer(**kwargs)

        return factory

    @pytest.fixture(name="temporary_plugin")
    def _temporary_plugin_fixture():
        registered = []

        def register(cls):
            register_plugin(cls)
            registered.append(cls.name)
            return cls

        yield register
        for name in registered:
            unregister_plugin(name)


def clone_model(model):
    """A deep copy of ``model`` (for side-by-side runs from identical weights)."""
    return copy.deepcopy(model)


def digit_fraction_reward(completions, **kwargs) -> list[float]:
    """A dense reward for untrained tiny models: the fraction of digit characters in the completion.

    Random completions get different values, so groups have non-zero reward variance and non-zero advantages
    (the accuracy reward is all zeros for an untrained model, which would make equality checks vacuous).
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]
