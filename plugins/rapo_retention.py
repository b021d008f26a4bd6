"""RaPO — Retention-aware Policy Optimization for continual RL fine-tuning (arXiv:2605.09640).

Not to be confused with ``RAPO`` of Fathom-DeepResearch (catalogue SMP-28, its pruning part in ``adaptive_sampler``):
this is the continual-learning method of "Overcoming Catastrophic Forgetting in Visual Continual Learning with
Reinforcement Fine-Tuning" (catalogue RWD-21). A run of this trainer learns **one task** of a task sequence; the
policy trained on the previous task is given as a frozen model (``teacher_model``: its path). Two components, as the
official code computes them (LMMMEng/RaPO @f25ad37, ``examples/baselines/_rapo_components.py``):

1. **Retention reward** (``_apply_retention_reward``, RetentionRewardConfig). Per completion ``o`` with loss tokens
   ``t = 1..|o|``, the one-sided drift of the rollout policy from the previous-task policy ``pi_prev``::

       D(o) = max(0, (1/|o|) sum_t [log pi_old(o_t | .) - log pi_prev(o_t | .)])      R_ret(o) = exp(-alpha D(o))

   ``R_ret`` in (0, 1] is a reward column (``rapo_retention``) that TRL adds with weight ``retention_lambda``:
   ``r = r_task + lambda R_ret`` (official defaults ``lambda = 0.5``, ``alpha = 20``). ``log pi_old`` are the policy's
   no-grad log-probs of the completion at the reward stage (``RewardContext.policy_logprobs``, the policy that
   sampled it); ``log pi_prev`` come from the teacher component (:mod:`trl_plugins.components.teacher`: a local
   Hugging Face model by path, ``teacher="hf"``, or an endpoint serving the echo protocol), scored through the
   checked teacher log-prob path (finite values <= 0, one per token; a failure on one process stops every process).
   Active from the second task on (``task_index >= 2``; the official ``activate_from_task = 2``).
2. **Cross-Task Advantage Normalisation (CTAN)** (``EMAAdvNormalizer``, EMAAdvConfig). Advantages are centred per
   group and divided by a persistent EMA of the batch reward std instead of the group std::

       s_k   = beta_k s_{k-1} + (1 - beta_k) std(r_batch)   (then max(s_k, min_std))
       A_i   = (r_i - mean_group(r)) / (max(s_hat_k, min_std) + eps)

   with ``std`` the unbiased std of the generation batch's total rewards (retention included), ``beta_k`` warmed
   linearly from ``ctan_beta_warmup_init`` to ``ctan_beta`` over the first ``ctan_beta_warmup_steps`` updates of each
   task, and a guard rail: a group with any ``|A_i| > ctan_guard_abs_max`` falls back to ``(r_i - mean) /
   (std_group + eps)``. The statistics persist **across tasks** in ``ctan_state_file`` (JSON, written by the main
   process after every update): task 1 only records the last batch's reward mean/std (its advantages stay TRL's),
   and task ``k >= 2`` reseeds the EMA from the previous task's last batch. Without a stored state a task ``>= 2``
   starts fresh: the EMA is seeded from its first batch and ``s_hat`` is the official bias correction
   ``(s_k - beta^t) / (1 - beta^t)`` (written for an EMA started at 1.0, reproduced as is; in practice the guard
   rail then takes over, so a fresh start is close to GRPO's group std -- run task 1 with ``ctan_state_file``).
   Official defaults: ``beta = 0.999``, warm-up 2 updates from 0.9, ``min_std = 1e-3``, ``eps = 1e-6``, guard 5.0,
   bias correction on, no bootstrap. The statistics are over the global batch (the same on every process).

Neutral setting: ``retention_lambda = 0`` and ``ctan = False`` (or ``task_index = 1``, whose CTAN only observes) is
vanilla GRPO (tested). Metrics: ``retention_drift`` (mean ``D``), ``retention_reward`` (mean ``R_ret``), ``ctan_std``
(the EMA std used), ``ctan_guard_fallback_fraction`` (groups that fell back to their own std).

Reconstructed / differing details: the official code reads the sampling policy's log-probs from the rollout worker
(verl's ``old_log_probs``), here the policy's forward at the reward stage (the same weights); the previous-task
policy's log-probs are raw (temperature 1), the policy's TRL's temperature-scaled ones, so the drift is exact at
``temperature = 1`` (a warning says so otherwise); the task sequence is a sequence of runs joined by
``teacher_model`` (the previous run's output) and ``ctan_state_file``, where the official launcher chains the tasks in
one process. The per-family ``rapo_cfg.json`` files the official launchers read are not in the stored snapshot, so
the defaults are the dataclass defaults of the official code. The paper trains Qwen2-VL on image prompts; the
previous-task policy here scores the prompt's text tokens only, so image prompts are refused.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.contexts import checked_teacher_logprobs
from trl_plugins.api.reasons import IMAGES_TEXT_TEACHER
from trl_plugins.api.success import placeholder_column
from trl_plugins.components.teacher import TeacherOptions, teacher_from_options

COLUMN = "rapo_retention"
#: Keys of the persisted CTAN statistics (``ctan_state_file`` and checkpoints).
STATE_KEYS = ("ema_mean", "ema_std", "update_count", "last_batch_reward_mean", "last_batch_reward_std")


@dataclass
class RapoRetentionOptions(TeacherOptions):
    """The previous task's policy is configured through the teacher options (``teacher_model``: its path, or
    ``teacher="endpoint"`` with ``teacher_base_url``): a teacher whose log-probs are read."""

    plugin_name: ClassVar[str] = "rapo_retention"

    task_index: int = option(
        2, min=1,
        help="1-based index of the task this run learns. 1: no previous policy (no retention reward; CTAN only records "
        "the batch statistics); >= 2: retention reward against teacher_model and CTAN active (official "
        "activate_from_task=2).",
    )
    retention_lambda: float = option(
        0.5, min=0.0, help="Weight of the retention reward column (r = r_task + lambda * R_ret; 0: no retention).")
    retention_alpha: float = option(
        20.0, min=0.0, help="Scale of the drift in R_ret = exp(-alpha * D) (official kl_scale).")
    ctan: bool = option(True, help="Cross-Task Advantage Normalisation (False: TRL's advantages).")
    ctan_beta: float = option(0.999, min=0.0, max=1.0, help="EMA decay of the batch reward std.")
    ctan_beta_warmup_steps: int = option(
        2, min=0, help="Updates at the start of each task over which the decay warms up linearly from "
        "ctan_beta_warmup_init to ctan_beta (0: no warm-up).")
    ctan_beta_warmup_init: float = option(0.9, min=0.0, max=1.0, help="Decay at the first update of a task.")
    ctan_min_std: float = option(1e-3, min=0.0, min_exclusive=True, help="Floor of the EMA std.")
    ctan_eps: float = option(1e-6, min=0.0, help="Added to the std in the advantage denominator.")
    ctan_guard_abs_max: float = option(
        5.0, min=0.0, help="A group with any |advantage| above this falls back to its own std (0: no guard rail).")
    ctan_bias_correction: bool = option(
        True, help="Bias-correct the EMA std on a fresh start (no state from a previous task), as the official code.")
    ctan_bootstrap_steps: int = option(
        0, min=0, help="Updates that use the group std while the EMA warms up (official default 0).")
    ctan_state_file: str | None = option(
        None, help="JSON file carrying the CTAN statistics across tasks: read when the run starts (if it exists), "
        "written by the main process after every update. Give every task of a sequence the same file.",
    )

    @property
    def retention_active(self) -> bool:
        return self.task_index >= 2 and self.retention_lambda > 0

    def validate(self) -> None:
        if self.retention_active:
            super().validate()  # the previous task's policy: teacher_model (hf) or teacher_base_url (endpoint)
        if self.ctan_state_file is not None:
            if not self.ctan:
                raise PluginConfigError(
                    f"Plugin 'rapo_retention': ctan_state_file={self.ctan_state_file!r} is only used with ctan=True "
                    "(the file carries the CTAN statistics across tasks); set ctan=True or drop the file.")
            read_state_file(self.ctan_state_file)  # a present but unreadable file is refused here


def read_state_file(path: str) -> dict | None:
    """The CTAN statistics stored at ``path`` (None when the file does not exist); a file that is not such a JSON
    object (numbers under :data:`STATE_KEYS`) is refused with a ``PluginConfigError`` naming it."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise PluginConfigError(
            f"Plugin 'rapo_retention': ctan_state_file={path!r} cannot be read as JSON ({exc}); allowed: a file written "
            "by rapo_retention, or a path that does not exist yet.") from exc
    bad = None if isinstance(state, dict) else "not a JSON object"
    for key in STATE_KEYS if bad is None else ():
        value = state.get(key)
        if key.startswith("last_batch") and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad = f"{key}={value!r}"
            break
    if bad is not None:
        raise PluginConfigError(
            f"Plugin 'rapo_retention': ctan_state_file={path!r} holds no CTAN statistics ({bad}); allowed: a file "
            f"written by rapo_retention (finite numbers under {', '.join(STATE_KEYS)}).")
    return {k: state.get(k) for k in STATE_KEYS}


