"""Runs at an equal budget of policy rollouts, evaluated on held-out data (``trl-plugins compare`` and
``scripts/bench_learning.py``).

A *policy rollout* is a completion sampled from the policy during training: TRL's own generation round plus every
completion a plugin asks the generation service for (extra rollouts, refilled groups), counted where they are
generated: the trainer's generation service counts them (``GenerationService.policy_rollouts``: its own requests and
the rows of TRL's rounds). Reference solutions spliced in by a plugin cost nothing. With tools, a rollout is a whole
episode: the turns TRL's tool loop generates after a tool result continue a rollout that was already counted, so a
method that calls more tools does not spend more of the budget.
:func:`count_policy_rollouts` reads the counter; :class:`EqualBudget` stops training at the first optimizer step
where the count reaches the budget and evaluates on held-out data every ``eval_every`` rollouts. So a plugin that
asks for extra completions takes fewer optimizer steps than vanilla GRPO for the same budget.

:func:`held_out_score` is the default evaluation: greedy completions of the held-out prompts scored by a reward
function (the verifier), averaged. The summary statistics (:func:`mean_std`, :func:`rollouts_to_target`,
:func:`tail_mean`, :func:`run_mean`) are shared with the benchmark script.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from transformers import TrainerCallback


class RolloutCount(Mapping):
    """The live, read-only counter ``{"rollouts": n, "tokens": m}``: policy rollouts a trainer generated while
    training since the counter was made, and the tokens sampled in them (:func:`count_policy_rollouts`)."""

    _ATTRIBUTES = {"rollouts": "policy_rollouts", "tokens": "policy_tokens"}

    def __init__(self, service: Any):
        self._service = service
        self._start = {key: getattr(service, attr) for key, attr in self._ATTRIBUTES.items()}

    def __getitem__(self, key: str) -> int:
        if key not in self._ATTRIBUTES:
            raise KeyError(key)
        return getattr(self._service, self._ATTRIBUTES[key]) - self._start[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ATTRIBUTES)

    def __len__(self) -> int:
        return len(self._ATTRIBUTES)

    def __repr__(self) -> str:
        return f"RolloutCount(rollouts={self['rollouts']}, tokens={self['tokens']})"


def count_policy_rollouts(trainer: Any) -> RolloutCount:
    """The policy rollouts ``trainer`` (a :class:`~trl_plugins.PluginGRPOTrainer`) generates while training from now
    on, as the live counter ``{"rollouts": n, "tokens": m}`` (``tokens``: the new tokens sampled in them,
    ``GenerationService.policy_tokens``: a shared prefix that is continued or forked is paid for once).

    The trainer's generation service counts them where they are sampled: TRL's rounds, the service's extra
    completions and refills; not generations in evaluation mode (``model.training`` False), nor the later turns of a
    multi-turn episode (TRL's tool loop continues a rollout already counted). Nothing on the trainer is replaced."""
    service = getattr(trainer, "generation_service", None)
    if service is None:
        raise TypeError(
            f"count_policy_rollouts needs a trl_plugins.PluginGRPOTrainer (its generation service counts the "
            f"rollouts); got {type(trainer).__name__}."
        )
    return RolloutCount(service)


class EqualBudget(TrainerCallback):
    """Stop at the first optimizer step where ``counts[unit] >= budget`` (``unit``: ``"rollouts"``, or ``"tokens"``
    for a budget of generated tokens, where trees that share prefixes pay for them once); call
    ``evaluate(step, spent)`` every ``eval_every`` of the unit and at the end; record one row per optimizer step in
    ``per_step`` (``{"step", "rollouts", "tokens"}``, filled with the logged metrics by :func:`merge_logs`).

    ``pending``: a dict the caller fills during a step (e.g. per-step reward statistics); merged into the step's row,
    then emptied. ``deadline`` (a ``time.time()`` value): a step ending past it evaluates and stops the run, which is
    then marked ``truncated`` (it spent less than the budget)."""

    def __init__(self, counts: Mapping[str, int], budget: int, eval_every: int,
                 evaluate: Callable[[int, int], None] | None = None, unit: str = "rollouts",
                 pending: dict | None = None, deadline: float | None = None):
        if budget <= 0 or eval_every <= 0:
            raise ValueError(f"budget and eval_every must be positive; got {budget} and {eval_every}.")
        if unit not in counts:
            raise ValueError(f"unit must be one of {sorted(counts)}; got {unit!r}.")
        self.counts, self.budget, self.eval_every, self.evaluate = counts, budget, eval_every, evaluate
        self.unit, self.next_eval = unit, eval_every
        self.pending, self.deadline = pending, deadline
        self.per_step: list[dict] = []
        self.truncated = False

    def on_step_end(self, args, state, control, **kwargs):
        spent = self.counts[self.unit]
        row = {"step": state.global_step, **dict(self.counts)}
        if self.pending is not None:
            row.update(self.pending)
            self.pending.clear()
        self.per_step.append(row)
        done = spent >= self.budget
        late = self.deadline is not None and time.time() >= self.deadline
        if self.evaluate is not None and (spent >= self.next_eval or done or late):
            self.evaluate(state.global_step, spent)
            while self.next_eval <= spent:
                self.next_eval += self.eval_every
        if done or late:
            self.truncated = late and not done
            control.should_training_stop = True
        return control


def merge_logs(per_step: list[dict], log_history: Sequence[dict]) -> list[dict]:
    """Fill each per-step row with the numeric metrics TRL logged at that step (rows keep their own keys)."""
    logs = {}
    for entry in log_history:
        if "step" in entry and "loss" in entry:
            logs[entry["step"]] = {k: v for k, v in entry.items() if isinstance(v, (int, float))}
    for row in per_step:
        row.update({k: v for k, v in logs.get(row["step"], {}).items() if k not in row})
    return per_step


def _prompt_inputs(tokenizer: Any, prompts: list, device: Any) -> dict:
    if prompts and isinstance(prompts[0], list):  # conversational
        enc = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            padding=True, return_tensors="pt")
    else:
        enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def greedy_completions(model: Any, tokenizer: Any, prompts: list, max_new_tokens: int,
                       batch_size: int = 32) -> list[Any]:
    """Greedy completions of ``prompts`` (strings or chat messages), in the format TRL gives reward functions: a
    string per plain prompt, ``[{"role": "assistant", "content": ...}]`` per conversational one."""
    import torch

    was_training, side = model.training, getattr(tokenizer, "padding_side", "left")
    model.eval()
    tokenizer.padding_side = "left"  # batched generation
    device = next(model.parameters()).device
    texts = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                enc = _prompt_inputs(tokenizer, prompts[start : start + batch_size], device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    conversational = bool(prompts) and isinstance(prompts[0], list)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def held_out_score(model: Any, tokenizer: Any, dataset: Any, reward_func: Callable, max_new_tokens: int) -> float:
    """Mean of ``reward_func`` over greedy completions of the held-out ``dataset`` (its other columns are passed
    as TRL passes them); rows the reward function cannot score (None) are left out."""
    rows = list(dataset)
    if not rows:
        raise ValueError("the held-out dataset is empty")
    prompts = [r["prompt"] for r in rows]
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens)
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion")}
    scores = [s for s in reward_func(prompts=prompts, completions=completions, **columns) if s is not None]
    return sum(scores) / len(scores) if scores else float("nan")


