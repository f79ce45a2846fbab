"""A tiny random Llama model and a character-level tokenizer, built offline for tests.

:func:`tiny_model_and_tokenizer` returns a 2-layer Llama with random weights
(seeded, so greedy output is reproducible) and a fast tokenizer whose vocab
is a few special tokens plus every printable ASCII character, tab and
newline; its ChatML-like chat template ends with the assistant header.
:func:`tiny_engine` wraps them in an :class:`~kvtier.engine.Engine`;
:func:`solo_greedy` is the plain model's greedy output, the reference that
generation through kvtier must match.
"""

from __future__ import annotations

from typing import Any

from kvtier.conformance.cases import (
    check_chunked_batches_and_preemption as check_chunked_batches_and_preemption,
)
from kvtier.conformance.cases import check_moved_request as check_moved_request
from kvtier.conformance.cases import (
    check_prefix_hit_and_host_tier as check_prefix_hit_and_host_tier,
)
from kvtier.conformance.cases import greedy_ignoring_eos as greedy_ignoring_eos
from kvtier.conformance.cases import run_all as run_all
from kvtier.conformance.cases import seeded_prompt as seeded_prompt
from kvtier.conformance.tiny import CHARS as CHARS
from kvtier.conformance.tiny import CHAT_TEMPLATE as CHAT_TEMPLATE
from kvtier.conformance.tiny import SPECIAL_TOKENS as SPECIAL_TOKENS
from kvtier.conformance.tiny import TinyFamily as TinyFamily
from kvtier.conformance.tiny import char_tokenizer as tiny_tokenizer


def tiny_llama_config(tok: Any, max_position_embeddings: int = 512) -> Any:
    """A 2-layer Llama config small enough to run in tests, over ``tok``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )


def tiny_gemma3_config(tok: Any, layer_types: list[str], window: int) -> Any:
    """A Gemma 3 text config of ``layer_types`` (sliding windows of ``window``) over ``tok``."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )


def tiny_model_and_tokenizer(seed: int = 0) -> tuple[Any, Any]:
    """A 2-layer random Llama (``vocab_size`` = the tokenizer's) and its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tok)).eval()
    return model, tok


def tiny_engine(**engine_kwargs: Any) -> Any:
    """An :class:`~kvtier.engine.Engine` over the tiny model (``model_id`` "tiny" by default)."""
    from kvtier.engine import Engine

    model, tok = tiny_model_and_tokenizer()
    engine_kwargs.setdefault("model_id", "tiny")
    return Engine(model, tok, **engine_kwargs)


def solo_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the plain model, full recomputation each step (no kvtier at all)."""
    import torch

    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    return out


def request_mixes() -> dict[str, Any]:
    """Hypothesis strategies for :func:`check_request_mix`'s arguments (``@given(**...)``)."""
    from hypothesis import strategies as st

    return {
        "lengths": st.lists(st.integers(1, 30), min_size=1, max_size=4),
        "shared": st.integers(0, 16),
        "num_blocks": st.integers(12, 40),
        "budget": st.integers(4, 24),
    }


def check_saved_directory_serves(family: TinyFamily, path: Any, text: str) -> Any:
    """What ``kvtier serve --model DIR`` does with the family saved to ``path``: probe, load
    and serve ``text`` over HTTP, answering the reference's greedy tokens. Returns the probe."""
    from serving import serving

    from kvtier.engine import Engine
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.model import probe_model

    family.reference.save_pretrained(path)
    family.tok.save_pretrained(path)
    info = probe_model(path)
    engine = Engine.from_config(EngineConfig(model=str(path)))
    with serving(engine, family.model_id) as srv:
        reply = srv.client().completions.create(
            model=family.model_id, prompt=text, max_tokens=5, temperature=0.0
        )
    prompt = family.tok.encode(text)
    want = family.tok.decode(family.hf_greedy(prompt, 5), skip_special_tokens=True)
    assert reply.choices[0].text == want
    return info


def check_request_mix(
    family: TinyFamily, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    """Prompts sharing a prefix of ``shared`` tokens, chunked by ``budget`` tokens a step, in
    a pool of ``num_blocks`` (preempting where it must): the reference's greedy tokens, and
    every block back in the pool at the end."""
    prefix = seeded_prompt(40, shared)
    prompts = [prefix + seeded_prompt(41 + i, n) for i, n in enumerate(lengths)]
    n = 6
    if any(len(p) + n > (num_blocks - 2) * family.block_size for p in prompts):
        return  # every request must fit the pool alone
    engine = family.engine(num_blocks=num_blocks, max_num_seqs=3, max_num_batched_tokens=budget)
    assert run_all(engine, prompts, n) == [family.hf_greedy(p, n) for p in prompts]
    engine.manager.check()
    assert engine.manager.stats().used_blocks == 0
