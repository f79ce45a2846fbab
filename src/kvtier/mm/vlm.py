"""Vision-language models in the reference engine: LLaVA-style and Idefics3/SmolVLM-style.

A Hugging Face image-text-to-text model is a vision tower, a projector and a
decoder. The engine runs the decoder through kvtier's paged attention like
any causal LM, fed ``inputs_embeds``: the token embeddings with each image's
projected features written over its placeholder tokens. What differs between
families is here, behind :class:`ImageTextModel`:

* how one image becomes placeholder tokens in the prompt
  (:meth:`~ImageTextModel.placeholder_ids`): LLaVA repeats ``<image>`` once
  per feature row; Idefics3 splits a large image into tiles, each introduced
  by ``<fake_token_around_image><row_i_col_j>``, then a downscaled global view;
* how the vision tower and projector run (:meth:`~ImageTextModel.encode`),
  which is what the encoder cache saves.

Each model is also an :class:`~kvtier.mm.cache.ItemEncoder`: its
:attr:`~ImageTextModel.spec` names the model, a fingerprint of the vision
weights (any change to them, a LoRA merged in, a new revision, changes every
key), and the image processor's settings, which change the output.

Image preprocessing uses the transformers image processors' PIL backends
(no torchvision).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from kvtier.errors import ConfigError
from kvtier.mm.keys import EncoderSpec, MediaItem
from kvtier.mm.tiers import Expected

#: The ``model_type`` of the supported families.
FAMILIES = ("llava", "idefics3")


def weights_fingerprint(modules: Iterable[torch.nn.Module]) -> str:
    """xxh3-128 over every parameter's name, dtype, shape and bytes: the weights' identity."""
    h = xxhash.xxh3_128()
    for module in modules:
        for name, param in module.state_dict().items():
            t = param.detach().to("cpu").contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            if t.numel():
                h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _image(item: MediaItem) -> Any:
    if item.decoded is None:
        from kvtier.mm.images import ImageLimits, decode_image

        return decode_image(bytes(item.data), ImageLimits())
    return item.decoded


class ImageTextModel:
    """What the engine needs of an image-text-to-text model (see the module docstring)."""

    family = "base"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        image_processor: Any,
        *,
        model_id: str,
        revision: str | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        if not isinstance(token, str):
            raise ConfigError(
                f"the tokenizer has no token for the model's image_token_id {self.image_token_id}"
            )
        #: The text a chat template writes for an image.
        self.image_token: str = token
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._embed = model.get_input_embeddings()
        proc = image_processor.to_dict() if hasattr(image_processor, "to_dict") else {}
        params = {
            "family": self.family,
            "processor": {k: v for k, v in proc.items() if not k.startswith("_")},
            "encoder": self._encoder_config(),
            "dtype": str(self.dtype),
        }
        fingerprint = revision or weights_fingerprint(self._encoder_modules())
        self.spec = EncoderSpec.make(
            model_id, f"{self.family}-vision", "image", revision=fingerprint, params=params
        )

    # -- family specifics ------------------------------------------------------------
    def _encoder_modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _encoder_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        """The token ids one image takes in the prompt; features fill its image tokens."""
        raise NotImplementedError

    def _features(self, item: MediaItem) -> torch.Tensor:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def encode(self, item: MediaItem) -> torch.Tensor:
        """The projected features of one image: ``[image tokens, hidden size]``."""
        with torch.no_grad():
            return self._features(item)

    def expected(self, rows: int) -> Expected:
        """What a stored output for an image of ``rows`` feature rows must look like."""
        return Expected((rows, int(self._embed.embedding_dim)), self.dtype)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings of ``ids`` (what it computes from ``input_ids``)."""
        return self._embed(ids)  # type: ignore[no-any-return]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class LlavaModel(ImageTextModel):
    """LLaVA: a CLIP/SigLIP tower, an MLP projector, ``<image>`` once per feature row."""

    family = "llava"

    def _encoder_modules(self) -> list[torch.nn.Module]:
        inner = self.model.model
        return [inner.vision_tower, inner.multi_modal_projector]

    def _encoder_config(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "vision_feature_layer": cfg.vision_feature_layer,
            "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
        }

    def rows(self) -> int:
        """Feature rows per image: the tower's positions, less CLS when the strategy drops it."""
        tower = self.model.model.vision_tower
        embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
        positions = getattr(embeddings, "num_positions", None)
        if not isinstance(positions, int):
            raise ConfigError("cannot tell how many features this LLaVA vision tower yields")
        drop = self.model.config.vision_feature_select_strategy == "default"
        return positions - 1 if drop else positions

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        return [self.image_token_id] * self.rows()

    def _features(self, item: MediaItem) -> torch.Tensor:
        pixels = self.image_processor(images=[_image(item)], return_tensors="pt")["pixel_values"]
        out = self.model.model.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype), return_dict=True
        )
        return out.pooler_output[0]  # type: ignore[no-any-return]


