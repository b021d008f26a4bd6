"""``PluginGRPOConfig``: TRL's ``GRPOConfig`` plus the plugin fields."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.runtime.plugin_settings import merge_plugin_settings


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

    One default differs from GRPOConfig's on a CPU (``use_cpu=True`` or no GPU): when ``bf16`` is not set and the
    CPU has no AMX bf16 units, ``bf16=False`` (bf16 autocast brings no speed there and TRL's default would stop a
    GPU-less machine); ``bf16=True`` set by hand on such a CPU gives a
    :class:`~trl_plugins.runtime.precision.SlowCpuPrecisionWarning` with the measured cost. See
    :mod:`trl_plugins.runtime.precision`.

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
        max_refill_rounds (`int`, defaults to 9): refill rounds per generation batch when plugins reject groups
            (``trl_plugins_reject_groups``); verl's ``max_num_gen_batches = n`` is ``max_refill_rounds = n - 1``.
        refill_at_limit (`str`, defaults to ``"keep"``): what becomes of groups still rejected after the last refill
            round: ``"keep"`` (train on them as they are), ``"zero_advantage"`` (keep them with advantage 0) or
            ``"error"`` (stop, as verl's DAPO trainer does).
        tool_timeout (`float` or `None`, defaults to 60): seconds a tool call may take (TRL ``tools`` /
            ``environment_factory``); None: no limit (tools run in the caller's thread). See
            :mod:`trl_plugins.guards.tool_guard`.
        tool_retries (`int`, defaults to 2): retries of a tool call that raised, timed out or returned garbage.
        tool_retry_backoff (`float`, defaults to 0.5): seconds before the first retry, doubled for each next one.
        tool_failure (`str`, defaults to "raise"): what a tool failing every attempt does: "raise" stops the run on
            every process with an error naming the tool and the row; "feedback" gives the error to the model (TRL's
            behaviour for every tool exception).
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
    tool_timeout: float | None = field(
        default=60.0,
        metadata={"help": "Seconds a tool call may take before it counts as failed (None: no limit)."},
    )
    tool_retries: int = field(
        default=2, metadata={"help": "Retries of a tool call that raised, timed out or returned garbage."}
    )
    tool_retry_backoff: float = field(
        default=0.5, metadata={"help": "Seconds before the first tool retry, doubled for each next one."}
    )
    tool_failure: str = field(
        default="raise",
        metadata={"help": "A tool failing every attempt: 'raise' (stop every process, naming tool and row) or "
                  "'feedback' (give the error to the model, TRL's behaviour)."},
    )

    max_refill_rounds: int = field(
        default=9,
        metadata={"help": "Refill rounds per generation batch when plugins reject groups (verl: max_num_gen_batches - 1)."},
    )
    refill_at_limit: str = field(
        default="keep",
        metadata={"help": "Groups still rejected after the last refill round: keep, zero_advantage or error."},
    )

    def __post_init__(self):
        from trl_plugins.runtime.precision import choose_cpu_precision

        # before TRL's own __post_init__, which json-loads a plugin_config string starting with "{" unchecked
        self.plugins, self.plugin_config = merge_plugin_settings(self.plugins, self.plugin_config)
        check_project_fields(self)
        # bf16 unset on a CPU without AMX bf16 units: float32; bf16=True set there: a warning with the measured cost
        choose_cpu_precision(self, bf16_was_set=self.bf16 is not None)
        try:
            super().__post_init__()
        except ValueError as exc:  # TRL's and transformers' own checks: the same error type as ours, for the CLI too
            raise PluginConfigError(f"Invalid configuration: {exc}") from exc
        if not self.use_vllm:  # vLLM-only settings that say "generate with vLLM" but would silently use HF generate
            given = [
                f"{name}={getattr(self, name)!r}"
                for name, unset in (("vllm_mode", "colocate"), ("vllm_server_base_url", None))
                if getattr(self, name) != unset
            ]
            if given:  # TRL accepts and ignores them: so do we (drop-in), but say so
                import warnings

                warnings.warn(
                    f"{', '.join(given)} only take effect with use_vllm=True; with use_vllm=False generation runs on "
                    "transformers' generate and these settings are ignored (as trl.GRPOConfig ignores them). Set "
                    "use_vllm=True to generate with vLLM, or remove them.",
                    UserWarning,
                    stacklevel=3,
                )
        from trl_plugins.runtime.manager import build_plugins

        build_plugins(self.plugins, self.plugin_config).check_loss_type(self.loss_type)  # fail now, not at step 500


    # ------------------------------------------------------------------ credentials in URLs stay out of saved copies
    # An endpoint URL may carry credentials (``judge_base_url: https://user:key@host/v1``, ``?api_key=...``). The run
    # uses them as given; every copy that leaves the process is redacted (trl_plugins.api.errors.redact_secrets):
    # ``training_args.bin`` (transformers pickles the args into every checkpoint and the final model folder), the
    # printed / logged ``repr(args)`` and ``args.to_dict()`` (``to_json_string``, report_to integrations' hparams).
    # Deep and shallow copies inside the process keep the real values.
    def __getstate__(self) -> dict:
        from trl_plugins.api.errors import redact_secrets

        return {key: redact_secrets(value) for key, value in self.__dict__.items()}

    def __copy__(self) -> PluginGRPOConfig:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> PluginGRPOConfig:
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        return new

    def to_dict(self) -> dict:
        from trl_plugins.api.errors import redact_secrets

        return {key: redact_secrets(value) for key, value in super().to_dict().items()}

    def __str__(self) -> str:
        from trl_plugins.api.errors import redact_secrets

        return redact_secrets(super().__str__())

    __repr__ = __str__


#: What ``refill_at_limit`` may say.
REFILL_AT_LIMIT = ("keep", "zero_advantage", "error")


def check_project_fields(args: PluginGRPOConfig) -> None:
    """The fields this package adds (and ``output_dir``), checked before TRL's and transformers' own checks."""
    gamma = args.offpolicy_shaping_gamma
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (math.isfinite(gamma) and gamma > 0):
        raise PluginConfigError(f"offpolicy_shaping_gamma must be a finite number > 0; got {gamma!r}.")
    chunk = args.head_stats_chunk_size
    if not _is_int(chunk) or chunk < 1:
        raise PluginConfigError(f"head_stats_chunk_size must be an integer >= 1; got {chunk!r}.")
    budget = args.plugin_generation_budget
    if budget is not None and (not _is_int(budget) or budget < 0):
        raise PluginConfigError(f"plugin_generation_budget must be an integer >= 0 or None (unlimited); got {budget!r}.")
    rounds = args.max_refill_rounds
    if not _is_int(rounds) or rounds < 0:
        raise PluginConfigError(f"max_refill_rounds must be an integer >= 0; got {rounds!r}.")
    if args.refill_at_limit not in REFILL_AT_LIMIT:
        raise PluginConfigError(
            f"refill_at_limit must be one of {', '.join(REFILL_AT_LIMIT)}; got {args.refill_at_limit!r}."
        )
    from trl_plugins.guards.tool_guard import ToolPolicy

    ToolPolicy.from_args(args)  # tool_timeout / tool_retries / tool_retry_backoff / tool_failure
    if args.max_steps == 0:
        raise PluginConfigError(
            "max_steps=0 trains nothing (and would still save a checkpoint); use a positive number of steps, or -1 to "
            "train for num_train_epochs."
        )
    if args.output_dir is not None and os.path.isfile(args.output_dir):
        raise PluginConfigError(
            f"output_dir {args.output_dir!r} is a file; it must be a directory (or not exist yet) for checkpoints "
            "and the final model."
        )
    if args.output_dir is not None and not os.path.isfile(args.output_dir):
        existing = os.path.abspath(args.output_dir)
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)  # the folder output_dir will be created in
        if os.path.exists(existing) and not os.path.isdir(existing):
            raise PluginConfigError(
                f"output_dir {args.output_dir!r} cannot be created: {existing} in its path is a file, not a folder. "
                "Choose an output_dir whose parent folders are folders."
            )
        if os.path.isdir(existing) and not os.access(existing, os.W_OK | os.X_OK):
            raise PluginConfigError(
                f"output_dir {args.output_dir!r} cannot be written ({existing} is not writable): the run would fail at "
                "its first save or log. Choose a writable folder."
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