# ------------------------------------------------------------------------------------------------ statistics
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of the non-NaN ``values`` (std 0 for one value; NaNs for none)."""
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    sd = (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
    return m, sd


def rollouts_to_target(evals: Sequence[dict], base: float, target: float, key: str = "accuracy") -> float:
    """Rollouts at which the held-out ``key`` first reaches ``target`` (linear interpolation between evaluations,
    starting from ``base`` at 0 rollouts); NaN if never."""
    prev_r, prev_a = 0, base
    if base >= target:
        return 0.0
    for e in evals:
        if e[key] >= target:
            if e[key] == prev_a:
                return float(e["rollouts"])
            return prev_r + (target - prev_a) * (e["rollouts"] - prev_r) / (e[key] - prev_a)
        prev_r, prev_a = e["rollouts"], e[key]
    return float("nan")


def tail_mean(per_step: Sequence[dict], key: str, n: int = 5) -> float:
    """Mean of the last ``n`` non-NaN values of ``key`` over the steps (NaN if none)."""
    vals = [r[key] for r in per_step if key in r and r[key] == r[key]]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else float("nan")


def run_mean(per_step: Sequence[dict], key: str) -> float:
    """Mean of the non-NaN values of ``key`` over the steps (NaN if none)."""
    vals = [r[key] for r in per_step if key in r and r[key] == r[key]]
    return sum(vals) / len(vals) if vals else float("nan")


def fmt_mean_std(ms: tuple[float, float], digits: int = 3) -> str:
    """``"0.412 ± 0.031"``, or ``"-"`` for NaN."""
    m, sd = ms
    return "-" if m != m or math.isnan(m) else f"{m:.{digits}f} ± {sd:.{digits}f}"
