"""Tiny random vision-language models (LLaVA-style and Idefics3-style), built offline for tests.

No vision-language weights can be downloaded here, so these are built from
configs with seeded random weights: a CLIP (LLaVA) or Idefics3 vision tower,
the projector, and the tiny Llama decoder of :mod:`tiny_model`, over the
character-level tokenizer with the image tokens added as special tokens.
:func:`png_bytes` makes real PNG files to send.
"""

from __future__ import annotations

import io
from typing import Any

from tiny_model import tiny_llama_config, tiny_tokenizer

IMAGE_TOKEN = "<image>"
IDEFICS_TOKENS = ("<fake_token_around_image>", "<global-img>")


def _text_config(tok: Any) -> Any:
    return tiny_llama_config(tok, max_position_embeddings=1024)


def vlm_tokenizer(family: str) -> Any:
    tok = tiny_tokenizer()
    extra = [IMAGE_TOKEN]
    if family == "idefics3":
        extra += list(IDEFICS_TOKENS) + [f"<row_{r}_col_{c}>" for r in (1, 2, 3) for c in (1, 2, 3)]
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *extra]})
    return tok


def tiny_llava(seed: int = 0, image_size: int = 32) -> tuple[Any, Any]:
    """A random LLaVA (CLIP tower 32 px, 8 px patches: 16 features per image) and its tokenizer."""
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = vlm_tokenizer("llava")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(tok),
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).eval(), tok


def tiny_idefics3(seed: int = 0) -> tuple[Any, Any]:
    """A random Idefics3 (SigLIP-style tower 32 px, 8 px patches, scale 2: 4 rows per tile)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tok = vlm_tokenizer("idefics3")
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    cfg = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=_text_config(tok).to_dict(),
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2,
    )
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(cfg).eval(), tok


def png_bytes(seed: int, size: tuple[int, int] = (40, 40)) -> bytes:
    """A PNG file of random RGB pixels (``size`` is width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def dashboard_engine(model_id: str) -> Any:
    """A tiny LLaVA with a host tier and the pool's pressure monitor: every family the
    Grafana dashboard plots (prefix cache, tiers, pressure, encoder cache) has series."""
    from kvtier.engine import Engine
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier
    from kvtier.pressure import PressureSpec

    model, tok = tiny_llava()
    return Engine(
        model,
        tok,
        model_id=model_id,
        num_blocks=256,
        block_size=4,
        tiers=[Tier(HostStore(), 64)],
        pressure=PressureSpec(monitor="pool"),
    )
