"""The attention features newly served: sinks, soft-capping, NoPE layers, sliding layouts.

GPT-OSS adds a learned logit per head to every softmax (attention sinks),
Gemma 2 bends attention logits with ``softcap * tanh(logit / softcap)``,
SmolLM3 leaves rotary positions out of some layers (NoPE), and Cohere 2,
OLMo 3, EXAONE 4 and Ministral interleave sliding-window and full layers in
their own layouts. Qwen2-MoE slides through its mask alone (its attention
passes no window), StableLM's decoder layers do not hand the engine's pass
on to their attention, and Falcon attends in code of its own rather than
through the attention interface. Each is served from kvtier's blocks with
the model's own answers: the written-out attention equals the model's eager
attention on random inputs with a ragged mask, a tiny model of each family,
saved to a directory as a user holds it, answers over HTTP (what ``kvtier
serve --model DIR`` does) with transformers' own greedy tokens, and Falcon's
other head layouts pass every conformance case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: Engine code is the same compiled or not: these run in the compiled pass only.
pytestmark = pytest.mark.families

from tiny_model import check_saved_directory_serves  # noqa: E402

from kvtier.conformance.cases import CASES  # noqa: E402
from kvtier.conformance.tiny import TinyFamily, causal_lm_class, char_tokenizer, tiny_config  # noqa: E402
from kvtier.engine.paged import attend_eager  # noqa: E402
from kvtier.layers.support import config_features  # noqa: E402


def _family(model_type: str) -> TinyFamily:
    tok = char_tokenizer()
    config = tiny_config(model_type, len(tok))
    return TinyFamily(causal_lm_class(model_type), config, tok, f"tiny-{model_type}", 4)


@pytest.mark.parametrize(
    ("softcap", "sinks"),
    [(None, False), (5.0, False), (None, True)],
    ids=["plain", "softcap", "sinks"],
)
def test_written_out_attention_equals_the_models_eager_attention(
    softcap: float | None, sinks: bool
) -> None:
    """Against transformers' GPT-OSS / Gemma 2 eager functions on the same inputs."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    g = torch.Generator().manual_seed(0)
    B, H, KV, Q, K, D = 2, 4, 2, 3, 9, 8
    q = torch.randn(B, H, Q, D, generator=g)
    k = torch.randn(B, KV, K, D, generator=g) * 3
    v = torch.randn(B, KV, K, D, generator=g)
    visible = torch.rand(B, 1, Q, K, generator=g) > 0.3
    visible[..., 0] = True
    bias = torch.zeros(B, 1, Q, K).masked_fill_(~visible, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups = H // KV
    module.training = False
    module.sinks = torch.nn.Parameter(torch.randn(H, generator=g))
    module.config = type("C", (), {"attn_logit_softcapping": softcap})()
    if sinks:
        want, _ = gpt_oss(module, q, k, v, bias, scaling=D**-0.5)
    else:
        want, _ = gemma2(module, q, k, v, bias, scaling=D**-0.5, softcap=softcap)
    kx, vx = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    got = attend_eager(q, kx, vx, bias, D**-0.5, softcap, module.sinks if sinks else None)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)


#: One family per newly served attention feature, and the features its tiny model has.
SAVED = [
    ("gpt_oss", {"sliding"}),  # attention sinks, sliding and full layers alternating
    ("gemma2", {"sliding", "softcap"}),
    ("smollm3", {"sliding"}),  # NoPE layers (every 4th layer without rotary positions)
    ("cohere2", {"sliding"}),
    ("olmo3", {"sliding"}),
    ("exaone4", {"sliding"}),
    ("ministral", {"sliding"}),
    ("gpt2", set()),  # config.json names its sizes n_layer, n_head, n_embd
    ("qwen2_moe", {"sliding"}),  # its attention passes no window: the mask slides
    ("stablelm", set()),  # decoder layers that drop the pass on the way to attention
    ("falcon", set()),  # attention in code of its own, fed the blocks through a cache
]


@pytest.mark.parametrize(("model_type", "features"), SAVED, ids=[t for t, _ in SAVED])
def test_a_saved_directory_serves(model_type: str, features: set[str], tmp_path: Path) -> None:
    family = _family(model_type)
    config = family.model.config
    assert config_features(lambda name: getattr(config, name, None)) == features
    if model_type == "smollm3":
        assert 0 in family.model.config.no_rope_layers  # some layers really skip rotary
    info = check_saved_directory_serves(family, tmp_path, "hello, " * 6 + "world")
    assert info.num_layers == 4


@pytest.mark.parametrize(
    "fields",
    [{"new_decoder_architecture": True, "num_kv_heads": 2}, {"multi_query": False}],
    ids=["grouped-query", "multi-head"],
)
def test_falcons_other_head_layouts_give_transformers_tokens(fields: dict[str, object]) -> None:
    """The sweep's tiny Falcon is multi-query (Falcon 7B); Falcon 40B / 180B group their
    query heads over a few K/V heads, handing each K/V head repeated per query head."""
    tok = char_tokenizer()
    config = tiny_config("falcon", len(tok), **fields)
    family = TinyFamily(causal_lm_class("falcon"), config, tok, "tiny-falcon", 4)
    for check in CASES.values():
        check(family)
