"""Testing kit for plugin authors (and this project's own tests).

Reference with examples: ``docs/testing-kit.md``. Usable as a pytest plugin: put ``pytest_plugins = ["trl_plugins.testing"]`` in your top-level ``conftest.py``
(or run ``pytest -p trl_plugins.testing``). It provides the fixtures ``tiny_tokenizer``, ``tiny_model``,
``tiny_dataset``, ``make_trainer`` and ``temporary_plugin``. Everything is built offline in seconds on a CPU: a
character-level tokenizer, a tiny Llama and the bundled arithmetic tasks. Every helper also works without pytest.

Training runs on the tiny model:
    :func:`make_tiny_trainer` builds a ``PluginGRPOTrainer`` (or ``trl.GRPOTrainer``) on the tiny model, quietly.
    :func:`record_run` trains a few steps and records, per generation batch and optimizer step, the
    completions, rewards, advantages, losses and gradients, so two runs can be compared exactly.
    :func:`assert_runs_equal` compares two such records.
    :func:`assert_reduces_to_vanilla` is the neutral-setting check in one call: the plugin in its neutral setting gives the
    same run as ``trl.GRPOTrainer`` for each loss type.

Hand-made stage contexts for unit tests (no model, no trainer; stub services record what the plugin asked):
    :func:`make_prompt_context`, :func:`make_rollout_context` (with :class:`StubGenerationService`),
    :func:`make_reward_context` (:func:`simulate_sampler_loop` drives a history sampler with it),
    :func:`make_advantage_context`, :func:`make_loss_context` (their services are
    :func:`stub_services`: a :class:`CharTokenizer`, a one-process gather ...; keyword arguments replace any);
    :func:`build_stack` / :func:`run_hook` enable a plugin by name (options validated, ``configure`` called) and
    call one of its hooks (``run_hook(name, "loss", ctx, options={...})``); :func:`loss_from_context` composes a loss context's contributions as the framework
    does; :func:`run_on_processes` runs a function on simulated processes with a working all-gather.

Vision-language runs, in :mod:`trl_plugins.testing.vlm` (``from trl_plugins.testing.vlm import ...``; it builds on this
module): ``tiny_vlm`` and ``tiny_vlm_processor`` (a tiny Llava with a ``ProcessorMixin`` over the character-level
tokenizer, built offline), ``tiny_image_dataset`` (image prompts with TRL's ``image`` column), ``with_images`` (adds
that column to any task), ``color_overlap_reward`` and ``make_vlm_trainer``.

Stage-contract assertions (work on contexts, on a generation batch and on a :class:`RunRecord`):
    :func:`assert_group_sizes` (exactly G rows per group, layout from the global position) and
    :func:`assert_offpolicy_logprobs_nan` (provenance: off-policy tokens and prompt-swapped rows carry NaN
    sampling log-probs, so TRL's vLLM importance-sampling correction leaves them alone).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

import torch

from trl_plugins.api.contexts import (
    AdvantageContext,
    Completion,
    LossContext,
    PolicyStats,
    PromptContext,
    RefillContext,
    RewardContext,
    RolloutContext,
    TEACHER_LOGPS_EXTRA,
    TURN_IDS_KEY,
    group_layout,
)
from trl_plugins.api.errors import GenerationBudgetExceeded, PluginError
from trl_plugins.api.services import RunInfo, StageServices
from trl_plugins.runtime.manager import (
    PluginStack,
    available_plugins,
    build_plugins,
    register_plugin,
    unregister_plugin,
)
from trl_plugins.api.plugin import Plugin
from trl_plugins.api.success import RewardColumns, is_placeholder

#: The loss types of the reduction and neutral-setting checks (TRL's token- and sequence-normalised objectives).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def tiny_tokenizer():
    """The bundled character-level tokenizer (with chat template)."""
    from trl_plugins.tasks.tiny import build_tokenizer

    return build_tokenizer()


def tiny_model(tokenizer=None, seed: int = 0, hidden_size: int = 32, num_layers: int = 2):
    """A freshly initialised tiny Llama matching ``tokenizer``."""
    from trl_plugins.tasks.tiny import build_tiny_model

    return build_tiny_model(tokenizer or tiny_tokenizer(), seed=seed, hidden_size=hidden_size, num_layers=num_layers)


def tiny_dataset(n: int = 8, levels=(1,), seed: int = 0):
    """``n`` arithmetic problems with every column the built-in plugins use."""
    from trl_plugins.tasks.arithmetic import make_dataset

    return make_dataset(n, levels=levels, seed=seed)


def default_reward_funcs() -> list[Callable]:
    from trl_plugins.tasks.arithmetic import accuracy_reward

    return [accuracy_reward]


def tiny_config(output_dir: str | None = None, config_cls=None, **overrides):
    """A ``PluginGRPOConfig`` sized for seconds-long CPU runs; ``overrides`` set any field."""
    from trl_plugins.runtime.config import PluginGRPOConfig, checkpointing_off

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
        **checkpointing_off(),
        disable_tqdm=True,
    )
    values.update(overrides)
    if config_cls is not PluginGRPOConfig:
        values.pop("plugins", None)
        values.pop("plugin_config", None)
    return config_cls(**values)


def make_tiny_trainer(
    trainer_cls=None,
    model=None,
    tokenizer=None,
    dataset=None,
    reward_funcs=None,
    seed: int = 0,
    *,
    eval_dataset=None,
    peft_config=None,
    verbose: bool = False,
    tools=None,
    environment_factory=None,
    **config,
):
    """A trainer on the tiny model and tasks: the kit's one trainer helper (the ``make_trainer`` fixture is this
    function with a per-test ``output_dir``). ``trainer_cls`` defaults to ``PluginGRPOTrainer``; pass
    ``trl.GRPOTrainer`` for the vanilla baseline (its config is then a plain ``GRPOConfig``). ``config`` sets any
    (Plugin)GRPOConfig field, e.g. ``plugins=[...]``, ``loss_type="dapo"``, ``max_steps=3``. Quiet: the metrics of
    each step are in ``trainer.state.log_history``, not printed (``verbose=True`` prints them as TRL does).
    ``tools`` / ``environment_factory`` go to the trainer as TRL's (give the tokenizer a tool-calling template
    first, e.g. :func:`trl_plugins.tasks.tools.enable_tool_calling`)."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_plugins.runtime.trainer import PluginGRPOTrainer

    trainer_cls = trainer_cls or PluginGRPOTrainer
    tokenizer = tokenizer or tiny_tokenizer()
    model = model if model is not None else tiny_model(tokenizer, seed=seed)
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else None
    args = tiny_config(config_cls=config_cls, seed=seed, **config)
    agent = {k: v for k, v in (("tools", tools), ("environment_factory", environment_factory)) if v is not None}
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs if reward_funcs is not None else default_reward_funcs(),
        args=args,
        train_dataset=dataset if dataset is not None else tiny_dataset(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        **agent,
    )
    if not verbose:
        trainer.remove_callback(PrinterCallback)  # TRL prints every step's whole metrics dict with disable_tqdm
    return trainer


def make_tool_trainer(trainer_cls=None, agent: str = "environment", kinds=("lookup", "scaled"), n: int = 8,
                      script: Callable[[str, int], str] | None = None, **config):
    """A tiny trainer on the bundled tool environment (:mod:`trl_plugins.tasks.tools`) whose generation backend
    follows the questions' gold traces (:func:`~trl_plugins.tasks.tools.gold_trace_script`; the random tiny model
    cannot write tool calls), so every batch holds real multi-turn tool rollouts run by TRL's tool loop.

    ``agent``: "environment" (``environment_factory=ToolEnvironment``, per-call rewards) or "tools" (``tools=`` the
    plain functions). ``config`` sets any (Plugin)GRPOConfig field, as in :func:`make_tiny_trainer`.
    """
    from trl_plugins.tasks.tools import (
        ToolEnvironment, calculator, enable_tool_calling, gold_trace_script, make_tool_dataset, search,
        tool_answer_reward,
    )

    if agent not in ("environment", "tools"):
        raise ValueError(f"agent must be 'environment' or 'tools'; got {agent!r}")
    dataset = make_tool_dataset(n, kinds=kinds)
    agent_kwargs = {"environment_factory": ToolEnvironment} if agent == "environment" else {"tools": [search, calculator]}
    values = dict(max_steps=2, max_completion_length=300, log_level="error")
    values.update(config)
    trainer = make_tiny_trainer(
        trainer_cls, tokenizer=enable_tool_calling(tiny_tokenizer()), dataset=dataset,
        reward_funcs=values.pop("reward_funcs", [tool_answer_reward]), **agent_kwargs, **values,
    )
    script_generation(trainer, script or gold_trace_script(dataset))
    return trainer


