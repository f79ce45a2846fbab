"""Tiny random-weight models of any transformers decoder family, and a tokenizer for them.

:func:`char_tokenizer` is a character-level fast tokenizer with a chat
template, built offline. :func:`tiny_config` shrinks a family's default
config to a few small layers without naming the family: only the fields
its config class has are set (sizes, experts, a sliding window small
enough to bind on short prompts), so the family derives its own layer plan
(``layer_types`` and the like) from them, as it would for a real checkpoint.
:class:`TinyFamily` holds such a model for engines and an untouched copy
that gives transformers' own greedy tokens.
"""

from __future__ import annotations

import copy
from typing import Any

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Printable ASCII (space to ``~``), tab and newline: any ASCII text encodes.
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))

#: The sliding window of a tiny model's sliding layers, in tokens: short enough that
#: the conformance prompts (up to ~40 tokens) cross it many times.
TINY_WINDOW = 6

#: Sizes every tiny model takes where its config class has the field.
_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Mixture-of-experts families: a few small experts.
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    # Weights large enough that greedy tokens vary from step to step.
    "initializer_range": 0.2,
}


#: Multi-head latent attention with a query LoRA, and a few routed experts.
MLA_FIELDS: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_key_value_heads": 4,  # MLA decompresses one K/V per attention head
}
_MLA_MOE: dict[str, Any] = {
    **MLA_FIELDS,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "head_dim": 8,  # DeepSeek's configs call the rotary width head_dim
}
#: Small gated delta-net (linear attention) layers around one attention layer.
_DELTA_NET: dict[str, Any] = {
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
_HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]

#: Families whose layer plan or state sizes need their own small values to build tiny
#: (sizes only: what a family is admitted for is what the sweep then finds).
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek_v2": _MLA_MOE,
    "deepseek_v3": _MLA_MOE,
    "glm4_moe_lite": _MLA_MOE,
    "longcat_flash": {
        **MLA_FIELDS,
        "num_layers": 2,
        "head_dim": 8,  # its rotary width: qk_rope_head_dim
        "moe_topk": 2,
        "zero_expert_num": 2,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
    },
    "lfm2": {
        "layer_types": ["conv", "full_attention", "conv", "conv"],
        "num_key_value_heads": 1,
        "conv_L_cache": 3,
    },
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_key_value_heads": 1,
        "num_dense_layers": 1,
    },
    "qwen3_next": _DELTA_NET,
    "qwen3_5_text": {
        **_DELTA_NET,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
    },
    "qwen3_5_moe_text": _DELTA_NET,
    "llama4_text": {"attention_chunk_size": 8, "floor_scale": 4, "intermediate_size_mlp": 128},
    "granitemoehybrid": {
        "layer_types": _HYBRID_LAYERS,
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
        "shared_intermediate_size": 64,
    },
    "nemotron_h": {
        "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 8,
        "n_groups": 2,
        "chunk_size": 8,
    },
    # Partial rotary embeddings narrower than the tiny heads.
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "jamba": {"attn_layer_period": 3, "attn_layer_offset": 1, "mamba_d_state": 8},
    "falcon_h1": {
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    },
    "kimi_linear": {
        "layer_types": _HYBRID_LAYERS,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "linear_head_dim": 16,
        "linear_num_heads": 2,
        "pad_token_id": 0,
    },
    "bamba": {
        "attn_layer_indices": [1],
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
        "pad_token_id": 0,
    },
}


def char_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(model_type: str, vocab_size: int, **fields: Any) -> Any:
    """``model_type``'s default config shrunk to a tiny model (``fields`` override).

    Raises whatever the config class raises for sizes it cannot take.
    """
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {}) or {}
    known = set(defaults) | set(aliases)
    small = {k: v for k, v in _SMALL.items() if k in known}
    window = defaults.get("sliding_window")
    if "sliding_window" in defaults and (window is None or isinstance(window, int)):
        # A window that binds: the family's sliding layers are exercised, not skipped.
        small["sliding_window"] = TINY_WINDOW
        if "use_sliding_window" in defaults:
            small["use_sliding_window"] = True
        if "max_window_layers" in defaults:
            small["max_window_layers"] = 1  # Qwen-style: layers from 1 on slide
    if "layer_types" in defaults:
        small["layer_types"] = None  # derived again for the tiny layer count
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = defaults.get(name)
        if isinstance(value, int) and value >= vocab_size:
            small[name] = 0 if name == "pad_token_id" else 1
    small["vocab_size"] = vocab_size
    return cls(**{**small, **FAMILY_FIELDS.get(model_type, {}), **fields})


def causal_lm_class(model_type: str) -> Any:
    """transformers' causal-LM class for ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


class TinyFamily:
    """A tiny random-weight model of one family for engines, an untouched copy for references.

    ``hf_greedy`` is transformers' own greedy ``generate`` on the reference
    (its own caches and masks), memoized; ``engine`` serves ``model``, a
    deep copy, through kvtier. Neither stops at EOS: the engine runs with
    ``ignore_eos``.
    """

    def __init__(
        self, model_class: Any, config: Any, tokenizer: Any, model_id: str, block_size: int,
        num_blocks: int = 64,
    ) -> None:  # fmt: skip
        import torch

        self.tok = tokenizer
        torch.manual_seed(0)
        self.reference = model_class(config).eval()
        self.reference.generation_config.eos_token_id = None
        self.model = copy.deepcopy(self.reference)
        self.model_id = model_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._refs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        import torch

        key = (tuple(prompt), n)
        if key not in self._refs:
            with torch.no_grad():
                out = self.reference.generate(
                    torch.tensor([prompt]), max_new_tokens=n, do_sample=False
                )
            self._refs[key] = out[0, len(prompt) :].tolist()
            if len(self._refs[key]) != n:
                raise AssertionError(f"generate gave {len(self._refs[key])} tokens, not {n}")
        return self._refs[key]

    def logit_margin(self, ids: list[int], preferred: int, other: int) -> tuple[float, float]:
        """How much the reference's next-token logit after ``ids`` favours ``preferred`` over
        ``other``, and the logits' scale (their largest magnitude)."""
        import torch

        with torch.no_grad():
            logits = self.reference(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return float(logits[preferred] - logits[other]), float(logits.abs().max())

    def engine(self, **kw: Any) -> Any:
        from kvtier.engine import Engine

        kw.setdefault("num_blocks", self.num_blocks)
        return Engine(
            self.model, self.tok, model_id=self.model_id, block_size=self.block_size, **kw
        )
