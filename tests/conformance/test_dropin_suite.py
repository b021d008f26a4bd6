"""Drop-in conformance: every ``GRPOConfig`` field and every ``GRPOTrainer`` argument of trl 1.16, run through
``trl.GRPOTrainer`` and ``PluginGRPOTrainer`` (no plugin: equal results), and through ``PluginGRPOTrainer`` with a
no-op plugin implementing every hook (runs; equal results where the plugin path changes nothing measurable).

The scenarios are the table :data:`trl_plugins.cli.dropin.SCENARIOS` (also rendered into ``docs/compatibility.md``).
The fast tests check the table covers every field and argument of the installed TRL (a TRL upgrade that adds a field
fails here until a scenario covers it) and run the construction-only scenarios; the training scenarios are slow.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_plugins import PluginGRPOTrainer, hookimpl
from trl_plugins.cli.dropin import (
    ANY, MODES, PLUGIN_OUTCOMES, SCENARIOS, Scenario, grpo_config_fields, grpo_trainer_arguments,
    redefaulted_training_arguments,
)
from trl_plugins.api.hookspecs import HOOK_STAGES
from trl_plugins.runtime.precision import cpu_bf16_is_native
from trl_plugins.api.plugin import Plugin
from trl_plugins.testing import (
    RunRecord, assert_runs_equal, digit_fraction_reward, make_tool_trainer, record_run, temporary_plugin,
    tiny_config, tiny_dataset, tiny_model, tiny_tokenizer,
)

NOOP = "dropin_noop"


def _noop_hooks() -> dict:
    """One do-nothing implementation per hook, with the spec's argument names (pluggy checks them)."""

    def trl_plugins_configure(self, trainer, args): pass
    def trl_plugins_on_step_end(self, trainer, step): pass
    def trl_plugins_state_dict(self): return {}
    def trl_plugins_load_state_dict(self, state): pass
    def trl_plugins_reward_functions(self, args): return []
    def trl_plugins_train_sampler(self, trainer, sampler, dataset): return None
    def trl_plugins_train_dataset(self, dataset, args): return None
    def trl_plugins_generation_prompts(self, ctx): pass
    def trl_plugins_after_generation(self, ctx): pass
    def trl_plugins_reject_groups(self, ctx): pass
    def trl_plugins_transform_rewards(self, ctx): pass
    def trl_plugins_transform_advantages(self, ctx): pass
    def trl_plugins_loss_advantages(self, ctx): pass
    def trl_plugins_loss(self, ctx): pass

    return {name: hookimpl(f) for name, f in locals().items() if name.startswith("trl_plugins_")}


def noop_plugin_class(name: str = NOOP, without: tuple[str, ...] = ()) -> type[Plugin]:
    """A plugin implementing every hook of :mod:`trl_plugins.api.hookspecs` but ``without``, each changing nothing."""
    hooks = {h: f for h, f in _noop_hooks().items() if h not in without}
    attrs = dict(name=name, summary="no-op on every hook (drop-in conformance)", multi_turn=True, **hooks)
    return type("EveryHookNoop", (Plugin,), attrs)


EveryHookNoop = noop_plugin_class()


def test_the_noop_plugin_implements_every_hook():
    assert set(EveryHookNoop.hook_names()) == set(HOOK_STAGES)
    assert set(EveryHookNoop.stages()) == {"sampling", "reward", "advantage", "loss"}


@pytest.fixture(scope="module")
def noop_plugin():
    with temporary_plugin(EveryHookNoop):
        yield NOOP


# ------------------------------------------------------------------ coverage of the table (fast)


def uncovered(fields, arguments, scenarios=SCENARIOS) -> list[str]:
    names = {s.name for s in scenarios}
    return [n for n in [*fields, *arguments] if n not in names]


def test_every_grpo_config_field_and_trainer_argument_has_a_scenario():
    fields, arguments = grpo_config_fields() + redefaulted_training_arguments(), grpo_trainer_arguments()
    assert len(fields) >= 77 + 5 and "GRPOTrainer(rollout_func=)" in arguments
    missing = uncovered(fields, arguments)
    assert not missing, f"no drop-in scenario covers {missing}: add one to trl_plugins/cli/dropin.py SCENARIOS"


def test_coverage_check_fails_on_a_new_field():
    assert uncovered([*grpo_config_fields(), "brand_new_field"], grpo_trainer_arguments()) == ["brand_new_field"]


