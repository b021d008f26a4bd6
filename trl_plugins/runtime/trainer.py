"""``PluginGRPOTrainer``: TRL's ``GRPOTrainer`` with the plugin stages wired in.

The trainer names no private member of TRL: it subclasses :class:`~trl_plugins.runtime.trl_seam.TrlSeamTrainer`, the one
module that does (``tests/runtime/test_trl_seam.py`` checks it), and overrides the seam's public override points, reaching
TRL's own code with ``super()``. With no plugins enabled every override defers to TRL's method, so the trainer is
identical to ``trl.GRPOTrainer`` (``tests/runtime/test_reduction.py``).

Where each stage runs inside TRL 1.16's ``_generate_and_score_completions`` (override point in brackets):

* sampling: ``_generate`` [``generate_rollouts``] (per-row generation prompts, then after-generation edits with the
  generation service, then the refill rounds of :mod:`trl_plugins.runtime.refill`), before TRL pads, computes old/ref
  log-probs and scores;
* reward: ``_calculate_rewards`` [``calculate_rewards``] (after TRL gathers the reward matrix, before it computes
  advantages);
* advantage: after TRL's method returns [``generate_and_score_completions``] (global advantages recomputed from the
  gathered batch, sliced back);
* loss: ``_compute_loss`` [``compute_grpo_loss``] (:func:`trl_plugins.runtime.loss.compute_loss_with_plugins`).

The no-grad policy forwards that stage contexts offer plugins live in :mod:`trl_plugins.runtime.policy_probe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import nn
from transformers import TrainerCallback
from trl import GRPOConfig
from trl.data_utils import apply_chat_template, is_conversational

from trl_plugins.api.data_checks import has_image_prompts
from trl_plugins.api.engines import check_engine_support, engine_of
from trl_plugins.runtime.checkpoints import (
    PLUGIN_STATE_FILE,
    disk_full_error,
    foreign_entries,
    is_complete_checkpoint,
    is_disk_full,
    last_complete_checkpoint,
    load_plugin_state,
    mark_incomplete,
    save_plugin_state,
)
from trl_plugins.api.collectives import HeldRewardErrors, raise_together
from trl_plugins.runtime.config import PluginGRPOConfig
from trl_plugins.api.contexts import (
    BEHAVIOUR_LOGPS_KEY,
    EXTRA_PREFIX,
    OFFPOLICY_KEY,
    TURN_IDS_KEY,
    AdvantageContext,
    PromptContext,
    RewardContext,
    RolloutContext,
    group_layout,
    masked_sampling_logprobs,
)
from trl_plugins.guards.dataset_guard import check_training_dataset
from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.runtime.generation import SCORING_FAILED, GenerationService
from trl_plugins.runtime.episode_replay import behaviour_logps_tensor
from trl_plugins.runtime.loss import check_loss_type, _global_masked_mean, compute_loss_with_plugins
from trl_plugins.runtime.whole_groups import check_whole_groups
from trl_plugins.runtime.reference import frozen_reference_copy, needs_reference_copy, reference_logprobs
from trl_plugins.runtime.manager import PluginStack, build_plugins
from trl_plugins.runtime.models import resolve_model_name
from trl_plugins.runtime.hidden_states import HiddenStateService
from trl_plugins.runtime.policy_probe import PolicyProbe
from trl_plugins.runtime.replay_update import ReplayUpdate
from trl_plugins.runtime.refill import REJECT_HOOK, RefillStage, zero_group_advantages
from trl_plugins.guards.rewards_guard import check_reward_columns, guard_reward_funcs
from trl_plugins.api.services import RunInfo, StageServices, gather_padded
from trl_plugins.api.success import RewardColumns, check_success_columns, is_placeholder, weighted_nansum
from trl_plugins.runtime.token_temperature import TemperatureRule, token_temperature_generation
from trl_plugins.guards.tool_guard import ResetGuard, ToolGuard, ToolPolicy
from trl_plugins.runtime.trl_seam import TrlSeamTrainer
from trl_plugins.api.turns import (
    TurnStructure,
    build_turn_structure,
    environment_call_rewards,
    single_turn,
    turn_ids_tensor,
    turn_rewards_tensor,
)

SAMPLING_HOOKS = ("trl_plugins_generation_prompts", "trl_plugins_after_generation")
LOSS_HOOKS = ("trl_plugins_loss_advantages", "trl_plugins_loss")


@dataclass
class _BatchState:
    """What the stages of one generation batch share (local rows unless said otherwise)."""

    inputs: list[dict]
    mode: str
    offpolicy: list[list[bool]] | None = None
    prompt_swapped: list[bool] | None = None
    annotations: list[dict] | None = None
    rewards_per_func: torch.Tensor | None = None
    policy_stats: dict = field(default_factory=dict)
    refill: Any = None  # the RefillOutcome of this batch (refill plugins only)
    turns: list[TurnStructure] | None = None
    behaviour: dict = field(default_factory=dict)  # local row -> behaviour log-probs of a replayed tool episode


class _StepEndCallback(TrainerCallback):
    def __init__(self, trainer: PluginGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.replay_update.run_if_due()  # rows a plugin scheduled for after this batch's optimizer steps
        self.trainer.plugin_stack.call("trl_plugins_on_step_end", trainer=self.trainer, step=state.global_step)


class _NothingLeft(Exception):
    """Raised by :class:`_NothingLeftToTrain` at ``on_train_begin``; caught by ``PluginGRPOTrainer.train``."""


class _NothingLeftToTrain(TrainerCallback):
    """A run resumed from a checkpoint already at ``max_steps`` (its final one) trains no further step.

    Transformers fast-forwards the dataloader past the trained batches and then runs the next step before it looks at
    ``max_steps`` again, so such a resume trained -- and saved -- one step past it. At ``on_train_begin`` the model,
    optimizer and state are the checkpoint's and ``max_steps`` is this run's: when nothing is left, the loop is left
    there (:class:`_NothingLeft`, caught by ``train``) -- no generation, no optimizer step, no save.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise _NothingLeft(state.global_step, state.max_steps)


