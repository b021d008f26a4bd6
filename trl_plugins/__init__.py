"""trl-plugins: research methods for RL on LLMs as stackable pluggy plugins for TRL's GRPOTrainer.

The user surface: the trainer and its config, the plugin manager's functions, and the plugin-facing API
re-exported. The package is laid out by role: ``api/`` (what plugins import), ``runtime/`` (the trainer and what
runs a step), ``guards/`` (checks of user input), ``components/`` (judges, PRMs, teachers), ``cli/`` (the command
line and its tools), ``testing/`` (the testing kit) and ``tasks/`` (the bundled demo tasks and tiny model).
"""

from trl_plugins.api import (
    AdvantageContext,
    Completion,
    GenerationBudgetExceeded,
    IncompatiblePluginsError,
    LossContext,
    ModelNotFoundError,
    Moved,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    PluginOptions,
    PolicyStats,
    PromptContext,
    RefillContext,
    RewardContext,
    RolloutContext,
    RunInfo,
    StageServices,
    TurnStructure,
    UnknownPluginError,
    hookimpl,
    option,
)
from trl_plugins.guards.tool_guard import ToolError, ToolInputError
from trl_plugins.runtime.manager import available_plugins, build_plugins, register_plugin, unregister_plugin

__version__ = "0.1.0"

_LAZY = {
    "PluginGRPOConfig": "runtime.config",
    "PluginGRPOTrainer": "runtime.trainer",
    "resolve_model": "runtime.models",
}


def __getattr__(name: str):
    # The trainer and config import TRL (and through it peft / bitsandbytes); load them on first use so that
    # `trl-plugins list` and plugin modules stay light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AdvantageContext",
    "Completion",
    "GenerationBudgetExceeded",
    "IncompatiblePluginsError",
    "LossContext",
    "ModelNotFoundError",
    "Moved",
    "OfficialSource",
    "Plugin",
    "PluginConfigError",
    "PluginError",
    "PluginGRPOConfig",
    "PluginGRPOTrainer",
    "PluginOptions",
    "PolicyStats",
    "PromptContext",
    "RefillContext",
    "RewardContext",
    "RolloutContext",
    "RunInfo",
    "StageServices",
    "ToolError",
    "ToolInputError",
    "TurnStructure",
    "UnknownPluginError",
    "available_plugins",
    "build_plugins",
    "hookimpl",
    "option",
    "register_plugin",
    "resolve_model",
    "unregister_plugin",
]
