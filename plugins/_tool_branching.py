"""Entropy-triggered step-level branches from tool boundaries (shared by ``arpo`` and ``aepo``'s rollout half).

Both follow the same rollout scheme of the ARPO code base: each group's first ``N`` rows are roots, the other
``G - N`` rows are slots; at each tool boundary (boundary ``k``: after the tool results of assistant turn ``k - 1``) a
root may make branches, decided by a per-plugin test of a uniform draw and the entropy change ``H[k-1] - H[0]`` of
its turns; a branch copies the root's turns before the boundary (tool results kept) and is continued through the
tool-episode seam (``ctx.continue_tool_episodes``), then put into a slot (``ctx.replace_episode``). What differs is
the test (``decide``) and the number of roots per group, which the plugins supply.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from trl_plugins.api import IncompatiblePluginsError, PluginConfigError, PluginError, RolloutContext
from trl_plugins.api.reasons import VLLM_TOOL_EPISODES, samples_outside_hf_generate

#: ``decide(u, delta, streak)``: whether a root branches, from a draw ``u ~ U(0, 1)``, the entropy change ``delta`` of
#: the turn before the boundary, and ``streak``, the number of consecutive boundaries just before this one at which
#: the group made a branch.
Decide = Callable[[float, float, int], bool]


class BranchingRoots:
    """Mixin of the branching plugins: the group size and seed seen at configure time, and ``roots``, the rows per
    group that are sources (option ``initial_rollouts``; None: half the group)."""

    num_generations: int | None = None
    seed: int = 0

    @property
    def roots(self) -> int:
        """N: root rollouts per group (``initial_rollouts``, default G // 2)."""
        G = self.num_generations or 0
        return self.options.initial_rollouts if self.options.initial_rollouts is not None else G // 2

    def configure_roots(self, args, full: str, roots: str, who: str) -> None:
        """Record ``args``' group size and seed; refuse ``initial_rollouts > num_generations`` (``full`` names what
        that setting is), a group left without a root when ``roots`` (what a root is called; empty: roots are not
        counted from the options), and vLLM when the plugin's ``trl_plugins_after_generation`` is enabled (``who``
        names the refused part)."""
        G, initial = args.num_generations, self.options.initial_rollouts
        if initial is not None and initial > G:
            raise PluginConfigError(
                f"Option 'initial_rollouts' of plugin '{self.name}' got {initial!r} with num_generations={G}; allowed: "
                f"1 <= initial_rollouts <= num_generations (num_generations: {full})."
            )
        self.num_generations, self.seed = G, int(getattr(args, "seed", 0))
        if roots and self.roots < 1:
            raise PluginConfigError(f"{self.name}: num_generations={G} leaves no {roots} rollout (num_generations // 2 "
                                    "= 0); set initial_rollouts >= 1 or num_generations >= 2.")
        if self.hook_enabled("trl_plugins_after_generation") and samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(f"{who} cannot run with use_vllm=True or continuous batching: "
                                           f"{VLLM_TOOL_EPISODES}")


def segment_entropy(entropies: torch.Tensor, span: tuple[int, int], tokens: int, vocab_size: int) -> float:
    """Official segment entropy: the sum of the per-token entropies of the first ``tokens`` tokens of ``span``
    (half-open completion positions of one assistant turn), divided by ``log(vocab_size)``; 0 for an empty span.

    Args:
        entropies: (T,) per-token entropies of the completion (nats).
    """
    start, end = span
    values = entropies[start: min(end, start + tokens)]
    if values.numel() == 0:
        return 0.0
    return float(values.float().sum().item()) / math.log(vocab_size)


def plan_branches(sources: Sequence[tuple[int, list[float]]], slots: int, beam_size: int, decide: Decide,
                  draw: Sequence) -> list[tuple[int, int]]:
    """``(source, boundary turn)`` of each branch of one group, in the official order: boundary by boundary
    (``k = 1, 2, ...``), sources in row order, at most ``beam_size - 1`` branches per source and boundary, ``slots``
    in all.

    Args:
        sources: per root row, ``(row, H)`` with ``H[u]`` the segment entropy of its assistant turn ``u``; boundary
            ``k`` exists when the row has more than ``k`` turns, and its entropy change is ``H[k-1] - H[0]``.
        decide: the branch test (:data:`Decide`); ``streak`` counts the boundaries before ``k`` at which this group
            branched, without a boundary free of branches in between.
        draw: per source (same order), a callable returning the next ``u ~ U(0, 1)``.
    """
    plan: list[tuple[int, int]] = []
    depth = max([len(h) for _, h in sources], default=0)
    streak = 0
    for k in range(1, depth):
        made = len(plan)
        for (row, h), rand in zip(sources, draw):
            if len(plan) >= slots:
                return plan
            if len(h) <= k:
                continue
            for _ in range(min(beam_size - 1, slots - len(plan))):
                if decide(rand(), h[k - 1] - h[0], streak):
                    plan.append((row, k))
        streak = streak + 1 if len(plan) > made else 0
    return plan


def require_whole_groups(ctx: RolloutContext, name: str) -> None:
    """Refuse a process whose rows are not whole groups (branches fill slots of their own group)."""
    G = ctx.num_generations
    if len(ctx) % G or ctx.global_index[0] % G:
        raise PluginError(f"{name}: this process holds {len(ctx)} rows starting at global row {ctx.global_index[0]}, "
                          f"not whole groups of num_generations={G}; allowed: a per-process generation batch that "
                          "is a multiple of num_generations (branches fill slots of their own group).")


def turn_entropies(ctx: RolloutContext, rows: Sequence[int], tokens: int) -> dict[int, list[float]]:
    """``{row: H}``, ``H[u]`` the :func:`segment_entropy` of assistant turn ``u`` of local row ``row`` under the
    current policy, for the turns that start within the completion limit (at least the first).

    Collective (``ctx.policy_entropies``): call it on every process, possibly with no rows.
    """
    rows = list(rows)
    vocab = len(ctx.tokenizer.get_vocab())
    limit = ctx.run.max_completion_length
    out = {}
    for i, entropies in zip(rows, ctx.policy_entropies(rows)):
        spans = ctx.turns[i].assistant_spans
        h = [segment_entropy(entropies, s, tokens, vocab) for s in spans]
        usable = [u for u in range(len(spans)) if spans[u][0] < limit]
        out[i] = h[: max(usable, default=0) + 1]
    return out


def branch_groups(ctx: RolloutContext, seed: int, roots: Sequence[int], entropies: dict[int, list[float]],
                  beam_size: int, decide: Decide, key: str) -> list[int]:
    """Plan and make the branches of every local group: group ``g``'s first ``roots[g]`` rows are its sources (their
    turn entropies in ``entropies``), its other rows the slots; the branches are continued through the tool-episode
    seam (one collective call, also with no request) and put into the slots in order, each annotated with
    ``key = "<global source row>@<boundary turn>"``. Returns the number of branches per group.

    Draws: per source row, a ``random.Random`` seeded from ``(seed, ctx.step, global row)``: the same on every run.
    """
    G = ctx.num_generations
    requests, slots_of, made = [], [], []
    for g, first in enumerate(range(0, len(ctx), G)):
        sources = [(i, entropies[i]) for i in range(first, first + roots[g])]
        draws = [random.Random((seed * 1_000_003 + ctx.step) * 1_000_003 + ctx.global_index[i]).random
                 for i, _ in sources]
        plan = plan_branches(sources, G - roots[g], beam_size, decide, draws)
        requests += plan
        slots_of += list(range(first + roots[g], first + roots[g] + len(plan)))
        made.append(len(plan))
    # one call on every process, with no request too: generation and the forward are collectives
    episodes = ctx.continue_tool_episodes([i for i, _ in requests], [k for _, k in requests])
    for slot, (source, k), episode in zip(slots_of, requests, episodes):
        ctx.replace_episode(slot, episode)
        ctx.annotations[slot][key] = f"{ctx.global_index[source]}@{k}"
    return made
