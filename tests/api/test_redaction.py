"""Credentials written inside an endpoint URL never reach a message or a saved copy of the arguments: one helper,
``trl_plugins.api.errors.redact_secrets``, used for every ``PluginError`` (so every ``EndpointError``) and for
``training_args.bin`` / ``repr(args)`` / ``args.to_dict()``. Keys given through ``*_api_key_env`` never appear anyway."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from trl_plugins import PluginGRPOConfig
from trl_plugins.components import (
    EndpointConfig,
    EndpointError,
    OpenAICompatibleClient,
    chat_response,
    serve_openai_compatible,
)
from trl_plugins.api.errors import PluginConfigError, PluginError, redact_secrets, redact_url

SECRET_URL = "https://alice:S3CRET@judge.example.com:8443/v1?api_key=K3Y&model=m#access_token=T0K"


@pytest.mark.parametrize("text, expected", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    (SECRET_URL, "https://***@judge.example.com:8443/v1?api_key=***&model=m#access_token=***"),
    ("http://tok@h/v1", "http://***@h/v1"),
    ("url 'http://u:p@h:80/v1/chat/completions' failed.", "url 'http://***@h:80/v1/chat/completions' failed."),
    ("see https://h/v1?token=abc).", "see https://h/v1?token=***)."),
    ("http://h/x?sig=1&design=2&X-Amz-Signature=abc&password=p&session_id=s",
     "http://h/x?sig=***&design=2&X-Amz-Signature=***&password=***&session_id=***"),
    ("http://[::1]:8000/v1?key=1", "http://[::1]:8000/v1?key=***"),
    ("user:secret@host:8000/v1", "***@host:8000/v1"),  # no scheme: still user-info
    ("http://h/v1/token=path-not-a-param", "http://h/v1/token=path-not-a-param"),
    ("write to a@b.com", "write to a@b.com"),
])
def test_redact_secrets(text, expected):
    assert redact_secrets(text) == expected


def test_redact_secrets_walks_containers_without_changing_them():
    given = {"judge": {"judge_base_url": SECRET_URL, "urls": ["http://u:p@h", ("http://h?token=t",)]}, "n": 3}
    out = redact_secrets(given)
    assert out == {"judge": {"judge_base_url": redact_url(SECRET_URL), "urls": ["http://***@h", ("http://h?token=***",)]},
                   "n": 3}
    assert given["judge"]["judge_base_url"] == SECRET_URL


def test_every_plugin_error_is_redacted():
    for cls in (PluginError, PluginConfigError, EndpointError):
        err = cls(f"{SECRET_URL}/chat/completions failed")
        assert "S3CRET" not in str(err) and "K3Y" not in str(err) and "T0K" not in str(err)
        assert "judge.example.com:8443/v1" in str(err)


def test_endpoint_errors_of_a_real_client_do_not_show_the_credentials():
    with serve_openai_compatible(lambda p, q: chat_response("x")) as url:
        pass  # stopped: the port is closed
    host = url.split("://", 1)[1]
    client = OpenAICompatibleClient(EndpointConfig(base_url=f"http://bob:S3CRET@{host}?api_key=K3Y", model="m",
                                                   max_retries=0, timeout=2))
    with pytest.raises(EndpointError) as err:
        client.chat([[{"role": "user", "content": "x"}]])
    client.close()
    assert f"http://***@{host}" in str(err.value) and "failed after 1 attempts" in str(err.value)
    assert "S3CRET" not in str(err.value) and "K3Y" not in str(err.value)
    with pytest.raises(PluginConfigError) as bad:
        EndpointConfig(base_url="ftp://bob:S3CRET@h/v1")
    assert "ftp://***@h/v1" in str(bad.value) and "S3CRET" not in str(bad.value)


def _args(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PluginGRPOConfig(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, plugins=["ruscarl"],
            plugin_config={"ruscarl": {"judge": "endpoint", "judge_model": "m", "judge_base_url": SECRET_URL}},
        )


def test_saved_and_printed_arguments_are_redacted_while_the_run_keeps_the_url(tmp_path):
    args = _args(tmp_path)
    buffer = io.BytesIO()
    torch.save(args, buffer)  # what transformers writes as training_args.bin
    for text in (buffer.getvalue().decode("latin-1"), repr(args), str(args), args.to_json_string(),
                 str(args.to_sanitized_dict())):
        assert "S3CRET" not in text and "K3Y" not in text and "T0K" not in text
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.plugin_config["ruscarl"]["judge_base_url"] == redact_url(SECRET_URL)
    assert args.plugin_config["ruscarl"]["judge_base_url"] == SECRET_URL  # the run itself is unchanged
    assert copy.deepcopy(args).plugin_config["ruscarl"]["judge_base_url"] == SECRET_URL
    assert copy.copy(args).plugin_config["ruscarl"]["judge_base_url"] == SECRET_URL


def test_training_args_bin_of_a_saved_model_holds_no_credentials(tmp_path):
    from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer

    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path / "run"),
                                log_level="error")
    trainer.args = _args(tmp_path / "run")
    trainer.save_model(str(tmp_path / "model"))
    data = (tmp_path / "model" / "training_args.bin").read_bytes()
    assert b"judge.example.com" in data and b"S3CRET" not in data and b"K3Y" not in data
