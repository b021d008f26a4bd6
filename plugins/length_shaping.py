"""Length shaping -- deprecated: one plugin per paper now (``laser``, ``dler``, ``decs``, ``pear``, ``siri``,
``hbpo``).

Until the next release, ``plugins: [length_shaping]`` with ``mode: X`` still builds the plugin that mode became, with
the options renamed (the table below, :attr:`LengthShapingPlugin.moved`), under the name ``length_shaping`` -- so its
metrics (``plugins/length_shaping/...``), its reward column and its checkpoint state keep their keys and a run
behaves as before -- and warns (``DeprecationWarning`` and the log) naming the new plugin and the option mapping.
Options of another mode, which did nothing with this one, are dropped (the warning names them).

========================  ===============================  ================================================
``mode``                  new plugin and options           renamed options
========================  ===============================  ================================================
``laser``                 ``laser``, ``variant: laser``
``laser_d`` (default)     ``laser``, ``variant: laser_d``
``laser_de``              ``laser``, ``variant: laser_de``
``dler``                  ``dler``
``dler_difficulty``       ``dler``, ``difficulty_aware``
``decs``                  ``decs``                         ``decs_beta`` ``decs_split_words``
                                                           ``decs_curriculum`` ``decs_kappa_lr`` lose ``decs_``
``pear``                  ``pear``                         ``pear_*`` lose ``pear_``
``siri``                  ``siri``                         ``siri_*`` lose ``siri_``
``hbpo``                  ``hbpo``                         ``hbpo_*`` lose ``hbpo_``
========================  ===============================  ================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trl_plugins.api import Moved, Plugin, PluginOptions, option
from trl_plugins.api.reasons import LENGTH_COUNTS_TOOL_TOKENS

CORRECTNESS = ("correctness_column", "correct_threshold")
LASER = (*CORRECTNESS, "alpha", "target_length", "num_budgets", "target_estimator", "ecr_min", "explore_gate",
         "format_column", "difficulty_edges", "window")
DLER = (*CORRECTNESS, "cap", "shrink", "min_cap", "zero_unfinished")


def _renamed(keep: tuple[str, ...] = (), prefix: str = "", prefixed: tuple[str, ...] = ()) -> dict[str, str]:
    """Old option -> new option: ``keep`` keep their name, ``prefixed`` lose ``prefix``."""
    return {**{k: k for k in keep}, **{prefix + k: k for k in prefixed}}


@dataclass
class LengthShapingOptions(PluginOptions):
    mode: Literal["laser", "laser_d", "laser_de", "dler", "dler_difficulty", "decs", "pear", "siri", "hbpo"] = option(
        "laser_d",
        help="Deprecated: every mode is a plugin of its own (laser, dler, decs, pear, siri, hbpo); the mode's options "
        "are renamed as the module's table says.",
    )


class LengthShapingPlugin(Plugin):
    """Deprecated spelling of the length-efficient reasoning plugins (every ``mode`` moved to its own plugin)."""

    name = "length_shaping"
    version = "0.1.0"
    paper = ("Deprecated: see laser (arXiv:2505.15612), dler (arXiv:2510.15110), decs (arXiv:2509.25827), pear "
             "(arXiv:2510.08026), siri (arXiv:2509.25176), hbpo (arXiv:2507.15844)")
    summary = "Deprecated (one release): mode X builds the plugin laser, dler, decs, pear, siri or hbpo."
    Options = LengthShapingOptions
    image_inputs = True
    multi_turn = LENGTH_COUNTS_TOOL_TOKENS
    moved_by = "mode"
    moved = {
        "laser": Moved("laser", {"variant": "laser"}, _renamed(LASER)),
        "laser_d": Moved("laser", {"variant": "laser_d"}, _renamed(LASER)),
        "laser_de": Moved("laser", {"variant": "laser_de"}, _renamed(LASER)),
        "dler": Moved("dler", {}, _renamed(DLER)),
        "dler_difficulty": Moved("dler", {"difficulty_aware": True}, _renamed(DLER)),
        "decs": Moved("decs", {}, _renamed((*CORRECTNESS, "answer_column"), "decs_",
                                           ("beta", "split_words", "curriculum", "kappa_lr"))),
        "pear": Moved("pear", {}, _renamed(CORRECTNESS, "pear_", ("alpha", "answer_alpha", "marker", "only_correct"))),
        "siri": Moved("siri", {}, _renamed((), "siri_", ("schedule", "min_cap", "max_cap", "period"))),
        "hbpo": Moved("hbpo", {}, _renamed(CORRECTNESS, "hbpo_", ("budgets", "prompt", "reward", "beta", "alpha",
                                                                   "max_length", "intra_weight"))),
    }
