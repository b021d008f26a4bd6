"""The drop-in scenario table: every ``GRPOConfig`` field and every ``GRPOTrainer`` argument of trl 1.16, with the
scenario that checks ``PluginGRPOTrainer`` behaves as ``trl.GRPOTrainer`` (with no plugin, and with a no-op plugin
implementing every hook).

Pure data, read by two consumers so that they cannot drift: the conformance suite
(``tests/conformance/test_dropin_suite.py``) runs each scenario, and :mod:`trl_plugins.cli.docs` renders it as the
"TRL features" section of ``docs/compatibility.md``.

Each :class:`Scenario` says how the feature is checked (``mode``):

* ``"run"``: both trainers train the tiny model (1-2 steps) with ``config`` set; the completions, rewards, advantages,
  losses, gradients, final parameters and TRL's logged metrics must be equal. Then the plugin trainer with the no-op
  plugin runs the same scenario; ``plugins`` says what is expected of it: ``"equal"`` (same numbers), ``"runs"``
  (trains; numbers not compared, ``reason`` says why) or ``"refused"`` (refused at construction with ``reason``).
* ``"construct"``: both trainers are built with ``config``; both accept it, or both refuse it with TRL's message
  (``refuses``: a fragment of TRL's message). ``reason`` says why the field is not trained here.
* ``"differs"``: the two trainers differ by design; ``reason`` says how, and the suite checks exactly that difference.

``setup`` names a recipe of the suite (a model given by path, two reward functions, an evaluation set, tools...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("run", "construct", "differs")
PLUGIN_OUTCOMES = ("equal", "runs", "refused")

NO_VLLM = "vLLM is not installed on the test machine (and needs a GPU)"
VLLM_OFF = (f"{NO_VLLM}; with `use_vllm=False` the field is read by no code path, so both trainers accept it and "
            "train alike")


#: ``Scenario.refuses`` for a construction whose outcome depends on the machine (network): both trainers must agree.
ANY = "*"
VLLM_WARNED = (f"{VLLM_OFF}; `PluginGRPOConfig` also warns that the setting is ignored without `use_vllm=True` (it "
               "says 'generate with vLLM' but transformers' generate runs)")


CPU_FLOAT32 = ("`bf16` left unset is True in `GRPOConfig` (TRL's default for GPUs) but False in `PluginGRPOConfig` on "
               "a CPU without bf16 units (float32: bf16 autocast brings no speed there, and TRL's default stops a "
               "GPU-less machine); every other default is TRL's")


@dataclass(frozen=True)
class Scenario:
    """One checked setting of a ``GRPOConfig`` field or a ``GRPOTrainer`` argument.

    Attributes:
        name: the field (``"beta"``) or the argument (``"GRPOTrainer(peft_config=)"``) it covers.
        config: the GRPOConfig values set for both trainers (besides the tiny defaults).
        mode: ``"run"``, ``"construct"`` or ``"differs"`` (see the module docstring).
        setup: the suite's recipe for model, data and trainer arguments ("" = the tiny default).
        plugins: with the no-op plugin: ``"equal"``, ``"runs"`` or ``"refused"``.
        reason: why the scenario is not a full run, why the plugin run is not compared, or how the trainers differ.
        refuses: for ``"construct"``: a fragment of the message both trainers refuse with ("" = both accept).
        steps: optimizer steps of a ``"run"``.
        refused_hooks: ``{hook: reason}``: hooks the plugin trainer refuses in this scenario (at construction, with
            the reason); the no-op plugin implementing every hook is refused, and the no-op plugin without these hooks
            gives what ``plugins`` says.
        xfail: a known difference between the two trainers (the suite marks the scenario xfail, strict, with it).
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "run"
    setup: str = ""
    plugins: str = "equal"
    reason: str = ""
    refuses: str = ""
    steps: int = 1
    refused_hooks: Mapping[str, str] = field(default_factory=dict)
    xfail: str = ""

    @property
    def is_argument(self) -> bool:
        return self.name.startswith("GRPOTrainer(")

    @property
    def id(self) -> str:
        values = ",".join(f"{k}={v!r}" for k, v in self.config.items() if k != self.name)
        own = self.config.get(self.name, "")
        return f"{self.name}={own!r}" + (f"[{values}]" if values else "") + (f"<{self.setup}>" if self.setup else "")


