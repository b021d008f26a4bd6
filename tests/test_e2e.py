"""End to end: the built-in plugins stacked on full fine-tuning, LoRA and QLoRA (4-bit bitsandbytes on CPU),
checkpoint / resume of plugin state, and bad configurations refused at construction."""

import os

import pytest
import torch
from datasets import Dataset

from trl_plugins import (
    IncompatiblePluginsError,
    Plugin,
    PluginConfigError,
    PluginGRPOConfig,
    PluginGRPOTrainer,
    UnknownPluginError,
    hookimpl,
)
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import (
    digit_fraction_reward,
    make_tiny_trainer,
    temporary_plugin,
    tiny_config,
    tiny_dataset,
    tiny_model,
    tiny_tokenizer,
)
from trl_plugins.runtime.trainer import PLUGIN_STATE_FILE

BUILTINS = ["hint_scaffold", "canon", "lp_reg"]
# Settings under which every built-in acts on an untrained tiny model within two steps: every group "fails"
# (hint_scaffold re-generates it), Lp-Reg's keep set is narrow and it selects half of the negative tokens.
BUILTIN_CONFIG = {
    "hint_scaffold": {"success_threshold": 0.9},
    "lp_reg": {"kappa": 0.45, "rho": 0.5},
}
REWARDS = [accuracy_reward, digit_fraction_reward]


