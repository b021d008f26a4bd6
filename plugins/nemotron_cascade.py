"""Nemotron-Cascade — cascaded domain-wise RL: one domain after another instead of a blend (arXiv:2512.13607).

Cascade RL trains a general-purpose reasoning model with **sequential, domain-wise RL stages** (the paper's cascade:
RLHF, then instruction following, math, code, software engineering), each stage on its own domain's prompts with its
own reward and settings (e.g. its response length), instead of blending heterogeneous prompts in one run; later
stages rarely undo earlier ones. Facts from the paper's abstract and method overview: the order of the stages, one
domain per stage, GRPO on-policy within each stage, per-stage reward functions and generation lengths.

Here the cascade is a schedule over one run: the training dataset holds every domain (``domain_column`` names each
row's), ``stages`` lists the domains in order and ``stage_steps`` how many optimizer steps each stage lasts (the last
runs to the end). While stage ``s`` is in force:

* the sampler draws only rows of ``stages[s]`` (uniformly without replacement within a generation batch; the draws of
  generation batch ``c`` depend on ``(seed, c)`` alone, so every process draws alike and a resumed run draws what the
  unbroken run drew; the sampler is :mod:`trl_plugins.components.prompt_history`'s, no history is read);
* reward columns outside ``stage_rewards[s]`` (reward function names; empty = every column) are zeroed in the reward
  matrix, so each stage trains on its own reward;
* generation is capped at ``stage_max_lengths[s]`` tokens (0 = ``max_completion_length``), the paper's per-stage
  response length.

A generation batch belongs to the stage of the optimizer step it starts in (``num_iterations * steps_per_generation /
gradient_accumulation_steps`` optimizer steps per generation batch). With ``stages`` empty the plugin keeps TRL's
sampler and rewards (vanilla GRPO).

No official training code was found (NVIDIA released models and data); the in-run schedule (one trainer instead of one
run per stage, so optimizer state and learning-rate schedule carry across stages), the uniform draws within a domain
and the zeroed columns (rather than per-stage reward functions) are reconstructed. Per-stage optimizer settings
(learning rate, rollouts per prompt) are not covered: run one trainer per stage for those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.options import PluginOptions
from trl_plugins.components.prompt_history import HistoryRepeatSampler, chunk_generator, refuse_iterable_dataset


@dataclass
class NemotronCascadeOptions(PluginOptions):
    stages: list[str] = option(
        default_factory=list,
        help="Domains in training order, one stage each (paper: RLHF, IF, math, code, SWE); empty = no cascade.",
    )
    stage_steps: list[int] = option(
        default_factory=list,
        help="Optimizer steps of each stage but the last (which runs to the end); one entry fewer than stages.",
    )
    domain_column: str = option("domain", help="Dataset column naming each row's domain.")
    stage_rewards: list[list[str]] = option(
        default_factory=list,
        help="Per stage, the reward functions that count (the other columns are zeroed); empty list = every column "
        "in every stage.",
    )
    stage_max_lengths: list[int] = option(
        default_factory=list,
        help="Per stage, the generation length cap in tokens (0 = max_completion_length); empty = no caps.",
    )

    def validate(self) -> None:
        n = len(self.stages)
        if len(set(self.stages)) != n:
            _refuse("stages", self.stages, "distinct domain names")
        if n and len(self.stage_steps) != n - 1:
            _refuse("stage_steps", self.stage_steps,
                    f"{n - 1} positive step counts (one per stage but the last, for stages={self.stages!r})")
        if any(s < 1 for s in self.stage_steps):
            _refuse("stage_steps", self.stage_steps, "positive counts")
        for key in ("stage_rewards", "stage_max_lengths"):
            if getattr(self, key) and len(getattr(self, key)) != n:
                _refuse(key, getattr(self, key), f"one entry per stage ({n} for stages={self.stages!r}) or an empty list")
        if any(v < 0 for v in self.stage_max_lengths):
            _refuse("stage_max_lengths", self.stage_max_lengths, "token counts >= 0 (0 = max_completion_length)")

    @property
    def active(self) -> bool:
        return bool(self.stages)


def _refuse(key: str, value: object, allowed: str) -> None:
    raise PluginConfigError(f"Option {key!r} of plugin 'nemotron_cascade' got {value!r}; allowed: {allowed}.")


def stage_of_step(step: float, stage_steps: list[int]) -> int:
    """Index of the stage in force at optimizer step ``step`` (0-based): stage ``s`` covers
    ``[sum(stage_steps[:s]), sum(stage_steps[:s+1]))``, the last stage everything after."""
    boundary = 0
    for s, length in enumerate(stage_steps):
        boundary += length
        if step < boundary:
            return s
    return len(stage_steps)


def domain_chunk(rows: torch.Tensor, size: int, generator: torch.Generator) -> list[int]:
    """``size`` row indices drawn uniformly from ``rows`` ((n_d,) long), without replacement while they last (a domain
    with fewer rows than a generation batch repeats them in a fresh permutation)."""
    order = [rows[torch.randperm(rows.numel(), generator=generator)] for _ in range(math.ceil(size / rows.numel()))]
    return torch.cat(order)[:size].tolist()


def masked_rewards(rewards: torch.Tensor, names: list[str], keep: list[str]) -> torch.Tensor:
    """``rewards`` (N, K) with the columns not named in ``keep`` set to 0 (``keep`` empty: unchanged)."""
    if not keep:
        return rewards
    mask = torch.tensor([name in keep for name in names], device=rewards.device)
    return torch.where(mask.unsqueeze(0), rewards, torch.zeros_like(rewards))


class NemotronCascadePlugin(Plugin):
    """Sequential domain-wise stages: each stage's prompts, reward columns and length cap in turn (sampling stage)."""

    name = "nemotron_cascade"
    multi_turn = True
    image_inputs = True
    version = "0.1.0"
    paper = (
        "Nemotron-Cascade: Scaling Cascaded Reinforcement Learning for General-Purpose Reasoning Models, "
        "arXiv:2512.13607"
    )
    summary = "Trains domain after domain (its prompts, its rewards, its length cap) instead of a blend of all domains."
    Options = NemotronCascadeOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official training code was found (models and data only); the cascade follows the paper's abstract "
        "and method overview; the in-run schedule, the draws within a domain and the zeroed reward columns are "
        "reconstructed.",
    )
    claim_metric = ("stage", "cascade stage in force")
    replaces = ("the training sampler (which prompts are drawn: the stage's domain only)",)
    conflicts_with_hooks = {
        "trl_plugins_train_sampler": "both replace the training sampler, and only the last replacement would draw the "
        "prompts (the cascade's domains would no longer be followed)",
    }
    reconstructed = (
        "one run with a step schedule (the paper trains one run per stage, from the previous stage's checkpoint)",
        "uniform draws without replacement within the stage's domain",
        "a stage's reward = the sum of its columns, the others zeroed (stage_rewards)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._seed = 0
        self._steps_per_chunk = 1.0
        self._rows: list[torch.Tensor] = []
        self._trainer_cap = None
        self._cap_stage = -1

    def hook_enabled(self, hook: str) -> bool:
        return self.options.active  # no stages: TRL's sampler and rewards (vanilla GRPO)

    def required_columns(self) -> list[str]:
        return [self.options.domain_column] if self.options.active else []

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        refuse_iterable_dataset(trainer, self.name)
        self._seed = int(args.seed)
        self._steps_per_chunk = trainer.num_iterations * args.steps_per_generation / args.gradient_accumulation_steps
        unknown = [n for stage in o.stage_rewards for n in stage if n not in trainer.reward_func_names]
        if unknown:
            raise PluginConfigError(
                f"nemotron_cascade: stage_rewards names {unknown}, which are not reward functions of this run "
                f"({trainer.reward_func_names})."
            )
        if trainer.train_dataset is not None:
            self._bind(trainer.train_dataset)
        self._apply_cap(trainer, 0)

    def _bind(self, dataset) -> None:
        o = self.options
        labels = [str(v) for v in dataset[o.domain_column]]
        self._rows = [torch.tensor([i for i, v in enumerate(labels) if v == d], dtype=torch.long) for d in o.stages]
        empty = [d for d, rows in zip(o.stages, self._rows) if rows.numel() == 0]
        if empty:
            raise PluginConfigError(
                f"nemotron_cascade: no training row has {o.domain_column}={empty[0]!r} (stages={o.stages!r}; the "
                f"dataset's domains: {sorted(set(labels))})."
            )

    @hookimpl
    def trl_plugins_train_sampler(self, trainer, sampler, dataset):
        self._bind(dataset)
        return HistoryRepeatSampler(self.draw_chunk, len(dataset), sampler.mini_repeat_count, sampler.batch_size,
                                    sampler.repeat_count)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        self._apply_cap(trainer, stage_of_step(step, self.options.stage_steps))

    def _apply_cap(self, trainer, stage: int) -> None:
        caps = self.options.stage_max_lengths
        if caps and stage != self._cap_stage:
            trainer.set_generation_length_cap(caps[stage] or None)
            self._cap_stage = stage

    # ------------------------------------------------------------------------------------------ stages
    def stage_of_chunk(self, chunk: int) -> int:
        """The stage of generation batch ``chunk``: that of the optimizer step it starts in."""
        return stage_of_step(math.floor(chunk * self._steps_per_chunk + 1e-9), self.options.stage_steps)

    def draw_chunk(self, chunk: int, size: int) -> list[int]:
        """``size`` rows of the domain of ``chunk``'s stage (a function of the seed and ``chunk`` alone)."""
        return domain_chunk(self._rows[self.stage_of_chunk(chunk)], size, chunk_generator(self._seed, chunk))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Zero the reward columns the current stage does not train on (the gathered matrix, every process alike)."""
        if ctx.mode != "train":
            return
        o = self.options
        stage = stage_of_step(ctx.step, o.stage_steps)
        if o.stage_rewards:
            ctx.rewards_per_func = masked_rewards(ctx.rewards_per_func, list(ctx.reward_func_names),
                                                  o.stage_rewards[stage])
        ctx.log_metric("stage", float(stage))
        domain = o.domain_column
        local = [str(row.get(domain)) == o.stages[stage] for row in ctx.local_rows]
        ctx.log_metric("stage_domain_fraction", sum(local) / max(len(local), 1))