S = Scenario
ITER2 = {"num_iterations": 2}  # two optimizer steps per generation: importance ratios differ from 1, clipping acts
REF = {"beta": 0.04}
# beta > 0: TRL loads the reference model by the policy's name or path, so these scenarios give the model by path


def no_refill(why: str) -> dict[str, str]:
    return {"trl_plugins_reject_groups": "refill (whole groups rejected and regenerated within the step) is refused "
                                         f"at construction with {why}"}


SCENARIOS: tuple[Scenario, ...] = (
    # ---------------------------------------------------------------- model loading
    S("model_init_kwargs", {"model_init_kwargs": {"dtype": "float32"}}, setup="model_path"),
    S("trust_remote_code", {"trust_remote_code": True}, setup="model_path"),
    S("router_aux_loss_coef", {"router_aux_loss_coef": 0.01}, mode="construct",
      refuses="not a Mixture-of-Experts model",
      reason="only Mixture-of-Experts models have router logits; no tiny MoE model is built here"),
    S("disable_dropout", {"disable_dropout": True}),
    S("cast_lm_head_to_fp32", {"cast_lm_head_to_fp32": True}),
    # ---------------------------------------------------------------- generation
    S("num_generations", {"num_generations": 2}),
    S("num_generations_eval", {"num_generations_eval": 2}, setup="eval"),
    S("max_completion_length", {"max_completion_length": 8}),
    S("ds3_gather_for_generation", {"ds3_gather_for_generation": False}),
    S("shuffle_dataset", {"shuffle_dataset": False}),
    S("pad_to_multiple_of", {"pad_to_multiple_of": 8}),
    S("generation_batch_size", {"generation_batch_size": 8}, steps=2),
    S("steps_per_generation", {"steps_per_generation": 2}, steps=2),
    S("temperature", {"temperature": 0.7}),
    S("top_p", {"top_p": 0.9}),
    S("top_k", {"top_k": 5}),
    S("min_p", {"min_p": 0.05}),
    S("generation_kwargs", {"generation_kwargs": {"top_k": 3}}),
    S("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": False}}),
    S("repetition_penalty", {"repetition_penalty": 1.3}),
    S("cache_implementation", {"cache_implementation": "dynamic"}),
    S("use_transformers_continuous_batching", {"use_transformers_continuous_batching": True}),
    S("transformers_continuous_batching_config",
      {"use_transformers_continuous_batching": True, "transformers_continuous_batching_config": {"max_batch_tokens": 256}},
      mode="construct", reason="continuous batching is trained by the scenario above (about a minute on a CPU); "
                               "this one checks both trainers build the same batching config"),
    S("use_transformers_paged", {"use_transformers_paged": True}, mode="construct",
      reason="deprecated alias of `use_transformers_continuous_batching` (trained above); both accept it alike"),
    # ---------------------------------------------------------------- vLLM
    S("use_vllm", {"use_vllm": True}, mode="construct", refuses="vLLM is not available",
      reason=NO_VLLM + "; both trainers refuse it with TRL's message"),
    *(S(name, {name: value}, mode="construct", reason=VLLM_WARNED)
      for name, value in (("vllm_mode", "server"), ("vllm_server_base_url", "http://localhost:8001"))),
    *(S(name, {name: value}, mode="construct", reason=VLLM_OFF) for name, value in (
        ("vllm_model_impl", "transformers"), ("vllm_enable_sleep_mode", True),
        ("vllm_structured_outputs_regex", r"\d+"),
        ("vllm_server_host", "127.0.0.1"), ("vllm_server_port", 8001), ("vllm_server_timeout", 10.0),
        ("vllm_group_port", 51217), ("vllm_gpu_memory_utilization", 0.5), ("vllm_max_model_length", 256),
        ("vllm_tensor_parallel_size", 2), ("vllm_importance_sampling_correction", False),
        ("vllm_importance_sampling_mode", "token_truncate"), ("vllm_importance_sampling_clip_max", 2.0),
        ("vllm_importance_sampling_clip_min", 0.5), ("vllm_importance_sampling_cap", 2.0))),
    # ---------------------------------------------------------------- loss
    S("beta", REF, setup="model_path"),
    S("num_iterations", ITER2, steps=2),
    S("epsilon", {"epsilon": 0.05, **ITER2}, steps=2),
    S("delta", {"delta": 1.05, **ITER2}, steps=2),
    S("epsilon_high", {"epsilon_high": 0.06, **ITER2}, steps=2),
    S("sapo_temperature_neg", {"loss_type": "sapo", "sapo_temperature_neg": 2.0}),
    S("sapo_temperature_pos", {"loss_type": "sapo", "sapo_temperature_pos": 2.0}),
    S("vespo_k_pos", {"loss_type": "vespo", "vespo_k_pos": 1.0}),
    S("vespo_lambda_pos", {"loss_type": "vespo", "vespo_lambda_pos": 1.0}),
    S("vespo_k_neg", {"loss_type": "vespo", "vespo_k_neg": 1.0}),
    S("vespo_lambda_neg", {"loss_type": "vespo", "vespo_lambda_neg": 1.0}),
    S("importance_sampling_level", {"importance_sampling_level": "sequence", **ITER2}, steps=2),
    *(S("loss_type", {"loss_type": t}) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")),
    S("mask_truncated_completions", {"mask_truncated_completions": True, "max_completion_length": 40}),
    S("sync_ref_model", {"sync_ref_model": True, "ref_model_sync_steps": 1, **REF}, steps=2, setup="model_path"),
    S("ref_model_mixup_alpha", {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.3,
                                **REF}, steps=2, setup="model_path"),
    S("ref_model_sync_steps", {"sync_ref_model": True, "ref_model_sync_steps": 1, **REF}, steps=2, setup="model_path"),
    S("top_entropy_quantile", {"top_entropy_quantile": 0.5}),
    S("entropy_coef", {"entropy_coef": 0.05}),
    S("use_adaptive_entropy", {"use_adaptive_entropy": True}, steps=2),
    S("entropy_coef_min", {"use_adaptive_entropy": True, "entropy_coef_min": 0.01}, steps=2),
    S("entropy_coef_max", {"use_adaptive_entropy": True, "entropy_coef_max": 0.02}, steps=2),
    S("entropy_coef_delta", {"use_adaptive_entropy": True, "entropy_coef_delta": 0.05}, steps=2),
    S("entropy_target", {"use_adaptive_entropy": True, "entropy_target": 2.0}, steps=2),
    S("off_policy_mask_threshold", {"off_policy_mask_threshold": 0.01, **ITER2}, steps=2),
    S("use_bias_correction_kl", {"use_bias_correction_kl": False, **REF, **ITER2}, steps=2, setup="model_path"),
    # ---------------------------------------------------------------- rewards
    S("reward_weights", {"reward_weights": [1.0, 0.5]}, setup="two_rewards"),
    S("multi_objective_aggregation", {"multi_objective_aggregation": "normalize_then_sum"}, setup="two_rewards"),
    S("scale_rewards", {"scale_rewards": "batch"}),
    S("scale_rewards", {"scale_rewards": "none"}),
    # ---------------------------------------------------------------- tools
    S("max_tool_calling_iterations", {"max_tool_calling_iterations": 1}, setup="tools", refused_hooks=no_refill("tools")),
    # ---------------------------------------------------------------- logging
    S("log_completions", {"log_completions": True}),
    S("log_multimodal", {"log_multimodal": False, "log_completions": True}),
    S("num_completions_to_print", {"num_completions_to_print": 2, "log_completions": True}),
    S("log_unique_prompts", {"log_unique_prompts": True, "log_completions": True}),
    S("log_completions_hub_repo", {"log_completions_hub_repo": "someone/completions", "log_completions": True},
      mode="construct", refuses=ANY,
      reason="pushes the completions to the Hugging Face Hub (TRL creates the dataset repo at construction), which the "
             "test machine cannot reach; both trainers do the same (here: both refuse with the same connection error)"),
    # ---------------------------------------------------------------- TrainingArguments fields GRPOConfig re-defaults
    S("learning_rate", {"learning_rate": 0.05}),
    S("logging_steps", {"logging_steps": 2}, steps=2),
    S("gradient_checkpointing", {"gradient_checkpointing": True, "activation_checkpointing": True}),
    S("remove_unused_columns", {"remove_unused_columns": True}),
    S("bf16", {"bf16": None}, mode="differs", setup="config_defaults", reason=CPU_FLOAT32),
    # ---------------------------------------------------------------- asked for by name
    S("use_liger_kernel", {"use_liger_kernel": True}, mode="construct", refuses=ANY,
      reason="liger-kernel is not installed on the test machine (and its kernels need a GPU); TRL 1.16 applies only its "
             "layer kernels (never the fused linear cross-entropy, which would replace the forward both trainers "
             "patch), so the log-probs every plugin reads come from the same fused LM head; both trainers agree here "
             "(trained with a stand-in for the kernels in tests/conformance/test_liger.py)"),
    # ---------------------------------------------------------------- GRPOTrainer arguments
    S("GRPOTrainer(model=)", setup="model_path"),
    S("GRPOTrainer(model=)", setup="peft_model"),
    S("GRPOTrainer(reward_funcs=)", setup="two_rewards"),
    S("GRPOTrainer(reward_funcs=)", setup="reward_model"),
    S("GRPOTrainer(args=)", setup="no_args", mode="differs",
      reason="without `args` TRL builds a `GRPOConfig`, the plugin trainer a `PluginGRPOConfig`: " + CPU_FLOAT32),
    S("GRPOTrainer(train_dataset=)", setup="iterable_dataset",
      refused_hooks=no_refill("an iterable training dataset (the refill stream draws rows by index)")),
    S("GRPOTrainer(eval_dataset=)", setup="eval"),
    S("GRPOTrainer(processing_class=)", setup="no_processing_class"),
    S("GRPOTrainer(reward_processing_classes=)", setup="reward_model"),
    S("GRPOTrainer(callbacks=)", setup="callbacks"),
    S("GRPOTrainer(optimizers=)", setup="optimizers"),
    S("GRPOTrainer(quantization_config=)", setup="quantization", mode="construct",
      reason="a trained 4-bit model needs bitsandbytes' CUDA kernels; on the CPU both trainers build it alike"),
    S("GRPOTrainer(peft_config=)", setup="peft_config"),
    S("GRPOTrainer(tools=)", setup="tools", refused_hooks=no_refill("tools")),
    S("GRPOTrainer(rollout_func=)", setup="rollout_func", refused_hooks=no_refill("rollout_func")),
    S("GRPOTrainer(environment_factory=)", setup="environment", refused_hooks=no_refill("tools, environment_factory")),
)


def scenario_names() -> set[str]:
    """Every field and argument name the table covers."""
    return {s.name for s in SCENARIOS}


def grpo_config_fields() -> list[str]:
    """``GRPOConfig``'s own fields (those ``transformers.TrainingArguments`` does not declare), in order."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited]


def redefaulted_training_arguments() -> list[str]:
    """``TrainingArguments`` fields whose default ``GRPOConfig`` changes (they are GRPO settings too)."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(GRPOConfig) if f.name in base and repr(f.default) != repr(base[f.name].default)]


def grpo_trainer_arguments() -> list[str]:
    """``GRPOTrainer.__init__``'s arguments, as ``"GRPOTrainer(name=)"``."""
    import inspect

    from trl import GRPOTrainer

    return [f"GRPOTrainer({p}=)" for p in inspect.signature(GRPOTrainer.__init__).parameters if p != "self"]
