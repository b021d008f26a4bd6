"""Hook specifications of trl-plugins: the reference documentation of every stage.

A plugin is a subclass of :class:`trl_plugins.Plugin` whose methods are decorated with
:data:`trl_plugins.hookimpl` and named after the specs below. Pluggy checks the names and argument names when
the plugin is registered; a misspelt hook is refused at construction.

Composition is explicit: each hook is called once per enabled plugin, **in the order of** ``args.plugins``,
and every hook of a stage works on the same mutable context object, so the output of one plugin is the input
of the next (a chain). One exception to the order: a plugin that recomputes a chained quantity from scratch
(``Plugin.overwrites`` / ``overwritten()``: ``"rewards"``, ``"advantages"``) runs first in that stage's chain, with a
warning naming the plugins it moved ahead of, and two plugins overwriting the same quantity are refused together.
Return values are ignored unless a spec says otherwise.

Shapes used below: ``N`` rows in the global generation batch (all processes), ``B`` rows on this process
(``N = B * num_processes``), ``T`` completion positions (right-padded), ``K`` reward functions, ``G`` =
``num_generations``. Rows are group-contiguous: global row ``g`` belongs to group ``g // G`` and has index
``g % G`` in it, whatever process holds it.

Collective services: under several processes (DDP, FSDP, DeepSpeed) the context services that gather or run the
policy -- ``gather``/``gather_padded``, ``service.generate``, ``score``, ``policy_logprobs``, ``policy_entropies``,
``policy_stats``, ``policy_features``/``reference_features``, ``reference_logprobs``, ``head_stats()``,
``schedule_replay_update`` -- are collectives: a hook must call each of them the same number of times on every
process (pass no rows rather than skip a call), deciding from data every process shares. A process that skips one
leaves the others waiting (ZeRO-3) or aborts them (FSDP). See docs/writing-a-plugin.md, *Collective services*.

Stages and the hooks that belong to them:

=========== ==========================================================================================
lifecycle   ``trl_plugins_configure``, ``trl_plugins_reward_functions``, ``trl_plugins_on_step_end``,
            ``trl_plugins_state_dict``, ``trl_plugins_load_state_dict``
sampling    ``trl_plugins_train_sampler`` (which prompts are drawn), ``trl_plugins_generation_prompts``,
            ``trl_plugins_after_generation``, ``trl_plugins_reject_groups`` (drop and refill whole groups)
reward      ``trl_plugins_reward_functions`` (adds columns), ``trl_plugins_transform_rewards``
advantage   ``trl_plugins_transform_advantages``
loss        ``trl_plugins_loss_advantages``, ``trl_plugins_loss``
=========== ==========================================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from trl_plugins.api.contexts import (
        AdvantageContext,
        LossContext,
        PromptContext,
        RefillContext,
        RewardContext,
        RolloutContext,
    )

PROJECT = "trl_plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Which stage each hook belongs to (used by ``trl-plugins list`` and the compatibility checks).
HOOK_STAGES: dict[str, str] = {
    "trl_plugins_configure": "lifecycle",
    "trl_plugins_on_step_end": "lifecycle",
    "trl_plugins_state_dict": "lifecycle",
    "trl_plugins_load_state_dict": "lifecycle",
    "trl_plugins_reward_functions": "reward",
    "trl_plugins_train_sampler": "sampling",
    "trl_plugins_train_dataset": "sampling",
    "trl_plugins_generation_prompts": "sampling",
    "trl_plugins_after_generation": "sampling",
    "trl_plugins_reject_groups": "sampling",
    "trl_plugins_transform_rewards": "reward",
    "trl_plugins_transform_advantages": "advantage",
    "trl_plugins_loss_advantages": "loss",
    "trl_plugins_loss": "loss",
}

STAGE_ORDER = ("sampling", "reward", "advantage", "loss")


# --------------------------------------------------------------------------------------------- lifecycle
@hookspec
def trl_plugins_configure(trainer: Any, args: Any) -> None:
    """Validate the plugin against the run and prepare it; called once at the end of trainer construction.

    Args:
        trainer: the :class:`~trl_plugins.PluginGRPOTrainer` (fully built: model, tokenizer, reward functions).
            Read settings here; code that runs later outside a stage context (a plugin's reward function) keeps
            ``trainer.plugin_services`` (:class:`~trl_plugins.StageServices`: tokenizer, ``policy_logprobs`` ...),
            never the trainer.
        args: its :class:`~trl_plugins.PluginGRPOConfig`.

    Raise :class:`~trl_plugins.api.errors.IncompatiblePluginsError` (or ``PluginConfigError``) for settings the
    method cannot work with (e.g. an option valid only with vLLM while ``use_vllm=False``), so that the error
    comes at construction, never at step 500.
    """


@hookspec
def trl_plugins_on_step_end(trainer: Any, step: int) -> None:
    """Called after every optimizer step (``step`` = ``trainer.state.global_step``), for schedules."""


@hookspec
def trl_plugins_state_dict() -> dict:
    """Return the plugin's resumable state; saved in every checkpoint.

    Only tensors, numbers, strings, bytes, ``None`` and lists / tuples / dicts / sets of them (numpy scalars are
    turned into Python numbers): checkpoints are loaded with ``torch.load(weights_only=True)``, which runs no code,
    and a state holding anything else (a deque, an array, an object) is refused when the checkpoint is saved."""


@hookspec
def trl_plugins_load_state_dict(state: dict) -> None:
    """Restore what :func:`trl_plugins_state_dict` returned, when training resumes from a checkpoint."""


# --------------------------------------------------------------------------------------------- reward
@hookspec
def trl_plugins_reward_functions(args: Any) -> list:
    """Return extra reward functions (TRL's signature: ``f(prompts, completions, completion_ids, **columns)``).

    They become named columns of the reward matrix after the user's own reward functions; TRL's
    ``reward_weights`` (extended with weight 1.0 for each added column unless the plugin sets
    ``func.reward_weight``) and ``multi_objective_aggregation`` apply to them. Called once, before TRL builds
    its reward list. ``args`` is the run's :class:`~trl_plugins.PluginGRPOConfig`.
    """


@hookspec
def trl_plugins_transform_rewards(ctx: RewardContext) -> None:
    """Transform the gathered reward matrix ``ctx.rewards_per_func`` (N, K) in place, with the groups in view.

    Runs on every process with the same global matrix (after TRL gathers it), before TRL computes its
    advantages and reward metrics, so TRL's weighting, normalisation and logging see the transformed values.
    """


# --------------------------------------------------------------------------------------------- sampling
@hookspec
def trl_plugins_train_sampler(trainer: Any, sampler: Any, dataset: Any) -> Any:
    """Return a replacement for the training sampler (which prompts are drawn), or None to keep ``sampler``.

    Called when the training dataloader is built (at the start of ``train()``, and again on resume), with TRL's
    ``RepeatSampler`` or the previous plugin's replacement (plugins chain in order). A replacement must keep TRL's
    layout: chunks of ``sampler.batch_size`` prompt indices, each index yielded ``sampler.mini_repeat_count`` (G)
    times in a row, each chunk yielded ``sampler.repeat_count`` times, ``len()`` unchanged, and the same sequence on
    every process (decide from seeds and from state updated only with gathered data). It may implement
    ``set_epoch(epoch)``. Not called for iterable datasets (TRL attaches no sampler to them).
    """


@hookspec
def trl_plugins_train_dataset(dataset: Any, args: Any) -> Any:
    """Return a replacement for the training dataset (a data transform of the method), or None to keep ``dataset``.

    Called once when the trainer is built, before TRL sees the dataset (before the column checks and TRL's own
    preparation), with the user's map-style dataset or the previous plugin's replacement (plugins chain in order).
    Every process calls it with the same dataset, so the transform must be a function of the dataset, the options and
    ``args.seed`` alone (no gathers needed: every process then trains on the same rows). Not called without a training
    dataset or for an iterable one.
    """


@hookspec
def trl_plugins_generation_prompts(ctx: PromptContext) -> None:
    """Choose per-row generation and training prompts before the first generation round of a step.

    ``ctx.generation_prompts[i]`` is what row ``i`` is sampled from; ``ctx.training_prompts[i]`` is the prompt
    the loss conditions on (prompt swap when they differ). Rows of one group may get different prompts; the
    trainer then generates one completion per row (vLLM server mode would otherwise de-duplicate prompts).
    Rows whose two prompts differ get NaN sampling log-probs, so TRL's vLLM importance-sampling correction
    leaves them alone. ``ctx.defer(i)`` skips row ``i`` in the first generation round: the plugin must fill it
    in ``trl_plugins_after_generation`` (``ctx.replace_row``), so a two-round method keeps exactly G rollouts per
    group. Only called in training mode.
    """


@hookspec
def trl_plugins_after_generation(ctx: RolloutContext) -> None:
    """Inspect and edit the generated batch before rewards are computed.

    With ``ctx`` a plugin may score candidates (``ctx.score``), ask the generation service for more
    completions within the step (``ctx.service.generate``; collective-safe, counted in the rollout budget),
    replace rows (``ctx.replace_row``; the group size never changes) and splice token spans recording their
    provenance (``ctx.splice``; off-policy tokens take the shaped loss branch and get NaN sampling log-probs).
    Every process must call the service the same number of times; decide from globally gathered data
    (``ctx.gather``). Only called in training mode.
    """


@hookspec
def trl_plugins_reject_groups(ctx: RefillContext) -> None:
    """Reject whole groups once the batch's rewards are known; the trainer refills their slots within the step.

    Runs at the end of the sampling stage (after ``after_generation``), on every process with the same gathered
    reward matrix, once per round: ``ctx.round`` 0 after the first generation, then after each refill round. Mark
    groups with ``ctx.reject(groups)``; optionally name their replacements with ``ctx.repeat(group, times)`` (the same
    prompt again) or ``ctx.supply(row)`` (a dataset row, e.g. from a buffer). Slots left without a named replacement
    are refilled from the trainer's refill stream: a seeded permutation of the training set, the same on every process
    and resumed from checkpoints. The trainer generates the replacement groups (G rows each, through the generation
    service: collective-safe, counted in the rollout budget), scores them and calls the hook again, until nothing is
    rejected or ``PluginGRPOConfig.max_refill_rounds`` refill rounds have run; groups still rejected then are kept,
    kept with zero advantage, or an error (``refill_at_limit``). Rejections chain over plugins in order (union).
    Metrics: ``plugins/framework/refill_rounds``, ``.../rejected_groups``, ``.../refill_rollouts``,
    ``.../kept_at_limit``. Replacement groups are plain on-policy groups of their own prompts: the other sampling
    hooks (prompt rewrites, splices, extra rollouts, ``after_generation``) do not run on them, so sampling-stage
    guidance (e.g. ``ampo``'s) reaches first-round groups only. Only called in training mode; not available with
    ``rollout_func``, tools, environments, images or iterable datasets (refused at construction).
    """


# --------------------------------------------------------------------------------------------- advantage
@hookspec
def trl_plugins_transform_advantages(ctx: AdvantageContext) -> None:
    """Transform the global advantages ``ctx.advantages`` ((N,) or (N, T)) in place; attach per-row extras.

    ``ctx.advantages`` starts as TRL's own computation (``scale_rewards``, ``multi_objective_aggregation``).
    Group-level quantities must be computed here: TRL shuffles and splits the batch before the loss, so a
    loss micro-batch never holds whole groups. Per-row tensors put in ``ctx.extras`` ride to the loss stage
    with their rows (``LossContext.extras``).
    """


# --------------------------------------------------------------------------------------------- loss
@hookspec
def trl_plugins_loss_advantages(ctx: LossContext) -> None:
    """Transform the token advantages ``ctx.advantages`` (B, T) of a micro-batch before the surrogate is built.

    Per-row advantages arrive expanded to (B, T); when the hooks leave them constant along each row, the surrogate
    and TRL's metrics use them per row, exactly as TRL does. This is also where ``ctx.scale_clip_range(c)`` widens or
    narrows the clip range per token (clipped loss types), since the surrogate is built right after these hooks.
    """


@hookspec
def trl_plugins_loss(ctx: LossContext) -> None:
    """Contribute to the micro-batch loss once the base per-token surrogate ``ctx.per_token_loss`` exists.

    Contributions compose: ``ctx.scale_tokens(w)`` multiplies (weights/masks multiply), ``ctx.add_token_loss``
    and ``ctx.add_loss`` add, and ``ctx.replace_tokens(mask, values)`` swaps the surrogate on a token subset
    (only a plugin declaring ``replaces_surrogate = True`` may call it, at most one per stack).
    """
