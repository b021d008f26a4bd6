"""Option groups several plugins share: declared once here, with the one check that goes with them.

A plugin's option dataclass derives from the groups it uses (``class MyOptions(OffPolicyOptions, WarmupOptions)``),
so the option names, defaults, ranges and help read the same in every plugin. Other groups live with their component:
the success rule (:class:`trl_plugins.api.success.SuccessOptions`), an external model's endpoint
(:func:`trl_plugins.components.client.endpoint_options`: the teacher, PRM, judge and critic groups), the teacher
(:class:`trl_plugins.components.teacher.TeacherOptions`) and the PRM (:class:`trl_plugins.components.prm.PRMOptions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trl_plugins.api.errors import IncompatiblePluginsError
from trl_plugins.api.options import PluginOptions, option

__all__ = ["OffPolicyOptions", "WarmupOptions", "check_offpolicy_gamma"]


def check_offpolicy_gamma(plugin: str, gamma: float, args: Any) -> None:
    """Refuse (at construction) a plugin whose shaping gamma differs from the run's ``offpolicy_shaping_gamma``.

    The shaped off-policy branch ``-A p/(p+gamma)`` of the loss
    (:func:`~trl_plugins.runtime.loss_rules.shaped_offpolicy_loss`) is shared by every plugin of a run, so a plugin's
    documented gamma (LUFFY: 0.1) is a check on the run setting, not a second knob.
    """
    run_gamma = getattr(args, "offpolicy_shaping_gamma", 0.1)
    if not math.isclose(float(run_gamma), float(gamma)):
        raise IncompatiblePluginsError(
            f"{plugin}: gamma={gamma} but the run's offpolicy_shaping_gamma={run_gamma}. The shaped off-policy branch "
            f"p/(p+gamma) is shared by every plugin of a run; set offpolicy_shaping_gamma: {gamma} in the config (or "
            f"the plugin's gamma to {run_gamma})."
        )


@dataclass
class OffPolicyOptions(PluginOptions):
    """The plugins whose injected tokens (demonstrations, corrections, anchors, hinted re-samples) are trained through
    the loss's shaped off-policy branch ``-A p/(p+gamma)`` (LUFFY). Call :meth:`check_gamma` from
    ``trl_plugins_configure``."""

    gamma: float = option(
        0.1, min=0.0, min_exclusive=True,
        help="gamma of the shaped off-policy branch p/(p+gamma) of this plugin's off-policy tokens (LUFFY: 0.1); must "
        "equal the run's offpolicy_shaping_gamma, which every plugin of a run shares.",
    )

    def check_gamma(self, plugin: str, args: Any) -> None:
        """:func:`check_offpolicy_gamma` of this plugin's ``gamma`` against the run's ``args``."""
        check_offpolicy_gamma(plugin, self.gamma, args)


@dataclass
class WarmupOptions(PluginOptions):
    """The plugins that leave the first steps of a run to plain GRPO."""

    warmup_steps: int = option(
        0, min=0, help="Plain GRPO for this many steps first: the plugin acts from step warmup_steps on."
    )

    def warming_up(self, step: int) -> bool:
        """Whether the plugin stays out of ``step`` (global step, 0-based)."""
        return step < self.warmup_steps