def gold_then_wrong_script(dataset, from_step: int, fail: Callable[[Any], bool] | None = None):
    """A scripted tool policy for replay tests: ``(script, bind)``. Before optimizer step ``from_step`` every request
    follows its question's gold trace (every rollout succeeds, with its tool calls); from it on, a first-turn request
    answers ``Answer: -1`` at once (every rollout fails), on the processes where ``fail(trainer)`` holds (default:
    all). Call ``bind(trainer)`` once the trainer is built (``make_tool_trainer(script=script, ...)``)."""
    from trl_plugins.tasks.tools import gold_trace_script

    gold = gold_trace_script(dataset, shortcut_every=0)
    holder: dict = {}

    def script(prompt_text: str, row: int) -> str:
        tr = holder["trainer"]
        if tr.state.global_step >= from_step and "<tool_response>" not in prompt_text and (fail is None or fail(tr)):
            return "Answer: -1"
        return gold(prompt_text, row)

    return script, lambda trainer: holder.update(trainer=trainer)


def script_generation(trainer, script: Callable[[str, int], str]) -> None:
    """Replace ``trainer``'s generation backend by ``script(prompt_text, row) -> completion text`` (in place).

    ``prompt_text`` is the rendered prompt (special tokens kept; with tools it holds the earlier turns and tool
    results), ``row`` the index of the request in the backend call. The completion is tokenised and closed with EOS.
    TRL's whole pipeline around the backend (tool loop, masks, rewards, loss) runs unchanged, so tests can drive tool
    calls with a model too small to make them. Works on any ``GRPOTrainer``
    (:func:`trl_plugins.runtime.trl_seam.replace_trl_method`).
    """
    from trl_plugins.runtime.trl_seam import replace_trl_method

    tokenizer = trainer.processing_class

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions = []
        for row, ids in enumerate(prompt_ids):
            text = script(tokenizer.decode(list(ids), skip_special_tokens=False), row)
            completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        return completions, None

    replace_trl_method(trainer, "generate_single_turn", generate_single_turn)


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

    from trl_plugins.runtime.trl_seam import replace_trl_method

    record = RunRecord()
    if steps is not None:
        trainer.args.max_steps = steps
    original_loss = trainer.compute_loss

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

    original_gen = replace_trl_method(trainer, "generate_and_score_completions", gen)
    original_rewards = replace_trl_method(trainer, "calculate_rewards", rewards)
    trainer.compute_loss = loss
    trainer.add_callback(GradRecorder())
    try:
        trainer.train()
    finally:
        replace_trl_method(trainer, "generate_and_score_completions", original_gen)
        replace_trl_method(trainer, "calculate_rewards", original_rewards)
        trainer.compute_loss = original_loss
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




# ------------------------------------------------------------------------------------------ reduction to vanilla
_VANILLA_CACHE: dict[Any, RunRecord] = {}
_NOT_RUN_SETTINGS = ("output_dir", "logging_dir", "report_to", "run_name", "log_level", "disable_tqdm")


def _resolve_plugin(plugin: str | type[Plugin]) -> tuple[str, type[Plugin] | None]:
    """(name, class to register temporarily or None) for a plugin given by name or class."""
    if isinstance(plugin, str):
        return plugin, None
    if isinstance(plugin, type) and issubclass(plugin, Plugin):
        known = available_plugins().get(plugin.name)
        return plugin.name, (None if known is plugin else plugin)
    raise TypeError(f"plugin must be a plugin name or a Plugin subclass; got {plugin!r}.")


def _without_zero_plugin_columns(ours: RunRecord, vanilla: RunRecord) -> RunRecord:
    """``ours`` without the reward columns the plugin added (appended after the run's own), which must be all zero:
    a plugin's own column at its neutral setting adds nothing to TRL's weighted sum."""
    K = vanilla.rewards[0].shape[1] if vanilla.rewards else 0
    if not ours.rewards or ours.rewards[0].shape[1] <= K:
        return ours
    for r in ours.rewards:
        assert torch.equal(r[:, K:], torch.zeros_like(r[:, K:])), "the plugin's own reward columns are not all zero"
    return dataclasses.replace(ours, rewards=[r[:, :K] for r in ours.rewards])


def assert_reduces_to_vanilla(
    plugin: str | type[Plugin],
    plugin_config: Mapping[str, Any] | None = None,
    *,
    loss_types: Sequence[str] = LOSS_TYPES,
    steps: int = 2,
    reward_funcs: Sequence[Callable] | None = None,
    seed: int = 0,
    atol: float = 0.0,
    rtol: float = 0.0,
    require_signal: bool = True,
    **config: Any,
) -> dict[str, RunRecord]:
    """Neutral setting: ``plugin`` with the options ``plugin_config`` (its neutral setting) gives the same run as
    ``trl.GRPOTrainer`` with the same seed, for each of ``loss_types``.

    Both runs train ``steps`` optimizer steps on the tiny model and are compared with :func:`assert_runs_equal`
    (completions exactly; rewards, advantages, per-micro-step losses, gradients and final parameters within
    ``atol``/``rtol``, exact by default). The default reward is :func:`digit_fraction_reward`, dense on an
    untrained model, so advantages are non-zero and the comparison is not vacuous (``require_signal`` checks
    it). ``config`` sets any GRPOConfig field of both runs (e.g. ``max_completion_length=16``).

    Args:
        plugin: a plugin name, or a ``Plugin`` subclass (registered for the duration of the check if needed).
        plugin_config: the plugin's options, e.g. ``{"scale": 1.0}``; ``None`` = its defaults.

    Returns:
        The plugin runs, keyed by loss type (to check metrics the plugin logged, for instance).
    """
    from trl import GRPOTrainer

    name, to_register = _resolve_plugin(plugin)
    funcs = list(reward_funcs) if reward_funcs is not None else [digit_fraction_reward]
    runs = {}
    scope = temporary_plugin(to_register) if to_register is not None else contextlib.nullcontext()
    with scope:
        for loss_type in loss_types:
            same_run = {k: v for k, v in config.items() if k not in _NOT_RUN_SETTINGS}
            key = (loss_type, steps, seed, tuple(id(f) for f in funcs), repr(sorted(same_run.items())))
            vanilla = _VANILLA_CACHE.get(key)
            if vanilla is None:
                vanilla = record_run(
                    make_tiny_trainer(GRPOTrainer, reward_funcs=funcs, seed=seed, loss_type=loss_type, max_steps=steps,
                                      **config)
                )
                if reward_funcs is None:  # only the module-level default reward is safe to cache by identity
                    _VANILLA_CACHE[key] = vanilla
            trainer = make_tiny_trainer(
                reward_funcs=funcs, seed=seed, loss_type=loss_type, max_steps=steps, plugins=[name],
                plugin_config={name: dict(plugin_config)} if plugin_config else {}, **config,
            )
            assert [p.name for p in trainer.plugin_stack] == [name], f"plugin {name!r} is not enabled"
            ours = record_run(trainer)
            if require_signal:
                assert any(a.abs().sum() > 0 for a in vanilla.advantages), (
                    "every advantage of the vanilla run is zero, so the comparison would be vacuous; pass a reward "
                    "with variance within groups (reward_funcs=...) or require_signal=False"
                )
            try:
                assert_runs_equal(vanilla, _without_zero_plugin_columns(ours, vanilla), atol=atol, rtol=rtol)
            except AssertionError as exc:
                raise AssertionError(
                    f"plugin {name!r} with {dict(plugin_config or {})!r} does not reduce to trl.GRPOTrainer "
                    f"(loss_type={loss_type!r}): {exc}"
                ) from exc
            runs[loss_type] = ours
    return runs


# ------------------------------------------------------------------------------------------ hand-made contexts
def char_encode(text: str) -> list[int]:
    """The stub tokenizer of the hand-made contexts: one id per character (``ord``)."""
    return [ord(c) for c in text]


def char_decode(ids: Sequence[int]) -> str:
    """Inverse of :func:`char_encode`."""
    return "".join(chr(int(i)) for i in ids)


def prompt_text(prompt: Any) -> str:
    """The text of a prompt or completion: a string as is, a message list as its last message's content."""
    if isinstance(prompt, str):
        return prompt
    return prompt[-1]["content"]


def _per_group(value: Any, group: int, n_groups: int) -> Any:
    if callable(value):
        return value(group)
    if isinstance(value, (list, tuple)) and len(value) == n_groups:
        return value[group]
    return value


def stub_rows(
    num_groups: int = 2,
    num_generations: int = 4,
    *,
    conversational: bool = True,
    first_group: int = 0,
    **columns: Any,
) -> list[dict]:
    """Local dataset rows as TRL's sampler delivers them: each prompt repeated G times, groups contiguous.

    Group ``g`` asks ``"Q{g}"`` (``[{"role": "user", "content": "Q{g}"}]`` when ``conversational``). Each extra
    column is a value shared by all rows, a list with one value per group, or a function of the group id, e.g.
    ``stub_rows(2, 4, solution=["1+1=2", "2+2=4"], answer=lambda g: str(2 * g + 2))``.
    """
    rows = []
    for k in range(num_groups):
        group = first_group + k
        prompt = [{"role": "user", "content": f"Q{group}"}] if conversational else f"Q{group}"
        row = {"prompt": prompt}
        row.update({c: _per_group(v, k, num_groups) for c, v in columns.items()})
        rows += [copy.deepcopy(row) for _ in range(num_generations)]
    return rows


