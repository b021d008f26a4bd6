"""SALT — Step-level Advantage Assignment for Long-horizon Agents via Trajectory Graph (arXiv:2510.20022).

A plug-in refinement of group-based advantages (GRPO, RLOO, ...) for multi-turn tool agents, from the outcome rewards
alone, with no change to the rollouts. Sources: the paper's abstract and overview (EACL 2026 Findings); no official
code is public. What they state:

1. The G trajectories of one prompt are merged into a **trajectory graph**: a step (one assistant turn / action)
   that several trajectories share becomes one node; steps where trajectories part ways stay distinct.
2. Shared steps are *neutral* and distinct steps *decisive*: the advantage of a node is the **mean of the
   trajectory-level advantages of the trajectories passing through it**. A step every trajectory shares gets the
   group's mean advantage (0 under GRPO: neither rewarded nor penalised); a step only one trajectory takes keeps that
   trajectory's own advantage.
3. Every token of a step gets its step's advantage (TRL masks the tool-result tokens out of the loss); the step
   advantages ride to the loss through the framework's turn-level path (``AdvantageContext.expand_turns``).

Reconstructed (options flagged ``[reconstructed]``): when two steps are "the same" (``step_identity``: by default
the whole action history up to and including the step, i.e. the trajectories' prefix tree, our reading of "shared
steps") and what a step's action is (``action``: the tool calls TRL parsed, name and arguments; a turn without calls
-- the final answer -- by its exact tokens). ``strength`` (ours, not the paper's) mixes the graph advantage with the
incoming one; 0 leaves the advantages as they came (vanilla), 1 is SALT.

The incoming advantages are the chain's so far (TRL's by default): (N,) per trajectory, or (N, T) per token from an
earlier plugin (then a step's value is its tokens' mean). Trajectories are grouped by prompt draw
(``AdvantageContext.pool_ids``). Rows without tool calls are one step each; a single-turn run would merge only
identical completions, whose advantages are equal already, so SALT leaves single-turn batches unchanged.

When it changes training: under ``step_identity="history"`` the trajectories through a node took the same actions
up to it; where their step tokens are also the same (the usual case: the same call written the same way), the
context is the same too, so are the log-probabilities and gradients, and replacing their advantages by their mean
leaves the summed policy gradient unchanged under token-level normalisation (TRL's default
``loss_type="dapo"``, also ``bnpo`` / ``dr_grpo``) with one update per batch. It then changes training only through
per-sequence normalisation (``loss_type="grpo"``), clipping over several updates per batch (``num_iterations > 1``),
a looser ``step_identity`` (``turn_action``, ``action``), whose merged steps differ in context, or steps that make
the same calls in different words. The agentic
benchmark (docs/benchmarks.md, section 3) measured exactly GRPO's numbers with the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginOptions, hookimpl, option
from trl_plugins.api.text import stable_key


@dataclass
class SaltOptions(PluginOptions):
    step_identity: Literal["history", "turn_action", "action"] = option(
        "history", reconstructed=True,
        help="When two trajectories' steps are the same node of the graph: 'history' -- same actions up to and "
        "including this step (the trajectories' prefix tree; our reading of the paper's shared steps); "
        "'turn_action' -- same action at the same turn index, whatever came before; 'action' -- same action at any "
        "turn.",
    )
    action: Literal["tool_calls", "tokens"] = option(
        "tool_calls", reconstructed=True,
        help="What a step's action is: 'tool_calls' -- the calls TRL parsed from the turn (name and arguments; a turn "
        "without calls, such as the final answer, by its exact tokens); 'tokens' -- the turn's exact tokens.",
    )
    strength: float = option(
        1.0, min=0.0, max=1.0,
        help="Advantage = (1 - strength) * incoming + strength * graph advantage (ours, not the paper's): 1 is SALT, "
        "0 leaves the incoming advantages unchanged (vanilla).",
    )


def turn_actions(turns, completion_ids: list[int], action: str) -> list[int]:
    """(U,) hashed action of each assistant turn of one completion.

    Args:
        turns: the completion's :class:`~trl_plugins.api.turns.TurnStructure`.
        completion_ids: its token ids. action: ``SaltOptions.action``.
    """
    out = []
    for (start, end), calls in zip(turns.assistant_spans, turns.tool_calls or [[]] * turns.num_turns):
        if action == "tool_calls" and calls:
            out.append(stable_key(["calls", [[c.get("name"), c.get("arguments")] for c in calls]]))
        else:
            out.append(stable_key(["tokens", list(completion_ids[start:end])]))
    return out


def step_keys(actions: list[int], identity: str) -> list[int]:
    """(U,) node key of each step from its turn's action hashes under ``identity`` (``SaltOptions.step_identity``)."""
    if identity == "action":
        return list(actions)
    if identity == "turn_action":
        return [stable_key([u, a]) for u, a in enumerate(actions)]
    keys, previous = [], 0
    for a in actions:
        previous = stable_key([previous, a])
        keys.append(previous)
    return keys


