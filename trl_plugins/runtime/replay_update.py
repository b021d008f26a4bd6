"""The replay update: extra optimizer steps on rows kept from earlier batches (SPEAR's replay batch).

A plugin schedules :class:`~trl_plugins.api.contexts.ReplayRow` objects at the advantage stage
(``AdvantageContext.schedule_replay_update``); :class:`ReplayUpdate` keeps them and, once the optimizer steps that
train the current generation batch are done (every pass of ``num_iterations``), runs the replay update::

    steps       ceil(R / (P * A * M)) optimizer steps, R rows, P processes, A = gradient_accumulation_steps,
                M = per_device_train_batch_size (:func:`plan_replay_steps`)
    placement   row k of a step goes to slot k mod (P * A); slot s is process s mod P, micro-batch s div P: the rows
                spread over processes first, then micro-batches, as evenly as they go; a micro-batch left without a row
                runs one zero-weight row (every process makes the same A forwards per step: FSDP / ZeRO-3 forwards
                are collectives)
    loss        TRL's surrogate of the run's loss_type with ratio exp(log pi_theta - old_logprobs) and the run's clip
                range, the row's advantage on every trained token, aggregated as TRL aggregates a micro-batch
                (dapo / cispo / vespo: over the loss tokens of the whole replay step on every process)
    step        gradients clipped to max_grad_norm, optimizer step, zero_grad; no scheduler step, no global_step

SPEAR's official code (TencentYoutuResearch/SPEAR@7e84315, ``verl/verl/workers/actor/dp_actor.py:526-608``) runs its
replay batch after the step's own mini-batches, split into mini-batches of ``ppo_mini_batch_size`` with one
optimizer step each (``_optimizer_step``: clip and step, no scheduler), its stored ``old_log_probs`` in the policy
loss, the KL term commented out; here one replay optimizer step covers P * A * M rows, the rows one optimizer step of
the run covers. SPEAR replays inside each of its ``ppo_epochs``; here once, after the batch's last pass (the same at
``num_iterations=1``, TRL's default and SPEAR's ``ppo_epochs``).

Rows scheduled and not yet trained are checkpointed (:meth:`ReplayUpdate.state_dict`, in the framework's part of the
plugin state). A checkpoint can fall between scheduling and training only with ``steps_per_generation`` larger than
``gradient_accumulation_steps``; TRL itself then resumes with a fresh generation batch (its micro-step counter starts
again at 0), and the restored rows train after that first generation batch's optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trl_plugins.api.contexts import ReplayRow
from trl_plugins.api.errors import PluginError
from trl_plugins.api.model_utils import prompt_completion_batch
from trl_plugins.api.text import stable_key
from trl_plugins.runtime import loss_rules as rules

#: The metric names (``plugins/framework/`` + name) the update logs in the step that runs it.
METRICS = ("replay_update_rows", "replay_update_steps", "replay_update_loss", "replay_update_grad_norm",
           "replay_update_clip_ratio")


def plan_replay_steps(n_rows: int, processes: int, accumulation: int, micro: int) -> list[list[list[list[int]]]]:
    """Which rows each process trains in each micro-batch of each replay optimizer step.

    Returns ``plan[step][process][micro_batch]`` = global row indices (an empty list: a zero-weight row), with
    ``ceil(n_rows / (processes * accumulation * micro))`` steps, ``processes`` lists per step and ``accumulation``
    micro-batches per process, each of at most ``micro`` rows.
    """
    per_step = processes * accumulation * micro
    slots = processes * accumulation
    plan = []
    for start in range(0, n_rows, per_step):
        step = [[[] for _ in range(accumulation)] for _ in range(processes)]
        for k, row in enumerate(range(start, min(start + per_step, n_rows))):
            s = k % slots
            step[s % processes][s // processes].append(row)
        plan.append(step)
    return plan


class ReplayUpdate:
    """The trainer's pending replay rows and the update that trains them (one per
    :class:`~trl_plugins.PluginGRPOTrainer`)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.rows: list[ReplayRow] = []
        self.due_micro_step: int | None = None  # TRL's micro-step after which the scheduled rows train

    def schedule(self, rows: list[ReplayRow]) -> None:
        """Keep ``rows`` for the update after this generation batch's optimizer steps (collective: the row count is
        checked to be the same on every process, or every process raises)."""
        t = self.trainer
        acc = t.accelerator
        if acc.num_processes > 1:  # one gather: each process's row count and a digest of its rows
            digest = stable_key([[r.prompt_ids, r.completion_ids, r.loss_mask, r.advantage] for r in rows])
            seen = acc.gather(torch.tensor([[len(rows), digest]], dtype=torch.long, device=acc.device)).tolist()
            if len({tuple(x) for x in seen}) > 1:
                raise PluginError(f"schedule_replay_update: the processes scheduled different rows (row counts "
                                  f"{[x[0] for x in seen]}, contents {'equal' if len({x[1] for x in seen}) == 1 else 'different'}); "
                                  "allowed: the same rows on every process (build them from the advantage stage's "
                                  "global data).")
        if not rows:
            return
        args = t.args
        batch_end = (t.micro_step // (args.steps_per_generation * t.num_iterations) + 1) * (
            args.steps_per_generation * t.num_iterations)
        self.rows.extend(rows)
        self.due_micro_step = batch_end

    def state_dict(self) -> dict:
        """The rows scheduled and not yet trained (plain lists and numbers: checkpointable)."""
        return {"rows": [r.state() for r in self.rows]}

    def load_state_dict(self, state: dict) -> None:
        """Restore pending rows on resume: TRL's micro-step counter starts again at 0 with a fresh generation batch,
        after whose optimizer steps the rows train (each row checked again, as at scheduling)."""
        self.rows = [ReplayRow.from_state(r) for r in state.get("rows", [])]
        args = self.trainer.args
        self.due_micro_step = args.steps_per_generation * self.trainer.num_iterations if self.rows else None

    def run_if_due(self) -> None:
        """Train the pending rows when the micro-steps of their generation batch are done (called at every step
        end, on every process)."""
        if not self.rows or self.due_micro_step is None or self.trainer.micro_step < self.due_micro_step:
            return
        rows, self.rows, self.due_micro_step = self.rows, [], None
        self.train(rows)

    def train(self, rows: list[ReplayRow]) -> None:
        """The replay update over ``rows`` (the same list on every process)."""
        t = self.trainer
        acc = t.accelerator
        args = t.args
        A, M, P = args.gradient_accumulation_steps, args.per_device_train_batch_size, acc.num_processes
        plan = plan_replay_steps(len(rows), P, A, M)
        model = t.model_wrapped
        model.train()
        losses, norms, clipped, tokens = [], [], [], 0.0
        for step in plan:
            step_rows = [r for micro in step for batch in micro for r in batch]
            step_tokens = float(sum(sum(rows[r].loss_mask) for r in step_rows))
            tokens += step_tokens
            for m, batch in enumerate(step[acc.process_index]):
                loss, logged, clip = self._micro_loss(model, rows, batch, step_tokens, A, P)
                t.extra_micro_backward(model, loss, last=m == A - 1)
                losses.append(logged)
                if clip is not None:
                    clipped.append(clip)
            norms.append(t.extra_optimizer_step(model))
        mean = acc.gather(torch.tensor([sum(losses) / max(len(losses), 1)], device=acc.device)).mean().item()
        t.record_metric("train", "plugins/framework/replay_update_rows", float(len(rows)))
        t.record_metric("train", "plugins/framework/replay_update_steps", float(len(plan)))
        t.record_metric("train", "plugins/framework/replay_update_loss", mean)
        finite = [n for n in norms if n is not None and math.isfinite(n)]
        if finite:
            t.record_metric("train", "plugins/framework/replay_update_grad_norm", sum(finite) / len(finite))
        if clipped:
            t.record_metric("train", "plugins/framework/replay_update_clip_ratio", sum(clipped) / len(clipped))

    def _micro_loss(self, model: Any, rows: list[ReplayRow], batch: list[int], step_tokens: float,
                    accumulation: int, processes: int) -> tuple[torch.Tensor, float, float | None]:
        """The loss of one micro-batch (global rows ``batch``; empty: the first row at zero weight), its value for the
        logs (before the accumulation division, as TRL logs it) and its clipped token fraction (None for a zero-weight
        micro-batch)."""
        t = self.trainer
        device = t.accelerator.device
        chosen = [rows[r] for r in batch] or [rows[0]]
        weight = 1.0 if batch else 0.0
        pad_id = t.text_tokenizer.pad_token_id
        pad_id = t.eos_token_ids[0] if pad_id is None else pad_id
        input_ids, attention_mask, C = prompt_completion_batch(
            [r.prompt_ids for r in chosen], [r.completion_ids for r in chosen], pad_id, device)
        mask = torch.zeros(len(chosen), C, device=device)
        old = torch.zeros(len(chosen), C, device=device)
        for j, r in enumerate(chosen):
            L = len(r.completion_ids)
            mask[j, :L] = torch.tensor(r.loss_mask, dtype=torch.float32, device=device) * weight
            old[j, :L] = torch.nan_to_num(torch.tensor(r.old_logprobs, dtype=torch.float32, device=device), nan=0.0)
        advantages = torch.tensor([[r.advantage * weight] for r in chosen], dtype=torch.float32, device=device)
        logps, _, _ = t.per_token_logps_and_entropies(model, input_ids, attention_mask, C, compute_entropy=False)
        settings = rules.LossSettings.from_trainer(t)
        weights = rules.importance_weights(logps, old, mask, settings.importance_sampling_level)
        surrogate = rules.base_surrogate(settings, logps, weights, advantages, mask)
        # steps_per_generation = accumulation: the dapo-type normaliser is the replay step's loss tokens per process
        loss, logged = rules.aggregate(
            settings.loss_type, surrogate.per_token_loss, mask,
            num_items_in_batch=torch.tensor(max(step_tokens, 1.0), device=device),
            max_completion_length=t.max_completion_length, num_processes=processes,
            gradient_accumulation_steps=accumulation, steps_per_generation=accumulation, mode="train",
        )
        if not batch:
            return loss, float(logged), None
        low, high = 1 - settings.epsilon_low, 1 + settings.epsilon_high
        coef = weights.coef_1.detach()
        out = ((coef < low) & (advantages < 0)) | ((coef > high) & (advantages > 0))
        return loss, float(logged), float((out.float() * mask).sum() / mask.sum().clamp(min=1.0))