class MetricsRecorder(dict):
    """``name -> [values]`` of every ``ctx.log_metric`` call (keys as in TRL's logs: ``plugins/<plugin>/<name>``)."""

    def __call__(self, key: str, value: float) -> None:
        self.setdefault(key, []).append(value)


class CharTokenizer:
    """The stub tokenizer of the hand-made contexts (``ctx.tokenizer``): one id per character (:func:`char_encode`).

    Enough of a Hugging Face tokenizer for plugins: ``tok(text, add_special_tokens=False)["input_ids"]``,
    ``encode``, ``decode``, ``batch_decode`` and ``eos_token_id`` / ``pad_token_id`` (id 0, dropped by
    ``skip_special_tokens=True``).
    """

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text: str | list[str] | None = None, add_special_tokens: bool = False, **kwargs: Any) -> dict:
        if isinstance(text, str):
            return {"input_ids": char_encode(text)}
        return {"input_ids": [char_encode(t) for t in text]}

    def encode(self, text: str, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        return char_encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        ids = [int(i) for i in ids]
        return char_decode([i for i in ids if i != self.eos_token_id] if skip_special_tokens else ids)

    def batch_decode(self, id_lists: Sequence[Sequence[int]], skip_special_tokens: bool = False, **kwargs: Any):
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in id_lists]


def _identity_gather(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _local_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def stub_services(
    metrics: Callable[[str, float], None] | None = None,
    *,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    tokenizer: Any = None,
    run: RunInfo | None = None,
    policy_logprobs: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]] | None = None,
    **members: Any,
) -> StageServices:
    """The stub :class:`~trl_plugins.api.services.StageServices` of the kit's contexts (one process unless ``gather``
    says otherwise).

    Defaults: ``gather`` the identity (``gather.objects``, as :func:`run_on_processes` gives it, gathers Python lists;
    else a list copy), ``tokenizer`` a :class:`CharTokenizer`, prompts tokenized as their text character by
    character, ``run`` an empty :class:`~trl_plugins.api.services.RunInfo`, token means over this process only.
    ``policy_logprobs`` (no default: a plugin calling it without one gets a ``PluginError``) and any other member
    (``score``, ``decode``, ``policy_stats`` ...) are passed through.
    """
    gather = gather or _identity_gather
    values = dict(
        run=(lambda: run) if run is not None else RunInfo,
        metric_sink=metrics,
        tokenizer=tokenizer if tokenizer is not None else CharTokenizer(),
        tokenize_prompts=lambda prompts: [char_encode(prompt_text(p)) for p in prompts],
        gather=gather,
        gather_object=getattr(gather, "objects", list),
        policy_logprobs=policy_logprobs,
        masked_mean=_local_masked_mean,
    )
    values.update(members)
    return StageServices(**values)


def _layout(B: int, G: int, process_index: int) -> tuple[list[int], list[int], list[int]]:
    return group_layout(process_index, B, G)


def make_prompt_context(
    rows: list[dict] | None = None,
    *,
    num_groups: int = 2,
    num_generations: int = 4,
    step: int = 0,
    process_index: int = 0,
    mode: str = "train",
    run: RunInfo | None = None,
    **services: Any,
) -> PromptContext:
    """A :class:`~trl_plugins.PromptContext` (sampling stage, before generation) of ``rows`` (default:
    :func:`stub_rows`), as the trainer builds it: generation and training prompts start as the original ones.
    ``run`` is what ``ctx.run`` gives; ``services`` go to :func:`stub_services` (``gather``, ``tokenizer`` ...).
    ``ctx.metrics`` records the metrics the plugin logs."""
    rows = rows if rows is not None else stub_rows(num_groups, num_generations)
    B, G = len(rows), num_generations
    global_index, group_ids, index_in_group = _layout(B, G, process_index)
    prompts = [r["prompt"] for r in rows]
    metrics = MetricsRecorder()
    ctx = PromptContext(
        rows=rows,
        prompts=prompts,
        generation_prompts=list(prompts),
        training_prompts=list(prompts),
        global_index=global_index,
        group_ids=group_ids,
        index_in_group=index_in_group,
        num_generations=G,
        step=step,
        annotations=[{} for _ in range(B)],
        mode=mode,
        services=stub_services(metrics, run=run, **services),
    )
    ctx.metrics = metrics
    return ctx


class StubGenerationService:
    """Stands in for the trainer's generation service in hand-made rollout contexts.

    ``respond(prompt, j)`` gives the completion text of request ``j`` of a call (``prompt`` is the prompt
    object, or its ids when the plugin passed ``prompt_ids``); the default answers ``"gen{call}.{j}"``. Every
    call is recorded in :attr:`calls` (the list of prompts, possibly empty: on several processes each one calls
    the service the same number of times, some with nothing to ask). Completions carry ``logprob`` per new token
    (None imitates HF generation) and NaN on a requested prefix, like the real service; ``budget`` caps the
    completions of the batch as ``plugin_generation_budget`` does. Whether each call asked for greedy decoding is
    recorded in :attr:`greedy_calls` (parallel to :attr:`calls`).
    """

    def __init__(
        self,
        respond: Callable[[Any, int], str] | None = None,
        *,
        logprob: float | None = -1.0,
        budget: int | None = None,
        max_completion_length: int | None = None,
    ):
        self.respond = respond or (lambda prompt, j: f"gen{len(self.calls)}.{j}")
        self.logprob = logprob
        self.budget = budget
        self.max_completion_length = max_completion_length
        self.calls: list[list[Any]] = []
        self.greedy_calls: list[bool] = []
        self.used_this_batch = 0
        self.total = 0

    @property
    def remaining(self) -> int | float:
        return math.inf if self.budget is None else self.budget - self.used_this_batch

    def tokenize(self, prompts: list) -> list[list[int]]:
        return [char_encode(prompt_text(p)) for p in prompts]

    def generate(self, prompts=None, *, prompt_ids=None, prefix_ids=None, greedy=False) -> list[Completion]:
        if (prompts is None) == (prompt_ids is None):
            raise PluginError("GenerationService.generate: pass exactly one of `prompts` or `prompt_ids`.")
        requests = list(prompts) if prompts is not None else [list(p) for p in prompt_ids]
        prefixes = [list(p) for p in prefix_ids] if prefix_ids is not None else [[] for _ in requests]
        if len(prefixes) != len(requests):
            raise PluginError(f"GenerationService.generate: {len(prefixes)} prefixes for {len(requests)} prompts.")
        if self.budget is not None and self.used_this_batch + len(requests) > self.budget:
            raise GenerationBudgetExceeded(
                f"Plugins requested {len(requests)} more completions, {self.used_this_batch} already used; "
                f"plugin_generation_budget is {self.budget}."
            )
        self.calls.append(requests)
        self.greedy_calls.append(bool(greedy))
        out = []
        for j, (request, prefix) in enumerate(zip(requests, prefixes)):
            new_ids = char_encode(self.respond(request, j))
            ids = prefix + new_ids
            lps = None if self.logprob is None else [math.nan] * len(prefix) + [self.logprob] * len(new_ids)
            if self.max_completion_length is not None:
                ids = ids[: self.max_completion_length]
                lps = None if lps is None else lps[: self.max_completion_length]
            out.append(Completion(completion_ids=ids, logprobs=lps, text=char_decode(ids)))
        self.used_this_batch += len(requests)
        self.total += len(requests)
        return out


def _text_codec(tokenizer: Any) -> tuple[Callable, Callable, Callable]:
    """(encode text, decode ids, tokenize a prompt) of the kit's rollout contexts: characters without a tokenizer,
    else the tokenizer's (prompts through its chat template with the generation prompt, as TRL tokenizes them)."""
    if tokenizer is None:
        return char_encode, char_decode, lambda prompt: char_encode(prompt_text(prompt))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize_prompt(prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return encode(prompt)
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False))

    return encode, (lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)), tokenize_prompt


def _weighted_scorer(reward_funcs: Sequence[Callable], weights: Sequence[float] | None) -> Callable:
    """The trainer's scorer contract for stub contexts: every reward function's column (NaN for None and for
    placeholder columns), with the functions' names and ``weights``."""
    weights = torch.tensor(list(weights) if weights is not None else [1.0] * len(reward_funcs), dtype=torch.float32)
    names = [getattr(f, "__name__", f"reward_{k}") for k, f in enumerate(reward_funcs)]
    placeholders = tuple(is_placeholder(f) for f in reward_funcs)

    def score(rows: list[dict], prompts: list, completions: list) -> RewardColumns:
        values = torch.full((len(rows), len(reward_funcs)), math.nan)
        if rows:
            columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
            ids = [char_encode(prompt_text(c)) for c in completions]
            for k, func in enumerate(reward_funcs):
                if not placeholders[k]:
                    out = func(prompts=prompts, completions=completions, completion_ids=ids, **columns)
                    values[:, k] = torch.tensor([math.nan if v is None else float(v) for v in out])
        return RewardColumns(values, names, weights, placeholders)

    return score


