"""The tool-episode branching seam: continue multi-turn tool rollouts from a turn boundary through TRL's own tool loop
(the driver of :meth:`~trl_plugins.runtime.generation.GenerationService.continue_tool_episodes`).

A request keeps a rollout's first ``u`` assistant turns with their tool results (the *kept prefix*, token-exact) and
samples the rest again: one generation call for the first new assistant turn of every request, then TRL's
``_tool_call_loop`` (through the plugin trainer's guarded :meth:`~trl_plugins.PluginGRPOTrainer.tool_call_loop`) on
``prompt_ids`` with ``completion_ids = kept prefix + new turn``, so TRL's own tool execution, tool-suffix tokens,
overlong rollback and truncation at ``max_completion_length`` apply to the whole completion.

* **Environment.** Each request gets a fresh instance of its row's environment (the row's ``environment_factory``),
  ``reset`` with the row's columns, and the kept turns' calls to its tool methods replayed on it in order (results
  discarded: the kept tokens are the original's), so its state is the state at the boundary. Standalone ``tools=``
  are stateless and not replayed. The new instance belongs to the continuation (``ToolEpisode.environment``).
* **Tool rounds.** TRL caps an episode at ``max_tool_calling_iterations`` tool rounds; a continuation from turn ``u``
  has ``max_tool_calling_iterations - u`` left. One TRL loop serves all requests of a process, with the largest
  allowance; a request that used more than its own is cut after its last allowed assistant turn (as TRL leaves an
  episode whose rounds ran out).
* **Lockstep.** TRL's tool loop calls the backend once per tool round, for the rows still calling tools, so processes
  make different numbers of calls. Within the seam every backend call is a round of :class:`Lockstep`: the processes
  all-gather ``(rows, done)``, pad to the largest row count with a dummy request and generate together; a process whose
  loop ended keeps joining rounds with dummy requests (:meth:`Lockstep.drain`) until every process is done. So every
  process makes the same number of backend calls with the same number of rows (as ZeRO-3 / FSDP need).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_plugins.api.errors import PluginError

WHERE = "continue_tool_episodes"


@dataclass
class EpisodeRequest:
    """One checked request: continue local row ``row`` (global ``global_row``) from assistant turn ``turn``.

    ``prompt`` is the row's conversation prompt (as TRL generated it, after the environment's ``reset``),
    ``prompt_ids`` its ids, ``completion_ids`` / ``tool_mask`` / ``messages`` the current rollout (TRL's), ``data``
    the dataset row (``reset`` keyword arguments), ``environment_name`` TRL's name of its environment (None: the single
    factory)."""

    row: int
    global_row: int
    turn: int
    prompt: list
    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    messages: list
    data: dict
    environment_name: Any = None

    @property
    def start(self) -> int:
        """Length of the kept prefix (completion tokens before the boundary)."""
        spans = _runs_of_ones(self.tool_mask)
        return spans[self.turn][0] if self.turn < len(spans) else len(self.completion_ids)

    @property
    def kept_messages(self) -> list:
        """TRL's messages of the kept turns (assistant messages before the ``turn``-th one, with their tool results)."""
        seen, kept = 0, []
        for message in self.messages:
            if isinstance(message, dict) and message.get("role") == "assistant":
                if seen == self.turn:
                    break
                seen += 1
            kept.append(message)
        return kept


def _runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m == 1 and start is None:
            start = t
        elif m != 1 and start is not None:
            spans.append((start, t))
            start = None
    return spans


def check_turns(turns: list, num_turns: list[int], rows: list[int]) -> list[int]:
    """The boundary turn of each request: an integer in ``[0, U)`` (``U`` = the row's assistant turns)."""
    if len(turns) != len(rows):
        raise PluginError(f"{WHERE}: {len(turns)} turns for {len(rows)} rows; allowed: one boundary turn per row.")
    out = []
    for row, u, n in zip(rows, turns, num_turns):
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < max(n, 1):
            raise PluginError(f"{WHERE}: turn {u!r} for local row {row}; allowed: an integer in [0, {max(n, 1)}) (the "
                              "row's assistant turns: the turns before it are kept with their tool results, turn "
                              f"{u!r} and the rest are sampled again).")
        out.append(u)
    return out