def test_the_table_names_only_real_fields_and_consistent_modes(tmp_path):
    fields, arguments = set(grpo_config_fields() + redefaulted_training_arguments()), set(grpo_trainer_arguments())
    fields_named = fields | {"use_liger_kernel"}
    all_config = {f.name for f in dataclasses.fields(GRPOConfig)}
    changed = set()
    base = tiny_config(str(tmp_path), config_cls=GRPOConfig)  # the value each scenario changes: the suite's base
    for s in SCENARIOS:
        assert s.name in fields_named | arguments, f"{s.name}: neither a GRPOConfig field nor a GRPOTrainer argument"
        assert set(s.config) <= all_config, f"{s.name}: unknown config keys {set(s.config) - all_config}"
        assert s.mode in MODES and s.plugins in PLUGIN_OUTCOMES
        if s.mode != "run" or s.plugins != "equal":
            assert s.reason, f"{s.id}: a scenario that is not an equal run says why"
        if s.mode == "differs":
            assert s.setup in DIFFERS_CHECKED_BY, f"{s.id}: no test checks this difference"
        if not s.is_argument:
            assert s.name in s.config, f"{s.id}: the scenario does not set its own field"
            if s.mode == "differs" or s.config[s.name] != getattr(base, s.name):
                changed.add(s.name)
    assert changed >= fields, f"no scenario sets a non-default value of {sorted(fields - changed)}"


# ------------------------------------------------------------------ building both trainers


def length_reward(completions, **kwargs):
    return [min(len(str(c)), 40) / 40 for c in completions]


class CountingCallback(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step))


def scripted_rollout(prompts, trainer):
    """A ``rollout_func``: the chat-rendered prompt's ids and a completion that depends on the row only."""
    tok = trainer.processing_class
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                  if isinstance(p, list) else tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prompt_ids = [list(ids["input_ids"]) if isinstance(ids, dict) else list(ids) for ids in prompt_ids]
    completion_ids = [tok(f"{i % 7} {i}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                      for i in range(len(prompts))]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[-1.0] * len(c) for c in completion_ids]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trl_plugins.tasks.tiny import build_and_save

    return build_and_save(tmp_path_factory.mktemp("dropin") / "model")


def build(cls, scenario: Scenario, out, model_dir, plugins=()):
    """The scenario's trainer of class ``cls`` (a plain ``GRPOConfig`` for TRL), ``plugins`` enabled."""
    torch.manual_seed(0)
    setup = scenario.setup
    config_cls = GRPOConfig if cls is GRPOTrainer else None
    values = dict(max_steps=scenario.steps, log_level="error", **scenario.config)
    if plugins:
        values["plugins"] = list(plugins)
    if setup in ("tools", "environment"):
        return make_tool_trainer(cls, agent="tools" if setup == "tools" else "environment", n=4,
                                 output_dir=str(out), **values)
    tokenizer = tiny_tokenizer()
    kwargs = dict(reward_funcs=[digit_fraction_reward], train_dataset=tiny_dataset(8), processing_class=tokenizer)
    if setup in ("model_path", "no_processing_class", "quantization"):
        model = str(model_dir)
        kwargs["processing_class"] = AutoTokenizer.from_pretrained(model_dir)
    else:
        model = tiny_model(tokenizer)
    if setup == "peft_model":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if setup == "peft_config":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    if setup == "no_processing_class":
        kwargs["processing_class"] = None
    if setup == "two_rewards":
        kwargs["reward_funcs"] = [digit_fraction_reward, length_reward]
    if setup == "reward_model":
        from transformers import LlamaConfig, LlamaForSequenceClassification

        torch.manual_seed(1)
        rm = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id))
        kwargs["reward_funcs"] = [digit_fraction_reward, rm]
        kwargs["reward_processing_classes"] = [None, tiny_tokenizer()]
    if setup == "iterable_dataset":
        kwargs["train_dataset"] = tiny_dataset(8).to_iterable_dataset()
    if setup == "eval":
        kwargs["eval_dataset"] = tiny_dataset(4, seed=1)
        values.update(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    if setup == "callbacks":
        kwargs["callbacks"] = [CountingCallback()]
    if setup == "optimizers":
        kwargs["optimizers"] = (torch.optim.SGD(model.parameters(), lr=0.1), None)
    if setup == "quantization":
        from transformers import BitsAndBytesConfig

        from peft import LoraConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True)
        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    if setup == "rollout_func":
        kwargs["rollout_func"] = scripted_rollout
    args = tiny_config(str(out), config_cls=config_cls, **values)
    torch.manual_seed(0)
    trainer = cls(model=model, args=args, **kwargs)
    trainer.remove_callback(PrinterCallback)
    return trainer


