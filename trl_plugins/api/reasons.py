"""Reasons several plugins give, kept in one place so that the same situation reads the same everywhere.

* Why a plugin cannot run on multi-turn tool rollouts (:attr:`trl_plugins.Plugin.multi_turn`): it edits completions
  after generation (:func:`edits_completions`, :data:`EDITS_COMPLETIONS`), or it drops groups for the refill stage
  (:data:`REFILLS_GROUPS`).
* Why two plugins are refused together (:attr:`trl_plugins.Plugin.conflict_reason`, "pick one"): one reason per family
  of plugins acting on the same quantity, so a plugin of the family names it here rather than importing a peer.
"""

from __future__ import annotations

__all__ = [
    "ADVANTAGE_PICK_ONE",
    "CORRECTNESS_PICK_ONE",
    "EDITS_COMPLETIONS",
    "ENTROPY_PICK_ONE",
    "LENGTH_COUNTS_TOOL_TOKENS",
    "LIKELIHOOD_PICK_ONE",
    "REFILLS_GROUPS",
    "edits_completions",
]


def edits_completions(how: str = "replace_row / splice / in-step generation") -> str:
    """The multi-turn refusal of a plugin that edits completions after generation (``how``: what it does to them)."""
    return (
        f"it edits completions after generation ({how}), and the generation service samples single-turn text without "
        "running tools, so the edited rows would lose their tool-call turns."
    )


#: The multi-turn refusal of the plugins that replace, splice or re-generate completions after generation.
EDITS_COMPLETIONS = edits_completions()

#: The multi-turn refusal of the plugins that drop groups for the refill stage.
REFILLS_GROUPS = (
    "it rejects groups for the refill stage, which regenerates whole groups through the generation service (no tool "
    "loop); the trainer refuses refill with tools."
)

#: The multi-turn refusal of the length-efficient reasoning plugins (laser, dler, decs, pear, siri, hbpo).
LENGTH_COUNTS_TOOL_TOKENS = (
    "its length reward counts completion_ids, which in tool rollouts include the tool-result tokens the model did not "
    "write."
)

#: clip_cov, kl_cov, lp_reg, siren, epo, hapo: remedies for entropy collapse.
ENTROPY_PICK_ONE = (
    "each is a complete remedy for entropy collapse acting on an overlapping set of tokens (high-covariance, "
    "low-probability or high-entropy ones); stacked, their corrections compound and match neither paper"
)

#: gtpo, llds: protecting the likelihood of good responses' tokens.
LIKELIHOOD_PICK_ONE = (
    "both protect the likelihood of tokens in good responses (GTPO the tokens good and bad completions share, LLDS "
    "the tokens whose likelihood dropped), so stacked they protect the same tokens twice; LLDS is meant for "
    "tool/search RL"
)

#: rlpr, empo: replacing the correctness reward.
CORRECTNESS_PICK_ONE = (
    "both replace the correctness reward (EMPO with answer agreement, without references; RLPR with the policy's "
    "probability of the reference answer); choose by whether your dataset has reference answers"
)

#: hapo (token-level advantage), canon, prl, riskpo: advantage estimators computing the advantages from scratch.
ADVANTAGE_PICK_ONE = (
    "both compute the advantages from scratch (the later one would silently discard the other's); pick one advantage "
    "estimator"
)