class Idefics3Model(ImageTextModel):
    """Idefics3 / SmolVLM: a SigLIP tower, pixel-shuffle connector, tiled large images."""

    family = "idefics3"
    fake_token = "<fake_token_around_image>"
    global_token = "<global-img>"

    def _encoder_modules(self) -> list[torch.nn.Module]:
        inner = self.model.model
        return [inner.vision_model, inner.connector]

    def _encoder_config(self) -> dict[str, Any]:
        return {"scale_factor": self.model.config.scale_factor}

    @property
    def seq_len(self) -> int:
        vision = self.model.config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return int(patches / self.model.config.scale_factor**2)

    def grid(self, item: MediaItem) -> tuple[int, int]:
        """Rows and columns of tiles the processor cuts the image into (0, 0: not split)."""
        width, height = _image(item).size
        _, rows, cols = self.image_processor.get_number_of_image_patches(height, width)
        return int(rows), int(cols)

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        rows, cols = self.grid(item)
        image = self.image_token * self.seq_len
        text = ""
        if rows or cols:
            for r in range(rows):
                for c in range(cols):
                    text += f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{image}"
                text += "\n"
            text += "\n"
        text += f"{self.fake_token}{self.global_token}{image}{self.fake_token}"
        ids = self._ids(text)
        tiles = rows * cols + 1 if rows or cols else 1
        if ids.count(self.image_token_id) != tiles * self.seq_len:
            raise ConfigError(
                "the tokenizer does not keep the Idefics3 image tokens whole "
                f"({self.fake_token}, {self.global_token}, <row_1_col_1>): add them as special "
                "tokens"
            )
        return ids

    def _features(self, item: MediaItem) -> torch.Tensor:
        out = self.image_processor(images=[[_image(item)]], return_tensors="pt")
        mask = out.get("pixel_attention_mask")
        feats = self.model.model.get_image_features(
            pixel_values=out["pixel_values"].to(self.device, self.dtype),
            pixel_attention_mask=None if mask is None else mask.to(self.device),
            return_dict=True,
        )
        return feats.pooler_output[0]  # type: ignore[no-any-return]


def _default_processor(family: str, config: Any) -> Any:
    """The family's image processor for the tower's resolution, when the model has none saved."""
    size = int(config.vision_config.image_size)
    if family == "llava":
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        return LlavaImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    return Idefics3ImageProcessorPil(
        size={"longest_edge": 4 * size}, max_image_size={"longest_edge": size}
    )


def image_text_model(
    model: Any,
    tokenizer: Any,
    image_processor: Any = None,
    *,
    model_id: str,
    revision: str | None = None,
) -> ImageTextModel | None:
    """The adapter of a supported image-text-to-text model; ``None`` for a text-only model.

    Raises :class:`ConfigError` for a vision-language model of a family kvtier
    cannot run.
    """
    config = model.config
    if getattr(config, "vision_config", None) is None:
        return None
    family = getattr(config, "model_type", "")
    classes: dict[str, type[ImageTextModel]] = {"llava": LlavaModel, "idefics3": Idefics3Model}
    cls = classes.get(family)
    if cls is None:
        raise ConfigError(
            f"vision-language models of type {family!r} are not supported: kvtier runs "
            f"{' and '.join(FAMILIES)} (LLaVA-style and Idefics3/SmolVLM-style) models"
        )
    processor = image_processor if image_processor is not None else _default_processor(
        family, config
    )
    return cls(model, tokenizer, processor, model_id=model_id, revision=revision)


def check_feature_rows(features: torch.Tensor, rows: int, what: str) -> None:
    """Raise unless ``features`` has ``rows`` rows (the placeholder tokens it must fill)."""
    if features.dim() != 2 or features.shape[0] != rows:
        raise ConfigError(
            f"{what}: the encoder produced features of shape {list(features.shape)} for "
            f"{rows} placeholder tokens"
        )


__all__ = [
    "FAMILIES",
    "Idefics3Model",
    "ImageTextModel",
    "LlavaModel",
    "check_feature_rows",
    "image_text_model",
    "weights_fingerprint",
]