# ============================================================================================= formulas
def retention_reward(policy_logps: torch.Tensor, previous_logps: torch.Tensor, mask: torch.Tensor,
                     alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One-sided per-sequence drift and retention reward.

    Args:
        policy_logps, previous_logps: (B, T) log-probs of the completion tokens under the sampling policy and the
            previous task's policy. mask: (B, T) tokens that count.
    Returns:
        ``(D, R)``: (B,) ``D = max(0, sum_t m (lp - lp_prev) / max(sum_t m, 1))`` and ``R = exp(-alpha D)``.
    """
    m = mask.to(policy_logps.dtype)
    diff = torch.where(m.bool(), policy_logps - previous_logps, torch.zeros_like(policy_logps))
    drift = (diff.sum(-1) / m.sum(-1).clamp(min=1)).clamp(min=0.0)
    return drift, torch.exp(-alpha * drift)


def group_mean_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) each row's group mean and unbiased group std."""
    mean, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        rows = group_ids == g
        mean[rows] = rewards[rows].mean()
        std[rows] = rewards[rows].std()
    return mean, std


class CrossTaskNormalizer:
    """CTAN statistics and advantages (the official ``EMAAdvNormalizer``'s computation path).

    ``state`` (from a previous task, :data:`STATE_KEYS`) starts a task that is not fresh: with ``task_index >= 2`` the
    EMA is reseeded from the previous task's last batch. Call :meth:`observe` (task 1: statistics only) or
    :meth:`advantages` (task >= 2) once per generation batch."""

    def __init__(self, o: RapoRetentionOptions, state: dict | None = None):
        self.o = o
        self.ema_mean, self.ema_std, self.update_count = 0.0, 1.0, 0
        self.last_mean: float | None = None
        self.last_std: float | None = None
        self.initialized, self.fresh_start, self.task_start = False, True, 0
        if state:
            self.ema_mean, self.ema_std = float(state["ema_mean"]), float(state["ema_std"])
            self.update_count = int(state["update_count"])
            self.last_mean, self.last_std = state.get("last_batch_reward_mean"), state.get("last_batch_reward_std")
            self.initialized, self.fresh_start, self.task_start = True, False, self.update_count
            if o.task_index >= 2 and self.last_mean is not None and self.last_std is not None:
                self.ema_mean, self.ema_std = float(self.last_mean), float(self.last_std)

    # -------------------------------------------------------------------------------------- statistics
    def observe(self, rewards: torch.Tensor) -> None:
        """Record the batch's reward mean and unbiased std (the task-1 path: no EMA update)."""
        self.last_mean, self.last_std = float(rewards.mean()), float(rewards.std())

    def effective_beta(self) -> float:
        o, step = self.o, self.update_count - self.task_start
        if o.ctan_beta_warmup_steps <= 0 or step >= o.ctan_beta_warmup_steps:
            return o.ctan_beta
        return o.ctan_beta_warmup_init + (o.ctan_beta - o.ctan_beta_warmup_init) * step / o.ctan_beta_warmup_steps

    def _update(self, mean: float, std: float) -> None:
        if not self.initialized:  # seeded from the previous task's last batch, else from this one
            seeded = self.last_mean is not None and self.last_std is not None
            self.ema_mean, self.ema_std = (self.last_mean, self.last_std) if seeded else (mean, std)
            self.initialized = True
        beta = self.effective_beta()
        self.ema_std = max(beta * self.ema_std + (1.0 - beta) * std, self.o.ctan_min_std)

    def corrected_std(self) -> float:
        """The EMA std, bias-corrected on a fresh start (official formula, for an EMA started at 1.0)."""
        o, t = self.o, self.update_count - self.task_start
        if not o.ctan_bias_correction or not self.fresh_start or t == 0:
            return self.ema_std
        bt = o.ctan_beta ** t
        if 1.0 - bt < 1e-12:
            return self.ema_std
        return max((self.ema_std - bt) / (1.0 - bt), o.ctan_min_std)

    # -------------------------------------------------------------------------------------- advantages
    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(N,) CTAN advantages of the (N,) total rewards; also the (N,) rows whose group fell back to its own std
        and the std used. Updates the statistics (one update per call)."""
        o = self.o
        self.observe(rewards)
        mean, group_std = group_mean_std(rewards, group_ids)
        centred = rewards - mean
        self._update(self.last_mean, self.last_std)
        fallback = torch.zeros_like(rewards, dtype=torch.bool)
        if self.update_count >= o.ctan_bootstrap_steps:
            std = max(self.corrected_std(), o.ctan_min_std)
            adv = centred / (std + o.ctan_eps)
            if o.ctan_guard_abs_max > 0:
                for g in torch.unique(group_ids):
                    rows = group_ids == g
                    if bool((adv[rows].abs() > o.ctan_guard_abs_max).any()):
                        fallback |= rows
                adv = torch.where(fallback, centred / (group_std + o.ctan_eps), adv)
        else:
            std = float("nan")
            adv = centred / (group_std + o.ctan_eps)
        self.update_count += 1
        return adv, fallback, std

    def state_dict(self) -> dict:
        return {"ema_mean": float(self.ema_mean), "ema_std": float(self.ema_std), "update_count": self.update_count,
                "last_batch_reward_mean": self.last_mean, "last_batch_reward_std": self.last_std,
                "initialized": self.initialized, "fresh_start": self.fresh_start, "task_start": self.task_start}

    def load_state_dict(self, state: dict) -> None:
        self.ema_mean, self.ema_std = float(state["ema_mean"]), float(state["ema_std"])
        self.update_count = int(state["update_count"])
        self.last_mean, self.last_std = state["last_batch_reward_mean"], state["last_batch_reward_std"]
        self.initialized, self.fresh_start = bool(state["initialized"]), bool(state["fresh_start"])
        self.task_start = int(state["task_start"])


def write_state_file(path: str, state: dict) -> None:
    """Write the cross-task statistics atomically (a reader never sees half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({k: state[k] for k in STATE_KEYS}, f, indent=2)
    os.replace(tmp, path)


# ============================================================================================= plugin
class RapoRetentionPlugin(Plugin):
    """Retention reward against the previous task's policy + cross-task EMA advantage normalisation (RaPO)."""

    name = "rapo_retention"
    version = "0.1.0"
    paper = ("Overcoming Catastrophic Forgetting in Visual Continual Learning with Reinforcement Fine-Tuning "
             "(RaPO), arXiv:2605.09640")
    summary = ("Continual RL: reward + lambda * exp(-alpha * drift from the previous task's policy); advantages "
               "scaled by a cross-task EMA of the reward std (RaPO, not Fathom's RAPO).")
    Options = RapoRetentionOptions
    official = OfficialSource(
        "LMMMEng/RaPO", "f25ad37", verdict="faithful",
        files=("examples/baselines/_rapo_components.py",),
        note="RetentionRewardConfig / _apply_retention_reward (L431-497) and EMAAdvConfig / EMAAdvNormalizer "
        "(L191-417): defaults lambda 0.5, alpha 20, beta 0.999 (warm-up 2 updates from 0.9), min_std 1e-3, eps 1e-6, "
        "guard 5.0, bias correction on, both from task 2. The policy's log-probs come from the reward-stage forward "
        "(verl: the rollout worker's old_log_probs); tasks are chained across runs by teacher_model and "
        "ctan_state_file.",
    )
    claim_metric = ("retention_drift", "mean one-sided drift from the previous task's policy")
    multi_turn = ("its drift averages the previous policy's log-probs over every completion token, which with tools "
                  "would include the tool results the policy did not write.")
    image_inputs = IMAGES_TEXT_TEACHER
    reconstructed = (
        "the sampling policy's log-probs are the policy's reward-stage forward (same weights as verl's old_log_probs)",
        "the task sequence is a sequence of runs chained by teacher_model and ctan_state_file (the official launcher "
        "chains tasks in one process)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.teacher = None
        self.main_process = True
        self.ctan = CrossTaskNormalizer(self.options, self._stored_state())

    def _stored_state(self) -> dict | None:
        o = self.options
        return read_state_file(o.ctan_state_file) if o.ctan and o.ctan_state_file else None

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: refused with the retention reward (the previous task's policy scores the prompt's text
        only); a first task (``task_index=1``) or ``retention_lambda=0`` runs CTAN alone, which reads rewards only."""
        return self.image_inputs if self.options.retention_active else None

    def multi_turn_refusal(self) -> str | None:
        return self.multi_turn if self.options.retention_active else None

    def overwritten(self) -> tuple[str, ...]:
        o = self.options
        return ("advantages",) if o.ctan and o.task_index >= 2 else ()

    def hook_enabled(self, hook: str) -> bool:
        if hook in ("trl_plugins_reward_functions", "trl_plugins_transform_rewards"):
            return self.options.retention_active
        if hook == "trl_plugins_transform_advantages":
            return self.options.ctan
        return True

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        if not self.options.retention_active:
            return []
        return [placeholder_column(COLUMN, self.options.retention_lambda)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        self.main_process = bool(getattr(getattr(trainer, "accelerator", None), "is_main_process", True))
        if o.ctan and o.task_index >= 2 and self.ctan.fresh_start:
            warnings.warn(
                f"rapo_retention: task_index={o.task_index} without CTAN statistics from the previous task "
                f"(ctan_state_file={o.ctan_state_file!r} {'is not set' if o.ctan_state_file is None else 'does not exist'}"
                "): CTAN starts fresh from this run's first batch. Run task 1 with the same ctan_state_file to carry "
                "them over.", stacklevel=2)
        if not o.retention_active or self.teacher is not None:
            return
        if float(getattr(args, "temperature", 1.0)) != 1.0:
            warnings.warn(
                f"rapo_retention: temperature={args.temperature}: the policy's log-probs are temperature-scaled, the "
                "previous task's policy's are not, so the drift is exact at temperature=1.0 only.", stacklevel=2)
        self.teacher = teacher_from_options(o, trainer_device(trainer))
        processing = getattr(trainer, "processing_class", None)
        tokenizer = getattr(processing, "tokenizer", processing)
        if tokenizer is None:
            raise PluginConfigError("rapo_retention: the trainer has no tokenizer to check the previous policy's against.")
        self.teacher.check_logprobs(tokenizer, probe=o.teacher_probe)

    # ------------------------------------------------------------------------------------------ reward stage
    def _local_retention(self, ctx: RewardContext, prompt_ids, completion_ids, policy) -> list[tuple[float, float]]:
        """(B,) ``(D, R_ret)`` of this process's rows."""
        first = ctx.process_slice.start or 0
        rows = list(range(len(completion_ids)))
        previous = checked_teacher_logprobs(self.teacher, prompt_ids, completion_ids, rows, self.name, first)
        width = max([len(c) for c in completion_ids] + [1])
        lp, prev, mask = (torch.zeros(len(rows), width) for _ in range(3))
        for i, (a, b) in enumerate(zip(policy, previous)):
            n = len(completion_ids[i])
            lp[i, :n], prev[i, :n], mask[i, :n] = a.float().cpu()[:n], b.float()[:n], 1.0
        drift, reward = retention_reward(lp, prev, mask, self.options.retention_alpha)
        return list(zip(drift.tolist(), reward.tolist()))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        names = ctx.reward_func_names
        if COLUMN not in names:
            return
        if self.teacher is None:
            raise PluginConfigError("rapo_retention: the previous task's policy was not loaded (plugin not configured).")
        if ctx.local_completion_ids is None:
            raise PluginConfigError("rapo_retention: the completions' token ids are not available at the reward stage.")
        prompt_ids = ctx.services.tokenize_prompts(list(ctx.local_prompts))
        completion_ids = [list(c) for c in ctx.local_completion_ids]
        policy = ctx.policy_logprobs(prompt_ids, completion_ids)  # collective: every process, once
        pairs = gather_objects_together(ctx, self.name, self._local_retention, ctx, prompt_ids, completion_ids, policy)
        drift = torch.tensor([d for d, _ in pairs], dtype=torch.float32)
        reward = torch.tensor([r for _, r in pairs], dtype=torch.float32)
        ctx.log_metric("retention_drift", drift.mean().item())
        ctx.log_metric("retention_reward", reward.mean().item())
        matrix = ctx.rewards_per_func.clone()
        matrix[:, names.index(COLUMN)] = reward.to(matrix)
        ctx.rewards_per_func = matrix

    # ------------------------------------------------------------------------------------------ advantage stage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.ctan or ctx.mode != "train":
            return
        rewards = torch.nan_to_num(ctx.rewards.detach().double().cpu(), nan=0.0)
        if o.task_index < 2:
            self.ctan.observe(rewards)  # task 1: statistics for the next task, TRL's advantages
        else:
            adv, fallback, std = self.ctan.advantages(rewards, ctx.group_ids.cpu())
            ctx.advantages = adv.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
            ctx.log_metric("ctan_std", std)
            groups = max(rewards.numel() // ctx.num_generations, 1)
            ctx.log_metric("ctan_guard_fallback_fraction", fallback.sum().item() / ctx.num_generations / groups)
        if o.ctan_state_file and self.main_process:
            write_state_file(o.ctan_state_file, self.ctan.state_dict())

    @hookimpl
    def trl_plugins_state_dict(self) -> dict:
        return {"ctan": self.ctan.state_dict()}

    @hookimpl
    def trl_plugins_load_state_dict(self, state: dict) -> None:
        if "ctan" in state:
            self.ctan.load_state_dict(state["ctan"])