class Lockstep:
    """Generation rounds in lockstep across processes (module docstring): wraps the generation backend."""

    def __init__(self, backend: Callable, gather: Callable, device: Any, dummy: list[int]):
        self.backend, self.gather, self.device, self.dummy = backend, gather, device, list(dummy)
        self.rounds: list[tuple[int, int]] = []  # (local rows, padded rows) of every round, for tests and metrics

    def _round(self, n: int, done: int) -> tuple[int, bool]:
        flags = self.gather(torch.tensor([[n, done]], dtype=torch.long, device=self.device)).view(-1, 2)
        return int(flags[:, 0].max().item()), bool((flags[:, 1] == 1).all().item())

    def __call__(self, prompt_ids, images=None, multimodal_fields=None, num_generations=1, has_tool_images=False):
        n = len(prompt_ids)
        width, _ = self._round(n, 0)
        self.rounds.append((n, width))
        if width == 0:
            return [], None
        padded = [list(p) for p in prompt_ids] + [self.dummy] * (width - n)
        ids, logprobs = self.backend(padded, None, {}, 1, False)
        return list(ids[:n]), None if logprobs is None else list(logprobs[:n])

    def drain(self) -> None:
        """Join the other processes' rounds with dummy requests until every process's loop has ended."""
        while True:
            width, all_done = self._round(0, 1)
            if all_done:
                return
            self.rounds.append((0, width))
            if width:
                self.backend([self.dummy] * width, None, {}, 1, False)


def replay_kept_calls(environment: Any, env_tools: dict, request: EpisodeRequest) -> None:
    """Call the kept turns' calls to the environment's tool methods (``env_tools``: name -> bound method) in order, so
    the fresh instance's state is the one at the boundary; results and errors are discarded (the kept tool-result
    tokens are the original rollout's)."""
    for message in request.kept_messages:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            method = env_tools.get(function.get("name"))
            if method is None:
                continue
            try:
                arguments = function.get("arguments") or {}
                method(**arguments) if isinstance(arguments, dict) else None
            except Exception:  # noqa: BLE001 - the original call failed the same way; TRL sent the model the error
                pass


def cut_to_rounds(ids: list[int], mask: list[int], messages: list, start: int, rounds: int) -> tuple:
    """Cut a continuation after its ``rounds + 1``-th new assistant turn (its ``rounds`` tool rounds used up): the
    ids, tool mask and messages kept; unchanged when it has no more turns."""
    spans = [(a + start, b + start) for a, b in _runs_of_ones(mask[start:])]
    if len(spans) <= rounds + 1:
        return ids, mask, messages
    end = spans[rounds][1]
    kept, seen = [], 0
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "assistant":
            if seen == rounds + 1:
                break
            seen += 1
        elif seen == rounds + 1:
            break
        kept.append(message)
    return ids[:end], mask[:end], kept


def nan_outside_new_turns(logps: torch.Tensor, mask: list[int], start: int) -> list[float]:
    """(L,) sampling log-probs of a continuation: the policy's on the new model tokens, NaN on the kept prefix (not
    sampled again) and on tool-result tokens (not sampled)."""
    values = logps.float().tolist()
    return [v if t >= start and m == 1 else math.nan for t, (v, m) in enumerate(zip(values, mask))]


def fresh_environment(trainer: Any, request: EpisodeRequest) -> Any:
    """A new instance of the request's environment, reset with the row (None without ``environment_factory``)."""
    factories = getattr(trainer, "environment_factories", None)
    if factories is None:
        return None
    environment = factories[request.environment_name]()
    multi = set(factories) != {None}
    kwargs = {k: v for k, v in request.data.items() if k != "environment"} if multi else dict(request.data)
    environment.reset(**kwargs)
    return environment


def initial_prompts(requests: list[EpisodeRequest]) -> list:
    """The conversation each continuation starts from (prompt + kept messages), as TRL's tool loop extends it."""
    return [copy.deepcopy(list(r.prompt)) + copy.deepcopy(r.kept_messages) for r in requests]
