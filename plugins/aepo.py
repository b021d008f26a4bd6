"""AEPO — Agentic Entropy-Balanced Policy Optimization (arXiv:2510.14545): the policy update and, as an option, the
entropy-balanced rollout.

Policy update (always on, the loss stage). Facts from AEPO's ``compute_policy_loss_entropy_balanced_clipping`` (verl
``core_algos.py``; flags ``enable_entropy_balanced_clipping`` and ``enable_entropy_balanced_advantage``, both on in
the released scripts):

1. Entropy clipping-balanced mechanism: the upper clip bound ``1 + eps_high`` becomes ``(1 + eps_high) r / sg(r)``.
   Its value is unchanged, but a token clipped from above (``A > 0``, ``r > 1 + eps_high``: mostly high-entropy
   tokens, which the paper shows the upper clip hits) keeps the gradient ``(1 + eps_high) A grad log pi`` instead of
   none. The lower bound stays a hard clip.
2. Entropy-aware advantage: ``A_t <- A_t (1 + 0.2 z_t)`` with ``z_t = (H_t - mean H) / std H`` the token entropy
   standardised over the loss tokens of the micro-batch (std 1 when it is 0; no gradient through ``z``).
3. Dual-clip PPO for ``A < 0`` (verl's ``clip_ratio_c = 3``): ``min(-A c, L)``, so a negative-advantage token whose
   ratio passed ``c`` contributes the constant ``-A c``.

Here (1) and (3) replace TRL's surrogate on the tokens they concern (``ctx.replace_tokens``; clipped loss types
only), and (2) is a ``trl_plugins_loss_advantages`` hook, so TRL's surrogate is built from the shaped advantages.
The entropy is TRL's full-vocabulary entropy of the loss forward, as verl's actor computes it. TRL's clip range
(``epsilon``, ``epsilon_high``) is used; a per-token clip scale from another plugin scales the upper bound too.

Rollout (``branching=True``; off by default: the released scripts run ``ENABLE_DYNAMIC_ROLLOUTS=False`` with ARPO's
branching). AEPO's rollout is ARPO's entropy-triggered branching from tool boundaries (see ``arpo``; the mechanism
has one home, ``plugins/_tool_branching.py``) with two changes. Facts from AEPO's
``AEPO/verl_aepo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py`` (``R``) and
``AEPO/scripts/AEPO_Qwen25_7B_DeepResearch.sh`` (``S``) as uploaded in commit 81e3a5d ("upload AEPO"), read in the
fork mowenruan/ARPO @ 410211f (the official repository's reachable snapshots predate AEPO):

4. Entropy pre-monitoring (``dynamic_rollouts``; R:206-565, 635-639): per prompt, a monitor rollout gives the root
   entropy ``H_root`` (its first segment) and ``H_tool``, the mean entropy of its segments through the tool rounds;
   the group starts with ``m = clamp(int(n sigmoid(0.5 (H_root - H_tool))) + 1, 1, n)`` global rollouts (R:541-550),
   the other ``n - m`` slots going to branches. A segment's entropy is ARPO's (the first 20 tokens, R:286, 388, 728,
   over ``log |V|``). Without it, ``m = initial_rollouts`` (S:61, 8 of ``rollout.n=16``).
5. Branch test with the consecutive-branch penalty (R:941-968, 1025-1036): ``p = clip((u + w dH) (1 - 0.05 c), 0,
   1)`` with ``u ~ U(0, 1)``, ``w = entropy_weight`` (S:64, 0.2), ``dH`` the entropy change of the turn before the
   boundary from the rollout's first turn, ``c`` the prompt's count of consecutive tool rounds with a branch (reset
   by a round without one); a branch is made when ``p >= branch_probability`` (S:63, 0.5), at most
   ``beam_size - 1`` (S:62, 2 - 1) per source and round, while the group has free slots.

Mapping onto TRL (sampling stage, ``trl_plugins_after_generation``, as ``arpo``): TRL samples whole groups; row 0 of
each group is its monitor rollout (4), rows ``index_in_group < m`` the global rollouts (roots), the others the slots;
entropies are the current policy's full-vocabulary ones (``ctx.policy_entropies``, one collective call for the
monitors and one for the other roots); branches are continued through the tool-episode seam and put into the slots
(``ctx.replace_episode``); slots no branch fills keep TRL's fresh rollouts (official: fresh rollouts from the
prompt). Each branch is counted once more in the rollout budget.

Reconstructed or different (documented): the monitor rollout is the group's first row, and ``H_root`` its first turn
(official: a separate monitor rollout and a separate 50-token sample for ``H_root``, both outside the group); branches
are not sources of further branches, and fresh rollouts given to a prompt without a running rollout do not count as
its branching (official: both happen); the entropy is the full-vocabulary one (official: vLLM's top-10 entries); HF
generate only (refused under vLLM).

Faithfulness: the loss half follows a public copy of the official function in a third-party fork and the paper's
text; the rollout half the fork above. The plugin stays marked reconstructed.

Neutral setting: ``balanced_clipping=False, entropy_advantage_coef=0, dual_clip=None`` switches the loss hooks off
(vanilla TRL), and ``branching=False`` (the default) the rollout hook. On the first pass over a batch (``r = 1``)
neither clip is active, so only (2) acts. With ``branching=True, dynamic_rollouts=False, initial_rollouts =
num_generations`` no slot is left: the rollout hook is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE

from ._tool_branching import BranchingRoots, branch_groups, require_whole_groups, turn_entropies

ENTROPY_ADVANTAGE_HOOK = "trl_plugins_loss_advantages"
CLIP_HOOK = "trl_plugins_loss"
ROLLOUT_HOOK = "trl_plugins_after_generation"
#: Annotation key: on a slot row filled by a branch, "<global source row>@<boundary turn>".
BRANCH_KEY = "aepo_branch"


@dataclass
class AepoOptions(PluginOptions):
    balanced_clipping: bool = option(
        True, help="Keep the gradient of tokens clipped from above: upper bound (1 + eps_high) r / sg(r)."
    )
    entropy_advantage_coef: float = option(
        0.2, min=0.0, help="A <- A (1 + coef z), z the token entropy standardised over the micro-batch; 0: off."
    )
    dual_clip: float | None = option(
        3.0, min=1.0, min_exclusive=True,
        help="Dual-clip constant c for A < 0: loss min(-A c, L); None: off (TRL has no dual clip).",
    )
    branching: bool = option(
        False, help="AEPO's rollout half: entropy-triggered branches from tool boundaries fill part of each group "
        "(tool runs, HF generate). False: the update half alone (the released scripts' rollout is ARPO's).",
    )
    dynamic_rollouts: bool = option(
        True, help="With branching: entropy pre-monitoring sets each group's global rollouts m = clamp(int(G "
        "sigmoid(budget_scale (H_root - H_tool))) + 1, 1, G) from its first row (official config default True; the "
        "released scripts set False). False: initial_rollouts.",
    )
    initial_rollouts: int | None = option(
        None, min=1,
        help="With branching and dynamic_rollouts=False: global rollouts per group, the other rows being slots for "
        "branches (official scripts: 8 of rollout.n=16; None: num_generations // 2).",
    )
    beam_size: int = option(2, min=1, help="A source makes at most beam_size - 1 branches per boundary (official: 2).")
    branch_probability: float = option(
        0.5, min=0.0, max=1.0,
        help="Branch when clip((u + entropy_weight dH) (1 - branch_penalty c), 0, 1) >= this (official: 0.5).",
    )
    entropy_weight: float = option(0.2, min=0.0, help="Weight w of the entropy change dH (official scripts: 0.2).")
    branch_penalty: float = option(
        0.05, min=0.0,
        help="Penalty per consecutive tool round with a branch, c, on the branch score (official: 0.05, fixed in the "
        "code); 0: ARPO's test.",
    )
    budget_scale: float = option(
        0.5, min=0.0, help="Scale of H_root - H_tool in the pre-monitoring sigmoid (official: 0.5, fixed in the code).",
    )
    entropy_tokens: int = option(
        20, min=1, help="A segment's entropy sums its first entropy_tokens tokens (official: 20, fixed in the code).",
    )

    def validate(self) -> None:
        if self.dynamic_rollouts and self.initial_rollouts is not None:
            raise PluginConfigError(
                f"Option 'initial_rollouts' of plugin 'aepo' got {self.initial_rollouts!r} with dynamic_rollouts=True; "
                "allowed: initial_rollouts=None with dynamic_rollouts=True (the pre-monitoring sets the global "
                "rollouts), or dynamic_rollouts=False."
            )


def entropy_scaled_advantages(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
                              coef: float) -> torch.Tensor:
    """``A (1 + coef z)``, ``z`` the entropy standardised over the loss tokens (unbiased std; 1 when it is 0).

    Args:
        advantages: (B, T). entropies: (B, T) (detached here). mask: (B, T) loss mask.
    Returns:
        (B, T) shaped advantages (unchanged when no token is in the mask).
    """
    valid = entropies.detach()[mask.bool()]
    if valid.numel() == 0:
        return advantages
    std = valid.std() if valid.numel() > 1 else valid.new_tensor(0.0)
    std = torch.where(std == 0, torch.ones_like(std), std)
    z = (entropies.detach() - valid.mean()) / std
    return advantages * (1 + coef * z)


def global_rollouts(h_root: float, h_tool: float, group_size: int, scale: float) -> int:
    """AEPO's entropy pre-monitoring budget split: ``clamp(int(G sigmoid(scale (h_root - h_tool))) + 1, 1, G)`` global
    rollouts of a group of ``G``, the other ``G - m`` rows going to branches."""
    m = int(group_size / (1.0 + math.exp(-scale * (h_root - h_tool)))) + 1
    return max(1, min(m, group_size))


def penalized_branch(u: float, delta: float, streak: int, weight: float, threshold: float, penalty: float) -> bool:
    """AEPO's branch test: ``clip((u + weight delta) max(0, 1 - penalty streak), 0, 1) >= threshold``, ``streak`` the
    consecutive tool rounds just before with a branch in the group (``u`` uniform in [0, 1))."""
    score = (u + weight * delta) * max(0.0, 1.0 - penalty * streak)
    return min(1.0, max(0.0, score)) >= threshold


def balanced_upper_clip(advantages: torch.Tensor, coef_1: torch.Tensor, upper: torch.Tensor | float) -> torch.Tensor:
    """Loss of a token clipped from above with the gradient kept: ``-A upper r / sg(r)`` (value ``-A upper``)."""
    return -advantages * upper * coef_1 / coef_1.detach()


class AepoPlugin(BranchingRoots, Plugin):
    """Gradient-preserving upper clip, entropy-aware advantages and dual clip: AEPO's policy update (loss stage); with
    ``branching``, its entropy-balanced rollout (sampling stage)."""

    name = "aepo"
    multi_turn = True
    image_inputs = True
    version = "0.2.0"
    paper = "Agentic Entropy-Balanced Policy Optimization (AEPO), arXiv:2510.14545"
    summary = ("Keeps the gradient of upper-clipped tokens, scales advantages by token entropy, dual-clips negatives; "
               "optionally entropy-balanced branching from tool boundaries.")
    Options = AepoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="The official repository's reachable snapshots (RUC-NLPIR/ARPO, dongguanting/ARPO @ e257337) predate "
        "AEPO; the loss rules follow a public copy of AEPO's compute_policy_loss_entropy_balanced_clipping (verl "
        "core_algos.py) in a third-party fork, and the paper; the rollout half (branching=True) follows AEPO's "
        "vllm_rollout_with_tools.py and scripts as uploaded in commit 81e3a5d, read in the fork mowenruan/ARPO @ "
        "410211f. TRL's clip range is used; the monitor rollout is the group's first row; branches are not sources "
        "of further branches; full-vocabulary entropy (official: vLLM's top-10 entries); HF generate only.",
        non_official_defaults={"initial_rollouts": "official scripts: 8 with rollout.n=16; None here is "
                               "num_generations // 2, the same ratio for any group size",
                               "branching": "the official rollout always branches (ARPO's, with the penalty); off "
                               "here so that the plugin stays the update half unless asked"},
    )
    claim_metric = ("preserved_clip_fraction", "upper-clipped tokens whose gradient is kept")
    replaces = ("the base surrogate on upper-clipped positive-advantage tokens (gradient kept) and, with dual_clip, "
                "on negative-advantage tokens past the dual-clip constant",)
    replaces_surrogate = True
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = "AEPO changes PPO's clipped surrogate; cispo, sapo and vespo replace that clipping otherwise."
    reconstructed = (
        "the rollout half's monitor rollout is each group's first row and H_root its first turn",
        "branches are not sources of further branches",
        "initial_rollouts=None means num_generations // 2 (the official scripts' 8 of 16)",
    )

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: the update half works; with branching=True the branches are sampled through the generation
        service from the prompts' token ids, which would not see the image."""
        return IMAGES_GENERATION_SERVICE if self.options.branching else None

    def hook_enabled(self, hook: str) -> bool:
        o = self.options
        if hook == ROLLOUT_HOOK:
            return o.branching and (o.dynamic_rollouts or self.num_generations is None
                                    or self.roots < self.num_generations)
        if hook == ENTROPY_ADVANTAGE_HOOK:
            return o.entropy_advantage_coef > 0
        if hook == CLIP_HOOK:
            return o.balanced_clipping or o.dual_clip is not None
        return True

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.options.branching:
            self.configure_roots(args, "no branch", "" if self.options.dynamic_rollouts else "global",
                                 "aepo's branching")

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        if not ctx.turns:  # no tools: no tool boundary, nothing branches (the same on every process)
            return
        o, G = self.options, ctx.num_generations
        require_whole_groups(ctx, "aepo")
        firsts = range(0, len(ctx), G)
        entropies: dict[int, list[float]] = {}
        if o.dynamic_rollouts:  # pre-monitoring: each group's first row (collective: every process, every batch)
            entropies = turn_entropies(ctx, list(firsts), o.entropy_tokens)
            monitors = [entropies[f] or [0.0] for f in firsts]
            roots = [global_rollouts(h[0], sum(h) / len(h), G, o.budget_scale) for h in monitors]
        else:
            roots = [self.roots] * len(firsts)
        rest = [i for f, m in zip(firsts, roots) for i in range(f, f + m) if i not in entropies]
        entropies.update(turn_entropies(ctx, rest, o.entropy_tokens))  # collective: every process, every batch
        made = branch_groups(
            ctx, self.seed, roots, entropies, o.beam_size,
            lambda u, delta, streak: penalized_branch(u, delta, streak, o.entropy_weight, o.branch_probability,
                                                      o.branch_penalty),
            BRANCH_KEY,
        )
        for m, count in zip(roots, made):
            ctx.log_metric("global_rollouts", float(m))
            ctx.log_metric("branches", float(count))

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx: LossContext):
        ctx.advantages = entropy_scaled_advantages(ctx.advantages, ctx.entropies, ctx.mask,
                                                   self.options.entropy_advantage_coef)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        mask = ctx.mask.bool() & ~ctx.offpolicy_mask  # injected tokens keep their shaped branch
        advantages = ctx.advantages.expand_as(ctx.mask)
        coef_1 = ctx.coef_1.expand_as(ctx.mask)
        upper = 1 + ctx.epsilon_high * (1.0 if ctx.clip_scale is None else ctx.clip_scale)
        upper = torch.as_tensor(upper, dtype=coef_1.dtype, device=coef_1.device).expand_as(coef_1)
        values = ctx.per_token_loss.expand_as(coef_1)
        preserved = mask & (advantages > 0) & (coef_1.detach() > upper) if o.balanced_clipping else torch.zeros_like(mask)
        dual = torch.zeros_like(mask)
        if o.dual_clip is not None:
            dual = mask & (advantages < 0) & (ctx.per_token_loss.detach() > -advantages * o.dual_clip)
        if preserved.any() or dual.any():
            values = torch.where(preserved, balanced_upper_clip(advantages, ctx.coef_1, upper), values)
            if o.dual_clip is not None:
                values = torch.where(dual, -advantages * o.dual_clip, values)
            ctx.replace_tokens(preserved | dual, values)
        ctx.log_metric("preserved_clip_fraction", ctx.global_masked_mean(preserved.float()))
        ctx.log_metric("dual_clip_fraction", ctx.global_masked_mean(dual.float()))