def step_values(advantages: torch.Tensor, turn_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
    """(N, U) incoming advantage of each step: the row's advantage for (N,) input; the mean over the step's tokens
    for (N, T) input (NaN for a step without tokens). ``turn_ids``: (N, T) with -1 outside assistant turns."""
    N = turn_ids.size(0)
    if advantages.dim() == 1:
        return advantages.float().unsqueeze(1).expand(N, num_steps).clone()
    adv = advantages.float()[:, : turn_ids.size(1)]
    ids = turn_ids[:, : adv.size(1)]
    valid = ids >= 0
    index = ids.clamp(min=0)
    sums = torch.zeros(N, num_steps).scatter_add_(1, index, torch.where(valid, adv, torch.zeros_like(adv)))
    counts = torch.zeros(N, num_steps).scatter_add_(1, index, valid.float())
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))


def graph_advantages(values: torch.Tensor, keys: torch.Tensor, num_steps: torch.Tensor, pools: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the steps of each prompt's trajectories into nodes and give each step its node's mean value.

    Args:
        values: (N, U) incoming advantage per step (NaN: a step without a value, left out of the means).
        keys: (N, U) long node key per step. num_steps: (N,) steps of each row (entries past it are ignored).
        pools: (N,) long, rows with the same pool were sampled from the same prompt.
    Returns:
        (N, U) node advantage per step (NaN past a row's steps), and (N, U) bool: the step shares its node with
        another step.
    """
    N, U = values.shape
    members: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for n in range(N):
        for u in range(int(num_steps[n])):
            members.setdefault((int(pools[n]), int(keys[n, u])), []).append((n, u))
    out = torch.full((N, U), float("nan"))
    shared = torch.zeros(N, U, dtype=torch.bool)
    for steps in members.values():
        valued = [float(values[n, u]) for n, u in steps if not torch.isnan(values[n, u])]
        mean = sum(valued) / len(valued) if valued else float("nan")
        for n, u in steps:
            out[n, u] = mean
            shared[n, u] = len(steps) > 1
    return out, shared


class SaltPlugin(Plugin):
    """Step-level advantages from a graph of the same prompt's trajectories (advantage stage)."""

    name = "salt"
    version = "0.1.0"
    paper = "SALT: Step-level Advantage Assignment for Long-horizon Agents via Trajectory Graph, arXiv:2510.20022"
    summary = "Merges the steps a prompt's trajectories share into a graph; each step gets its node's mean advantage."
    Options = SaltOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found (abstract and overview only): the step identity and the action grouping are "
        "reconstructed.",
    )
    image_inputs = True
    multi_turn = True
    claim_metric = ("shared_step_fraction", "steps merged with another trajectory's step")
    replaces = ("the advantages (step-level, expanded to tokens)",)
    overwrites = ()  # refines the incoming advantages: runs where the chain puts it
    reconstructed = (
        "step_identity: two steps are the same node when their action histories agree (prefix tree)",
        "action: a turn's action is its parsed tool calls; a turn without calls is identified by its tokens",
    )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.turn_ids is None or o.strength == 0:
            ctx.log_metric("shared_step_fraction", 0.0)
            return  # single-turn rows are single steps: only identical completions would merge
        local_keys = self._local_keys(ctx)
        width = max([len(k) for k in local_keys] + [1])
        packed = torch.zeros(len(local_keys), width, dtype=torch.long)
        for i, keys in enumerate(local_keys):
            if keys:
                packed[i, : len(keys)] = torch.tensor(keys, dtype=torch.long)
        keys = ctx.gather_padded(packed.to(ctx.device), dim=1, pad_value=0).cpu()
        turn_ids = ctx.turn_ids.cpu()
        num_steps = (turn_ids.max(dim=1).values + 1).clamp(min=0)
        U = max(int(num_steps.max().item()) if num_steps.numel() else 0, 1)
        keys = torch.cat([keys, torch.zeros(keys.size(0), max(U - keys.size(1), 0), dtype=torch.long)], dim=1)[:, :U]
        incoming = ctx.advantages.detach().cpu()
        values = step_values(incoming, turn_ids, U)
        node_values, shared = graph_advantages(values, keys, num_steps, ctx.pool_ids().cpu())
        steps = torch.arange(U).unsqueeze(0) < num_steps.unsqueeze(1)
        mixed = (1 - o.strength) * values.nan_to_num(0.0) + o.strength * node_values.nan_to_num(0.0)
        device = ctx.advantages.device
        ctx.advantages = ctx.expand_turns(torch.where(steps, mixed, torch.zeros_like(mixed)).to(device))
        total = int(steps.sum().item())
        ctx.log_metric("shared_step_fraction", float(shared[steps].float().mean()) if total else 0.0)
        changed = (node_values - values).abs()[steps & ~torch.isnan(values)]
        ctx.log_metric("advantage_change_mean", float(changed.mean()) if changed.numel() else 0.0)
        ctx.log_metric("steps_mean", float(num_steps.float().mean()))

    def _local_keys(self, ctx: AdvantageContext) -> list[list[int]]:
        """Per local row, the node key of each of its steps."""
        out = []
        for i, turns in enumerate(ctx.local_turns):
            ids = ctx.local_completion_ids[i].tolist() if ctx.local_completion_ids is not None else []
            actions = turn_actions(turns, ids, self.options.action)
            out.append(step_keys(actions, self.options.step_identity))
        return out