def _trainable(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def _merged_logs(trainer):
    merged = {}
    for log in trainer.state.log_history:
        merged.update(log)
    return merged


def _assert_builtin_metrics(logs):
    for key in (
        "plugins/hint_scaffold/all_fail_group_fraction",
        "plugins/hint_scaffold/extra_rollouts",
        "plugins/canon/lam",
        "plugins/canon/abs_advantage",
        "plugins/lp_reg/regularised_token_fraction",
        "plugins/lp_reg/selected_token_fraction",
        "plugins/framework/extra_rollouts",
        "plugins/framework/offpolicy_token_fraction",
    ):
        assert key in logs, f"{key} not logged; got {sorted(k for k in logs if k.startswith('plugins/'))}"
    assert logs["plugins/hint_scaffold/all_fail_group_fraction"] > 0
    assert logs["plugins/framework/extra_rollouts"] > 0
    assert logs["plugins/lp_reg/selected_token_fraction"] > 0


# ============================================================================================ (a) full fine-tuning


@pytest.mark.slow
def test_builtins_stacked_full_finetuning(tmp_path):
    trainer = make_tiny_trainer(
        plugins=BUILTINS, plugin_config=BUILTIN_CONFIG, loss_type="dr_grpo", reward_funcs=REWARDS,
        output_dir=str(tmp_path), log_level="error", max_steps=2,
    )
    before = _trainable(trainer.model)
    trainer.train()
    after = _trainable(trainer.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"
    logs = _merged_logs(trainer)
    _assert_builtin_metrics(logs)
    assert logs["plugins/lp_reg/regularised_token_fraction"] > 0
    assert trainer.generation_service.total > 0
    assert all(torch.isfinite(p).all() for p in after.values())


# ============================================================================================ (b) LoRA, (c) QLoRA


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _check_adapter_run(trainer, before):
    after = _trainable(trainer.model)
    assert before and set(before) == set(after)
    assert all("lora_" in n for n in before), "only adapter weights may be trainable"
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any("lora_B" in n for n in changed), "adapters did not train"
    _assert_builtin_metrics(_merged_logs(trainer))


@pytest.mark.slow
def test_builtins_with_lora(tmp_path):
    tokenizer = tiny_tokenizer()
    args = tiny_config(
        output_dir=str(tmp_path), plugins=BUILTINS, plugin_config=BUILTIN_CONFIG, loss_type="dr_grpo",
        beta=0.05,  # the reference model is the base model with adapters disabled
        log_level="error", max_steps=2,
    )
    base = tiny_model(tokenizer)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    trainer = PluginGRPOTrainer(
        model=base, reward_funcs=REWARDS, args=args, train_dataset=tiny_dataset(), processing_class=tokenizer,
        peft_config=_lora_config(),
    )
    from peft import PeftModel

    assert isinstance(trainer.model, PeftModel)
    before = _trainable(trainer.model)
    trainer.train()
    _check_adapter_run(trainer, before)
    # the base weights are untouched
    for name, param in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            torch.testing.assert_close(param.detach(), frozen[key], rtol=0, atol=0)
    assert "kl" in _merged_logs(trainer)


@pytest.mark.slow
def test_builtins_with_qlora_4bit_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoTokenizer, BitsAndBytesConfig

    from trl_plugins.tasks.tiny import build_and_save

    path = build_and_save(tmp_path / "tiny")
    args = tiny_config(
        output_dir=str(tmp_path / "out"), plugins=BUILTINS, plugin_config=BUILTIN_CONFIG, loss_type="dr_grpo",
        log_level="error", max_steps=1,
    )
    trainer = PluginGRPOTrainer(
        model=str(path),  # loaded by path, as a user would load a hub model by name
        reward_funcs=REWARDS, args=args, train_dataset=tiny_dataset(),
        processing_class=AutoTokenizer.from_pretrained(path),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        peft_config=_lora_config(),
    )
    import bitsandbytes as bnb

    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized, "the base model is not 4-bit"
    assert getattr(trainer.model.get_base_model(), "is_loaded_in_4bit", False)
    before = _trainable(trainer.model)
    trainer.train()
    _check_adapter_run(trainer, before)


# ============================================================================================ (d) resume


class Counter(Plugin):
    """A plugin with resumable state: counts optimizer steps and asks for one extra rollout per batch."""

    name = "test_counter"
    loaded: list = []

    def __init__(self, options=None):
        super().__init__(options)
        self.count = 0

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.service.generate(prompts=ctx.prompts[:1])

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        self.count += 1

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"count": self.count}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        Counter.loaded.append(dict(state))
        self.count = state["count"]


def _resume_trainer(output_dir, max_steps):
    return make_tiny_trainer(
        plugins=["test_counter"], reward_funcs=[digit_fraction_reward], output_dir=str(output_dir),
        max_steps=max_steps, save_strategy="steps", save_steps=1, log_level="error",
    )


@pytest.mark.slow
def test_resume_restores_plugin_state_and_continues_like_the_unbroken_run(tmp_path):
    Counter.loaded = []
    with temporary_plugin(Counter):
        unbroken = _resume_trainer(tmp_path / "a", max_steps=3)
        unbroken.train()
        assert unbroken.plugin_stack.by_name["test_counter"].count == 3
        for step in (1, 2, 3):
            state_file = tmp_path / "a" / f"checkpoint-{step}" / PLUGIN_STATE_FILE
            assert state_file.exists()
            state = torch.load(state_file, weights_only=True)
            assert state["test_counter"] == {"count": step}
            assert state["__framework__"]["generation_service"] == {"total": step}
        assert Counter.loaded == []

        resumed = _resume_trainer(tmp_path / "b", max_steps=3)
        assert resumed.plugin_stack.by_name["test_counter"].count == 0
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert Counter.loaded == [{"count": 1}]
    assert resumed.plugin_stack.by_name["test_counter"].count == 3
    assert resumed.generation_service.total == 3
    # the resumed run continues as the unbroken one
    for name, param in unbroken.model.named_parameters():
        torch.testing.assert_close(resumed.model.state_dict()[name], param.detach(), msg=f"{name} differs")
    saved = torch.load(tmp_path / "b" / "checkpoint-3" / PLUGIN_STATE_FILE, weights_only=True)
    assert saved["test_counter"] == {"count": 3}


def test_no_plugin_state_file_without_plugins(tmp_path):
    trainer = make_tiny_trainer(
        reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path), max_steps=1, save_strategy="steps",
        save_steps=1, log_level="error",
    )
    trainer.train()
    assert os.path.isdir(tmp_path / "checkpoint-1")
    assert not (tmp_path / "checkpoint-1" / PLUGIN_STATE_FILE).exists()


# ============================================================================================ (e) bad input


def _config(tmp_path, **kwargs):
    return PluginGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


