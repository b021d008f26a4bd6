"""The plugin-facing API: what a plugin module may import, built-in or third party, beside the components.

A plugin imports from ``trl_plugins`` only this package (and its submodules) and :mod:`trl_plugins.components`
(judges, PRMs, teachers, verifier feedback: a library built on this API); ``tests/test_layout.py`` enforces it
for the built-in plugins and the scaffolded template. This package re-exports the core; the rest lives in
submodules:

- :mod:`~trl_plugins.api.plugin` (``Plugin``, ``Moved``), :mod:`~trl_plugins.api.faithfulness` (``OfficialSource``), :mod:`~trl_plugins.api.hookspecs` (``hookimpl``, the hook
  specifications), :mod:`~trl_plugins.api.contexts` (the stage contexts), :mod:`~trl_plugins.api.options` and
  :mod:`~trl_plugins.api.option_groups` (typed options), :mod:`~trl_plugins.api.errors`;
- helpers plugins call: :mod:`~trl_plugins.api.reasons` (shared refusal reasons), :mod:`~trl_plugins.api.success`
  (the success rule), :mod:`~trl_plugins.api.text`, :mod:`~trl_plugins.api.answers`,
  :mod:`~trl_plugins.api.collectives`, :mod:`~trl_plugins.api.data_checks`, :mod:`~trl_plugins.api.turns`,
  :mod:`~trl_plugins.api.tool_calls`, :mod:`~trl_plugins.api.loss_types`, :mod:`~trl_plugins.api.model_utils`,
  :mod:`~trl_plugins.api.registry`, :mod:`~trl_plugins.api.services`.

The API is the ground floor: nothing in it imports the runtime, the guards, the components, the CLI, the testing
kit or the tasks.
"""

from trl_plugins.api.contexts import (
    AdvantageContext,
    Completion,
    Continuation,
    HiddenChunk,
    LossContext,
    PolicyStats,
    PromptContext,
    RefillContext,
    RewardContext,
    RolloutContext,
    ReplayRow,
    StoredEpisode,
    TokenProbe,
    ToolEpisode,
)
from trl_plugins.api.errors import (
    GenerationBudgetExceeded,
    IncompatiblePluginsError,
    ModelNotFoundError,
    PluginConfigError,
    PluginError,
    UnknownPluginError,
)
from trl_plugins.api.faithfulness import OfficialSource
from trl_plugins.api.hookspecs import hookimpl
from trl_plugins.api.options import PluginOptions, option
from trl_plugins.api.plugin import Moved, Plugin
from trl_plugins.api.services import RunInfo, StageServices
from trl_plugins.api.turns import TurnStructure

__all__ = [
    "AdvantageContext",
    "Completion",
    "Continuation",
    "GenerationBudgetExceeded",
    "IncompatiblePluginsError",
    "LossContext",
    "ModelNotFoundError",
    "Moved",
    "OfficialSource",
    "Plugin",
    "PluginConfigError",
    "PluginError",
    "PluginOptions",
    "HiddenChunk",
    "PolicyStats",
    "PromptContext",
    "RefillContext",
    "RewardContext",
    "RolloutContext",
    "TokenProbe",
    "ReplayRow",
    "StoredEpisode",
    "ToolEpisode",
    "RunInfo",
    "StageServices",
    "TurnStructure",
    "UnknownPluginError",
    "hookimpl",
    "option",
]