def outcome(fn):
    """("ok", value) or ("error", exception)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 -- the suite compares whatever both trainers raise
        return "error", exc


def assert_same_outcome(trl, ours, scenario, who):
    if trl[0] == "error":
        assert ours[0] == "error", f"{scenario.id}: TRL refuses ({trl[1]!r}) but {who} accepts"
        assert str(trl[1]) in str(ours[1]) or _core(trl[1]) in str(ours[1]), (
            f"{scenario.id}: {who} refuses without TRL's message:\n TRL: {trl[1]!r}\n ours: {ours[1]!r}")
    else:
        assert ours[0] == "ok", f"{scenario.id}: TRL accepts but {who} refuses: {ours[1]!r}"


def _core(exc) -> str:
    return str(exc).split("\n")[0][:120]


# ------------------------------------------------------------------ construction-only scenarios (fast)

def param(scenario):
    marks = [pytest.mark.xfail(reason=scenario.xfail, strict=True)] if scenario.xfail else []
    return pytest.param(scenario, id=scenario.id, marks=marks)


CONSTRUCT = [param(s) for s in SCENARIOS if s.mode == "construct"]


@pytest.mark.parametrize("scenario", CONSTRUCT)
def test_construction_scenario(scenario, tmp_path, model_dir, noop_plugin):
    trl = outcome(lambda: build(GRPOTrainer, scenario, tmp_path / "trl", model_dir))
    ours = outcome(lambda: build(PluginGRPOTrainer, scenario, tmp_path / "ours", model_dir))
    noop = outcome(lambda: build(PluginGRPOTrainer, scenario, tmp_path / "noop", model_dir, plugins=[noop_plugin]))
    if scenario.refuses == ANY:
        pass  # machine-dependent (network): the trainers must agree, whatever TRL does here
    elif scenario.refuses:
        assert trl[0] == "error" and scenario.refuses in str(trl[1]), f"TRL no longer refuses as recorded: {trl}"
    else:
        assert trl[0] == "ok", f"TRL no longer accepts {scenario.id}: {trl[1]!r}"
    assert_same_outcome(trl, ours, scenario, "PluginGRPOTrainer")
    assert_same_outcome(trl, noop, scenario, "PluginGRPOTrainer with the no-op plugin")
    if trl[0] == "ok":
        for name, value in scenario.config.items():
            assert getattr(ours[1].args, name) == getattr(trl[1].args, name), f"{name} is read differently"


#: setup of a "differs" scenario -> the test that checks exactly that difference
DIFFERS_CHECKED_BY = {"no_args": "test_no_args_differs_only_in_the_cpu_precision_default",
                      "config_defaults": "test_plugin_config_defaults_are_grpo_configs_but_the_cpu_precision"}


def test_no_args_differs_only_in_the_cpu_precision_default(tmp_path, model_dir, monkeypatch):
    """Where equality cannot hold by design: without ``args`` TRL's default config asks for bf16 (refused or
    emulated on a CPU without bf16 units); the plugin trainer's default keeps float32 there. Every other field equal."""
    monkeypatch.chdir(tmp_path)
    tokenizer = tiny_tokenizer()

    def make(cls):
        trainer = cls(model=tiny_model(tokenizer), reward_funcs=[digit_fraction_reward], train_dataset=tiny_dataset(8),
                      processing_class=tokenizer)
        return trainer.args

    trl, ours = outcome(lambda: make(GRPOTrainer)), outcome(lambda: make(PluginGRPOTrainer))
    assert ours[0] == "ok", ours[1]
    if trl[0] == "error":  # TRL's bf16 default stops this machine
        assert "bf16" in str(trl[1]) or "bfloat16" in str(trl[1]), trl[1]
        # float32 without AMX bf16 units; with them TRL's bf16 on the CPU (trl_plugins.runtime.precision)
        assert ours[1].bf16 is cpu_bf16_is_native()
        return
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {"output_dir", "logging_dir", "run_name", "bf16"}
    for name in own:
        a, b = getattr(trl[1], name), getattr(ours[1], name)
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), name
    assert (trl[1].bf16, ours[1].bf16) in ((True, False), (True, True))


# ------------------------------------------------------------------ training scenarios (slow)

TIMING = re.compile(r"(runtime|per_second|step_time|flos)")
RUN = [param(s) for s in SCENARIOS if s.mode == "run"]


def comparable_logs(record: RunRecord) -> list[dict]:
    return [{k: v for k, v in entry.items() if not TIMING.search(k) and not k.removeprefix("eval_").startswith("plugins/")}
            for entry in record.logs]


