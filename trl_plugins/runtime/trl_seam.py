"""The seam: the one module that names TRL's private members (written against ``trl>=1.16,<1.17``).

TRL keeps GRPO's pipeline in private methods and its bookkeeping in private attributes, and the framework needs both:
the plugin stages run inside ``_generate_and_score_completions``, the plugin loss replaces ``_compute_loss``, the
generation service calls TRL's generation backend, plugin metrics join TRL's ``_metrics``. Every such contact is made
here and nowhere else (as is the one private accelerate member the framework touches,
``GradientState._set_sync_gradients``, which transformers' training loop sets the same way: the replay update's micro-
batches), so a TRL upgrade is a change to this file plus a run of the reduction tests
(``tests/runtime/test_reduction.py`` and every plugin's neutral-setting check); ``tests/runtime/test_trl_seam.py`` fails when any
other module of ``trl_plugins/`` or ``plugins/`` names a private member of ``trl.GRPOTrainer`` or
``transformers.Trainer``. (The loss path, :mod:`trl_plugins.runtime.loss`, re-implements TRL's ``_compute_loss`` through
the public names below; the reduction tests check it against TRL's own.)

Three parts:

* :class:`TrlSeamTrainer`, the base class of :class:`~trl_plugins.PluginGRPOTrainer`. Each TRL private method the
  framework changes forwards to a public **override point** whose default is TRL's own method; the plugin trainer
  overrides the override points and reaches TRL's code with ``super()``. With nothing overridden the class runs
  exactly ``trl.GRPOTrainer``'s code (one more call per method):

  ==========================================  =====================================
  TRL calls                                   override point
  ==========================================  =====================================
  ``_generate_and_score_completions``          :meth:`~TrlSeamTrainer.generate_and_score_completions`
  ``_generate``                                :meth:`~TrlSeamTrainer.generate_rollouts`
  ``_generate_single_turn``                    :meth:`~TrlSeamTrainer.generate_single_turn`
  ``_tool_call_loop``                          :meth:`~TrlSeamTrainer.tool_call_loop`
  ``_calculate_rewards``                       :meth:`~TrlSeamTrainer.calculate_rewards`
  ``_compute_loss``                            :meth:`~TrlSeamTrainer.compute_grpo_loss`
  ``_get_train_sampler``                       :meth:`~TrlSeamTrainer.get_train_sampler`
  ``_save_checkpoint``                         :meth:`~TrlSeamTrainer.save_checkpoint`
  ``_load_optimizer_and_scheduler``            :meth:`~TrlSeamTrainer.load_optimizer_and_scheduler`
  ``_prepare_inputs``                          :meth:`~TrlSeamTrainer.prepare_inputs`
  ==========================================  =====================================

* the **accessors** of TRL's private state and helpers, each a public, documented method or property of
  :class:`TrlSeamTrainer` (``record_metric``, ``per_token_logps_and_entropies``, ``sample_completions``, ...): the
  trainer, the refill stage, the generation service, the reference policy, the loss path and the policy probe use
  these. (``OVERRIDE_POINTS`` and ``ACCESSORS`` name them all; ``tests/runtime/test_trl_seam.py`` checks that none of them
  shadows a member of TRL's own.)
* :func:`replace_trl_method`: how the testing kit replaces one of TRL's methods on one trainer instance, on any
  ``GRPOTrainer`` (vanilla included): scripted generation backends, recorded runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from trl import GRPOTrainer

#: TRL's private method -> the override point of :class:`TrlSeamTrainer` it forwards to.
OVERRIDE_POINTS = {
    "_generate_and_score_completions": "generate_and_score_completions",
    "_generate": "generate_rollouts",
    "_generate_single_turn": "generate_single_turn",
    "_tool_call_loop": "tool_call_loop",
    "_calculate_rewards": "calculate_rewards",
    "_compute_loss": "compute_grpo_loss",
    "_get_train_sampler": "get_train_sampler",
    "_save_checkpoint": "save_checkpoint",
    "_load_optimizer_and_scheduler": "load_optimizer_and_scheduler",
    "_prepare_inputs": "prepare_inputs",
}

#: The public accessors of TRL's private state and helpers that :class:`TrlSeamTrainer` adds.
ACCESSORS = (
    "record_metric", "log_completion_extra", "pending_completion_extras", "replace_logged_advantages",
    "text_tokenizer", "tokenize_prompts", "sample_completions", "per_token_logps_and_entropies", "micro_step",
    "entropy_bonus_enabled", "entropy_bonus", "copied_tool_dicts", "checkpoint_folder", "environment_pool",
    "batch_environment_names", "tool_dicts_for", "parse_tool_turn", "tool_rows", "wrapped_generation_backend",
    "extra_micro_backward", "extra_optimizer_step",
)


#: The multimodal fields of TRL's generation batch (the output of ``_generate_and_score_completions``) that TRL's own
#: forwards pass to ``_get_per_token_logps_and_entropies``: a vision-language model sees the prompts' images only
#: through them (absent fields are None, as TRL passes them).
MULTIMODAL_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def multimodal_forward_kwargs(batch: dict) -> dict:
    """The :data:`MULTIMODAL_FORWARD_KEYS` of TRL's generation batch ``batch``, for a forward of its rows."""
    return {key: batch.get(key) for key in MULTIMODAL_FORWARD_KEYS}


class TrlSeamTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with its private protocol turned into public override points and accessors (module
    docstring). Not used on its own: :class:`~trl_plugins.PluginGRPOTrainer` is the trainer."""

    # ---------------------------------------------------------------------------------------- override points
    def _generate_and_score_completions(self, inputs):
        return self.generate_and_score_completions(inputs)

    def generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """TRL's ``_generate_and_score_completions``: one generation batch of local ``inputs`` rows, generated, scored,
        with advantages; TRL's dict of local tensors (``completion_ids`` (B, T), ``advantages`` (B,), ...)."""
        return super()._generate_and_score_completions(inputs)

    def _generate(self, prompts):
        return self.generate_rollouts(prompts)

    def generate_rollouts(self, prompts: list) -> tuple:
        """TRL's ``_generate``: tokenize the local prompts, generate (tool loop included), decode, log TRL's length
        metrics; TRL's 8-tuple ``(prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images,
        tool_images)`` of local rows."""
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self.generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's ``_generate_single_turn``, the generation backend (HF generate or vLLM): one completion per row of
        ``prompt_ids``; returns ``(completion_ids, logprobs)`` (lists per row; logprobs None with HF generate)."""
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        return self.tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields)

    def tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's ``_tool_call_loop``: run the tool calls of the completions and generate after each result; TRL's
        7-tuple ``(tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count,
        tool_images)``."""
        return super()._tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self.calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """TRL's ``_calculate_rewards``: every reward function on the local rows, gathered: the (N, K) matrix."""
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _compute_loss(self, model, inputs):
        return self.compute_grpo_loss(model, inputs)

    def compute_grpo_loss(self, model: Any, inputs: dict) -> torch.Tensor:
        """TRL's ``_compute_loss``: the GRPO loss of one micro-batch (a scalar tensor)."""
        return super()._compute_loss(model, inputs)

    def _prepare_inputs(self, generation_batch):
        return self.prepare_inputs(generation_batch)

    #: Group size G when a loss plugin needs whole groups in every micro-batch (set by the plugin trainer,
    #: :mod:`trl_plugins.runtime.whole_groups`); None: TRL's row shuffle.
    whole_groups: int | None = None

    def prepare_inputs(self, generation_batch: Any) -> dict:
        """TRL's ``_prepare_inputs``: the micro-batch of the current step (generating, scoring, shuffling and splitting
        a new generation batch every ``steps_per_generation * num_iterations`` steps). With :attr:`whole_groups` set,
        the same steps in training with whole groups shuffled instead of rows (evaluation batches are not shuffled)."""
        if self.whole_groups is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

        from trl_plugins.runtime.whole_groups import group_permutation, permute_rows

        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            batch = permute_rows(batch, group_permutation(batch["completion_ids"].size(0), self.whole_groups))
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in split_tensor_dict(batch, steps)]
        return self._buffered_inputs[self._step % steps]

    def _get_train_sampler(self, dataset=None):
        return self.get_train_sampler(dataset)

    def get_train_sampler(self, dataset: Any = None) -> Any:
        """TRL's ``_get_train_sampler``: the sampler of the training dataloader (TRL's repeat sampler)."""
        return super()._get_train_sampler(dataset)

    def _save_checkpoint(self, model, trial):
        return self.save_checkpoint(model, trial)

    def save_checkpoint(self, model: Any, trial: Any) -> None:
        """Transformers' ``_save_checkpoint``: write ``checkpoint-<global_step>`` (:meth:`checkpoint_folder`)."""
        return super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        return self.load_optimizer_and_scheduler(checkpoint)

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Transformers' ``_load_optimizer_and_scheduler``: restore them from ``checkpoint`` on resume (None: no-op)."""
        return super()._load_optimizer_and_scheduler(checkpoint)

    # ---------------------------------------------------------------------------------------- accessors
    def record_metric(self, mode: str, key: str, value: float) -> None:
        """Append ``value`` to TRL's metric ``key`` of ``mode`` ("train" / "eval"); TRL averages what a metric
        collected and logs it at the next log step, as it does its own."""
        self._metrics[mode][key].append(value)

    def log_completion_extra(self, column: str, values: list) -> None:
        """Add a column to TRL's completions table for the rows being generated (one value per local row)."""
        self._log_completion_extra(column, values)

    @property
    def pending_completion_extras(self) -> dict[str, list]:
        """TRL's completions-table columns logged since the last log step (reward functions' ``log_extra`` and
        :meth:`log_completion_extra`): column -> values, the current batch's B local rows last. Live: edit in place."""
        return self._pending_extra_logs

    def replace_logged_advantages(self, values: list[float]) -> None:
        """Overwrite the advantages TRL logged for the current batch's N rows in its completions table (the last N
        entries) with ``values``; nothing when the table holds fewer than N."""
        logged = self._logs["advantages"]
        if len(logged) < len(values):
            return
        for j, value in enumerate(values):
            logged[len(logged) - len(values) + j] = value

    @property
    def text_tokenizer(self) -> Any:
        """TRL's text tokenizer (the processing class, or its ``tokenizer`` for a multimodal processor)."""
        return self._tokenizer

    def tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], Any, dict]:
        """TRL's ``_tokenize_prompts``: generation-prompt ids of ``prompts`` (chat template with generation prompt)
        exactly as TRL builds them, with TRL's images and multimodal fields: ``(prompt_ids, images, fields)``."""
        return self._tokenize_prompts(prompts)

    def sample_completions(self, prompt_ids: list[list[int]], num_generations: int = 1) -> tuple[list, list | None]:
        """Call TRL's generation backend the way TRL's ``_generate`` does, text-only: one completion per row of
        ``prompt_ids``; ``(completion_ids, logprobs)``. Goes through whatever backend this instance has (the plugin
        trainer's :meth:`generate_single_turn`, or a testing kit's :func:`replace_trl_method` replacement)."""
        return self._generate_single_turn(prompt_ids, None, {}, num_generations=num_generations)

    def per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """TRL's ``_get_per_token_logps_and_entropies`` (its fused LM head, temperature applied): (B, C) log-probs of
        the last ``logits_to_keep`` = C tokens of ``input_ids`` (B, P + C), (B, C) entropies (``compute_entropy``)
        or None, and the MoE aux loss (``compute_aux_loss``); ``kwargs`` are TRL's (``batch_size``, image fields)."""
        return self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)

    @property
    def micro_step(self) -> int:
        """TRL's count of training micro-steps (``training_step`` calls) so far; picks the iteration of a batch."""
        return self._step

    def extra_micro_backward(self, model: Any, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch of an update outside transformers' loop (the replay update), the way its inner
        loop runs one: accelerate's ``sync_gradients`` set to ``last`` (DeepSpeed steps its engine at that boundary),
        gradients not all-reduced before the last micro-batch (``no_sync``, except under DeepSpeed), DeepSpeed's own
        accumulation scaling off (``loss`` is already divided by the accumulation steps). ``model`` is the wrapped
        model (``model_wrapped``) whose forward made ``loss``."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        acc.gradient_state._set_sync_gradients(last)
        deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        kwargs = {"scale_wrt_gas": False} if deepspeed else {}
        sync = contextlib.nullcontext() if deepspeed or last else acc.no_sync(model=model)
        with sync:
            acc.backward(loss, **kwargs)

    def extra_optimizer_step(self, model: Any) -> float | None:
        """The optimizer step of an update outside transformers' loop, as its loop takes one after the last
        micro-batch (gradients clipped to ``max_grad_norm``, ``optimizer.step()``, ``zero_grad``) but with no learning-
        rate scheduler step, no ``global_step`` count and no callbacks. Returns the gradient norm (before clipping)."""
        grad_norm = self._clip_grad_norm(model) if self.args.max_grad_norm > 0 else None
        grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)
        self.optimizer.step()
        model.zero_grad()
        self.accelerator.gradient_state._set_sync_gradients(True)
        return None if grad_norm is None else float(grad_norm)

    @property
    def entropy_bonus_enabled(self) -> bool:
        """Whether TRL adds its entropy bonus to the loss (``entropy_coef`` or the adaptive entropy coefficient)."""
        return self._entropy_bonus_enabled

    def entropy_bonus(self, loss: torch.Tensor, policy_loss: torch.Tensor, entropies: torch.Tensor,
                      mask: torch.Tensor, entropy_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
        """TRL 1.16's entropy bonus of ``_compute_loss``, unchanged: ``loss - coef * mean entropy`` over the (B, T)
        ``mask`` (times ``entropy_mask``), with TRL's adaptive coefficient update and its metrics."""
        args = self.args
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        loss = loss - apply_coef * entropy_loss
        self.record_metric(mode, "policy_loss", self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self.record_metric(mode, "entropy_coef", self.entropy_coef)
        return loss

    @contextlib.contextmanager
    def copied_tool_dicts(self) -> Iterator[tuple[list[dict], list[dict]]]:
        """Within the block TRL's tool loop calls tools from copies of its per-row tool dicts (sync, async: one
        ``{name: callable}`` per local row), which the block may wrap; TRL's own dicts are restored after."""
        originals = self._sync_tool_dicts, self._async_tool_dicts
        self._sync_tool_dicts = [dict(d) for d in originals[0]]
        self._async_tool_dicts = [dict(d) for d in originals[1]]
        try:
            yield self._sync_tool_dicts, self._async_tool_dicts
        finally:
            self._sync_tool_dicts, self._async_tool_dicts = originals

    @property
    def environment_pool(self) -> dict | None:
        """TRL's pool of reusable environment instances ({environment name: [instances]}; None without
        ``environment_factory``)."""
        return getattr(self, "_environment_pool", None)

    @property
    def batch_environment_names(self) -> list | None:
        """TRL's environment name of each local row of the current batch (None entries with a single
        ``environment_factory``); None without ``environment_factory``."""
        if getattr(self, "environment_factories", None) is None:
            return None
        return list(getattr(self, "_batch_environments", []) or [])

    def tool_dicts_for(self, environment: Any) -> tuple[dict, dict]:
        """``(sync, async)`` ``{name: callable}`` tool dicts of one rollout, built as TRL 1.16 builds them in
        ``_generate_and_score_completions``: the standalone ``tools`` plus the public methods of ``environment`` other
        than ``reset`` / ``get_reward`` (None: the standalone tools alone)."""
        import inspect

        methods = []
        if environment is not None:
            methods = [
                getattr(environment, name) for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
                if name not in ("reset", "get_reward") and not name.startswith("_")
            ]
        sync, asynchronous = {}, {}
        for tool in list(self._standalone_tools or []) + methods:
            (asynchronous if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
        return sync, asynchronous

    def parse_tool_turn(self, completion_ids: list[int], prefix_ids: list[int], environment_name: Any = None) -> dict:
        """One generated assistant turn as TRL's ``_generate`` parses it: ``parse_response`` with the tools the row's
        prompt was rendered with (its environment's, or ``tools``) when the tokenizer has a response template, else a
        plain ``{"role": "assistant", "content": text}``; ``prefix_ids`` are the ids it was generated after."""
        from transformers import __version__ as transformers_version
        from packaging.version import Version

        tok = self._tokenizer
        parses = Version(transformers_version) >= Version("5.0.0") and (
            getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None
        )
        if not parses:
            text = self.processing_class.batch_decode([completion_ids], skip_special_tokens=True)[0]
            return {"role": "assistant", "content": text}
        from trl.trainer.grpo_trainer import parse_response

        tools = self._env_tools[environment_name] if self.environment_factories is not None else self.tools
        return parse_response(tok, list(completion_ids), prefix=list(prefix_ids), tools=tools)

    @contextlib.contextmanager
    def tool_rows(self, sync_dicts: list[dict], async_dicts: list[dict], environment_names: list) -> Iterator[None]:
        """Within the block TRL's tool loop runs on other rows than the batch's: row ``j`` of the loop calls the tools
        of ``sync_dicts[j]`` / ``async_dicts[j]`` and is parsed with the tools of environment ``environment_names[j]``;
        TRL's own per-row state is restored after."""
        saved = (getattr(self, "_sync_tool_dicts", None), getattr(self, "_async_tool_dicts", None),
                 getattr(self, "_batch_environments", None))
        self._sync_tool_dicts, self._async_tool_dicts = list(sync_dicts), list(async_dicts)
        self._batch_environments = list(environment_names)
        try:
            yield
        finally:
            self._sync_tool_dicts, self._async_tool_dicts, self._batch_environments = saved

    @contextlib.contextmanager
    def wrapped_generation_backend(self, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
        """Within the block every call of TRL's generation backend (``_generate_single_turn``: TRL's tool loop's, the
        generation service's) goes through ``wrap(backend)``, ``backend`` being what this instance calls now (the plugin
        trainer's :meth:`generate_single_turn`, or a testing kit's replacement); restored after."""
        replaced = "_generate_single_turn" in vars(self)
        current = self._generate_single_turn
        self._generate_single_turn = wrap(current)
        try:
            yield
        finally:
            if replaced:
                self._generate_single_turn = current
            else:
                del self._generate_single_turn

    def checkpoint_folder(self, trial: Any = None) -> str:
        """The folder transformers' ``_save_checkpoint`` writes for the current global step
        (``<output_dir>/checkpoint-<global_step>``)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")


# ------------------------------------------------------------------------------------------ any GRPOTrainer
#: TRL's methods the testing kit may replace on one trainer instance: public name -> TRL's private method.
REPLACEABLE_METHODS = {
    "generate_and_score_completions": "_generate_and_score_completions",
    "calculate_rewards": "_calculate_rewards",
    "generate_single_turn": "_generate_single_turn",
}


def replace_trl_method(trainer: Any, name: str, replacement: Callable) -> Callable:
    """Replace TRL's method ``name`` (a key of ``REPLACEABLE_METHODS``) on this one ``trainer`` (any
    ``trl.GRPOTrainer``, a vanilla one included); TRL's own calls and the framework's (the generation service's
    :meth:`TrlSeamTrainer.sample_completions`) then reach ``replacement``. Returns the method it replaced (bound):
    pass it back to undo. For tests and benchmarks: scripted generation backends, recorded runs."""
    if name not in REPLACEABLE_METHODS:
        raise ValueError(f"replace_trl_method: {name!r} is not replaceable; choose one of {sorted(REPLACEABLE_METHODS)}.")
    private = REPLACEABLE_METHODS[name]
    original = getattr(trainer, private)
    setattr(trainer, private, replacement)
    return original