class PluginGRPOTrainer(TrlSeamTrainer):
    """[`~trl.GRPOTrainer`] whose sampling, reward, advantage and loss stages run the enabled plugins.

    Takes exactly GRPOTrainer's arguments. ``args`` should be a :class:`~trl_plugins.PluginGRPOConfig`; a
    plain ``GRPOConfig`` is accepted and means "no plugins".
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, **kwargs):
        uses_tools = bool(kwargs.get("tools")) or kwargs.get("environment_factory") is not None
        if isinstance(model, str):  # builtin:tiny / builtin:smollm2, or one clear error for a name nothing can load
            builtin = model.startswith("builtin:")
            model, tokenizer = resolve_model_name(model, args)
            if tokenizer is not None and kwargs.get("processing_class") is None:
                kwargs["processing_class"] = tokenizer
            if builtin and uses_tools:  # the built-in models ship no tool-calling chat template
                from trl_plugins.runtime.models import enable_tool_calling

                if kwargs.get("processing_class") is None:
                    from transformers import AutoTokenizer

                    kwargs["processing_class"] = AutoTokenizer.from_pretrained(model)
                enable_tool_calling(kwargs["processing_class"])
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = PluginGRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        names = getattr(args, "plugins", []) or []
        stack = build_plugins(names, getattr(args, "plugin_config", None))
        if uses_tools:
            stack.check_multi_turn()
        image_prompts = has_image_prompts(train_dataset) or has_image_prompts(kwargs.get("eval_dataset"))
        if image_prompts:
            stack.check_image_inputs()
        user_reward_weights = args.reward_weights
        try:
            reward_funcs = self._with_plugin_rewards(stack, reward_funcs, args)
            train_dataset = self._plugin_train_dataset(stack, train_dataset, args)
            check_training_dataset(train_dataset, environment_owned=kwargs.get("environment_factory") is not None)
            self._check_columns(stack, train_dataset)
            check_reward_columns(reward_funcs, train_dataset)
            # NaN / inf rewards: an error naming function, row, value; held until every process reached the gather
            #: Reward-function errors held until every process reached the next collective (then raised together).
            self.held_reward_errors = HeldRewardErrors()
            reward_funcs = guard_reward_funcs(reward_funcs, self.held_reward_errors)
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        finally:  # TRL reads the extended weights once (self.reward_weights); the config can build another trainer
            args.reward_weights = user_reward_weights
        if getattr(self, "environment_factories", None) is not None and not self.tools:
            names = [getattr(f, "__name__", repr(f)) for f in self.environment_factories.values()]
            raise PluginConfigError(
                f"environment_factory {names}: its environments have no tool method (a public method other than reset "
                "/ get_reward, with type hints and a Google-style docstring) and no tools= were given. TRL exposes those "
                "methods as the model's tools, so every rollout would be single-turn without a word. Add a tool method, "
                "or leave environment_factory out for single-turn training."
            )
        self.plugin_stack: PluginStack = stack
        #: The prompts carry images (a dataset with TRL's image column): the services that run the policy on token ids
        #: alone refuse (:func:`trl_plugins.runtime.generation.check_text_only`).
        self.image_prompts: bool = image_prompts
        self.add_callback(_NothingLeftToTrain())
        #: The engine this run trains under ("single", "ddp", "fsdp1", "fsdp2", "zero2", "zero3"; trl_plugins.api.engines).
        self.engine: str = engine_of(self.accelerator)
        check_engine_support(list(stack), self.engine)
        self.generation_service = GenerationService(self)
        #: No-grad forwards of the current policy for the stage contexts (:mod:`trl_plugins.runtime.policy_probe`).
        self.policy_probe = PolicyProbe(self)
        #: Rows plugins scheduled for a replay update after their batch's optimizer steps
        #: (:mod:`trl_plugins.runtime.replay_update`).
        self.replay_update = ReplayUpdate(self)
        #: What stage contexts (and plugin code running outside one, e.g. a plugin's reward function reading it in
        #: ``trl_plugins_configure``) may ask of the run: tokenizer, collectives, no-grad policy forwards, metrics.
        self.plugin_services: StageServices = self._build_plugin_services()
        self._pbatch: _BatchState | None = None
        self._per_row_generation = False
        #: Per-token sampling temperature rule (:meth:`set_token_temperature`); None = TRL's own sampling.
        self._token_temperature: TemperatureRule | None = None
        #: Retries, timeout and result checks of tool calls; a tool failing every attempt stops every process together.
        self._tool_guard = ToolGuard(ToolPolicy.from_args(args))
        #: An environment's reset raising for a row: held, then raised on every process together (generate_rollouts).
        self._reset_guard = ResetGuard()
        #: Whether a plugin runs at the sampling stage (prompt or after-generation hooks).
        self.uses_sampling_stage = any(stack.has(h) for h in SAMPLING_HOOKS)
        self._uses_plugin_loss = self.uses_sampling_stage or any(stack.has(h) for h in LOSS_HOOKS)
        if self._uses_plugin_loss:
            check_loss_type(self.loss_type)
        stack.check_loss_type(self.loss_type)
        if stack.needs_whole_groups:  # loss plugins comparing a group's rows: groups, not rows, are shuffled
            check_whole_groups([p.name for p in stack if p.needs_whole_groups], args, self.num_generations,
                               self.num_generations_eval)
            self.whole_groups = self.num_generations
        #: The refill stage (plugins rejecting whole groups: ``trl_plugins_reject_groups``), else None.
        self.refill_stage: RefillStage | None = RefillStage(self) if stack.has(REJECT_HOOK) else None
        #: Frozen copy of the initial policy for plugins needing the reference (full fine-tuning with beta=0 only).
        self.reference_copy = None
        if needs_reference_copy(self, list(stack)):
            self.reference_copy = frozen_reference_copy(self, list(stack))
        if stack:
            self.add_callback(_StepEndCallback(self))
            self._configure_plugins_together(stack, args)
            check_success_columns(list(stack), list(self.reward_func_names),
                                  [is_placeholder(f) for f in self.reward_funcs])

    # ------------------------------------------------------------------------------------------ construction
    def _configure_plugins_together(self, stack: PluginStack, args: Any) -> None:
        """Each plugin's ``trl_plugins_configure``; with several processes a plugin failing on one of them only (a
        teacher endpoint probe that timed out there, a file missing on one node) raises on every process together
        (one gathered flag after each plugin), so no process goes on alone into the next collective."""
        acc = self.accelerator

        def after_each(plugin_name: str, error: BaseException | None) -> None:
            if acc.num_processes > 1:
                raise_together(acc.gather, acc.device, f"plugin {plugin_name!r} (trl_plugins_configure)", error)
            elif error is not None:
                raise error

        stack.call_each("trl_plugins_configure", after_each, trainer=self, args=args)

    @staticmethod
    def _with_plugin_rewards(stack: PluginStack, reward_funcs: Any, args: Any) -> Any:
        """Append plugin reward functions (named columns) and extend ``reward_weights`` accordingly."""
        extra = []
        for plugin, funcs in stack.call("trl_plugins_reward_functions", args=args):
            extra.extend(funcs)
        if not extra:
            return reward_funcs
        funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs])
        if args.reward_weights is not None:
            if len(args.reward_weights) != len(funcs):
                raise PluginConfigError(
                    f"reward_weights has {len(args.reward_weights)} entries for {len(funcs)} reward functions "
                    "(plugin reward functions are weighted separately via their `reward_weight` attribute)."
                )
            args.reward_weights = list(args.reward_weights) + [float(getattr(f, "reward_weight", 1.0)) for f in extra]
        elif any(getattr(f, "reward_weight", 1.0) != 1.0 for f in extra):
            args.reward_weights = [1.0] * len(funcs) + [float(getattr(f, "reward_weight", 1.0)) for f in extra]
        return funcs + extra

    @staticmethod
    def _check_columns(stack: PluginStack, dataset: Any) -> None:
        """Refuse a dataset that lacks a column a plugin needs (named, with the columns it has)."""
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            return
        if isinstance(columns, dict):  # DatasetDict
            columns = next(iter(columns.values()))
        for plugin in stack:
            for column in plugin.required_columns():
                if column not in columns:
                    raise PluginConfigError(
                        f"Plugin {plugin.name!r} needs the dataset column {column!r}, which the training dataset "
                        f"does not have (columns: {', '.join(columns)})."
                    )

    def _build_plugin_services(self) -> StageServices:
        """The real :class:`~trl_plugins.api.services.StageServices` of this trainer (batch-independent members)."""
        processing_class = self.processing_class
        return StageServices(
            run=self._run_info,
            metric_sink=self._plugin_metric_sink,
            tokenizer=getattr(processing_class, "tokenizer", processing_class),
            tokenize_prompts=self.generation_service.tokenize,
            decode=self.decode_completion,
            score=self.score_locally,
            gather=lambda tensor: self.accelerator.gather(tensor),  # late-bound: the accelerator may be wrapped
            gather_object=gather_object,
            policy_entropies=self.policy_probe.entropies,
            policy_features=self.policy_probe.features,
            reference_features=functools.partial(self.policy_probe.features, reference=True),
            policy_logprobs=self.policy_probe.logprobs,
            masked_mean=functools.partial(_global_masked_mean, self),
        )

    def _run_info(self) -> RunInfo:
        """The run's settings as of now (``ctx.run``)."""
        max_steps = int(getattr(self.state, "max_steps", 0) or 0)
        return RunInfo(
            max_completion_length=self.max_completion_length,
            max_steps=max_steps if max_steps > 0 else max(int(self.args.max_steps), 0),
            reward_func_names=tuple(self.reward_func_names),
            num_processes=self.accelerator.num_processes,
            device=str(self.accelerator.device),
            mode="train" if self.model.training else "eval",
            placeholder_columns=tuple(is_placeholder(f) for f in self.reward_funcs),
            learning_rate=self._current_learning_rate(),
        )

    def _current_learning_rate(self) -> float:
        """The learning rate of the next optimizer step: the scheduler's last value (``args.learning_rate`` before the
        scheduler exists)."""
        scheduler = getattr(self, "lr_scheduler", None)
        if scheduler is not None:
            return float(scheduler.get_last_lr()[0])
        return float(self.args.learning_rate)

    @property
    def global_step(self) -> int:
        """Optimizer steps done so far (``state.global_step``), for a plugin that restores a schedule when the training
        dataloader is built again on resume (``trl_plugins_train_sampler`` carries no step)."""
        return int(self.state.global_step)

    def set_generation_length_cap(self, cap: int | None) -> int:
        """Cap the tokens generated per completion from the next generation on (HF generation and vLLM alike), for
        plugins that schedule the rollout length (call it from ``trl_plugins_configure``, ``trl_plugins_train_sampler``
        or ``trl_plugins_on_step_end``). ``cap`` is clamped to ``[1, max_completion_length]``; None restores
        ``max_completion_length``. Padding, the loss normalisers and the in-step generation service keep
        ``max_completion_length``. Returns the cap in force."""
        limit = self.max_completion_length if cap is None else max(1, min(int(cap), self.max_completion_length))
        if self.use_vllm:
            self.vllm_generation.max_completion_length = limit
        else:
            self.generation_config.max_new_tokens = limit
        return limit

    def set_token_temperature(self, rule: TemperatureRule | None) -> None:
        """Sample with a per-token temperature from the next generation on: ``rule(logits)`` maps one decoding step's
        (B, V) logits to (B,) temperatures, replacing ``temperature`` (top-k / top-p / min-p still apply after it;
        :mod:`trl_plugins.runtime.token_temperature`). Transformers generation only (vLLM samples a request at one
        temperature: refused); None restores TRL's sampling. The loss keeps the run's temperature. Call it from
        ``trl_plugins_configure``."""
        if rule is not None and (self.use_vllm or getattr(self, "use_transformers_continuous_batching", False)):
            raise PluginConfigError(
                "A per-token sampling temperature (set_token_temperature) needs TRL's transformers generate; vLLM "
                "(and transformers' continuous batching) sample every token of a request at one temperature. Set "
                "use_vllm=False or turn the plugin option off."
            )
        self._token_temperature = rule

    def _plugin_metric_sink(self, key: str, value: float) -> None:
        self.record_metric("train" if self.model.training else "eval", key, value)

    # ------------------------------------------------------------------------------------------ batch
    def generate_and_score_completions(self, inputs):
        if getattr(self, "environment_factories", None) is not None and hasattr(self, "_reset_guard"):
            self.environment_factories = self._reset_guard.guard(self.environment_factories, self.environment_pool)
        if not self.plugin_stack:
            return super().generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        self._pbatch = _BatchState(inputs=inputs, mode=mode)
        try:
            output = super().generate_and_score_completions(inputs)
            output = self._finish_batch(output)
        finally:
            self._pbatch = None
            self._per_row_generation = False
        return output

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Rows of a group with different prompts: one completion per row (vLLM server mode de-duplicates otherwise)
        if self._per_row_generation:
            num_generations = 1
        rule = self._token_temperature
        with token_temperature_generation(self, rule) if rule is not None else contextlib.nullcontext():
            return super().generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)

    def _trl_generation_round(self, prompts: list) -> tuple:
        """TRL's own generation of ``prompts`` (its tool loop included): TRL's 8-tuple of local rows. Its rows are
        counted as policy rollouts, and their sampled tokens as policy tokens, by the generation service
        (:meth:`GenerationService.count_rollouts`)."""
        generated = super().generate_rollouts(prompts)
        completion_ids, tool_mask = generated[1], generated[2]
        sampled = (sum(sum(m) for m in tool_mask) if tool_mask is not None  # tool responses are not sampled
                   else sum(len(c) for c in completion_ids))
        self.generation_service.count_rollouts(len(completion_ids), sampled)
        return generated

    def generate_rollouts(self, prompts: list):
        """The sampling stage (:meth:`_generate_sampling_stage`), then the refill rounds when a plugin rejects groups
        (:mod:`trl_plugins.runtime.refill`; edits TRL's ``inputs`` and ``prompts`` lists in place for replaced rows).

        An instance built without ``__init__`` (as TRL's own unit tests of ``_generate`` build one) has no plugin
        stack: it generates exactly as TRL does."""
        if getattr(self, "plugin_stack", None) is None:
            return super().generate_rollouts(prompts)
        self._raise_reset_errors(len(prompts))
        generated = self._generate_sampling_stage(prompts)
        state = self._pbatch
        if self.refill_stage is not None and state is not None and state.mode == "train":
            generated, state.refill = self.refill_stage.run(state, prompts, generated)
        return generated

    def _raise_reset_errors(self, local_rows: int) -> None:
        """An environment ``reset`` that raised for a row of this batch (held by the reset guard): raised here, before
        generation, on every process together (one gathered flag when the run has environments)."""
        if getattr(self, "environment_factories", None) is None:
            return
        acc = self.accelerator
        error = self._reset_guard.take(getattr(self, "environments", None), acc.process_index * local_rows,
                                       acc.process_index)
        if acc.num_processes > 1:
            raise_together(acc.gather, acc.device, "environment reset", error)
        elif error is not None:
            raise error

    def _generate_sampling_stage(self, prompts: list):
        """TRL's generation (``generate_rollouts``) with the sampling stage: prompt hooks, generation, after-generation
        hooks.

        Steps: :meth:`_run_prompt_hooks` (per-row generation/training prompts, deferred rows),
        :meth:`_sample_first_round` (TRL's generation on the same path on every process),
        :meth:`_rollout_context` (the generated batch under the training prompts), :meth:`_run_after_generation_hooks`
        (row edits, in-step generation), :meth:`_finish_sampling` (provenance, NaN sampling log-probs, TRL's tuple).
        """
        state = self._pbatch
        if state is None or state.mode != "train" or not self.uses_sampling_stage:
            if state is not None and self.uses_sampling_stage:  # eval rows: blank annotations keep the table aligned
                self.log_completion_extra("plugin_annotations", [""] * len(prompts))
            generated = self._trl_generation_round(prompts)
            if state is not None and self.tools:
                state.turns = self._turn_structures(generated[1], generated[2], generated[3])
            return generated
        pctx = self._run_prompt_hooks(state, prompts)
        generated = self._sample_first_round(pctx)
        rctx = self._rollout_context(state, pctx, generated)
        extra_rollouts = self._run_after_generation_hooks(rctx)
        return self._finish_sampling(state, rctx, generated, extra_rollouts)

    def _run_prompt_hooks(self, state: _BatchState, prompts: list) -> PromptContext:
        """The ``generation_prompts`` hooks on the local rows (B = len(prompts), each prompt repeated G times)."""
        B, G = len(prompts), self.num_generations
        global_index, group_ids, index_in_group = group_layout(self.accelerator.process_index, B, G)
        pctx = PromptContext(
            rows=state.inputs,
            prompts=prompts,
            generation_prompts=list(prompts),
            training_prompts=list(prompts),
            global_index=global_index,
            group_ids=group_ids,
            index_in_group=index_in_group,
            num_generations=G,
            step=self.state.global_step,
            annotations=[{} for _ in range(B)],
            mode=state.mode,
            services=self.plugin_services,
        )
        self.plugin_stack.call("trl_plugins_generation_prompts", pctx)
        if not pctx.deferred:
            pctx.deferred = [False] * B
        return pctx

    def _sample_first_round(self, pctx: PromptContext) -> tuple:
        """TRL's generation of the generation prompts (deferred rows left out); TRL's 8-tuple of local rows.

        Every process must take the same generation path (vLLM server mode gathers across processes): one (1,)
        code per process is gathered, bit 0 = prompts differ within a group (one completion per row), bit 1 = rows
        deferred to a later round.
        """
        differs_in_group = any(g != p for g, p in zip(pctx.generation_prompts, pctx.prompts))
        code = int(differs_in_group) | (2 if any(pctx.deferred) else 0)
        codes = self.accelerator.gather(torch.tensor([code], device=self.accelerator.device))
        self._per_row_generation = bool((codes != 0).any().item())
        if bool(((codes & 2) != 0).any().item()):
            return self._generate_first_round(pctx.generation_prompts, pctx.deferred)
        return self._trl_generation_round(pctx.generation_prompts)

    def _rollout_context(self, state: _BatchState, pctx: PromptContext, generated: tuple) -> RolloutContext:
        """The generated rows as a :class:`RolloutContext`; rows whose training prompt differs from their generation
        prompt (prompt swap) get the training prompt's ids."""
        prompt_ids, completion_ids, _tool_mask, completions, logprobs = generated[:5]
        prompt_ids = [list(ids) for ids in prompt_ids]
        swapped = [g != t for g, t in zip(pctx.generation_prompts, pctx.training_prompts)]
        swapped_rows = [i for i, s in enumerate(swapped) if s]
        if swapped_rows:
            train_ids = self.generation_service.tokenize([pctx.training_prompts[i] for i in swapped_rows])
            for i, ids in zip(swapped_rows, train_ids):
                prompt_ids[i] = ids
        return RolloutContext(
            rows=state.inputs,
            prompts=pctx.prompts,
            training_prompts=list(pctx.training_prompts),
            prompt_ids=prompt_ids,
            completion_ids=[list(c) for c in completion_ids],
            completions=list(completions),
            sampling_logprobs=None if logprobs is None else [list(lp) for lp in logprobs],
            offpolicy=[[False] * len(c) for c in completion_ids],
            prompt_swapped=swapped,
            global_index=pctx.global_index,
            group_ids=pctx.group_ids,
            index_in_group=pctx.index_in_group,
            num_generations=pctx.num_generations,
            step=self.state.global_step,
            annotations=pctx.annotations,
            service=self.generation_service,
            deferred=pctx.deferred if any(pctx.deferred) else [],
            mode=state.mode,
            services=self.plugin_services,
            turns=self._turn_structures(completion_ids, _tool_mask, completions) if self.tools else [],
        )

    def _turn_structures(self, completion_ids: list, tool_mask: list | None, completions: list) -> list[TurnStructure]:
        """The :class:`~trl_plugins.api.turns.TurnStructure` of each local completion (tool rollouts), with the per-call
        rewards of the row's environment when it keeps a ``turn_rewards`` list."""
        environments = self.environments or []
        return [
            self.turn_structure(ids, None if tool_mask is None else tool_mask[i], completions[i],
                                environments[i] if i < len(environments) else None,
                                self.accelerator.process_index * len(completion_ids) + i)
            for i, ids in enumerate(completion_ids)
        ]

    def turn_structure(self, completion_ids: list[int], tool_mask: list[int] | None, messages: Any, environment: Any,
                       row: int) -> TurnStructure:
        """The :class:`~trl_plugins.api.turns.TurnStructure` of one completion of global row ``row``, with the per-call
        rewards ``environment`` keeps (a bad entry is held and raised on every process together, before the gather of
        turns)."""
        tokenizer = self.text_tokenizer
        fields = (getattr(tokenizer, "response_template", None) or {}).get("fields", {})
        marker = fields.get("tool_calls", {}).get("open") or "<tool_call>"
        rewards, problem = environment_call_rewards(environment, row)
        if problem is not None and getattr(self, "_turn_rewards_problem", None) is None:
            self._turn_rewards_problem = problem
        return build_turn_structure(list(completion_ids), tool_mask, messages, rewards,
                                    lambda t: tokenizer.decode([t]), marker)

    def tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's tool loop with every tool call guarded (:mod:`trl_plugins.guards.tool_guard`): the model's bad calls go
        back to it as TRL does; a tool that raises, hangs or returns garbage is retried and, failing every attempt,
        stops every process together with an error naming the tool and the row."""
        B = len(prompts)
        start = self.accelerator.process_index * B
        guard = self._tool_guard
        guard.begin_batch()
        with self.copied_tool_dicts() as (sync_dicts, async_dicts):
            guard.wrap_row_dicts(sync_dicts, async_dicts, list(range(start, start + B)))
            result = super().tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        if self.tool_loop_lockstep is not None:  # the tool-episode seam: wait for the other processes' tool rounds
            self.tool_loop_lockstep.drain()
        error = guard.take() if guard.policy.failure == "raise" else None
        if self.accelerator.num_processes > 1:  # one gathered flag: every process raises together
            raise_together(self.accelerator.gather, self.accelerator.device, "tool calls", error)
        elif error is not None:
            raise error
        return result

    #: The lockstep of a running tool-episode continuation (:mod:`trl_plugins.runtime.tool_episodes`), None otherwise:
    #: :meth:`tool_call_loop` drains it before its own collective.
    tool_loop_lockstep: Any = None

    def raise_reset_errors_together(self, environments: list) -> None:
        """An environment ``reset`` that raised (held by the reset guard) for one of ``environments`` (instances made
        outside TRL's batch, e.g. by the tool-episode seam): raised on every process together."""
        acc = self.accelerator
        error = self._reset_guard.take(environments, 0, acc.process_index) if hasattr(self, "_reset_guard") else None
        if acc.num_processes > 1:
            raise_together(acc.gather, acc.device, "environment reset", error)
        elif error is not None:
            raise error

    def _run_after_generation_hooks(self, rctx: RolloutContext) -> float:
        """The ``after_generation`` hooks; returns the extra rollouts of the batch, summed over processes.

        With several processes ``ctx.score``'s reward errors are held until the next framework collective (the
        generation service's, or the extra-rollouts count here), where every process raises together. A row
        deferred at the prompt stage and left unfilled is an error.
        """
        self.generation_service.begin_batch(rctx.prompt_ids[0])
        held = self.held_reward_errors
        with held.holding_while(self.accelerator.num_processes > 1):
            self.plugin_stack.call("trl_plugins_after_generation", rctx)
        # every process runs this gather once per batch, like TRL's gathered metrics
        used = held.gather_with_flag(self.accelerator.gather, [self.generation_service.used_this_batch],
                                     self.accelerator.device, SCORING_FAILED)
        unfilled = [i for i, d in enumerate(rctx.deferred) if d and i not in rctx.changed]
        if unfilled:
            raise PluginError(
                f"Rows {[rctx.global_index[i] for i in unfilled]} were deferred to a later generation round "
                "(PromptContext.defer) but no after_generation hook filled them with replace_row."
            )
        return float(used.sum().item())

    def _finish_sampling(self, state: _BatchState, rctx: RolloutContext, generated: tuple, extra_rollouts: float):
        """Record provenance for the later stages, apply the NaN sampling-log-prob rule, return TRL's 8-tuple."""
        tool_mask, extra_fields, images, tool_images = generated[2], generated[5], generated[6], generated[7]
        episodes = rctx.episodes  # rows replaced by a tool-episode continuation keep its turns and environment
        if tool_mask is not None:
            for i in rctx.changed:
                tool_mask[i] = list(episodes[i].tool_mask) if i in episodes else [1] * len(rctx.completion_ids[i])
        if rctx.turns:
            for i in rctx.changed:  # a replaced row is one assistant turn, unless a tool episode replaced it
                rctx.turns[i] = episodes[i].turns if i in episodes else single_turn(len(rctx.completion_ids[i]))
            state.turns = rctx.turns
        for i, episode in episodes.items():
            if self.environments is not None and episode.environment is not None and i < len(self.environments):
                self.environments[i] = episode.environment  # TRL's reward pass reads the row's environment
        if rctx.sampling_logprobs is not None:  # NaN => TRL's vLLM IS correction leaves the token alone
            for i, lps in enumerate(rctx.sampling_logprobs):
                rctx.sampling_logprobs[i] = masked_sampling_logprobs(lps, rctx.offpolicy[i], rctx.prompt_swapped[i])
        state.offpolicy, state.prompt_swapped, state.annotations = rctx.offpolicy, rctx.prompt_swapped, rctx.annotations
        state.behaviour = {i: rctx.behaviour_logprobs[i] for i in rctx.behaviour_logprobs if not any(rctx.offpolicy[i])}
        self.log_completion_extra("plugin_annotations", [_format_annotation(a) for a in rctx.annotations])
        self.record_metric("train", "plugins/framework/extra_rollouts", extra_rollouts)
        return (
            rctx.prompt_ids,
            rctx.completion_ids,
            tool_mask,
            rctx.completions,
            rctx.sampling_logprobs,
            extra_fields,
            images,
            tool_images,
        )

    @staticmethod
    def _plugin_train_dataset(stack: PluginStack, dataset: Any, args: Any) -> Any:
        """The training dataset after the plugins' ``trl_plugins_train_dataset`` transforms (chained in order)."""
        import datasets
        from torch.utils.data import IterableDataset

        iterable = isinstance(dataset, (IterableDataset, datasets.IterableDataset))
        if dataset is None or iterable or not stack.has("trl_plugins_train_dataset"):
            return dataset
        for plugin in stack.implementers("trl_plugins_train_dataset"):
            replacement = plugin.trl_plugins_train_dataset(dataset=dataset, args=args)
            if replacement is not None:
                dataset = replacement
        return dataset

    def get_train_sampler(self, dataset=None):
        sampler = super().get_train_sampler(dataset)
        stack = getattr(self, "plugin_stack", None)
        if stack is None or not stack.has("trl_plugins_train_sampler"):
            return sampler
        dataset = self.train_dataset if dataset is None else dataset
        for plugin in stack.implementers("trl_plugins_train_sampler"):  # chain: each sees the previous choice
            replacement = plugin.trl_plugins_train_sampler(trainer=self, sampler=sampler, dataset=dataset)
            if replacement is not None:
                sampler = replacement
        return sampler

    def _generate_first_round(self, prompts: list, deferred: list[bool]):
        """TRL's generation on the rows that are not deferred; deferred rows get an empty completion.

        Collective-safe: every process generates the same number of rows (padded with copies of one of its prompts,
        whose results are dropped), as vLLM server mode and ZeRO-3/FSDP require. TRL's length metrics of this round
        count the padding rows (only when processes hold different numbers of first-round rows).
        """
        if self.rollout_func is not None or self.tools:
            raise PluginConfigError(
                "A plugin deferred rows to a later generation round (PromptContext.defer), which is not supported "
                "with rollout_func or tools (with tools, such plugins are refused at construction: Plugin.multi_turn)."
            )
        B = len(prompts)
        keep = [i for i in range(B) if not deferred[i]]
        counts = self.accelerator.gather(torch.tensor([len(keep)], device=self.accelerator.device))
        width = int(counts.max().item())
        if width == 0:
            raise PluginError("Every row of the generation batch was deferred (PromptContext.defer); nothing to sample.")
        sub = [prompts[i] for i in keep]
        sub += [sub[0] if sub else prompts[0]] * (width - len(keep))
        (p_ids, c_ids, _tool_mask, comps, lps, extra_fields, images, tool_images) = self._trl_generation_round(sub)
        if images is not None or extra_fields:
            raise PluginConfigError("Deferred generation rows (PromptContext.defer) support text-only prompts.")
        prompt_ids, completion_ids, completions = [None] * B, [None] * B, [None] * B
        logprobs = None if lps is None else [None] * B
        for j, i in enumerate(keep):
            prompt_ids[i], completion_ids[i], completions[i] = list(p_ids[j]), list(c_ids[j]), comps[j]
            if logprobs is not None:
                logprobs[i] = list(lps[j])
        rest = [i for i in range(B) if deferred[i]]
        for i, ids in zip(rest, self.generation_service.tokenize([prompts[i] for i in rest])):
            prompt_ids[i], completion_ids[i] = ids, []
            completions[i] = self.decode_completion([], prompts[i])
            if logprobs is not None:
                logprobs[i] = []
        return prompt_ids, completion_ids, None, completions, logprobs, {}, None, tool_images

    def decode_completion(self, completion_ids: list[int], prompt: Any) -> Any:
        """``completion_ids`` decoded in the format TRL gives reward functions for ``prompt`` (a string, or one
        assistant message for a conversational prompt)."""
        text = self.processing_class.batch_decode([completion_ids], skip_special_tokens=True)[0]
        if is_conversational({"prompt": prompt}):
            return [{"role": "assistant", "content": text}]
        return text

    def score_locally(
        self, rows: list[dict], prompts: list, completions: list, completion_ids: list[list[int]] | None = None
    ) -> RewardColumns:
        """Every reward function's value for candidate completions on this process only (no gather, no logging):
        the (n, K) matrix, NaN where a function returned None and in placeholder columns (filled at the reward stage,
        so not run here); ``RolloutContext.score`` takes TRL's weighted nansum of it. ``completion_ids``: the rows'
        generated ids (default: the completions re-tokenized)."""
        device = self.accelerator.device
        placeholders = tuple(is_placeholder(f) for f in self.reward_funcs)
        if not rows:
            return RewardColumns(torch.zeros(0, len(self.reward_funcs), device=device), list(self.reward_func_names),
                                 self.reward_weights.to(device), placeholders)
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [r[k] for r in rows] for k in keys}
        kwargs.update(trainer_state=self.state, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
        if completion_ids is None:
            completion_ids = [
                self.processing_class(text=c if isinstance(c, str) else c[-1]["content"], add_special_tokens=False)[
                    "input_ids"
                ]
                for c in completions
            ]
        columns = []
        for func, proc, placeholder in zip(self.reward_funcs, self.reward_processing_classes, placeholders):
            if placeholder:
                values = [float("nan")] * len(rows)
            elif isinstance(func, nn.Module):
                if is_conversational({"prompt": prompts[0]}):
                    texts = [
                        apply_chat_template({"messages": p + c}, proc, **self.chat_template_kwargs)["text"]
                        for p, c in zip(prompts, completions)
                    ]
                else:
                    texts = [p + c for p, c in zip(prompts, completions)]
                enc = proc(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
                enc = {k: v.to(device) for k, v in enc.items()}
                with torch.inference_mode():
                    values = func(**enc).logits[:, 0].tolist()
            else:
                out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
                if inspect.isawaitable(out):
                    out = asyncio.run_coroutine_threadsafe(_await(out), self.async_loop).result()
                values = [float("nan") if v is None else float(v) for v in out]
            columns.append(torch.tensor(values, dtype=torch.float32, device=device))
        return RewardColumns(torch.stack(columns, dim=1), list(self.reward_func_names), self.reward_weights.to(device),
                             placeholders)

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        state = self._pbatch
        if state is not None and state.refill is not None:  # the refill stage scored the final batch already
            rewards_per_func = state.refill.rewards_per_func
        else:
            rewards_per_func = self.gathered_rewards(inputs, prompts, completions, completion_ids_list)
        if state is None:
            return rewards_per_func
        if self.plugin_stack.has("trl_plugins_transform_rewards"):
            G = self.num_generations if state.mode == "train" else self.num_generations_eval
            N = rewards_per_func.size(0)
            rows = torch.arange(N, device=rewards_per_func.device)
            ctx = RewardContext(
                rewards_per_func=rewards_per_func,
                reward_func_names=list(self.reward_func_names),
                reward_weights=self.reward_weights.to(rewards_per_func.device),
                group_ids=rows // G,
                index_in_group=rows % G,
                num_generations=G,
                local_rows=inputs,
                local_prompts=prompts,
                local_completions=completions,
                process_slice=self._process_slice(len(prompts)),
                step=self.state.global_step,
                local_completion_ids=[list(ids) for ids in completion_ids_list],
                mode=state.mode,
                services=self.plugin_services,
                local_turns=list(state.turns or []),
                local_annotations=list(state.annotations or []),
            )
            self.plugin_stack.call("trl_plugins_transform_rewards", ctx)
            rewards_per_func = ctx.rewards_per_func
        state.rewards_per_func = rewards_per_func
        return rewards_per_func

    def gathered_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """TRL's (N, K) reward matrix; a reward function failing on one process stops every process together.

        With several processes the guards hold their errors (placeholder zeros) until TRL's gather has completed
        everywhere; then one gathered flag decides: the failing process raises its own error, the others a
        ``PluginError`` naming it -- instead of waiting in the gather until the collective's timeout.
        """
        if self.accelerator.num_processes == 1:
            return super().calculate_rewards(inputs, prompts, completions, completion_ids_list)
        held = self.held_reward_errors
        with held.holding_while(True):
            rewards_per_func = super().calculate_rewards(inputs, prompts, completions, completion_ids_list)
        held.gather_with_flag(self.accelerator.gather, [], self.accelerator.device, "reward functions")
        return rewards_per_func

    def _process_slice(self, local_rows: int) -> slice:
        start = self.accelerator.process_index * local_rows
        return slice(start, start + local_rows)

    def _finish_batch(self, output: dict) -> dict:
        """Attach provenance tensors and run the advantage stage on the global batch."""
        state = self._pbatch
        B, T = output["completion_ids"].shape
        device = output["completion_ids"].device
        offpolicy = torch.zeros(B, T, dtype=torch.bool, device=device)
        if state.offpolicy is not None:
            for i, flags in enumerate(state.offpolicy):
                if any(flags):
                    offpolicy[i, : len(flags)] = torch.tensor(flags, dtype=torch.bool, device=device)
        if self._uses_plugin_loss:
            output[OFFPOLICY_KEY] = offpolicy
            if state.behaviour:  # replayed tool episodes: their behaviour log-probs become the old log-probs
                output[BEHAVIOUR_LOGPS_KEY] = behaviour_logps_tensor(state.behaviour, B, T, device)
        if state.turns is not None:  # multi-turn tool rollouts: each token's assistant turn rides to the loss
            output[TURN_IDS_KEY] = turn_ids_tensor(state.turns, T, device)
        if self.plugin_stack.has("trl_plugins_transform_advantages"):
            output = self._run_advantage_stage(output, offpolicy)
        if state.refill is not None and state.refill.zero_advantage_groups:  # refill_at_limit="zero_advantage"
            output["advantages"] = zero_group_advantages(
                output["advantages"], state.refill.zero_advantage_groups, self.num_generations, self._process_slice(B)
            )
        return output

    def _run_advantage_stage(self, output: dict, offpolicy: torch.Tensor) -> dict:
        state = self._pbatch
        acc = self.accelerator
        B = output["completion_ids"].size(0)
        G = self.num_generations if state.mode == "train" else self.num_generations_eval
        rewards_per_func = state.rewards_per_func
        N = rewards_per_func.size(0)
        device = rewards_per_func.device
        rewards = weighted_nansum(rewards_per_func, self.reward_weights)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        lengths = mask.sum(-1).float()
        off_frac = (offpolicy.float() * mask).sum(-1) / lengths.clamp(min=1.0)
        swapped = torch.tensor(state.prompt_swapped or [False] * B, dtype=torch.bool, device=device)
        annotations = state.annotations or [{} for _ in range(B)]
        rows = torch.arange(N, device=device)
        turn_ids = turn_rewards = None
        if TURN_IDS_KEY in output:  # (N, T_max) and (N, U_max), padded across processes
            problem, self._turn_rewards_problem = getattr(self, "_turn_rewards_problem", None), None
            raise_together(acc.gather, device, "environment turn_rewards", problem)
            turn_ids = gather_padded(acc.gather, output[TURN_IDS_KEY], 1, -1)
            turn_rewards = gather_padded(acc.gather, turn_rewards_tensor(state.turns).to(device), 1, float("nan"))
        ctx = AdvantageContext(
            rewards_per_func=rewards_per_func,
            rewards=rewards,
            advantages=acc.gather(output["advantages"]),
            group_ids=rows // G,
            index_in_group=rows % G,
            num_generations=G,
            completion_lengths=acc.gather(lengths),
            offpolicy_fraction=acc.gather(off_frac),
            prompt_swapped=acc.gather(swapped),
            annotations=gather_object(annotations) if acc.num_processes > 1 else annotations,
            process_slice=self._process_slice(B),
            step=self.state.global_step,
            local_completion_ids=output["completion_ids"],
            local_prompt_ids=[ids[m.bool()].tolist() for ids, m in zip(output["prompt_ids"], output["prompt_mask"])],
            local_completion_mask=output["completion_mask"],
            mode=state.mode,
            prompt_keys=None if state.refill is None else state.refill.prompt_keys,
            services=dataclasses.replace(
                self.plugin_services,
                policy_stats=functools.partial(self.policy_probe.stats, output, state.policy_stats),
                completion_mask=lambda: acc.gather(acc.pad_across_processes(mask, dim=1, pad_index=0)),
                reference_logprobs=functools.partial(reference_logprobs, self, output, state.policy_stats),
                hidden_states=(functools.partial(HiddenStateService(self).run, output)
                               if self.plugin_stack.needs_hidden_states else None),
                replay_update=self.replay_update.schedule if state.mode == "train" else None,
            ),
            turn_ids=turn_ids,
            turn_rewards=turn_rewards,
            local_turns=list(state.turns or []),
            local_rows=list(state.inputs),
        )
        self.plugin_stack.call("trl_plugins_transform_advantages", ctx)
        advantages = ctx.advantages[ctx.process_slice]
        if advantages.dim() == 2:
            advantages = advantages[:, : output["completion_ids"].size(1)]
        output["advantages"] = advantages
        if ctx.advantages.dim() == 1:  # the completions table shows the final advantages
            self.replace_logged_advantages(ctx.advantages.tolist())
        for name, tensor in ctx.extras.items():
            output[EXTRA_PREFIX + name] = tensor[ctx.process_slice]
        for name, tensor in ctx.local_extras.items():
            output[EXTRA_PREFIX + name] = tensor
        return output

    # ------------------------------------------------------------------------------------------ loss
    def compute_grpo_loss(self, model, inputs):
        if not self._uses_plugin_loss:
            return super().compute_grpo_loss(model, inputs)
        return compute_loss_with_plugins(self, model, inputs)

    # ------------------------------------------------------------------------------------------ checkpoints
    def plugin_state_dict(self) -> dict:
        """Resumable state of every plugin, plus the framework's rollout counter."""
        state = {"__framework__": {"generation_service": self.generation_service.state_dict(),
                                   "replay_update": self.replay_update.state_dict()}}
        if self.refill_stage is not None:
            state["__framework__"]["refill"] = self.refill_stage.state_dict()
        for plugin, value in self.plugin_stack.call("trl_plugins_state_dict"):
            state[plugin.name] = value
        return state

    def load_plugin_state_dict(self, state: dict) -> None:
        self.generation_service.load_state_dict(state.get("__framework__", {}).get("generation_service", {}))
        self.replay_update.load_state_dict(state.get("__framework__", {}).get("replay_update", {}))
        if self.refill_stage is not None:
            self.refill_stage.load_state_dict(state.get("__framework__", {}).get("refill", {}))
        missing = []
        for plugin in self.plugin_stack.implementers("trl_plugins_load_state_dict"):
            if plugin.name in state:
                plugin.trl_plugins_load_state_dict(state=state[plugin.name])
            else:
                missing.append(plugin.name)
        if missing:
            warnings.warn(
                f"The checkpoint's {PLUGIN_STATE_FILE} holds no state for plugins {missing} (saved by a run without "
                "them): their state starts fresh instead of being restored.",
                stacklevel=2,
            )
        foreign = foreign_entries(state, [p.name for p in self.plugin_stack])
        if foreign:
            warnings.warn(
                f"The checkpoint's {PLUGIN_STATE_FILE} holds state for plugins {foreign}, which this run does not "
                f"enable (plugins={[p.name for p in self.plugin_stack]}): that state is ignored. Enable them to "
                "restore it.",
                stacklevel=2,
            )

    def save_checkpoint(self, model, trial):
        # Plugin state first, written atomically; transformers writes trainer_state.json last, which marks the folder
        # complete (trl_plugins/runtime/checkpoints.py): a run killed at any point of the save leaves a folder that resuming
        # skips, and a hub push of the checkpoint (inside TRL's save) includes the plugin state.
        folder = self.checkpoint_folder(trial)
        if self.args.should_save:
            mark_incomplete(folder)
            if self.plugin_stack:
                save_plugin_state(self.plugin_state_dict(), folder)
        try:
            super().save_checkpoint(model, trial)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            # a full disk while transformers wrote the model / optimizer (torch.save says only "file write failed"):
            # the folder is incomplete (no trainer_state.json) and its partial files only take space -- removed
            removed = False
            if self.args.should_save and os.path.isdir(folder) and not is_complete_checkpoint(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed = not os.path.exists(folder)
            raise disk_full_error(exc, folder, removed) from exc

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest *complete* checkpoint of ``output_dir``
        (folders left by a run stopped while saving are skipped with a warning)."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == "true" and not os.path.isdir(
            resume_from_checkpoint
        ):
            resume_from_checkpoint = True
        self._check_output_dir_writable()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise PluginError(
                    f"resume_from_checkpoint=True, but output_dir {self.args.output_dir!r} holds no complete "
                    "checkpoint-N folder to resume from."
                )
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        except _NothingLeft as done:
            from transformers.trainer_utils import TrainOutput

            step, max_steps = done.args
            self.is_in_train = False
            warnings.warn(
                f"Resumed at step {step}, which is this run's max_steps={max_steps}: nothing is left to train (the "
                "model and state are the checkpoint's). Raise max_steps (or num_train_epochs) to train further.",
                stacklevel=2,
            )
            return TrainOutput(step, 0.0, {"train_runtime": 0.0})

    def _check_output_dir_writable(self) -> None:
        """Before the first step: the saving process creates ``output_dir`` and writes (then removes) a probe file in
        it, so a folder that cannot be written (read-only mount, a file in its path, no permission -- also for root,
        which ``os.access`` does not reveal) is refused now, on every process together, not at the first save."""
        error = None
        if self.args.should_save and self.args.output_dir is not None:
            import tempfile

            try:
                os.makedirs(self.args.output_dir, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.args.output_dir, prefix=".trl_plugins-write-probe-") as probe:
                    probe.write(b"ok")
                    probe.flush()
            except OSError as exc:
                error = PluginConfigError(
                    f"output_dir {self.args.output_dir!r} cannot be written ({type(exc).__name__}: {exc}): checkpoints, "
                    "logs and the final model go there, so the run is refused before its first step. Choose a "
                    "writable folder."
                )
        if self.accelerator.num_processes > 1:
            raise_together(self.accelerator.gather, self.accelerator.device, "output_dir check", error)
        elif error is not None:
            raise error

    def load_optimizer_and_scheduler(self, checkpoint):
        super().load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.plugin_stack:
            path = os.path.join(checkpoint, PLUGIN_STATE_FILE)
            if os.path.exists(path):
                self.load_plugin_state_dict(load_plugin_state(path))
            elif self.plugin_stack.has("trl_plugins_load_state_dict"):
                names = [p.name for p in self.plugin_stack.implementers("trl_plugins_load_state_dict")]
                warnings.warn(
                    f"Checkpoint {checkpoint} has no {PLUGIN_STATE_FILE} (saved by a run without plugins, or "
                    f"interrupted while saving): the state of plugins {names} starts fresh instead of being restored.",
                    stacklevel=2,
                )


async def _await(awaitable):
    return await awaitable


def _format_annotation(annotation: dict) -> str:
    return ";".join(f"{k}={v}" for k, v in sorted(annotation.items()))
