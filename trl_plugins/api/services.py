"""What a stage context can ask of the run: one typed services object, handed to every context at construction.

The trainer builds the real :class:`StageServices` (its tokenizer, collectives, policy forwards, metric sink);
the testing kit's ``make_*_context`` builders build stubs. A context reads its services only through its own
documented methods (``ctx.score``, ``ctx.gather``, ``ctx.tokenizer`` ...); a member the services object lacks
raises a :class:`~trl_plugins.api.errors.PluginError` naming the member and the context.

Shapes: ``B`` rows on this process, ``N`` rows over all processes, ``T`` completion positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_plugins.api.errors import PluginError


@dataclass(frozen=True)
class RunInfo:
    """Read-only settings of the run that plugins read at a stage (``ctx.run``).

    Attributes:
        max_completion_length: TRL's ``max_completion_length`` (None when unknown).
        max_steps: total optimizer steps of the run (``trainer.state.max_steps`` once training runs, epochs
            resolved; else ``args.max_steps``; 0 when unknown).
        reward_func_names: TRL's reward column names, in column order (plugin reward functions included).
        num_processes: processes taking part in the run's collectives.
        device: the device of the run's collectives (the accelerator's), as a string.
        mode: "train" or "eval" (whether the policy is in training mode now).
        placeholder_columns: per reward column, whether its function is a placeholder (filled by a transform).
        learning_rate: the optimizer's current learning rate (the scheduler's last value, the one the next optimizer
            step uses; ``args.learning_rate`` before the scheduler exists); None when unknown (stand-in contexts).
            The same value on every process.
    """

    max_completion_length: int | None = None
    max_steps: int = 0
    reward_func_names: tuple[str, ...] = ()
    num_processes: int = 1
    device: str = "cpu"
    mode: str = "train"
    placeholder_columns: tuple[bool, ...] = ()
    learning_rate: float | None = None


@dataclass(frozen=True)
class StageServices:
    """The callables behind the contexts' methods (each None where this run or stub does not provide it).

    Attributes:
        run: ``() -> RunInfo``, the run's settings as of now (``ctx.run``).
        metric_sink: ``(key, value) -> None``; records a metric under ``key`` (``ctx.log_metric``).
        tokenizer: the text tokenizer (TRL's ``processing_class``, or its ``.tokenizer`` for a multimodal
            processor) (``ctx.tokenizer``).
        tokenize_prompts: ``(prompts: list) -> list[list[int]]``, token ids exactly as TRL tokenizes prompts
            for generation (``RolloutContext.tokenize_prompts``).
        decode: ``(ids: list[int], prompt) -> completion`` in TRL's completion format for that prompt (string, or
            an assistant message list) (``RolloutContext.decode``).
        score: ``(rows, prompts, completions) -> scores`` of candidate completions on this process; opaque here,
            ``RolloutContext.score`` defines what it returns.
        gather: ``(tensor (B, ...)) -> (N, ...)``, all-gather in global row order (collective).
        gather_object: ``(values: list of B) -> list of N``, all-gather of Python objects (collective).
        policy_entropies: ``(prompt_ids, completion_ids) -> [(len(c),) per row]``, no-grad per-token entropies
            of the current policy (collective, padded to the same number of rows on every process).
        policy_logprobs: ``(prompt_ids, completion_ids) -> [(len(c),) per row]``, no-grad per-token log-probs
            of the completion tokens under the current policy (temperature applied; runs on this process only).
        policy_features: ``(prompt_ids, completion_ids) -> (R, d)``, no-grad mean of the policy's last hidden state
            over each completion's tokens (collective, padded to the same number of rows on every process).
        reference_features: the same as ``policy_features`` under the reference policy (plugins declaring
            ``needs_reference_model``).
        policy_stats: ``(head_stats: bool) -> PolicyStats`` of the local generation batch (advantage stage).
        completion_mask: ``() -> (N, T_max)`` loss mask of all rows (advantage stage, collective).
        reference_logprobs: ``() -> (B, T)`` no-grad log-probs of the local completion tokens under the reference
            policy (advantage stage; plugins declaring ``needs_reference_model``).
        hidden_states: ``(reduce, layer, head) -> reduced`` per-token hidden states of one layer of the local
            generation batch, reduced chunk by chunk (advantage stage, plugins declaring ``needs_hidden_states``;
            collective: the same forwards on every process).
        head_stats: ``() -> HeadStats`` of the loss forward (loss stage, plugins declaring ``needs_head_stats``).
        masked_mean: ``(x (B, T), mask (B, T)) -> float``, token-mean across all processes (collective).
        replay_update: ``(rows: list[ReplayRow]) -> None`` schedules extra optimizer steps on stored rows after this
            generation batch's own update (advantage stage, training; collective: the same rows on every process).
    """

    run: Callable[[], RunInfo] = RunInfo
    metric_sink: Callable[[str, float], None] | None = None
    tokenizer: Any = None
    tokenize_prompts: Callable[[list], list[list[int]]] | None = None
    decode: Callable[[list[int], Any], Any] | None = None
    score: Callable[[list[dict], list, list], Any] | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    gather_object: Callable[[list], list] | None = None
    policy_entropies: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]] | None = None
    policy_logprobs: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]] | None = None
    policy_features: Callable[[list[list[int]], list[list[int]]], torch.Tensor] | None = None
    reference_features: Callable[[list[list[int]], list[list[int]]], torch.Tensor] | None = None
    policy_stats: Callable[[bool], Any] | None = None
    completion_mask: Callable[[], torch.Tensor] | None = None
    reference_logprobs: Callable[[], torch.Tensor] | None = None
    hidden_states: Callable[[Any, int, bool], Any] | None = None
    head_stats: Callable[[], Any] | None = None
    masked_mean: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    replay_update: Callable[[list], None] | None = None

    def require(self, member: str, context: str) -> Any:
        """The member ``member``, or a ``PluginError`` naming it and the context that asked."""
        value = getattr(self, member)
        if value is None:
            raise PluginError(
                f"{context}: '{member}' is not available here (the services this context was built with do not "
                f"provide it; in unit tests pass it to the testing kit's make_* builder)."
            )
        return value


def gather_padded(
    gather: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor, dim: int = 1, pad_value: float = 0
) -> torch.Tensor:
    """Pad ``tensor`` along ``dim`` to the largest size on any process, then all-gather it along dim 0.

    Two collectives (the sizes, then the padded tensors), on every process. With one process it returns the
    tensor as it is. ``(B, T_local) -> (N, T_max)`` for ``dim=1``; ``(n_local,) -> (P * n_max,)`` for ``dim=0``.
    """
    sizes = gather(torch.tensor([tensor.size(dim)], device=tensor.device))
    width = int(sizes.max().item())
    if tensor.size(dim) < width:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = width - tensor.size(dim)
        tensor = torch.cat([tensor, tensor.new_full(pad_shape, pad_value)], dim=dim)
    return gather(tensor)
