"""Tool-episode replay: keep past multi-turn tool episodes and splice them back into rows of a later batch (the driver
of ``RolloutContext.store_tool_episodes`` / ``replay_tool_episodes``, the replay half of the tool-episode seam of
:mod:`trl_plugins.runtime.tool_episodes`).

* **Store.** A row's episode is kept whole: its completion ids with the tool-result tokens, TRL's tool mask and
  messages, and the **behaviour log-probs** of its model tokens (one teacher-forced no-grad forward of the policy in
  the step that sampled it, padded across processes; NaN on tool-result tokens). The stored episodes of every process
  are gathered (one object all-gather carrying the failure flag), so a plugin's per-prompt buffers stay identical on
  every process.
* **Replay.** A stored episode becomes a :class:`~trl_plugins.api.contexts.ToolEpisode` with ``behaviour=True`` for a
  row with the same prompt ids: its turn structure, and a fresh instance of the row's environment, ``reset`` with the
  row and with every tool call of the episode that TRL executed (assistant messages followed by a tool result)
  replayed in order, so TRL's reward pass reads the state the episode left. ``replace_episode`` puts it into the row;
  its behaviour log-probs ride to the loss as the row's old log-probs (``BEHAVIOUR_LOGPS_KEY``), so the replayed
  tokens train with TRL's clipped ratio ``exp(log pi_theta - log pi_behaviour)``, exact for an off-policy episode.

Collective: each call makes a fixed number of collectives on every process, whatever the process's row count (zero
included): store = one padded forward + one object gather; replay = one error flag + the reset-error flag.
"""

from __future__ import annotations

from typing import Any

import torch

from trl_plugins.api.collectives import raise_together
from trl_plugins.api.contexts import StoredEpisode, ToolEpisode
from trl_plugins.api.errors import PluginError
from trl_plugins.runtime.tool_episodes import EpisodeRequest, fresh_environment, replay_kept_calls

STORE = "RolloutContext.store_tool_episodes"
REPLAY = "RolloutContext.replay_tool_episodes"


def _check_rows(ctx: Any, rows: list, where: str) -> None:
    if not ctx.turns:
        raise PluginError(f"{where}: the run has no tools (tools= or environment_factory=); single-turn rows are "
                          "replayed with ctx.replace_row.")
    for i in rows:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(ctx.rows):
            raise PluginError(f"{where}: row {i!r}; allowed: a local row index in [0, {len(ctx.rows)}).")


def executed_messages(messages: list) -> list:
    """The messages up to the last tool result: the assistant turns whose tool calls TRL executed (a last turn's
    calls left unanswered when its tool rounds ran out are not replayed)."""
    last = max((k for k, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "tool"), default=-1)
    return list(messages[: last + 1])


def store_episodes(trainer: Any, ctx: Any, rows: list) -> list[StoredEpisode]:
    """Every process's :class:`StoredEpisode` of its local rows ``rows``, in global row order (collective)."""
    _check_rows(ctx, rows, STORE)
    error = None
    for i in rows:
        if i in ctx.changed and i not in ctx.episodes:
            error = PluginError(f"{STORE}: local row {i} was replaced by replace_row in this stage; allowed: rows TRL "
                                "generated or replace_episode set.")
        elif ctx.prompt_swapped[i] or i in ctx.behaviour_logprobs:
            error = PluginError(f"{STORE}: local row {i} is prompt-swapped or a replayed episode (not this policy's "
                                "sample under its prompt); allowed: rows this step's policy sampled.")
    picked = [] if error is not None else rows
    logps = ctx.policy_logprobs([ctx.prompt_ids[i] for i in picked], [ctx.completion_ids[i] for i in picked])
    local = []
    if error is None:
        try:
            local = [StoredEpisode(
                prompt_ids=ctx.prompt_ids[i], completion_ids=ctx.completion_ids[i],
                tool_mask=list(ctx.turns[i].tool_mask), messages=list(ctx.completions[i]),
                logprobs=lp.float().tolist(), step=int(ctx.step), global_row=int(ctx.global_index[i]),
            ).state() for i, lp in zip(rows, logps)]
        except PluginError as exc:
            error = exc
    gathered = trainer.plugin_services.gather_object([(None if error is None else str(error), local)])
    failed = [k for k, (text, _) in enumerate(gathered) if text is not None]
    if failed:
        if error is not None:
            raise error
        raise PluginError(f"{STORE}: process {failed[0]} failed: {gathered[failed[0]][0]}")
    return [StoredEpisode.from_state(state) for _, states in gathered for state in states]


