"""bf16 on a CPU: PluginGRPOConfig picks float32 when bf16 is unset on a CPU without AMX bf16 units, and warns (with
the measured cost and the fix) when the user sets bf16=True there. The CPU is simulated with
TRL_PLUGINS_CPU_BF16 and a patched accelerator probe, so these tests mean the same on any machine."""

import warnings

import pytest

from trl_plugins import PluginGRPOConfig
from trl_plugins.runtime import precision
from trl_plugins.runtime.precision import SlowCpuPrecisionWarning


@pytest.fixture
def cpu_only(monkeypatch):
    """A machine with no GPU; the fixture's value sets whether the CPU has AMX bf16 units."""

    def configure(native: bool):
        monkeypatch.setattr(precision, "accelerator_available", lambda: False)
        monkeypatch.setenv("TRL_PLUGINS_CPU_BF16", "1" if native else "0")

    return configure


def _config(tmp_path, **fields):
    return PluginGRPOConfig(output_dir=str(tmp_path), report_to="none", **fields)


def test_unset_bf16_on_a_cpu_without_native_bf16_trains_in_float32_without_trls_gpu_error(cpu_only, tmp_path):
    cpu_only(native=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowCpuPrecisionWarning)
        config = _config(tmp_path)  # no use_cpu: TRL alone would stop with "Your setup doesn't support bf16/gpu"
    assert config.bf16 is False
    assert config.use_cpu is False


def test_trls_default_would_have_failed_here(cpu_only, tmp_path):
    """The situation the fix is for: TRL's GRPOConfig with bf16 unset on a machine with no GPU."""
    cpu_only(native=False)
    from trl import GRPOConfig

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: TRL's bf16 default is valid here")
    with pytest.raises(ValueError, match="doesn't support bf16/gpu"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none")


def test_unset_bf16_on_a_cpu_with_amx_keeps_trls_bf16_and_uses_the_cpu(cpu_only, tmp_path):
    cpu_only(native=True)
    config = _config(tmp_path)
    assert config.bf16 is True and config.use_cpu is True


def test_explicit_bf16_on_a_slow_cpu_warns_with_cost_and_fix(cpu_only, tmp_path):
    cpu_only(native=False)
    with pytest.warns(SlowCpuPrecisionWarning) as record:
        config = _config(tmp_path, use_cpu=True, bf16=True)
    assert config.bf16 is True  # the user's choice is kept
    message = str(record[0].message)
    assert precision.MEASURED_COST in message
    assert "Set bf16=False" in message and "`bf16: false`" in message and "--bf16 false" in message


def test_explicit_bf16_false_and_fp16_are_left_alone(cpu_only, tmp_path):
    cpu_only(native=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowCpuPrecisionWarning)
        assert _config(tmp_path, bf16=False).bf16 is False
    cpu_only(native=True)
    assert _config(tmp_path, use_cpu=True, bf16=False).bf16 is False


def test_on_a_gpu_machine_trls_default_is_untouched(monkeypatch, tmp_path):
    monkeypatch.setattr(precision, "accelerator_available", lambda: True)
    monkeypatch.setenv("TRL_PLUGINS_CPU_BF16", "0")
    args = PluginGRPOConfig.__new__(PluginGRPOConfig)  # decide only; a real GPU config needs a GPU to construct
    args.use_cpu, args.bf16, args.fp16 = False, None, False
    precision.choose_cpu_precision(args, bf16_was_set=False)
    assert args.bf16 is None and args.use_cpu is False


def test_yaml_without_bf16_gets_the_fast_setting_through_trls_parser(cpu_only, tmp_path):
    """`trl-plugins train` parses YAML with TrlParser: an absent `bf16` key must reach the config as unset."""
    cpu_only(native=False)
    from trl import ModelConfig, TrlParser

    from trl_plugins.cli.train import TrainScriptArguments

    path = tmp_path / "c.yaml"
    path.write_text(f"output_dir: {tmp_path}\nreport_to: none\n")
    _, args, _ = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path)]
    )
    assert args.bf16 is False
    path.write_text(f"output_dir: {tmp_path}\nreport_to: none\nuse_cpu: true\nbf16: true\n")
    with pytest.warns(SlowCpuPrecisionWarning):
        _, args, _ = TrlParser((TrainScriptArguments, PluginGRPOConfig, ModelConfig)).parse_args_and_config(
            ["--config", str(path)]
        )
    assert args.bf16 is True


def test_cpu_flag_detection_reads_amx(monkeypatch):
    monkeypatch.delenv("TRL_PLUGINS_CPU_BF16", raising=False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert precision.cpu_bf16_is_native() is False  # AVX512-BF16 alone: measured slow
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert precision.cpu_bf16_is_native() is True