def make_rollout_context(
    completions: Sequence[str] | Sequence[Sequence[str]],
    *,
    num_generations: int | None = None,
    rows: list[dict] | None = None,
    service: Any = None,
    reward_funcs: Sequence[Callable] | None = None,
    reward_weights: Sequence[float] | None = None,
    scorer: Callable | None = None,
    sampling_logprob: float | Callable[[int], float] | None = -1.0,
    conversational: bool | None = None,
    process_index: int = 0,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    step: int = 0,
    deferred: Sequence[int] = (),
    entropy: Callable[[list[int], list[int]], torch.Tensor] | None = None,
    mode: str = "train",
    run: RunInfo | None = None,
    tokenizer: Any = None,
    policy_logprobs: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]] | None = None,
    eos: bool = False,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    annotations: list[dict] | None = None,
    **services: Any,
) -> RolloutContext:
    """A :class:`~trl_plugins.RolloutContext` (sampling stage, after generation) with stub services.

    Args:
        completions: one list of G completion texts per group (or a flat list with ``num_generations``).
        rows: the local dataset rows (default: :func:`stub_rows` with one group per completion group).
        service: the generation service (default: a :class:`StubGenerationService`; read ``ctx.service.calls``).
        reward_funcs, reward_weights: what ``ctx.score`` runs (TRL's reward-function signature, weighted sum);
            default :func:`digit_fraction_reward`; ``ctx.success`` decides on the first non-placeholder one.
            ``scorer(rows, prompts, completions) -> RewardColumns`` (or an (n, K) / (n,) tensor) replaces both.
        sampling_logprob: the sampling log-prob of every generated token (vLLM), or a function of the token's
            position; None imitates HF generation (``ctx.sampling_logprobs is None``).
        process_index, gather: the process this context stands for and its all-gather (default: one process,
            identity); see :func:`run_on_processes` to simulate several.
        deferred: local rows left out of the first generation round (``PromptContext.defer``): they hold an
            empty completion and ``ctx.deferred[i]`` is True.
        entropy: ``entropy(prompt_ids, completion_ids) -> (len(completion_ids),)`` behind
            ``ctx.policy_entropies``; default 1.0 per token. The calls are recorded in ``ctx.entropy_calls``.
        run, tokenizer, policy_logprobs: what ``ctx.run``, ``ctx.tokenizer`` (default :class:`CharTokenizer`) and
            ``ctx.policy_logprobs`` give (see :func:`stub_services`).

        eos: end each completion's token ids with the tokenizer's EOS id (a generation that stopped).
        prompt_ids: the rows' prompt token ids (default: the prompts tokenized as described below).
        annotations: the rows' annotations (e.g. a prompt context's, which the trainer carries over).
        services: replace any other stub service (``tokenize_prompts``, ``decode``, ``policy_entropies`` ...;
            see :func:`stub_services`).

    Without ``tokenizer``, tokens are characters (:func:`char_encode`) and prompts are tokenized as their text; with
    one (e.g. :func:`tiny_tokenizer`), completions are encoded by it, prompts tokenized with its chat template (as
    TRL does for generation) and ``ctx.decode`` decodes with it (special tokens skipped). ``ctx.decode`` gives TRL's
    completion format (an assistant message list for conversational prompts). With ``process_index`` > 0 or
    partial groups (a group straddling processes), the layout comes from the global position, as in the trainer.
    ``ctx.metrics`` records the metrics the plugin logs.
    """
    if completions and not isinstance(completions[0], str):
        groups = [list(g) for g in completions]
        G = num_generations or len(groups[0])
        texts = [t for g in groups for t in g]
    else:
        if num_generations is None:
            raise ValueError("make_rollout_context: pass num_generations with a flat list of completions.")
        G, texts = num_generations, list(completions)
    B = len(texts)
    global_index, group_ids, index_in_group = _layout(B, G, process_index)
    if rows is None:  # one stub row per local row, asking its group's question
        rows = [stub_rows(1, 1, conversational=conversational is not False, first_group=g)[0] for g in group_ids]
    if len(rows) != B:
        raise ValueError(f"make_rollout_context: {len(rows)} rows for {B} completions.")
    prompts = [r["prompt"] for r in rows]
    if conversational is None:
        conversational = not isinstance(prompts[0], str)
    texts = ["" if i in set(deferred) else t for i, t in enumerate(texts)]
    encode, decode, tokenize_prompt = _text_codec(tokenizer)
    eos_ids = [tokenizer.eos_token_id if tokenizer else CharTokenizer.eos_token_id] if eos else []
    ids = [[] if i in set(deferred) else encode(t) + eos_ids for i, t in enumerate(texts)]

    def as_completion(text: str) -> Any:
        return [{"role": "assistant", "content": text}] if conversational else text

    logprob_at = sampling_logprob if callable(sampling_logprob) else (lambda j: sampling_logprob)
    entropy = entropy or (lambda p, c: torch.ones(len(c)))
    entropy_calls: list[int] = []

    def entropy_fn(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        entropy_calls.append(len(completion_ids))
        return [entropy(p, c) for p, c in zip(prompt_ids, completion_ids)]

    metrics = MetricsRecorder()
    ctx = RolloutContext(
        rows=rows,
        prompts=prompts,
        training_prompts=list(prompts),
        prompt_ids=[list(p) for p in prompt_ids] if prompt_ids is not None else [tokenize_prompt(p) for p in prompts],
        completion_ids=ids,
        completions=[as_completion(t) for t in texts],
        sampling_logprobs=None if sampling_logprob is None else [[float(logprob_at(j)) for j in range(len(x))]
                                                                 for x in ids],
        offpolicy=[[False] * len(x) for x in ids],
        prompt_swapped=[False] * B,
        global_index=global_index,
        group_ids=group_ids,
        index_in_group=index_in_group,
        num_generations=G,
        step=step,
        annotations=annotations if annotations is not None else [{} for _ in range(B)],
        service=service if service is not None else StubGenerationService(
            logprob=logprob_at(0) if sampling_logprob is not None else None),
        deferred=[i in set(deferred) for i in range(B)] if deferred else [],
        mode=mode,
        services=stub_services(metrics, gather=gather, tokenizer=tokenizer, run=run, policy_logprobs=policy_logprobs,
                               **{**dict(
                                   score=scorer or _weighted_scorer(reward_funcs or [digit_fraction_reward],
                                                                    reward_weights),
                                   decode=lambda ids_, prompt: as_completion(decode(ids_)),
                                   tokenize_prompts=lambda ps: [tokenize_prompt(p) for p in ps],
                                   policy_entropies=entropy_fn,
                               ), **services}),
    )
    ctx.metrics, ctx.entropy_calls = metrics, entropy_calls
    return ctx


def _as_matrix(values: Any) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32)
    return t.unsqueeze(1) if t.dim() == 1 else t


