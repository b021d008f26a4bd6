"""trl-plugins: research methods for RL on LLMs as stackable pluggy plugins for TRL's GRPOTrainer."""

from .config import PluginGRPOConfig
from .contexts import AdvantageContext, Completion, LossContext, PolicyStats, PromptContext, RewardContext, RolloutContext
from .errors import (
    GenerationBudgetExceeded,
    IncompatiblePluginsError,
    PluginConfigError,
    PluginError,
    UnknownPluginError,
)
from .hookspecs import hookimpl
from .manager import available_plugins, build_plugins, register_plugin, unregister_plugin
from .options import PluginOptions, option
from .plugin import Plugin
from .trainer import PluginGRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "AdvantageContext",
    "Completion",
    "GenerationBudgetExceeded",
    "IncompatiblePluginsError",
    "LossContext",
    "Plugin",
    "PluginConfigError",
    "PluginError",
    "PluginGRPOConfig",
    "PluginGRPOTrainer",
    "PluginOptions",
    "PolicyStats",
    "PromptContext",
    "RewardContext",
    "RolloutContext",
    "UnknownPluginError",
    "available_plugins",
    "build_plugins",
    "hookimpl",
    "option",
    "register_plugin",
    "unregister_plugin",
]
