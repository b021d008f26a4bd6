"""The loss types plugins may rely on, and when the policy moves before the loss (constants and one rule).

The formulas themselves live in the runtime (:mod:`trl_plugins.runtime.loss_rules`); this module holds only what
a plugin checks at configure: which ``loss_type`` values the plugin loss path implements, which of them clip the
ratio PPO-style, which hooks route a stack's loss through that path, and :func:`policy_moves_before_loss`.
"""

from __future__ import annotations

from typing import Any

#: Every ``loss_type`` the plugin loss path implements (all of TRL 1.16's).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: The loss types a stack with loss- or sampling-stage plugins supports (the plugin loss path's).
SUPPORTED_LOSS_TYPES = LOSS_TYPES
#: Loss types whose surrogate is PPO's two-sided clipped one (``-min(r A, clip(r) A)``).
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: Hooks whose presence in a stack makes the trainer compute the loss on the plugin loss path instead of TRL
#: (sampling hooks may inject off-policy tokens; the trainer's SAMPLING_HOOKS + LOSS_HOOKS).
LOSS_PATH_HOOKS = (
    "trl_plugins_generation_prompts", "trl_plugins_after_generation", "trl_plugins_loss_advantages", "trl_plugins_loss",
)


def policy_moves_before_loss(args: Any, num_iterations: int | None = None) -> bool:
    """Whether the policy is updated between a generation batch's rollout and some of its loss computations.

    TRL computes ``old_per_token_logps`` only then (``gradient_accumulation_steps`` not a multiple of
    ``steps_per_generation * num_iterations``); otherwise ``lp_old = sg(lp)`` at the loss, ratios are 1, and
    terms built on ``lp - lp_old`` (KL-Cov's penalty, LLDS's likelihood-drop gate) are exactly zero.
    """
    iterations = num_iterations if num_iterations is not None else getattr(args, "num_iterations", 1)
    generate_every = getattr(args, "steps_per_generation", 1) * iterations
    return args.gradient_accumulation_steps % generate_every != 0