def make_reward_context(
    rewards_per_func: Any,
    *,
    num_generations: int,
    reward_func_names: Sequence[str] | None = None,
    reward_weights: Sequence[float] | None = None,
    rows: list[dict] | None = None,
    completions: list | None = None,
    step: int = 0,
    mode: str = "train",
    run: RunInfo | None = None,
    local_completion_ids: list[list[int]] | None = None,
    num_processes: int = 1,
    process_index: int = 0,
    turns: Sequence[Any] | None = None,
    annotations: Sequence[dict] | None = None,
    **services: Any,
) -> RewardContext:
    """A :class:`~trl_plugins.RewardContext`: the gathered (N, K) matrix, and the local rows of process
    ``process_index`` of ``num_processes`` (default: one process holding the whole batch).

    ``rewards_per_func`` is (N, K) (or (N,) for one reward function; nested lists are fine). Names default to
    ``reward_0..``, weights to 1. ``rows``, ``completions`` and ``local_completion_ids`` are given for all N rows;
    the context holds this process's slice. ``local_completion_ids`` default to the completions encoded as
    characters (:func:`char_encode`). ``run`` is what ``ctx.run`` gives; ``services`` go to :func:`stub_services`
    (``gather`` from :func:`run_on_processes` also gathers ``ctx.gather_object``). ``ctx.metrics`` records the
    metrics the plugin logs. ``turns``: (N,) :class:`~trl_plugins.api.turns.TurnStructure` of multi-turn tool rollouts
    (this process's slice becomes ``local_turns``). ``annotations``: (N,) sampling-stage per-row dicts (this process's
    slice becomes ``local_annotations``).
    """
    matrix = _as_matrix(rewards_per_func).clone()
    N, K = matrix.shape
    G = num_generations
    if N % G:
        raise ValueError(f"make_reward_context: {N} rows are not whole groups of {G}.")
    rows = rows if rows is not None else stub_rows(N // G, G)
    completions = completions if completions is not None else [[{"role": "assistant", "content": ""}]] * N
    if local_completion_ids is None:
        local_completion_ids = [char_encode(prompt_text(c)) for c in completions]
    B = N // num_processes
    local = slice(process_index * B, (process_index + 1) * B)
    idx = torch.arange(N)
    metrics = MetricsRecorder()
    ctx = RewardContext(
        rewards_per_func=matrix,
        reward_func_names=list(reward_func_names or [f"reward_{k}" for k in range(K)]),
        reward_weights=torch.tensor(list(reward_weights) if reward_weights is not None else [1.0] * K),
        group_ids=idx // G,
        index_in_group=idx % G,
        num_generations=G,
        local_rows=rows[local],
        local_prompts=[r.get("prompt") for r in rows[local]],
        local_completions=list(completions[local]),
        process_slice=local,
        step=step,
        local_completion_ids=list(local_completion_ids[local]),
        mode=mode,
        services=stub_services(metrics, run=run, **services),
        local_turns=list(turns[local]) if turns is not None else [],
        local_annotations=list(annotations[local]) if annotations is not None else [],
    )
    ctx.metrics = metrics
    return ctx


def simulate_sampler_loop(
    plugin: Any, start: int, stop: int, chunk_size: int, num_generations: int,
    success_of: Callable[[int, int], float], lag: int = 1,
) -> dict[int, list[int]]:
    """A training loop for a history sampler (``plugin.draw_chunk`` + its reward hook), without a model.

    Batch ``c`` (from ``start`` to ``stop - 1``) is chunk ``c``; the dataloader draws ``lag`` chunks ahead of the batch
    it reports, as TRL with accelerate's prefetch does. Prompt ``idx`` of batch ``c`` gets ``round(success_of(idx, c)
    * G)`` correct rollouts (reward 1 on a single verifier column ``acc``) of ``G = num_generations``.

    Returns:
        ``{chunk: prompt indices}`` of every chunk drawn.
    """
    drawn: dict[int, list[int]] = {}
    G = num_generations
    for c in range(start, stop):
        for ahead in range(c, c + lag + 1):
            if ahead not in drawn:
                drawn[ahead] = plugin.draw_chunk(ahead, chunk_size)
        rows = [1.0 if j < round(success_of(idx, c) * G) else 0.0 for idx in drawn[c] for j in range(G)]
        plugin.trl_plugins_transform_rewards(make_reward_context(
            torch.tensor(rows).unsqueeze(1), num_generations=G, reward_func_names=["acc"],
            completions=[f"c{j}" for j in range(len(rows))], step=c,
        ))
    return drawn


def group_normalized_advantages(rewards: torch.Tensor, num_generations: int, scale: bool = True) -> torch.Tensor:
    """TRL's default advantages: reward minus the group mean, divided by the group std + 1e-4 (``scale``)."""
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(num_generations)
    if scale:
        advantages = advantages / (grouped.std(dim=1).repeat_interleave(num_generations) + 1e-4)
    return advantages


def stub_policy_stats(
    num_rows: int, length: int = 4, *, seed: int = 0, mask: torch.Tensor | None = None, head_stats: Any = None
) -> PolicyStats:
    """Deterministic :class:`~trl_plugins.api.contexts.PolicyStats` of ``num_rows`` rows and ``length`` tokens:
    log-probs in (-3, 0), entropies in (0, 2), all tokens in the loss mask unless ``mask`` is given."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(num_rows, length) if mask is None else mask.float()
    logps = -3 * torch.rand(num_rows, length, generator=g)
    entropies = 2 * torch.rand(num_rows, length, generator=g)
    mean_entropy = (entropies * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    ids = torch.randint(0, 50, (num_rows, length), generator=g)
    return PolicyStats(per_token_logps=logps, entropies=entropies, mask=mask, completion_ids=ids,
                       mean_entropy=mean_entropy, head_stats=head_stats)


def make_advantage_context(
    rewards: Any,
    *,
    num_generations: int,
    rewards_per_func: Any = None,
    advantages: torch.Tensor | None = None,
    scale_rewards: bool = True,
    completion_lengths: Any = None,
    policy_stats: PolicyStats | None = None,
    annotations: list[dict] | None = None,
    offpolicy_fraction: Any = None,
    prompt_swapped: Any = None,
    step: int = 0,
    mode: str = "train",
    run: RunInfo | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    prompt_keys: Any = None,
    turns: Sequence[Any] | None = None,
    rows: list[dict] | None = None,
    **services: Any,
) -> AdvantageContext:
    """An :class:`~trl_plugins.AdvantageContext` of one process holding the whole batch (N rows).

    Multi-turn rows: ``turns`` ((N,) :class:`~trl_plugins.api.turns.TurnStructure`, e.g. from
    :func:`~trl_plugins.api.turns.build_turn_structure`) fill ``local_turns``, ``turn_ids`` ((N, T) with T the longest
    tool mask) and ``turn_rewards``; ``rows`` and ``prompt_ids`` fill ``local_rows`` / ``local_prompt_ids``.

    Args:
        rewards: (N,) combined rewards.
        rewards_per_func: (N, K); default ``rewards`` as one column.
        advantages: what the chain starts from; default TRL's (:func:`group_normalized_advantages`).
        completion_lengths: (N,); default 4 tokens per row.
        policy_stats: what ``ctx.policy_stats()`` returns; default :func:`stub_policy_stats`. The calls are
            recorded in ``ctx.policy_stats_calls`` (their ``head_stats`` flags). ``ctx.completion_mask()`` is
            its mask, and so is ``ctx.local_completion_mask``; its ``completion_ids`` are ``ctx.local_completion_ids``.
        run: what ``ctx.run`` gives; ``services`` go to :func:`stub_services` (``gather``, ``tokenizer`` ...).
        prompt_ids: ``ctx.local_prompt_ids`` (N lists); default each group's question of :func:`stub_rows`, as
            characters.
        prompt_keys: (N // G,) one key per group (groups a refill plugin repeated share one); default None.

    ``ctx.metrics`` records the metrics the plugin logs.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32).clone()
    N, G = rewards.numel(), num_generations
    if N % G:
        raise ValueError(f"make_advantage_context: {N} rows are not whole groups of {G}.")
    if advantages is None:
        advantages = group_normalized_advantages(torch.nan_to_num(rewards, nan=0.0), G, scale=scale_rewards)
    lengths = torch.full((N,), 4.0) if completion_lengths is None else torch.as_tensor(completion_lengths).float()
    stats = policy_stats if policy_stats is not None else stub_policy_stats(N, int(lengths.max().item()))
    idx = torch.arange(N)
    policy_stats_calls: list[bool] = []

    def policy_stats_fn(head_stats: bool) -> PolicyStats:
        policy_stats_calls.append(head_stats)
        return stats

    metrics = MetricsRecorder()
    ctx = AdvantageContext(
        rewards_per_func=_as_matrix(rewards if rewards_per_func is None else rewards_per_func).clone(),
        rewards=rewards,
        advantages=torch.as_tensor(advantages, dtype=torch.float32).clone(),
        group_ids=idx // G,
        index_in_group=idx % G,
        num_generations=G,
        completion_lengths=lengths,
        offpolicy_fraction=(torch.zeros(N) if offpolicy_fraction is None
                            else torch.as_tensor(offpolicy_fraction).float()),
        prompt_swapped=(torch.zeros(N, dtype=torch.bool) if prompt_swapped is None
                        else torch.as_tensor(prompt_swapped, dtype=torch.bool)),
        annotations=annotations if annotations is not None else [{} for _ in range(N)],
        process_slice=slice(0, N),
        step=step,
        local_completion_ids=stats.completion_ids,
        local_prompt_ids=([list(p) for p in prompt_ids] if prompt_ids is not None else
                          [char_encode(prompt_text(r["prompt"])) for r in stub_rows(N // G, G)]),
        local_completion_mask=stats.mask,
        mode=mode,
        prompt_keys=None if prompt_keys is None else torch.as_tensor(prompt_keys, dtype=torch.long),
        services=stub_services(metrics, run=run, policy_stats=policy_stats_fn, completion_mask=lambda: stats.mask,
                               **services),
    )
    ctx.metrics, ctx.policy_stats_calls = metrics, policy_stats_calls
    if turns is not None:
        from trl_plugins.api.turns import turn_ids_tensor, turn_rewards_tensor

        ctx.local_turns = list(turns)
        ctx.turn_ids = turn_ids_tensor(turns, max([len(t.tool_mask) for t in turns] + [1]))
        ctx.turn_rewards = turn_rewards_tensor(turns)
    ctx.local_rows = list(rows or [])
    return ctx


def make_refill_context(
    rewards_per_func: Any,
    *,
    num_generations: int,
    reward_weights: Sequence[float] | None = None,
    round: int = 0,
    max_refill_rounds: int = 9,
    fresh: Any = None,
    prompt_keys: Any = None,
    step: int = 0,
    run: RunInfo | None = None,
    **services: Any,
) -> RefillContext:
    """A :class:`~trl_plugins.api.contexts.RefillContext` over a whole batch (what every process sees).

    Args:
        rewards_per_func: (N, K) reward-function values, or (N,) for one column.
        reward_weights: (K,) TRL's weights; default 1.0 each. ``ctx.rewards`` is their weighted nansum.
        fresh: (S,) groups generated in this round; default all. ``prompt_keys``: (S,); default ``arange(S)``.
        run: what ``ctx.run`` gives (its ``reward_func_names`` / ``placeholder_columns`` drive ``ctx.success``).

    After the hook: ``ctx.rejected`` (S,) bool, ``ctx.replacements`` (what the plugin asked for), ``ctx.metrics``.
    """
    from trl_plugins.api.success import combined_reward

    values = _as_matrix(rewards_per_func).float().clone()
    N, K = values.shape
    G = num_generations
    if N % G:
        raise ValueError(f"make_refill_context: {N} rows are not whole groups of {G}.")
    S = N // G
    weights = torch.ones(K) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32)
    combined = combined_reward(values, weights)
    idx = torch.arange(N)
    metrics = MetricsRecorder()
    ctx = RefillContext(
        rewards_per_func=values,
        rewards=combined,
        group_ids=idx // G,
        index_in_group=idx % G,
        num_generations=G,
        round=round,
        max_refill_rounds=max_refill_rounds,
        fresh=torch.ones(S, dtype=torch.bool) if fresh is None else torch.as_tensor(fresh, dtype=torch.bool),
        prompt_keys=torch.arange(S) if prompt_keys is None else torch.as_tensor(prompt_keys, dtype=torch.long),
        rejected=torch.zeros(S, dtype=torch.bool),
        step=step,
        services=stub_services(metrics, run=run, **services),
    )
    ctx.metrics = metrics
    return ctx




def make_loss_context(
    per_token_logps: torch.Tensor | None = None,
    *,
    shape: tuple[int, int] = (2, 4),
    old_per_token_logps: torch.Tensor | None = None,
    advantages: Any = None,
    mask: torch.Tensor | None = None,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    offpolicy_mask: torch.Tensor | None = None,
    offpolicy_gamma: float = 0.1,
    extras: dict[str, torch.Tensor] | None = None,
    teacher_logps: torch.Tensor | None = None,
    completion_ids: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    clip_scale: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | None = None,
    head_stats: Any = None,
    iteration: int = 0,
    mode: str = "train",
    gradient_accumulation_steps: int = 1,
    num_generations: int | None = None,
    seed: int = 0,
    loss_options: Mapping[str, Any] | None = None,
    run: RunInfo | None = None,
    **services: Any,
) -> LossContext:
    """A :class:`~trl_plugins.LossContext` of one micro-batch, with the base surrogate built as the framework does.

    Defaults (B, T = ``shape``): deterministic log-probs in (-3, 0) with grad, old log-probs equal to them
    (ratio 1, as in the first pass over a batch), advantages ``[1, -1, 1, ...]`` per row, every token in the
    mask, ``num_items_in_batch`` = the mask's sum. ``advantages`` (B,) becomes (B, 1), as the framework passes it
    when no plugin implements ``trl_plugins_loss_advantages``; a (B, T) tensor is kept. The importance ratio
    (``importance_sampling_level``) and the surrogate of ``loss_type`` are the framework's own
    (:mod:`trl_plugins.runtime.loss_rules`: TRL's clipped surrogate, CISPO, SAPO's sigmoid gate, VESPO's gamma weights);
    tokens in ``offpolicy_mask`` take the shaped branch ``-A p/(p+gamma)``. ``loss_options`` sets the other fields
    of :class:`~trl_plugins.runtime.loss_rules.LossSettings` by name (``{"delta": 1.5}``, ``sapo_temperature_pos``,
    ``vespo_k_pos`` ...; TRL's defaults otherwise). Use :func:`loss_from_context` for the micro-batch loss with the
    plugins' contributions. ``teacher_logps`` (B, T, NaN where absent) is what ``ctx.teacher_logps`` gives (the extra
    the advantage stage attaches). ``turn_ids`` (B, T) is what ``ctx.turn_ids`` gives (multi-turn rollouts);
    ``clip_scale`` (B, T) builds the clipped surrogate with the per-token range a ``trl_plugins_loss_advantages``
    hook sets through ``ctx.scale_clip_range`` (call the hook on one context, then pass its ``ctx.clip_scale`` here).
    ``gradient_accumulation_steps`` is TRL's normaliser (1 in eval mode, as the trainer gives
    it); ``num_generations`` (G) says the rows are whole groups of G consecutive rows (``ctx.group_rows``, for plugins
    declaring ``needs_whole_groups``); ``run`` is what ``ctx.run`` gives; ``services`` go to :func:`stub_services`. ``ctx.metrics`` records the
    metrics the plugin logs.
    """
    from trl_plugins.runtime import loss_rules as rules

    loss_options = dict(loss_options or {})
    named = {"loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level", "offpolicy_gamma"}
    allowed = [f.name for f in fields(rules.LossSettings) if f.name not in named]
    unknown = sorted(set(loss_options) - set(allowed))
    if unknown:
        raise ValueError(f"make_loss_context: unknown loss option(s) {unknown}; allowed: {', '.join(allowed)}.")
    settings = rules.LossSettings(
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level,
        offpolicy_gamma=offpolicy_gamma,
        **loss_options,
    )
    if per_token_logps is None:
        g = torch.Generator().manual_seed(seed)
        per_token_logps = (-3 * torch.rand(*shape, generator=g)).requires_grad_(True)
    B, T = per_token_logps.shape
    old = per_token_logps.detach().clone() if old_per_token_logps is None else old_per_token_logps
    if advantages is None:
        advantages = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(B)])
    advantages = torch.as_tensor(advantages, dtype=per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mask = torch.ones(B, T) if mask is None else mask
    offpolicy = torch.zeros(B, T, dtype=torch.bool) if offpolicy_mask is None else offpolicy_mask.bool()
    weights = rules.importance_weights(per_token_logps, old, mask, settings.importance_sampling_level)
    surrogate = rules.base_surrogate(settings, per_token_logps, weights, advantages, mask, clip_scale=clip_scale)
    per_token_loss = rules.shape_offpolicy_tokens(
        surrogate.per_token_loss, per_token_logps, advantages, offpolicy if offpolicy.any() else None,
        settings.offpolicy_gamma,
    )
    if completion_ids is None:
        completion_ids = torch.arange(B * T).view(B, T) % 50
    metrics = MetricsRecorder()
    inputs = {"completion_ids": completion_ids, "completion_mask": mask}
    if turn_ids is not None:
        inputs[TURN_IDS_KEY] = turn_ids
    ctx = LossContext(
        inputs=inputs,
        per_token_logps=per_token_logps,
        old_per_token_logps=old,
        ref_per_token_logps=ref_per_token_logps,
        sampling_per_token_logps=sampling_per_token_logps,
        entropies=entropies if entropies is not None else torch.ones(B, T),
        advantages=advantages,
        mask=mask,
        offpolicy_mask=offpolicy,
        extras={**dict(extras or {}), **({} if teacher_logps is None else {TEACHER_LOGPS_EXTRA: teacher_logps})},
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        num_items_in_batch=mask.sum() if num_items_in_batch is None else num_items_in_batch,
        iteration=iteration,
        mode=mode,
        gradient_accumulation_steps=gradient_accumulation_steps if mode == "train" else 1,
        num_generations=num_generations,
        log_ratio=weights.log_weights,
        coef_1=weights.coef_1,
        per_token_loss=per_token_loss,
        clip_scale=clip_scale,
        services=stub_services(metrics, run=run, head_stats=None if head_stats is None else (lambda: head_stats),
                               **services),
    )
    ctx.metrics = metrics
    return ctx


def loss_from_context(ctx: LossContext, max_completion_length: int | None = None) -> torch.Tensor:
    """The micro-batch loss the framework builds from a loss context after the ``trl_plugins_loss`` hooks.

    The framework's own rules (:func:`~trl_plugins.runtime.loss_rules.compose_token_loss`,
    :func:`~trl_plugins.runtime.loss_rules.aggregate`) for one process, no gradient accumulation and none of TRL's extra
    factors (no KL, entropy mask, off-policy sequence mask, vLLM ratio or entropy bonus): the replaced token subset,
    times every plugin's token weights, plus the additive token terms, aggregated by ``ctx.loss_type``
    (``dr_grpo`` divides by ``B * max_completion_length``, default T), plus the scalar terms.
    """
    from trl_plugins.runtime import loss_rules as rules

    per_token = rules.compose_token_loss(
        ctx.per_token_loss, replacement=ctx.replacement, token_weights=ctx.token_weights, token_terms=ctx.token_terms
    )
    loss, _ = rules.aggregate(
        ctx.loss_type,
        per_token,
        ctx.mask,
        num_items_in_batch=ctx.num_items_in_batch,
        max_completion_length=max_completion_length or ctx.mask.size(1),
        mode=ctx.mode,
    )
    return rules.add_scalar_terms(loss, ctx.scalar_terms)


# ------------------------------------------------------------------------------------------ enabling and calling
def stub_trainer(args: Any, **attributes: Any) -> SimpleNamespace:
    """A stand-in trainer for ``trl_plugins_configure`` in unit tests: the attributes plugins usually read
    (``args``, ``max_completion_length``, ``num_generations``, ``loss_type``, ``temperature``, ``beta``,
    ``state.global_step``, ``accelerator.num_processes``, ``plugin_services`` (:func:`stub_services`) ...);
    ``attributes`` adds or overrides any."""
    values = dict(
        args=args,
        max_completion_length=args.max_completion_length,
        num_generations=args.num_generations,
        loss_type=args.loss_type,
        temperature=args.temperature,
        beta=args.beta,
        use_vllm=args.use_vllm,
        processing_class=None,
        state=SimpleNamespace(global_step=0, max_steps=args.max_steps),
        accelerator=SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                                    device=torch.device("cpu")),
        plugin_services=stub_services(),
    )
    values.update(attributes)
    return SimpleNamespace(**values)


def build_stack(
    plugins: str | type[Plugin] | Sequence[str | type[Plugin]],
    plugin_config: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    configure: bool = True,
    trainer: Any = None,
    **config: Any,
) -> PluginStack:
    """Enable plugins by name (or class, e.g. one defined in the test) with validated options, and call their
    ``trl_plugins_configure`` hooks with a tiny ``PluginGRPOConfig``
    (``config`` sets its fields, e.g. ``loss_type="dr_grpo"``) and ``trainer`` (default :func:`stub_trainer`).

    ``plugin_config`` is keyed by plugin name, as in ``PluginGRPOConfig``.
    """
    items = [plugins] if isinstance(plugins, (str, type)) else list(plugins)
    names, to_register = [], []
    for item in items:
        name, cls = _resolve_plugin(item)
        names.append(name)
        if cls is not None:
            to_register.append(cls)
    with contextlib.ExitStack() as scope:
        for cls in to_register:  # registered by name only while the stack and its config are built
            scope.enter_context(temporary_plugin(cls))
        stack = build_plugins(names, plugin_config)
        if configure:
            config.setdefault("output_dir", os.path.join(tempfile.gettempdir(), "trl_plugins_stack"))
            args = tiny_config(plugins=names, plugin_config=dict(plugin_config or {}), **config)
    if configure:
        stack.call("trl_plugins_configure", trainer=trainer if trainer is not None else stub_trainer(args), args=args)
    return stack


def hook_name(hook: str) -> str:
    """The full hook name for ``hook``, which may omit the ``trl_plugins_`` prefix (``"loss"``,
    ``"transform_advantages"``); an unknown name is refused with the closest hooks."""
    from trl_plugins.api.errors import suggest
    from trl_plugins.api.hookspecs import HOOK_STAGES

    full = hook if hook.startswith("trl_plugins_") else f"trl_plugins_{hook}"
    if full not in HOOK_STAGES:
        short = [h[len("trl_plugins_"):] for h in HOOK_STAGES]
        raise PluginError(f"Unknown hook {hook!r}.{suggest(full, HOOK_STAGES) or suggest(hook, short)} Hooks: "
                          f"{', '.join(short)} (with or without the trl_plugins_ prefix).")
    return full


def run_hook(
    plugins: str | type[Plugin] | Sequence[str | type[Plugin]] | PluginStack,
    hook: str,
    ctx: Any,
    plugin_config: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    **config: Any,
) -> Any:
    """Call ``hook`` of the enabled plugins on ``ctx``, in order, exactly as the trainer does (the context knows
    which plugin is active, so metrics get its name), and return ``ctx``.

    Args:
        plugins: a plugin name or class, several, or a stack from :func:`build_stack`.
        hook: the hook, with or without its ``trl_plugins_`` prefix: ``"transform_advantages"``, ``"loss"`` ...
        ctx: a context from ``make_*_context``.
        plugin_config: options keyed by plugin name, as in ``PluginGRPOConfig``.
        options: shorthand for one plugin: its options (``options={"kappa": 0.1}`` is
            ``plugin_config={name: {"kappa": 0.1}}``).
        config: ``PluginGRPOConfig`` fields of the run the plugins are configured with (``max_completion_length=4``).

    Example::

        ctx = run_hook("my_method", "transform_advantages", make_advantage_context([1, 0, 0, 1]),
                       options={"scale": 2.0})
    """
    hook = hook_name(hook)
    if options is not None:
        if isinstance(plugins, PluginStack) or not isinstance(plugins, (str, type)):
            raise PluginError("run_hook: options= is for one plugin given by name or class; use plugin_config= "
                              "({name: {...}}) for several plugins or a built stack.")
        if plugin_config:
            raise PluginError("run_hook: give either options= or plugin_config=, not both.")
        plugin_config = {_resolve_plugin(plugins)[0]: dict(options)}
    stack = plugins if isinstance(plugins, PluginStack) else build_stack(plugins, plugin_config, **config)
    stack.call(hook, ctx)
    return ctx


# ------------------------------------------------------------------------------------------ simulated processes
class SimulatedCollective:
    """All-gather across threads standing for processes (concatenation in rank order, like
    ``accelerator.gather``). A process that does not join a collective makes the others time out with an
    error instead of hanging: that is the deadlock the framework must never allow."""

    def __init__(self, num_processes: int, timeout: float = 30.0):
        self.num_processes = num_processes
        self._slots: list[Any] = [None] * num_processes
        self._barrier = threading.Barrier(num_processes, timeout=timeout)
        self.calls = [0] * num_processes

    def gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.calls[rank] += 1
        self._slots[rank] = tensor
        self._barrier.wait()
        out = torch.cat([torch.as_tensor(s) for s in self._slots])
        self._barrier.wait()
        return out

    def gather_object(self, rank: int, values: list) -> list:
        """Concatenate every process's Python list in rank order (like ``accelerate.utils.gather_object``)."""
        self.calls[rank] += 1
        self._slots[rank] = list(values)
        self._barrier.wait()
        out = [value for slot in self._slots for value in slot]
        self._barrier.wait()
        return out


def run_on_processes(num_processes: int, fn: Callable[[int, Callable], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank, gather)`` on ``num_processes`` simulated processes (threads) and return their results.

    ``gather`` is that process's all-gather; pass it as ``make_rollout_context(..., process_index=rank,
    gather=gather)``. ``gather.objects`` gathers Python lists the same way (a reward context's ``gather_object``:
    ``make_reward_context(..., gather=gather)``). The first exception of any process is re-raised (a collective left
    by one process raises ``threading.BrokenBarrierError`` in the others)."""
    collective = SimulatedCollective(num_processes, timeout=timeout)
    results: list[Any] = [None] * num_processes
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            gather = functools.partial(collective.gather, rank)
            gather.objects = functools.partial(collective.gather_object, rank)  # type: ignore[attr-defined]
            results[rank] = fn(rank, gather)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)
            collective._barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(num_processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results


#: The collective members of :class:`~trl_plugins.api.services.StageServices`: a hook must call each the same number of
#: times on every process (docs/writing-a-plugin.md, "Collective services").
COLLECTIVE_SERVICES = ("gather", "gather_object", "score", "policy_entropies", "policy_logprobs", "policy_features",
                       "reference_features", "policy_stats", "reference_logprobs", "head_stats")


def assert_collective_calls_even(
    plugins: str | type[Plugin] | Sequence[str | type[Plugin]] | PluginStack,
    hook: str,
    contexts: Sequence[Any],
    plugin_config: Mapping[str, Mapping[str, Any]] | None = None,
    **config: Any,
) -> dict[str, list[int]]:
    """Fail when ``hook`` calls a collective service a different number of times on different processes.

    ``contexts`` holds one context per simulated process (e.g. ``make_rollout_context(..., process_index=rank)`` for
    each rank, with the rows that differ between processes). The hook runs on each, in turn, with every collective
    service (:data:`COLLECTIVE_SERVICES`, and ``ctx.service.generate`` where the context has a generation service)
    counted. Under FSDP or ZeRO-3 a process that calls one of them fewer times leaves the others waiting or aborts
    them; here it raises an ``AssertionError`` naming the service and the counts per process. Returns
    ``{service: [calls on process 0, 1, ...]}``.
    """
    import dataclasses

    stack = plugins if isinstance(plugins, PluginStack) else build_stack(plugins, plugin_config, **config)
    counts: dict[str, list[int]] = {}
    for rank, ctx in enumerate(contexts):
        def counted(name: str, fn: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                counts.setdefault(name, [0] * len(contexts))[rank] += 1
                return fn(*args, **kwargs)
            return call

        services = ctx.services
        wrapped = {name: counted(name, getattr(services, name)) for name in COLLECTIVE_SERVICES
                   if getattr(services, name, None) is not None}
        ctx.services = dataclasses.replace(services, **wrapped)
        generation = getattr(ctx, "service", None)
        original_generate = getattr(generation, "generate", None)
        if original_generate is not None:
            generation.generate = counted("service.generate", original_generate)
        try:
            stack.call(hook_name(hook), ctx)
        finally:
            ctx.services = services
            if original_generate is not None:
                generation.generate = original_generate
    uneven = {name: calls for name, calls in counts.items() if len(set(calls)) > 1}
    if uneven:
        detail = "; ".join(f"{name}: {calls}" for name, calls in uneven.items())
        raise AssertionError(
            f"{hook_name(hook)} calls collective services a different number of times per process ({detail}; calls "
            "on process 0, 1, ...). Call each once on every process, with no rows where a process has none "
            "(docs/writing-a-plugin.md, 'Collective services')."
        )
    return counts


# ------------------------------------------------------------------------------------------ stage contracts
def _check_layout(global_index: Sequence[int], group_ids: Sequence[int], index_in_group: Sequence[int], G: int) -> None:
    for g, gid, k in zip(global_index, group_ids, index_in_group):
        assert gid == g // G and k == g % G, (
            f"row with global index {g} has group id {gid} and index in group {k}; expected {g // G} and {g % G} "
            "(both come from the global position)"
        )
    if global_index:
        expected = list(range(global_index[0], global_index[0] + len(global_index)))
        assert list(global_index) == expected, "global indices of the local rows are not contiguous"


def assert_group_sizes(obj: Any, num_generations: int | None = None) -> None:
    """Group structure: exactly G rows per prompt, and a row's group and index come from its global position.

    ``obj`` is a stage context (prompt, rollout, reward or advantage), a generation batch returned by
    ``trainer._generate_and_score_completions`` (a dict; pass ``num_generations``) or a :class:`RunRecord`.
    Checks that every per-row field has one entry per row, that group ids / indices equal ``g // G`` and
    ``g % G``, that whole groups are present, and (sampling contexts) that the rows of a group share one
    original prompt.
    """
    if isinstance(obj, (PromptContext, RolloutContext)):
        G = num_generations or obj.num_generations
        B = len(obj.rows)
        fields = ["prompts", "training_prompts", "global_index", "group_ids", "index_in_group", "annotations"]
        if isinstance(obj, PromptContext):
            fields.append("generation_prompts")
        else:
            fields += ["prompt_ids", "completion_ids", "completions", "offpolicy", "prompt_swapped"]
            if obj.sampling_logprobs is not None:
                fields.append("sampling_logprobs")
        for name in fields:
            n = len(getattr(obj, name))
            assert n == B, f"{type(obj).__name__}.{name} has {n} entries for {B} rows (the group size never changes)"
        _check_layout(obj.global_index, obj.group_ids, obj.index_in_group, G)
        groups: dict[int, list[int]] = {}
        for i, gid in enumerate(obj.group_ids):
            groups.setdefault(gid, []).append(i)
        for gid, members in groups.items():
            whole = obj.global_index[0] <= gid * G and (gid + 1) * G <= obj.global_index[0] + B
            if whole:
                assert len(members) == G, f"group {gid} has {len(members)} rows; expected G={G}"
            first = obj.prompts[members[0]]
            assert all(obj.prompts[i] == first for i in members), f"rows of group {gid} have different prompts"
        return
    if isinstance(obj, (RewardContext, AdvantageContext)):
        G = num_generations or obj.num_generations
        N = obj.rewards_per_func.size(0)
        assert N % G == 0, f"{N} rows are not whole groups of G={G}"
        idx = torch.arange(N, device=obj.group_ids.device)
        assert torch.equal(obj.group_ids, idx // G), "group_ids differ from global_row // G"
        assert torch.equal(obj.index_in_group, idx % G), "index_in_group differs from global_row % G"
        per_row = {"rewards_per_func": obj.rewards_per_func}
        if isinstance(obj, AdvantageContext):
            per_row.update(rewards=obj.rewards, advantages=obj.advantages, completion_lengths=obj.completion_lengths,
                           offpolicy_fraction=obj.offpolicy_fraction, prompt_swapped=obj.prompt_swapped,
                           **{f"extras[{k!r}]": v for k, v in obj.extras.items()})
            assert len(obj.annotations) == N, f"{len(obj.annotations)} annotations for {N} rows"
        for name, tensor in per_row.items():
            assert tensor.size(0) == N, f"{name} has {tensor.size(0)} rows; expected N={N}"
        return
    if isinstance(obj, RunRecord):
        assert obj.completion_ids, "no generation batch recorded"
        for ids, adv in zip(obj.completion_ids, obj.advantages):
            assert adv.size(0) == ids.size(0), f"{adv.size(0)} advantages for {ids.size(0)} rows"
            if num_generations is not None:
                assert ids.size(0) % num_generations == 0, f"{ids.size(0)} rows are not whole groups of G"
        return
    if isinstance(obj, Mapping):
        sizes = {k: v.size(0) for k, v in obj.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
        n = obj["completion_ids"].size(0)
        wrong = {k: s for k, s in sizes.items() if s != n}
        assert not wrong, f"per-row tensors of the batch disagree with completion_ids ({n} rows): {wrong}"
        if num_generations is not None:
            assert n % num_generations == 0, f"{n} rows are not whole groups of G={num_generations}"
        return
    raise TypeError(f"assert_group_sizes: unsupported object {type(obj).__name__}")


def _all_nan(values: Sequence[float]) -> bool:
    return all(math.isnan(v) for v in values)


def assert_offpolicy_logprobs_nan(obj: Any, prompt_swapped: Sequence[bool] | None = None) -> None:
    """Provenance: every off-policy token, and every token of a row trained under another prompt
    than it was sampled from, has a NaN sampling log-prob, so TRL's vLLM importance-sampling correction and
    off-policy masks leave it alone; flags and log-probs have one entry per completion token.

    ``obj`` is a :class:`~trl_plugins.RolloutContext` (after the plugin ran) or a generation batch returned by
    ``trainer._generate_and_score_completions`` (a dict with ``offpolicy_mask`` and, when the backend gives
    them, ``sampling_per_token_logps``; pass ``prompt_swapped`` per row to check swapped rows too). With HF
    generation there are no sampling log-probs: only the shapes are checked.

    Inside an ``after_generation`` hook of a real run, rows swapped at the prompt stage still hold the backend's
    log-probs (the trainer sets them to NaN once the sampling hooks are done); check such a context with
    ``prompt_swapped=[False] * len(ctx)`` and the swapped rows on the generation batch.
    """
    if isinstance(obj, RolloutContext):
        swapped = obj.prompt_swapped if prompt_swapped is None else prompt_swapped
        for i, ids in enumerate(obj.completion_ids):
            assert len(obj.offpolicy[i]) == len(ids), (
                f"row {i}: {len(obj.offpolicy[i])} provenance flags for {len(ids)} completion tokens"
            )
            if obj.sampling_logprobs is None:
                continue
            lps = obj.sampling_logprobs[i]
            assert len(lps) == len(ids), f"row {i}: {len(lps)} sampling log-probs for {len(ids)} completion tokens"
            if swapped[i]:
                assert _all_nan(lps), f"row {i} is prompt-swapped but has finite sampling log-probs"
            bad = [t for t, (off, lp) in enumerate(zip(obj.offpolicy[i], lps)) if off and not math.isnan(lp)]
            assert not bad, f"row {i}: off-policy tokens {bad} have finite sampling log-probs"
        return
    if isinstance(obj, Mapping):
        from trl_plugins.api.contexts import OFFPOLICY_KEY

        mask = obj["completion_mask"].bool()
        off = obj.get(OFFPOLICY_KEY)
        if off is not None:
            assert off.shape == mask.shape, (
                f"{OFFPOLICY_KEY} has shape {tuple(off.shape)}; expected {tuple(mask.shape)}"
            )
        lps = obj.get("sampling_per_token_logps")
        if lps is None:
            return
        assert lps.shape == mask.shape, f"sampling_per_token_logps has shape {tuple(lps.shape)}"
        if off is not None:
            bad = off.bool() & mask & ~torch.isnan(lps)
            assert not bad.any(), f"off-policy tokens with finite sampling log-probs at {bad.nonzero().tolist()}"
        for i, s in enumerate(prompt_swapped or []):
            if s:
                assert torch.isnan(lps[i][mask[i]]).all(), (
                    f"row {i} is prompt-swapped but has finite sampling log-probs"
                )
        return
    raise TypeError(f"assert_offpolicy_logprobs_nan: unsupported object {type(obj).__name__}")


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
        """:func:`make_tiny_trainer` with ``output_dir`` in the test's temporary directory."""
        return functools.partial(make_tiny_trainer, output_dir=str(tmp_path / "out"))

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



def digit_fraction_reward(completions, **kwargs) -> list[float]:
    """A dense reward for untrained tiny models: the fraction of digit characters in the completion.

    Random completions get different values, so groups have non-zero reward variance and non-zero advantages
    (the accuracy reward is all zeros for an untrained model, which would make equality checks vacuous).
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]
