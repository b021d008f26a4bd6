"""Bad configuration through the user's entry point, ``trl-plugins train CONFIG.yaml``: every mistake is refused while
the YAML is parsed -- before a model is loaded or a step runs -- with exit status 2 and a message that names the bad
value and what is allowed (with a suggestion for near-misses). ``tests/test_e2e.py`` covers the Python API.
"""

from __future__ import annotations

import pytest
import yaml

from trl_plugins import PluginGRPOConfig
from trl_plugins.cli import main

BASE = {
    "model_name_or_path": "builtin:tiny",
    "report_to": "none",
    "use_cpu": True,
    "max_steps": 1,
}


def _train(tmp_path, capsys, monkeypatch, overrides=(), **config):
    import trl_plugins.cli.train as train_module

    def never(*args, **kwargs):  # a refused config must never get as far as loading the model
        raise AssertionError("the model was loaded: the config was not refused while parsing")

    monkeypatch.setattr(train_module, "load_model", never)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "out"), **config}))
    status = main(["train", str(path), *overrides])
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "config,fragments",
    [
        pytest.param(
            {"plugins": ["hint_scafold"]},
            ["Unknown plugin 'hint_scafold'", "Did you mean 'hint_scaffold'", "Available plugins:"],
            id="unknown-plugin",
        ),
        pytest.param(
            {"plugins": ["lp_reg"], "plugin_config": {"lp_reg": {"kapa": 0.1}}},
            ["Unknown option 'kapa' for plugin 'lp_reg'", "Did you mean 'kappa'", "Allowed options:"],
            id="misspelt-option",
        ),
        pytest.param(
            {"plugins": ["lp_reg"], "plugin_config": {"lp_reg": {"kappa": "high"}}},
            ["Option 'kappa' of plugin 'lp_reg' got 'high'", "a number"],
            id="wrong-type",
        ),
        pytest.param(
            {"plugins": ["hint_scaffold"], "plugin_config": {"hint_scaffold": {"replace_index": -1}}},
            ["Option 'replace_index' of plugin 'hint_scaffold' got -1", ">= 0"],
            id="out-of-range",
        ),
        pytest.param(
            {"plugins": ["lp_reg"], "plugin_config": {"lp_reg": {"threshold_mode": "maxp"}}},
            ["'threshold_mode'", "'maxp'", "'minp', 'fixed'"],
            id="not-a-choice",
        ),
        pytest.param(
            {"plugins": ["lp_reg", "clip_cov"]},
            ["Plugins 'lp_reg' and 'clip_cov' cannot be stacked: each is a complete remedy for entropy collapse",
             "Enable only one"],
            id="incompatible-pair",
        ),
        pytest.param(
            {"plugins": ["disco"], "loss_type": "dapo"},
            ["Plugin 'disco' does not support loss_type='dapo': the DisCO score is a token-mean per response",
             "Use loss_type 'grpo', or disable disco"],
            id="loss-type-a-plugin-is-not-defined-for",
        ),
        pytest.param(
            {"plugins": ["canon"], "plugin_config": {"lp_reg": {"kappa": 0.1}}},
            ["plugin_config has options for 'lp_reg', which is not in plugins=['canon']"],
            id="options-for-a-plugin-not-enabled",
        ),
    ],
)
def test_bad_yaml_is_refused_while_parsing(config, fragments, tmp_path, capsys, monkeypatch):
    status, err = _train(tmp_path, capsys, monkeypatch, **config)
    assert status == 2, err
    assert err.startswith("trl-plugins: error: "), err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def test_bad_command_line_override_is_refused_too(tmp_path, capsys, monkeypatch):
    status, err = _train(tmp_path, capsys, monkeypatch, overrides=["--plugins", "lp_rge"], plugins=["canon"])
    assert status == 2 and "Did you mean 'lp_reg'" in err, err


def test_vllm_settings_without_vllm_are_accepted_as_trl_accepts_them_with_a_warning():
    import warnings

    from trl import GRPOConfig

    common = dict(output_dir="unused", report_to="none", use_cpu=True)
    config = PluginGRPOConfig(**common, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://h:8000")
    assert config.use_vllm and config.vllm_mode == "server"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        PluginGRPOConfig(**common)  # the defaults (vllm_mode='colocate', no URL) say nothing about vLLM
    GRPOConfig(**common, vllm_mode="server", vllm_server_base_url="http://h:8000")  # TRL accepts them ...
    with pytest.warns(UserWarning, match=r"vllm_mode='server', vllm_server_base_url='http://h:8000' "
                                         r"only take effect with use_vllm=True"):
        config = PluginGRPOConfig(**common, vllm_mode="server", vllm_server_base_url="http://h:8000")  # ... so do we
    assert not config.use_vllm and config.vllm_mode == "server"