def assert_logs_equal(a: RunRecord, b: RunRecord, atol=0.0, rtol=0.0):
    la, lb = comparable_logs(a), comparable_logs(b)
    assert len(la) == len(lb) > 0, "logged entries differ in number"
    for x, y in zip(la, lb):
        assert x.keys() == y.keys(), f"logged metrics differ: {sorted(x.keys() ^ y.keys())}"
        for k in x:
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert math.isclose(x[k], y[k], rel_tol=rtol, abs_tol=atol) or (math.isnan(x[k]) and math.isnan(y[k])), (
                    f"metric {k}: {x[k]} != {y[k]}")
            else:
                assert x[k] == y[k], f"metric {k}: {x[k]!r} != {y[k]!r}"


def assert_same_run(a: RunRecord, b: RunRecord, atol=0.0, rtol=0.0):
    assert_runs_equal(a, b, atol=atol, rtol=rtol)
    assert_logs_equal(a, b, atol=atol, rtol=rtol)


def test_the_run_comparison_can_fail():
    """Guard against a vacuous comparison: a one-ulp change of one parameter, or of one logged metric, is caught."""
    rec = RunRecord(completion_ids=[torch.tensor([[1, 2]])], advantages=[torch.tensor([0.5])],
                    rewards=[torch.tensor([[1.0]])], losses=[0.1], grads=[{"w": torch.ones(2)}],
                    logs=[{"loss": 0.1, "reward": 1.0, "step_time": 3.0}], params={"w": torch.ones(2)})
    assert_same_run(rec, dataclasses.replace(rec, logs=[{"loss": 0.1, "reward": 1.0, "step_time": 9.0}]))
    with pytest.raises(AssertionError):
        assert_same_run(rec, dataclasses.replace(rec, params={"w": torch.nextafter(torch.ones(2), torch.zeros(2))}))
    with pytest.raises(AssertionError):
        assert_same_run(rec, dataclasses.replace(rec, logs=[{"loss": 0.1, "reward": 0.999}]))
    with pytest.raises(AssertionError):
        assert_same_run(rec, dataclasses.replace(rec, completion_ids=[torch.tensor([[1, 3]])]))


@pytest.mark.slow
def test_a_one_field_difference_between_the_trainers_is_caught(tmp_path, model_dir):
    """The live comparison is not vacuous: the same scenario with one field changed for the plugin trainer only
    (the clip range, acting from the second step of a two-iteration generation) fails it."""
    base = Scenario("epsilon", {"epsilon": 0.05, "num_iterations": 2}, steps=2)
    trl = record_run(build(GRPOTrainer, base, tmp_path / "trl", model_dir))
    ours = record_run(build(PluginGRPOTrainer, dataclasses.replace(base, config={**base.config, "epsilon": 0.06}),
                            tmp_path / "ours", model_dir))
    with pytest.raises(AssertionError):
        assert_same_run(trl, ours)


def _callback_events(trainer):
    return [cb.events for cb in trainer.callback_handler.callbacks if isinstance(cb, CountingCallback)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", RUN)
def test_training_scenario(scenario, tmp_path, model_dir, noop_plugin):
    trl_trainer = build(GRPOTrainer, scenario, tmp_path / "trl", model_dir)
    trl = record_run(trl_trainer)
    assert any(a.abs().sum() > 0 for a in trl.advantages) or scenario.setup in ("rollout_func",), (
        "every advantage is zero: the comparison would be vacuous")
    ours_trainer = build(PluginGRPOTrainer, scenario, tmp_path / "ours", model_dir)
    ours = record_run(ours_trainer)
    assert_same_run(trl, ours)
    assert _callback_events(trl_trainer) == _callback_events(ours_trainer)

    if scenario.plugins == "refused":
        with pytest.raises(Exception, match=re.escape(scenario.reason[:40])):
            build(PluginGRPOTrainer, scenario, tmp_path / "noop", model_dir, plugins=[noop_plugin])
        return
    if scenario.refused_hooks:
        with pytest.raises(Exception) as refused:
            build(PluginGRPOTrainer, scenario, tmp_path / "noop", model_dir, plugins=[noop_plugin])
        for hook in scenario.refused_hooks:
            assert hook in str(refused.value) and "not supported" in str(refused.value), refused.value
        partial = noop_plugin_class(NOOP + "_partial", without=tuple(scenario.refused_hooks))
        with temporary_plugin(partial):
            _noop_run(scenario, trl, tmp_path, model_dir, partial.name)
    else:
        _noop_run(scenario, trl, tmp_path, model_dir, noop_plugin)


def _noop_run(scenario, trl, tmp_path, model_dir, plugin):
    noop_trainer = build(PluginGRPOTrainer, scenario, tmp_path / "noop", model_dir, plugins=[plugin])
    assert [p.name for p in noop_trainer.plugin_stack] == [plugin]
    noop = record_run(noop_trainer)
    assert noop_trainer.state.global_step == scenario.steps
    if scenario.plugins == "equal":
        assert_same_run(trl, noop)
