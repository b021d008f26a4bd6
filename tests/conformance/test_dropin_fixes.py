"""The drop-in differences found with TRL's own GRPO scenarios: each scenario runs through ``trl.GRPOTrainer`` and
``PluginGRPOTrainer`` and both must behave the same (same acceptance, same refusal, same numbers where no plugin acts).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_plugins import PluginGRPOTrainer
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import make_tiny_trainer, tiny_config, tiny_dataset, tiny_tokenizer

TRAINERS = [GRPOTrainer, PluginGRPOTrainer]

# ------------------------------------------------------------------ 1. trust_remote_code from the config

CONFIG_CODE = """
from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"
"""
MODEL_CODE = """
from transformers import LlamaForCausalLM

from .configuration_remote_llama import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory):
    """A local model folder whose config and model classes are custom code (``auto_map``), as a Hub model with
    ``trust_remote_code`` has."""
    path = build_and_save(tmp_path_factory.mktemp("remote") / "model", hidden_size=32, num_layers=1, num_heads=1)
    (path / "configuration_remote_llama.py").write_text(CONFIG_CODE)
    (path / "modeling_remote_llama.py").write_text(MODEL_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="remote_llama", architectures=["RemoteLlamaForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote_llama.RemoteLlamaConfig",
        "AutoModelForCausalLM": "modeling_remote_llama.RemoteLlamaForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _by_name(cls, path, tmp_path, **fields):
    config_cls = GRPOConfig if cls is GRPOTrainer else None
    args = tiny_config(str(tmp_path / cls.__name__), config_cls=config_cls, max_steps=1, **fields)
    return cls(model=str(path), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
               train_dataset=tiny_dataset(4), processing_class=AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_trust_remote_code_from_the_config_loads_custom_code(cls, remote_code_model, tmp_path):
    trainer = _by_name(cls, remote_code_model, tmp_path, trust_remote_code=True)
    assert type(trainer.model).__name__ == "RemoteLlamaForCausalLM"


def test_without_trust_remote_code_both_refuse_with_transformers_reason(remote_code_model, tmp_path):
    errors = []
    for cls in TRAINERS:
        with pytest.raises(Exception) as info:
            _by_name(cls, remote_code_model, tmp_path, trust_remote_code=False)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1])
    assert "trust_remote_code" in str(errors[0]) and "trust_remote_code" in str(errors[1])


def test_train_cli_reads_trust_remote_code_from_the_config(monkeypatch):
    """``trl-plugins train`` resolves the model with the config's ``trust_remote_code`` (model_init_kwargs win)."""
    from types import SimpleNamespace

    import trl_plugins.runtime.models as models
    from trl_plugins.cli import train
    from trl_plugins.runtime.models import hub_kwargs_of

    assert hub_kwargs_of(None, True) == {"trust_remote_code": True}
    assert hub_kwargs_of({"trust_remote_code": False, "revision": "v1"}, True) == {"trust_remote_code": False,
                                                                                   "revision": "v1"}
    assert hub_kwargs_of({}, None) == {}
    seen = {}
    monkeypatch.setattr(models, "resolve_model", lambda name, **kw: seen.update(name=name, **kw) or (name, None))
    train.load_model(SimpleNamespace(model_name_or_path="org/custom", model_revision="main"),
                     SimpleNamespace(model_init_kwargs=None, trust_remote_code=True))
    assert seen == {"name": "org/custom", "trust_remote_code": True, "revision": "main"}


# ------------------------------------------------------------------ 2. data owned by the environments


class CountingEnvironment:
    """An environment that owns the data: ``reset()`` returns the question; one tool."""

    def reset(self, **kwargs):
        return "What is 2 + 3?"

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: first integer
            b: second integer
        """
        return str(a + b)


def _length_reward(completions, **kwargs):
    return [float(len(str(c))) / 100 for c in completions]


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_dataset_with_only_an_environment_column_trains(cls, tmp_path):
    from trl_plugins.tasks.tools import enable_tool_calling

    dataset = Dataset.from_dict({"environment": ["math"] * 8})
    trainer = make_tiny_trainer(cls, tokenizer=enable_tool_calling(tiny_tokenizer()), dataset=dataset,
                                reward_funcs=[_length_reward], environment_factory={"math": CountingEnvironment},
                                output_dir=str(tmp_path), max_steps=1, log_level="error")
    trainer.train()
    assert trainer.state.global_step == 1


def test_plugin_trainer_still_refuses_a_dataset_without_prompts_when_no_environment_owns_it(tmp_path):
    from trl_plugins import PluginConfigError

    with pytest.raises(PluginConfigError, match="no 'prompt' column"):
        make_tiny_trainer(dataset=Dataset.from_dict({"question": ["a", "b"]}), output_dir=str(tmp_path))


# ------------------------------------------------------------------ 3. evaluation before the first training step


def _eval_trainer(cls, tmp_path, **config):
    torch.manual_seed(0)
    return make_tiny_trainer(cls, eval_dataset=tiny_dataset(4, seed=1), output_dir=str(tmp_path / cls.__name__),
                             per_device_eval_batch_size=4, **config)


def test_evaluate_before_training_matches_trl_with_no_plugin(tmp_path):
    metrics = [_eval_trainer(cls, tmp_path).evaluate() for cls in TRAINERS]
    assert metrics[0]["eval_loss"] == metrics[1]["eval_loss"]


@pytest.mark.parametrize("plugin", ["lp_reg", "clip_cov", "kl_cov"])
def test_evaluate_before_training_with_a_loss_plugin(plugin, tmp_path):
    metrics = _eval_trainer(PluginGRPOTrainer, tmp_path, plugins=[plugin]).evaluate()
    assert math.isfinite(metrics["eval_loss"])


def test_eval_on_start_with_a_loss_plugin(tmp_path):
    trainer = _eval_trainer(PluginGRPOTrainer, tmp_path, plugins=["lp_reg"], eval_on_start=True,
                            eval_strategy="steps", eval_steps=1, max_steps=1)
    trainer.train()
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


# ------------------------------------------------------------------ 4. _generate on an instance built without __init__


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_generate_on_a_bare_instance_is_trls(cls, monkeypatch):
    """TRL's unit tests of ``_generate`` build the trainer with ``__new__`` and set only what generation reads; the
    plugin trainer must then generate exactly as TRL does (here: TRL's ``_generate`` body, replaced by a recorder)."""
    seen = []

    def trl_generate(self, prompts):
        seen.append(list(prompts))
        return ("ids", prompts)

    monkeypatch.setattr(GRPOTrainer, "_generate", trl_generate)
    bare = cls.__new__(cls)
    assert bare._generate(["a", "b"]) == ("ids", ["a", "b"])
    assert seen == [["a", "b"]]
