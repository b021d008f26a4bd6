"""ARPO — Agentic Reinforced Policy Optimization (arXiv:2507.19849): entropy-based adaptive rollout for tool agents.

After a tool result, a language model agent is often uncertain about how to go on; ARPO spends part of each group's
rollout budget on extra *step-level branches* sampled from those points, more readily where the entropy of the
generation after the tool result rose above the rollout's initial entropy. Facts from the official code
(dongguanting/ARPO @ e257337, ``ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py``
(``R``) and ``ARPO/scripts/ARPO_7B_Reasoning_1node.sh`` (``S``)):

1. Budget (R:83-86, 238-260; S:55-59): a group of ``n`` rollouts (``rollout.n=16``) starts with ``initial_rollouts``
   full rollouts (8); branches fill the other ``n - initial_rollouts`` slots; slots still free when a prompt's rollouts
   have all ended get fresh rollouts from the prompt (R:494-510), so every group has exactly ``n`` rows.
2. Entropy (R:114, 172-177, 281-305): each generation segment (an assistant turn) gets
   ``H = sum over its first 20 tokens of -sum_top10 p log p / log |V|`` (vLLM's top-10 log-probs); a rollout's first
   segment gives its initial entropy ``H_init``.
3. Branching (R:452-486): after every tool round, each rollout still going (it called a tool and got the result) is a
   source; at most ``beam_size - 1`` branches per source (2 - 1 = 1), while the group has free slots; a branch is
   sampled with ``p = clip(u - entropy_weight * (H_now - H_init), 0, 1)``, ``u ~ U(0, 1)``, and made when
   ``p <= branch_probability`` (0.5), ``H_now`` being the entropy of the segment that just ended with the tool call.
   A branch copies the source's tokens up to and including the tool result and continues from there.
4. Advantage (S:105 ``algorithm.adv_estimator=grpo``): GRPO over the group's ``n`` trajectories, a branch being a
   whole trajectory (shared prefix included): the paper's *soft* advantage attribution, where the tokens a branch
   shares with its source are trained in both rows, each with its own trajectory's advantage.

Mapping onto TRL (sampling stage, ``trl_plugins_after_generation``): TRL samples whole groups, so rows
``index_in_group < initial_rollouts`` are the roots and the other rows are the slots; ``H`` of every assistant turn of
the roots comes from ``ctx.policy_entropies`` (full-vocabulary entropy of the current policy, temperature applied),
the branch decisions follow 3 turn boundary by turn boundary, and the branches are continued through the tool-episode
seam (``ctx.continue_tool_episodes``: the source's turns before the boundary with their tool results kept, TRL's own
tool loop after it, a fresh environment brought to the boundary; one collective call per batch) and put into the slots
with ``ctx.replace_episode`` (their turns, tool mask and environment kept). Slots that no branch fills keep TRL's fresh
rollouts (official: fresh rollouts from the prompt, the same distribution). The advantage is TRL's, unchanged (4).

Cost and budget: TRL first samples all ``G`` rows, so the slot rows a branch replaces were sampled and dropped; each
branch is counted once more in the rollout budget (``plugin_generation_budget``). Training sees ARPO's groups.

Neutral setting: ``initial_rollouts = num_generations`` leaves no slot: nothing is generated and the run is vanilla
TRL. Without tools there are no tool boundaries and nothing branches either.

Reconstructed or different (documented): branches are not sources of further branches (official: a branch still
going is a source in the next rounds); the entropy is the full-vocabulary one (official: vLLM's top-10 entries);
HF generate only (the seam is refused under vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginOptions,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE

from ._tool_branching import BranchingRoots, branch_groups, require_whole_groups, turn_entropies
from ._tool_branching import plan_branches as plan_tool_branches
from ._tool_branching import segment_entropy  # noqa: F401  (arpo's public name, kept)

#: Annotation key: on a slot row filled by a branch, "<global source row>@<boundary turn>".
BRANCH_KEY = "arpo_branch"


@dataclass
class ArpoOptions(PluginOptions):
    initial_rollouts: int | None = option(
        None, min=1,
        help="Rollouts per group that are roots; the other num_generations - initial_rollouts rows are filled with "
        "branches (official scripts: 8 of rollout.n=16; None: num_generations // 2). num_generations: vanilla TRL.",
    )
    beam_size: int = option(
        2, min=1, help="A source makes at most beam_size - 1 branches at a boundary (official scripts: 2).",
    )
    branch_probability: float = option(
        0.5, min=0.0, max=1.0,
        help="Branch when clip(u - entropy_weight * dH, 0, 1) <= this, u ~ U(0, 1) (official scripts: 0.5).",
    )
    entropy_weight: float = option(
        0.2, min=0.0, help="Weight of the entropy change dH in the branch test (official scripts: 0.2).",
    )
    entropy_tokens: int = option(
        20, min=1, help="A segment's entropy sums its first entropy_tokens tokens (official: 20, fixed in the code).",
    )


def branches(u: float, delta: float, weight: float, threshold: float) -> bool:
    """The official branch test: ``clip(u - weight * delta, 0, 1) <= threshold`` (``u`` uniform in [0, 1))."""
    return min(1.0, max(0.0, u - weight * delta)) <= threshold


def plan_branches(sources: Sequence[tuple[int, list[float]]], slots: int, beam_size: int, weight: float,
                  threshold: float, draw: Sequence) -> list[tuple[int, int]]:
    """ARPO's branch plan of one group: :func:`~trl_plugins_builtin._tool_branching.plan_branches` with the test
    :func:`branches` (no dependence on earlier branchings)."""
    return plan_tool_branches(sources, slots, beam_size, lambda u, delta, _streak: branches(u, delta, weight, threshold),
                              draw)


class ArpoPlugin(BranchingRoots, Plugin):
    """Entropy-triggered step-level branches from tool boundaries fill part of each group (ARPO)."""

    name = "arpo"
    version = "0.1.0"
    paper = "Agentic Reinforced Policy Optimization (ARPO), arXiv:2507.19849"
    summary = "Entropy-based adaptive rollout: step-level branches from tool boundaries where entropy rises."
    Options = ArpoOptions
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = True
    official = OfficialSource(
        "dongguanting/ARPO", "e257337", verdict="faithful",
        files=(
            "ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py",
            "ARPO/scripts/ARPO_7B_Reasoning_1node.sh",
        ),
        note="Branches are not sources of further branches; full-vocabulary entropy (official: vLLM's top-10 "
        "entries); TRL samples whole groups first, so the slots a branch fills were sampled and dropped; HF generate "
        "only (the tool-episode seam).",
        non_official_defaults={"initial_rollouts": "official scripts: 8 with rollout.n=16; None here is "
                               "num_generations // 2, the same ratio for any group size"},
    )
    claim_metric = ("branches", "branches per group (slots filled by step-level branches)")
    reconstructed = (
        "branches are not sources of further branches",
        "initial_rollouts=None means num_generations // 2 (the official scripts' 8 of 16)",
    )

    def hook_enabled(self, hook: str) -> bool:
        return self.num_generations is None or self.roots < self.num_generations

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.configure_roots(args, "vanilla", "root", "arpo")

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        if not ctx.turns:  # no tools: no tool boundary, nothing branches (the same on every process)
            return
        o, G, N = self.options, ctx.num_generations, self.roots
        require_whole_groups(ctx, "arpo")
        roots = [i for i in range(len(ctx)) if ctx.index_in_group[i] < N]
        entropies = turn_entropies(ctx, roots, o.entropy_tokens)  # collective: every process, every batch
        made = branch_groups(ctx, self.seed, [N] * (len(ctx) // G), entropies, o.beam_size,
                             lambda u, delta, _streak: branches(u, delta, o.entropy_weight, o.branch_probability),
                             BRANCH_KEY)
        for count in made:
            ctx.log_metric("branches", float(count))
