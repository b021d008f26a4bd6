"""RLPR — Reinforcement Learning with reference Probability Reward (arXiv:2506.18254).

Verifier-free RL for free-form answers. A response ``o = (z, y)`` is its reasoning
``z`` followed by its answer ``y``. RLPR swaps the generated answer for the reference answer ``y*`` and asks the
policy itself how likely ``y*`` is after its own reasoning:

1. ``o' = z || y*``; one extra **no-grad** forward of the policy on ``[prompt + z + y*]`` gives the per-token
   probabilities ``p_j`` of the ``y*`` tokens (through the framework's ``policy_logprobs`` service:
   no full-vocabulary logits are kept, the sampling temperature applies as in TRL's log-probs).
2. Probability reward: the **mean** token probability ``r = (1/|y*|) sum_j p_j`` (more robust than the sequence
   likelihood, which collapses on long answers).
3. Debiasing: ``r_hat = clip(r - r_0, 0, 1)`` with ``r_0`` the same mean probability of ``y*`` directly after the
   prompt (no reasoning), so that only the reasoning's contribution is rewarded (``debias=false`` keeps ``r``).
   As in the official code (OpenBMB/RLPR), ``r_0`` is computed **once with the initial policy**: at the first
   training reward call, before any update, for every (prompt, reference) pair of the training dataset, and then
   looked up (``baseline="initial"``). A pair not in the dataset (e.g. a prompt a sampling plugin rewrote, or an
   iterable dataset that cannot be scanned) gets its ``r_0`` from the policy of the step it first appears in, kept
   from then on (metric ``late_baseline_fraction``). ``baseline="current"`` recomputes ``r_0`` with the current
   policy at every step instead (the plugin's earlier behaviour; not the official recipe).
4. Standard-deviation filtering: prompts whose rewards barely vary across the group carry no learning signal and
   mostly noise; groups whose ``rlpr`` reward std is below a threshold are **dropped and the batch refilled** with
   new prompts, as the official trainer filters every generation batch and generates more until the batch is full
   (sharkchill-xy/DPPR@76b76f3, derived from OpenBMB/RLPR, ``verl/trainer/ppo/ray_trainer.py:1390-1425`` keep
   ``std >= lower bound``, ``:1605-1620`` the refill loop). Here the ``trl_plugins_reject_groups`` hook rejects such
   groups of every refill round and the trainer refills their slots (``max_refill_rounds`` / ``refill_at_limit``);
   ``filter_drop="zero_advantage"`` keeps the batch and zeroes their advantages instead (cheaper, no regeneration;
   the plugin's behaviour before 2026-11-27).
   Official recipe (``reproduce_qwen.sh`` and ``ray_trainer.py:1555-1592, 1776-1778, 2110-2121``): threshold =
   ``std_filter_beta`` (0.5) times an exponential moving average (ratio 0.99) of the per-step mean group std. Steps are
   counted from 1, one per training batch. The steps ``ema_start_step`` (6) .. ``filter_start_step - 1`` (10) only
   record the mean group std of their final batch; at ``filter_start_step`` (11) the average starts as the mean of
   those records, and each later step first folds in the previous step's mean -- from step 11 on the mean over every
   group generated in that step (refill rounds included, as the official list extends over every generation batch).
   The threshold of a step therefore never uses that step's own batch; no group is filtered before step 11.
   ``std_threshold`` fixes the threshold instead (from step 1).

The reward is the column ``rlpr``. Splitting ``z`` from ``y``: ``z`` is the completion up to and including the first
match of ``answer_marker`` (default: ``Answer:``, the bundled tasks' answer line), and ``y*`` is
``answer_template`` filled with the row's ``answer`` column; a completion without a marker keeps all its text as
``z`` followed by ``answer_prefix``.

Differences from the official code: the official reward adds a 0.1-weighted format
score (add a format reward function for it), and its filter reads the std of that total reward where the plugin
reads the std of the ``rlpr`` column. Reconstructed (options marked so): the marker/template defaults (the
paper uses its own answer tags), the prefix used for ``r_0``, the unbiased std. The earlier filter of this plugin
(threshold = the moving average itself, updated with the current batch before filtering, from the first step) is
``std_filter_beta=1, ema_start_step=1, filter_start_step=1, threshold_uses_current_batch=true``.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RefillContext,
    StageServices,
    hookimpl,
    option,
)
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.reasons import CORRECTNESS_PICK_ONE, REFILLS_GROUPS
from trl_plugins.api.text import check_template, completion_text
from trl_plugins.api.reasons import IMAGES_POLICY_PROBE

COLUMN = "rlpr"


@dataclass
class RlprOptions(PluginOptions):
    answer_column: str = option("answer", help="Dataset column with the reference answer y*.")
    answer_marker: str = option(
        r"(?i)answer\s*:", help="Regex; the reasoning z ends with its first match in the completion.",
        reconstructed=True,
    )
    answer_template: str = option(
        " {answer}", help="How the reference answer is written after the marker ({answer} is replaced).",
        reconstructed=True,
    )
    answer_prefix: str = option(
        "\nAnswer:", help="Appended to a completion without a marker (and after the prompt for r_0) before y*.",
        reconstructed=True,
    )
    debias: bool = option(True, help="Subtract the no-reasoning probability r_0 and clip to [0, 1].")
    baseline: Literal["initial", "current"] = option(
        "initial",
        help="Policy that gives r_0. initial (official): computed once with the initial policy for every "
        "(prompt, reference) pair of the training dataset before the first update; current: recomputed with the "
        "current policy at every step (not the official recipe).",
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the rlpr column.")
    std_filter: bool = option(True, help="Drop the groups whose rlpr reward std is below the threshold (filter_drop).")
    filter_drop: Literal["refill", "zero_advantage"] = option(
        "refill",
        help="How std_filter drops a group. refill (official: filter and resample): reject it through the refill "
        "stage, the trainer regenerates its slot with a new prompt (max_refill_rounds, refill_at_limit); "
        "zero_advantage: keep it with zero advantages (cheaper; no regeneration).",
    )
    std_threshold: float | None = option(
        None, min=0.0,
        help="Fixed std threshold, applied from step 1; None = std_filter_beta x moving average of the per-step "
        "mean group std (official).",
    )
    std_filter_beta: float = option(
        0.5, min=0.0,
        help="Threshold = beta x moving average (official recipes: 0.5 for Qwen, 0.9 for Llama, 1.0 for Gemma).",
    )
    ema_decay: float = option(0.99, min=0.0, max=1.0, help="Decay of the threshold's moving average (official 0.99).")
    ema_start_step: int = option(
        6, min=1, help="First step (1-based, one per training generation batch) whose mean group std is recorded "
        "to start the moving average (official 6).",
    )
    filter_start_step: int = option(
        11, min=1, help="First step that filters (official 11); earlier steps keep every group.",
    )
    threshold_uses_current_batch: bool = option(
        False,
        help="Fold the current batch into the moving average before filtering it (the plugin's earlier behaviour); "
        "official: a step's threshold uses only the steps before it.",
    )

    def validate(self) -> None:
        try:
            re.compile(self.answer_marker)
        except re.error as exc:
            raise PluginConfigError(f"Option 'answer_marker' of plugin 'rlpr' is not a valid regex: {exc}.") from exc
        check_template("rlpr", "answer_template", self.answer_template, ("answer",))
        if self.ema_start_step > self.filter_start_step:
            raise PluginConfigError(
                f"Options of plugin 'rlpr': ema_start_step={self.ema_start_step} must not exceed "
                f"filter_start_step={self.filter_start_step}."
            )


# --------------------------------------------------------------------------------------------- pure functions
def split_reasoning(text: str, marker: str, prefix: str) -> str:
    """The reasoning z: ``text`` up to and including the first ``marker`` match, else ``text + prefix``."""
    m = re.search(marker, text)
    return text[: m.end()] if m else text + prefix


def mean_token_probability(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean probability of the masked tokens per row. logps, mask: (B, A). Returns (B,) (0 for empty rows)."""
    probs = torch.exp(logps) * mask
    return probs.sum(-1) / mask.sum(-1).clamp(min=1)


