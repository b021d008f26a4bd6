"""``PluginGRPOConfig``: TRL's ``GRPOConfig`` plus the plugin fields."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig


@dataclass
class PluginGRPOConfig(GRPOConfig):
    """[`~trl.GRPOConfig`] with plugins enabled by name.

    Every GRPOConfig field works unchanged. In a YAML file read by ``trl-plugins train`` (TRL's ``TrlParser``
    conventions) the plugin fields sit next to the GRPOConfig fields::

        output_dir: out
        num_generations: 8
        plugins: [hint_scaffold, lp_reg]
        plugin_config:
          lp_reg: {kappa: 0.02}

    Plugin names and options are validated here, at construction: unknown names (with close-match
    suggestions), unknown or mistyped options and incompatible stacks raise at once.

    Parameters:
        plugins (`list[str]`): plugins to enable, in the order their hooks chain within each stage.
        plugin_config (`dict[str, dict]`): per-plugin options, keyed by plugin name.
        offpolicy_shaping_gamma (`float`, defaults to 0.1): gamma of the shaped off-policy loss branch
            ``-A * f(p)``, ``f(p) = p / (p + gamma)`` (LUFFY, arXiv:2504.14945), applied to tokens a sampling
            plugin marked off-policy.
        head_stats_chunk_size (`int`, defaults to 1024): valid tokens projected through the LM head at once
            when a plugin needs LM-head statistics; peak extra memory is ``chunk * vocab`` floats.
        plugin_generation_budget (`int` or `None`): the most extra completions plugins may request from the
            generation service per generation batch and process (None: unlimited, still counted and logged).
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["plugin_config"]

    plugins: list[str] = field(
        default_factory=list,
        metadata={"help": "Plugins to enable, in order (e.g. `--plugins hint_scaffold lp_reg`)."},
    )
    plugin_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Per-plugin options keyed by plugin name (a mapping, or a JSON string on the CLI)."},
    )
    offpolicy_shaping_gamma: float = field(
        default=0.1,
        metadata={"help": "gamma of the shaped off-policy branch f(p) = p/(p+gamma) (LUFFY uses 0.1)."},
    )
    head_stats_chunk_size: int = field(
        default=1024,
        metadata={"help": "Valid tokens per chunk for LM-head statistics (peak memory chunk * vocab floats)."},
    )
    plugin_generation_budget: int | None = field(
        default=None,
        metadata={"help": "Max extra completions plugins may request per generation batch and process."},
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.plugins, str):
            self.plugins = [p.strip() for p in self.plugins.split(",") if p.strip()]
        if isinstance(self.plugin_config, str):
            self.plugin_config = json.loads(self.plugin_config) if self.plugin_config.strip() else {}
        if self.plugin_config is None:
            self.plugin_config = {}
        if self.offpolicy_shaping_gamma <= 0:
            raise ValueError(f"offpolicy_shaping_gamma must be > 0; got {self.offpolicy_shaping_gamma!r}.")
        if self.head_stats_chunk_size < 1:
            raise ValueError(f"head_stats_chunk_size must be >= 1; got {self.head_stats_chunk_size!r}.")
        if self.plugin_generation_budget is not None and self.plugin_generation_budget < 0:
            raise ValueError(f"plugin_generation_budget must be >= 0 or None; got {self.plugin_generation_budget!r}.")
        if not self.use_vllm:  # vLLM-only settings that say "generate with vLLM" but would silently use HF generate
            given = [
                f"{name}={getattr(self, name)!r}"
                for name, unset in (("vllm_mode", "colocate"), ("vllm_server_base_url", None))
                if getattr(self, name) != unset
            ]
            if given:
                from .errors import IncompatiblePluginsError

                raise IncompatiblePluginsError(
                    f"{', '.join(given)} only take effect with use_vllm=True; with use_vllm=False generation runs on "
                    "transformers' generate and these settings would be ignored. Set use_vllm=True, or remove them."
                )
        from .manager import build_plugins

        build_plugins(self.plugins, self.plugin_config).check_loss_type(self.loss_type)  # fail now, not at step 500


def checkpointing_off() -> dict[str, bool]:
    """Config fields that switch activation checkpointing off without transformers' deprecation warning.

    TRL's ``GRPOConfig`` defaults ``gradient_checkpointing=True``; transformers 5 renamed the field
    ``activation_checkpointing`` and warns whenever only the old name is set. Returns the field the installed
    transformers knows.
    """
    import dataclasses

    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: False}