def replay_episodes(trainer: Any, ctx: Any, rows: list, episodes: list) -> list[ToolEpisode]:
    """One :class:`ToolEpisode` (``behaviour=True``) per ``(rows[j], episodes[j])`` of this process (collective)."""
    _check_rows(ctx, rows, REPLAY)
    acc = trainer.accelerator
    error, results, environments = None, [], []
    try:
        if len(rows) != len(episodes):
            raise PluginError(f"{REPLAY}: {len(episodes)} episodes for {len(rows)} rows; allowed: one per row.")
        names = trainer.batch_environment_names or []
        limit = trainer.max_completion_length
        for i, stored in zip(rows, episodes):
            if not isinstance(stored, StoredEpisode):
                raise PluginError(f"{REPLAY}: got {type(stored).__name__} for local row {i}; allowed: a StoredEpisode "
                                  "(from ctx.store_tool_episodes or StoredEpisode.from_state).")
            if list(stored.prompt_ids) != list(ctx.prompt_ids[i]):
                raise PluginError(f"{REPLAY}: the stored episode's prompt ids differ from local row {i}'s; allowed: an "
                                  "episode stored under the same prompt.")
            if len(stored.completion_ids) > limit:
                raise PluginError(f"{REPLAY}: the stored episode has {len(stored.completion_ids)} tokens; allowed: at "
                                  f"most max_completion_length={limit}.")
            done = executed_messages(stored.messages)
            request = EpisodeRequest(
                row=i, global_row=ctx.global_index[i],
                turn=sum(1 for m in done if isinstance(m, dict) and m.get("role") == "assistant"),
                prompt=ctx.prompts[i], prompt_ids=list(ctx.prompt_ids[i]), completion_ids=list(stored.completion_ids),
                tool_mask=list(stored.tool_mask), messages=done, data=dict(ctx.rows[i]),
                environment_name=names[i] if i < len(names) else None,
            )
            env = fresh_environment(trainer, request)
            standalone = set(trainer.tool_dicts_for(None)[0])
            sync, _ = trainer.tool_dicts_for(env)
            replay_kept_calls(env, {k: v for k, v in sync.items() if k not in standalone}, request)
            environments.append(env)
            results.append((i, stored, env))
    except Exception as exc:  # re-raised on every process together below
        error = exc
    if acc.num_processes > 1:
        raise_together(acc.gather, acc.device, REPLAY, error)
    elif error is not None:
        raise error
    trainer.raise_reset_errors_together(environments)
    return [
        ToolEpisode(
            row=i, turn=stored.num_turns, start=len(stored.completion_ids), completion_ids=list(stored.completion_ids),
            tool_mask=list(stored.tool_mask), messages=list(stored.messages), logprobs=list(stored.logprobs),
            turns=trainer.turn_structure(stored.completion_ids, stored.tool_mask, stored.messages, env,
                                         ctx.global_index[i]),
            environment=env, behaviour=True,
        )
        for i, stored, env in results
    ]


def behaviour_logps_tensor(behaviour: dict, rows: int, width: int, device: Any) -> torch.Tensor:
    """(rows, width) float32: the behaviour log-probs of the replayed local rows (``{row: (L,) list}``), NaN elsewhere
    (other rows, tool-result tokens, padding): the generation batch's ``BEHAVIOUR_LOGPS_KEY``."""
    out = torch.full((rows, width), float("nan"), dtype=torch.float32)
    for i, values in behaviour.items():
        values = list(values)[:width]
        out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)
