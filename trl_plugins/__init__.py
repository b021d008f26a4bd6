"""trl-plugins: research methods for RL on LLMs as stackable pluggy plugins for TRL's GRPOTrainer."""

from .contexts import (
    AdvantageContext,
    Completion,
    LossContext,
    PolicyStats,
    PromptContext,
    RefillContext,
    RewardContext,
    RolloutContext,
)
from .errors import (
    GenerationBudgetExceeded,
    IncompatiblePluginsError,
    ModelNotFoundError,
    PluginConfigError,
    PluginError,
    UnknownPluginError,
)
from .hookspecs import hookimpl
from .manager import available_plugins, build_plugins, register_plugin, unregister_plugin
from .options import PluginOptions, option
from .faithfulness import OfficialSource
from .plugin import Moved, Plugin
from .services import RunInfo, StageServices
from .tool_guard import ToolError, ToolInputError
from .turns import TurnStructure

__version__ = "0.1.0"

_LAZY = {"PluginGRPOConfig": "config", "PluginGRPOTrainer": "trainer", "resolve_model": "models"}


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
