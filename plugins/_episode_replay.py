"""Shared tool-episode replay of ``replay`` (SPEAR) and ``adaptive_sampler`` (RAPO replay buffers): per-prompt
buffers of whole multi-turn tool episodes, through the tool-episode seam (``ctx.store_tool_episodes``,
``ctx.replay_tool_episodes``, ``ctx.replace_episode``).

Both functions are collective and take **global** decisions (rows to store, rows to splice: the same on every
process, decided from gathered flags), so every process calls the seam the same number of times: a plugin calls them
when the global decision is not empty, every process with its own local rows (zero where it has none).

Buffer entries (a :class:`~._rollout_buffer.RolloutBuffer` under the prompt key) are plain dicts: ``"episode"`` (the
:class:`~trl_plugins.api.StoredEpisode` state: ids with tool-result tokens, tool mask, messages, behaviour log-probs),
``"step"`` and ``"advantage"`` (filled at the advantage stage by the plugin).
"""

from __future__ import annotations

import dataclasses
import math

from trl_plugins.api import RolloutContext, StoredEpisode

from ._rollout_buffer import RolloutBuffer


def own_episode(ctx: RolloutContext, i: int) -> bool:
    """Local row ``i`` holds an episode this step's policy sampled under the row's prompt (TRL's, or one the
    tool-episode seam continued): not replaced by ``replace_row``, prompt-swapped, off-policy or replayed."""
    return (bool(ctx.completion_ids[i]) and not (i in ctx.changed and i not in ctx.episodes)
            and i not in ctx.behaviour_logprobs and not ctx.prompt_swapped[i] and not any(ctx.offpolicy[i]))


def calls_a_tool(ctx: RolloutContext, i: int) -> bool:
    """Local row ``i``'s episode holds at least one assistant turn with a tool call (SPEAR stores only those)."""
    return bool(ctx.turns) and any(ctx.turns[i].tool_calls)


def store_tool_rows(ctx: RolloutContext, buffers: RolloutBuffer, rows: list[int], keys: list[int],
                    limit: int | None) -> dict[int, dict]:
    """Store the episodes of global rows ``rows`` under their prompt keys (``keys``: (N,) global), at most ``limit``
    per key, newest last; returns global row -> the stored entry (collective: call when ``rows`` is not empty)."""
    wanted = set(rows)
    stored = ctx.store_tool_episodes([i for i in range(len(ctx)) if ctx.global_index[i] in wanted])
    out = {}
    for episode in stored:
        entry = {"episode": episode.state(), "step": int(episode.step), "advantage": math.nan}
        out[episode.global_row] = buffers.add(keys[episode.global_row], entry, limit)
    return out


def splice_tool_rows(ctx: RolloutContext, splices: dict[int, dict], tokens: str) -> list[int]:
    """Replay each ``splices[global row]`` entry's episode into that row (collective: call when ``splices`` is not
    empty). ``tokens``: 'behaviour' (TRL's clipped ratio against the stored behaviour log-probs), 'offpolicy' (the
    shaped off-policy branch) or 'policy' (TRL's ratio, old log-probs recomputed now). A row whose prompt ids differ
    from the episode's (a prompt keyed by ``key_column`` worded differently) is left alone. Returns the local rows
    replaced."""
    rows, episodes = [], []
    for i in range(len(ctx)):
        entry = splices.get(ctx.global_index[i])
        if entry is None:
            continue
        stored = StoredEpisode.from_state(entry["episode"])
        if stored.prompt_ids == list(ctx.prompt_ids[i]) and not ctx.prompt_swapped[i]:
            rows.append(i)
            episodes.append(stored)
    for episode in ctx.replay_tool_episodes(rows, episodes):
        if tokens == "policy":
            episode = dataclasses.replace(episode, behaviour=False)
        ctx.replace_episode(episode.row, episode, offpolicy=tokens == "offpolicy")
    return rows