def debiased_reward(r: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
    """``clip(r - r0, 0, 1)`` elementwise."""
    return torch.clamp(r - r0, min=0.0, max=1.0)


def group_std(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unbiased std per group (NaN ignored; 0 for groups with fewer than two values). values (N,) -> (N/G,)."""
    v = values.view(-1, group_size).float()
    valid = ~torch.isnan(v)
    n = valid.sum(1)
    mean = torch.where(valid, v, 0).sum(1) / n.clamp(min=1)
    sq = torch.where(valid, (v - mean.unsqueeze(1)) ** 2, 0).sum(1)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return torch.where(n >= 2, std, torch.zeros_like(std))


def _sharded_engine(trainer: Any) -> str | None:
    """"FSDP" or "ZeRO-3" when the run shards the policy over several processes (a forward is a collective), else
    None."""
    accelerator = getattr(trainer, "accelerator", None)
    if getattr(accelerator, "num_processes", 1) <= 1:
        return None
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    deepspeed = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return "ZeRO-3" if getattr(deepspeed, "zero_stage", None) == 3 else None


def _finite_mean(values: torch.Tensor) -> float:
    """Mean of the finite entries (NaN when there is none), as the official list keeps only finite stds."""
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if finite.numel() else float("nan")


def ema_update(previous: float | None, value: float, decay: float) -> float:
    """``decay * previous + (1 - decay) * value``; the first value initialises the average."""
    return value if previous is None else decay * previous + (1.0 - decay) * value


@dataclass
class StdThresholdSchedule:
    """The std filter's threshold over training: ``beta`` x a moving average of the per-step mean group std.

    Steps are 1-based, one per call of :meth:`advance`. Steps ``ema_start .. filter_start - 1`` only record their
    batch's mean group std; at ``filter_start`` the average starts as the mean of those records (the step's own
    mean when there are none) and every later step first folds in the previous step's mean (``decay`` on the old
    value). With ``include_current`` the current batch is folded in before its threshold is taken (the first
    value then initialises the average). Non-finite means are not recorded.
    """

    beta: float
    decay: float
    ema_start: int
    filter_start: int
    include_current: bool = False
    step: int = 0
    warmup_means: list[float] = field(default_factory=list)
    ema: float | None = None
    pending: float | None = None

    def advance(self, batch_mean: float) -> float:
        """Account for one training batch of mean group std ``batch_mean``; return its threshold (0 = keep all)."""
        self.step += 1
        value = batch_mean if math.isfinite(batch_mean) else None
        if self.step < self.filter_start:
            if self.step >= self.ema_start and value is not None:
                self.warmup_means.append(value)
            return 0.0
        if self.ema is None and self.warmup_means:
            self.ema = sum(self.warmup_means) / len(self.warmup_means)
            self.warmup_means = []
        elif self.pending is not None:
            self.ema = ema_update(self.ema, self.pending, self.decay)
        self.pending = None
        if self.include_current or self.ema is None:
            if value is not None:
                self.ema = ema_update(self.ema, value, self.decay)
        else:
            self.pending = value
        return self.threshold()

    def threshold(self) -> float:
        """The current threshold without advancing (0 before the average exists)."""
        return 0.0 if self.ema is None or self.step < self.filter_start else self.beta * self.ema

    def state_dict(self) -> dict:
        return {"step": self.step, "warmup_means": list(self.warmup_means), "ema": self.ema, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))
        self.warmup_means = list(state.get("warmup_means", []))
        self.ema = state.get("ema")
        self.pending = state.get("pending")


class RlprPlugin(Plugin):
    """Reference-answer probability reward (reward stage) with std filtering of low-variance groups (advantage)."""

    name = "rlpr"
    image_inputs = IMAGES_POLICY_PROBE
    multi_turn = True
    version = "0.2.0"
    paper = "RLPR: Extrapolating RLVR to General Domains without Verifiers, arXiv:2506.18254"
    summary = "Verifier-free reward: the policy's mean probability of the reference answer after its own reasoning."
    Options = RlprOptions
    official = OfficialSource(
        "sharkchill-xy/DPPR", "76b76f3", verdict="faithful",
        files=("verl/trainer/ppo/ray_trainer.py", "verl/workers/reward_manager/prob.py"),
        note="OpenBMB/RLPR was not reachable; DPPR is derived from it (near-official). The official 0.1-weighted "
        "format score is not included (add a format reward).",
        variants=("baseline", "filter_drop", "threshold_uses_current_batch"),
    )
    claim_metric = ("answer_probability", "reference-answer probability")
    replaces = ("the correctness reward (reference-answer probability column)",)
    conflicts_with = ("empo",)
    conflict_reason = CORRECTNESS_PICK_ONE
    reconstructed = (
        "answer_marker / answer_template / answer_prefix defaults fit the bundled tasks (paper: its answer tags)",
        "unbiased (Bessel) group std",
        "r_0 of a (prompt, reference) pair missing from the training dataset comes from the policy of the step it "
        "first appears in (official: such a batch is skipped)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self.services: StageServices | None = None
        self.dataset: Any = None
        self.schedule = StdThresholdSchedule(
            beta=o.std_filter_beta, decay=o.ema_decay, ema_start=o.ema_start_step,
            filter_start=o.filter_start_step, include_current=o.threshold_uses_current_batch,
        )
        self.baselines: dict[tuple, float] = {}  # (prompt ids, target ids) -> r_0 (baseline="initial")
        self._threshold = 0.0  # the std threshold of the current step (filter_drop="refill")
        self._step_stds: list[float] = []  # finite group stds of every group generated in this step (refill rounds)
        self.dataset_scanned = False

    def required_columns(self) -> list[str]:
        return [self.options.answer_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        engine = _sharded_engine(trainer)
        if self._refills() and engine is not None:
            raise IncompatiblePluginsError(
                f"rlpr: filter_drop='refill' is not supported under {engine} with several processes: the refill stage "
                "scores the regenerated rows on the processes that hold them, and the rlpr reward runs a policy "
                "forward there, which is a collective under sharded engines (the processes would not all join it). "
                "Use filter_drop='zero_advantage' (or std_filter=false)."
            )
        # the reward function runs inside TRL's reward call, outside any stage context: it keeps the run's services
        self.services = trainer.plugin_services
        self.dataset = getattr(trainer, "train_dataset", None)  # scanned once for the initial-policy baselines
        check_column_filled(self.name, self.dataset, self.options.answer_column,
                            "the reward is the policy's probability of the reference answer, which an empty answer "
                            "turns into the probability of the answer prefix alone")

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        plugin = self

        def rlpr(prompts, completions, **kwargs):
            return plugin.rewards(prompts, completions, kwargs)

        rlpr.reward_weight = self.options.reward_weight
        return [rlpr]

    # ------------------------------------------------------------------------------------------ reward
    def answer_probabilities(self, contexts: list[list[int]], targets: list[list[int]]) -> torch.Tensor:
        """Mean probability of each ``targets[i]`` after ``contexts[i]`` under the current policy (no grad)."""
        logps = self.services.policy_logprobs(contexts, targets)  # one (len(targets[i]),) tensor per row
        return torch.stack([
            mean_token_probability(lp.float().unsqueeze(0), torch.ones(1, lp.numel(), device=lp.device))[0]
            for lp in logps
        ]).cpu()

    def rewards(self, prompts: list, completions: list, columns: dict) -> list[float]:
        o = self.options
        if self.services is None:
            raise PluginConfigError("rlpr: the plugin was not configured with a trainer.")
        refs = columns.get(o.answer_column)
        if refs is None:
            raise PluginConfigError(f"rlpr: the reward function got no {o.answer_column!r} column.")
        tok = self.services.tokenizer
        prompt_ids = self.services.tokenize_prompts(list(prompts))

        def encode(text: str) -> list[int]:
            return list(tok(text=text, add_special_tokens=False)["input_ids"])

        targets = [encode(o.answer_template.format(answer=str(a))) for a in refs]
        contexts = [
            p + encode(split_reasoning(completion_text(c), o.answer_marker, o.answer_prefix))
            for p, c in zip(prompt_ids, completions, strict=True)
        ]
        r = self.answer_probabilities(contexts, targets)
        log_metric = columns.get("log_metric")
        if o.debias:
            reward = debiased_reward(r, self.baseline_probabilities(prompt_ids, targets, encode, log_metric))
        else:
            reward = r
        if callable(log_metric):
            log_metric("plugins/rlpr/answer_probability", float(r.mean()))
        return reward.tolist()

    def baseline_probabilities(self, prompt_ids: list[list[int]], targets: list[list[int]], encode,
                               log_metric=None) -> torch.Tensor:
        """(B,) ``r_0``: the mean probability of each target directly after its prompt and ``answer_prefix``.

        ``baseline="current"``: the current policy, every call. ``baseline="initial"``: looked up in the values the
        initial policy gave the training dataset (scanned at the first training call); a pair not found is
        computed now and kept.
        """
        o = self.options
        keys = [(tuple(p), tuple(t)) for p, t in zip(prompt_ids, targets)]
        if o.baseline == "current":
            unique = list(dict.fromkeys(keys))
            values = dict(zip(unique, self._prefix_probabilities(unique, encode).tolist()))
            return torch.tensor([values[k] for k in keys])
        if not self.dataset_scanned and self.services.run().mode == "train":
            self.dataset_scanned = True
            self._scan_training_dataset(encode)
        missing = list(dict.fromkeys(k for k in keys if k not in self.baselines))
        if missing:
            self.baselines.update(zip(missing, self._prefix_probabilities(missing, encode).tolist()))
        if callable(log_metric):
            late = set(missing)
            log_metric("plugins/rlpr/late_baseline_fraction", sum(k in late for k in keys) / max(len(keys), 1))
        return torch.tensor([self.baselines[k] for k in keys])

    def _prefix_probabilities(self, keys: list[tuple], encode, chunk: int = 64) -> torch.Tensor:
        """Mean target probability after ``prompt + answer_prefix`` for (prompt ids, target ids) keys, in chunks."""
        prefix = encode(self.options.answer_prefix)
        parts = [
            self.answer_probabilities([list(p) + prefix for p, _ in keys[i : i + chunk]],
                                      [list(t) for _, t in keys[i : i + chunk]])
            for i in range(0, len(keys), chunk)
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _scan_training_dataset(self, encode) -> None:
        """``r_0`` of every (prompt, reference) pair of the training dataset under the current (initial) policy."""
        dataset = self.dataset
        o = self.options
        columns = getattr(dataset, "column_names", None) or []
        if not hasattr(dataset, "__len__") or "prompt" not in columns or o.answer_column not in columns:
            return
        prompts, answers = dataset["prompt"], dataset[o.answer_column]
        targets = [encode(o.answer_template.format(answer=str(a))) for a in answers]
        keys = list(dict.fromkeys(
            (tuple(p), tuple(t)) for p, t in zip(self.services.tokenize_prompts(list(prompts)), targets)
        ))
        self.baselines.update(zip(keys, self._prefix_probabilities(keys, encode).tolist()))

    # ------------------------------------------------------------------------------------------ std filter
    def _refills(self) -> bool:
        return self.options.std_filter and self.options.filter_drop == "refill"

    def hook_enabled(self, hook: str) -> bool:
        return hook != "trl_plugins_reject_groups" or self._refills()

    def multi_turn_refusal(self) -> str | None:
        return REFILLS_GROUPS if self._refills() else super().multi_turn_refusal()

    @hookimpl
    def trl_plugins_reject_groups(self, ctx: RefillContext) -> None:
        """Reject the fresh groups whose rlpr std is below this step's threshold (taken in round 0, from the earlier
        steps only; the step's own mean is folded in at the advantage stage)."""
        stds = group_std(ctx.rewards_per_func[:, self._column(ctx)].cpu(), ctx.num_generations)
        fresh = ctx.fresh.cpu()
        if ctx.round == 0:
            self._step_stds = []
            o = self.options
            if o.std_threshold is not None:
                self._threshold = o.std_threshold
            else:  # what advance() will return for this step, without recording it yet
                self._threshold = copy.deepcopy(self.schedule).advance(_finite_mean(stds[fresh]))
            ctx.log_metric("std_threshold", float(self._threshold))
        judged = stds[fresh]
        self._step_stds += [float(x) for x in judged if math.isfinite(float(x))]
        drop = fresh.clone()
        drop[fresh] = judged < self._threshold
        if ctx.round == 0:
            ctx.log_metric("kept_group_fraction", float(1.0 - drop.float().mean()))
        ctx.reject(drop)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.std_filter:
            return
        values = ctx.rewards_per_func[:, self._column(ctx)]
        stds = group_std(values, ctx.num_generations)
        training = ctx.mode == "train"
        if self._refills():  # the groups were filtered at the refill stage; record the step's mean for the average
            if training and o.std_threshold is None:
                step = self.schedule.step + 1
                pool = self._step_stds if step >= o.filter_start_step else [float(x) for x in stds]
                self.schedule.advance(_finite_mean(torch.tensor(pool)) if pool else float("nan"))
            self._step_stds = []
            ctx.log_metric("reward_std", float(stds.mean()))
            return
        if o.std_threshold is not None:
            threshold = o.std_threshold
        elif training:
            threshold = self.schedule.advance(float(stds.mean()))
        else:
            threshold = self.schedule.threshold()
        keep = stds >= threshold
        rows = keep.repeat_interleave(ctx.num_generations).to(ctx.advantages.device, ctx.advantages.dtype)
        ctx.advantages = ctx.advantages * rows.view((-1,) + (1,) * (ctx.advantages.dim() - 1))
        ctx.log_metric("std_threshold", float(threshold))
        ctx.log_metric("kept_group_fraction", float(keep.float().mean()))
        ctx.log_metric("reward_std", float(stds.mean()))

    def _column(self, ctx: AdvantageContext | RefillContext) -> int:
        names = ctx.run.reward_func_names
        if COLUMN in names:
            return names.index(COLUMN)
        return ctx.rewards_per_func.size(1) - 1

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"schedule": self.schedule.state_dict(), "baselines": dict(self.baselines),
                "dataset_scanned": self.dataset_scanned}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.schedule.load_state_dict(state.get("schedule", {}))
        self.baselines = dict(state.get("baselines", {}))
        self.dataset_scanned = bool(state.get("dataset_scanned", False))