def test_unknown_plugin_name_with_suggestion(tmp_path):
    with pytest.raises(UnknownPluginError) as err:
        _config(tmp_path, plugins=["lp_rge"])
    message = str(err.value)
    assert "'lp_rge'" in message and "Did you mean 'lp_reg'" in message
    assert "Available plugins:" in message and "hint_scaffold" in message
    # the same refusal through the trainer factory (construction, not training)
    with pytest.raises(UnknownPluginError, match="lp_rge"):
        make_tiny_trainer(plugins=["canon", "lp_rge"])


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"kapa": 0.1}, ["'kapa'", "'lp_reg'", "Did you mean 'kappa'", "Allowed options:", "rho"]),
        ({"kappa": "high"}, ["'kappa'", "'high'", "a number"]),
        ({"kappa": 2.0}, ["'kappa'", "2.0", "<= 1.0"]),
        ({"kappa": 0.0}, ["'kappa'", "0.0", "> 0.0"]),
        ({"threshold_mode": "maxp"}, ["'threshold_mode'", "'maxp'", "'minp', 'fixed'"]),
        ({"rho": True}, ["'rho'", "True", "a number"]),
    ],
)
def test_bad_options_refused_with_value_and_allowed(tmp_path, options, expected):
    with pytest.raises(PluginConfigError) as err:
        _config(tmp_path, plugins=["lp_reg"], plugin_config={"lp_reg": options})
    for fragment in expected:
        assert fragment in str(err.value), f"{fragment!r} not in {str(err.value)!r}"


def test_options_for_a_plugin_not_enabled(tmp_path):
    with pytest.raises(PluginConfigError, match="'lp_reg'.*not in plugins=\\['canon'\\]"):
        _config(tmp_path, plugins=["canon"], plugin_config={"lp_reg": {"kappa": 0.1}})
    with pytest.raises(PluginConfigError, match="hint_scaffold"):
        _config(tmp_path, plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"hint_fractions": [0.5, 1.5]}})


class ClipCov(Plugin):
    name = "clip_cov"

    @hookimpl
    def trl_plugins_loss(self, ctx):
        pass


class ReplacerOne(Plugin):
    name = "test_replacer_one"
    replaces_surrogate = True

    @hookimpl
    def trl_plugins_loss(self, ctx):
        pass


class ReplacerTwo(ReplacerOne):
    name = "test_replacer_two"


def test_incompatible_stacks_refused(tmp_path):
    with temporary_plugin(ClipCov):
        with pytest.raises(IncompatiblePluginsError) as err:
            _config(tmp_path, plugins=["lp_reg", "clip_cov"])
    assert "'lp_reg' and 'clip_cov'" in str(err.value) and "Enable only one" in str(err.value)
    with temporary_plugin(ReplacerOne), temporary_plugin(ReplacerTwo):
        with pytest.raises(IncompatiblePluginsError, match="test_replacer_one.*test_replacer_two.*at most one"):
            _config(tmp_path, plugins=["test_replacer_one", "test_replacer_two"])
        with pytest.raises(IncompatiblePluginsError, match="lp_reg.*test_replacer_one"):
            _config(tmp_path, plugins=["lp_reg", "test_replacer_one"])
    with pytest.raises(IncompatiblePluginsError, match="'canon' is enabled twice"):
        _config(tmp_path, plugins=["canon", "canon"])


def test_incompatible_with_run_settings_refused_at_trainer_construction():
    with pytest.raises(IncompatiblePluginsError, match="entropy_coef=0.01"):
        make_tiny_trainer(plugins=["lp_reg"], entropy_coef=0.01)
    # TRL itself accepts any loss_type until the first loss; the plugin path refuses one it does not implement
    with pytest.raises(IncompatiblePluginsError, match="loss_type='ppo' is not supported.*supported: grpo.*vespo"):
        make_tiny_trainer(plugins=["lp_reg"], loss_type="ppo")


def test_missing_dataset_column_refused(tmp_path):
    data = tiny_dataset(4)
    without_solution = Dataset.from_list([{k: v for k, v in row.items() if k != "solution"} for row in data])
    with pytest.raises(PluginConfigError) as err:
        make_tiny_trainer(plugins=["hint_scaffold"], dataset=without_solution, output_dir=str(tmp_path))
    message = str(err.value)
    assert "'hint_scaffold'" in message and "'solution'" in message and "columns: prompt" in message
    # the column the option names is the one required
    with pytest.raises(PluginConfigError, match="'reference'"):
        make_tiny_trainer(
            plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"solution_column": "reference"}},
            dataset=data, output_dir=str(tmp_path),
        )
