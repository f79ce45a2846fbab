"""Multi-head latent attention served from its compressed latent, with HF's tokens.

Tiny random-weight DeepSeek V3, DeepSeek V2, GLM-4 MoE Lite and LongCat-Flash
models (MLA with a query LoRA, mixture-of-experts layers after the first;
LongCat-Flash has two attention sublayers per layer and zero-computation
experts) generate through kvtier's batched engine. kvtier's
blocks hold what the model's own cache holds: per token, the compressed
latent (``kv_lora_rank`` values) as one head of K and the shared rotary key
as V; the model decompresses them per head as it attends. Single requests,
batches with chunked prompts and preemption, a prefix hit, a host tier round
trip and ``generate`` with a ``KvTierCache`` all give the tokens of
transformers' own greedy ``generate``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: Engine code is the same compiled or not: these run in the compiled pass only.
pytestmark = pytest.mark.families

from tiny_model import (  # noqa: E402
    TinyFamily,
    check_chunked_batches_and_preemption,
    greedy_ignoring_eos,
    run_all,
    seeded_prompt,
    tiny_tokenizer,
)

from kvtier.engine import KvTierCache, attach, layout_for_model  # noqa: E402
from kvtier.layers.geometry import geometry  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.manager import KVCacheManager  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.offload.tier import Tier  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

BS = 4
#: qk_nope 16 + qk_rope 8 = 24 wide K per head; V 16 wide (padded to 24 in the blocks).
MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


_MOE = {"n_routed_experts": 4, "n_group": 1, "topk_group": 1, "n_shared_experts": 1}
_DEEPSEEK_LIKE = {
    **_MOE,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}
#: family -> (config class, model class, the family's own config fields). Every
#: family has 3 attention layers but LongCat-Flash: 2 layers of 2 attention sublayers.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_LIKE),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _DEEPSEEK_LIKE),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", _DEEPSEEK_LIKE),
    "longcat_flash": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {
            "num_layers": 2,
            "head_dim": MLA["qk_rope_head_dim"],  # LongCat's rotary width
            "n_routed_experts": 4,
            "moe_topk": 2,
            "zero_expert_num": 2,
            "ffn_hidden_size": 128,
            "expert_ffn_hidden_size": 32,
        },
    ),
}


def _config(family: str, tok: Any) -> Any:
    config_class, _, fields = FAMILIES[family]
    return getattr(transformers, config_class)(
        vocab_size=len(tok),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        **fields,
        **MLA,
    )


class DeepSeek(TinyFamily):
    """The tiny model for engines, an untouched copy for references, and their cache."""

    def __init__(self, family: str) -> None:
        tok = tiny_tokenizer()
        config = _config(family, tok)
        assert config.model_type == family
        super().__init__(
            getattr(transformers, FAMILIES[family][1]),
            config,
            tok,
            f"tiny-{family}",
            BS,
            num_blocks=64,
        )
        self.layers = config.num_hidden_layers


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ds(request: pytest.FixtureRequest) -> DeepSeek:
    return DeepSeek(request.param)


def test_a_block_holds_the_latent_not_the_decompressed_heads(ds: DeepSeek) -> None:
    layout = layout_for_model(ds.model.config, BS, torch.float32)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (ds.layers, 1, 16)
    # config.json (probed before the weights load) gives the same geometry.
    fields = ds.model.config.to_dict()
    assert geometry(fields.get) == (ds.layers, 4, 1, 16)
    # Decompressed (4 heads of 24-wide K, V padded to it) a block would be 6x larger.
    decompressed = KVLayout(ds.layers, 4, 24, BS, "float32")
    assert decompressed.bytes_per_block == 6 * layout.bytes_per_block


def test_single_requests_give_hf_generate_tokens(ds: DeepSeek) -> None:
    engine = ds.engine()
    for seed, length in ((1, 9), (2, 27)):
        prompt = seeded_prompt(seed, length)
        assert run_all(engine, [prompt], 10) == [ds.hf_greedy(prompt, 10)]
    engine.manager.check()


def test_batches_with_chunks_and_preemption(ds: DeepSeek) -> None:
    check_chunked_batches_and_preemption(ds, max_batched_tokens=12)


def test_a_prefix_hit_and_a_host_tier_round_trip(ds: DeepSeek) -> None:
    engine = ds.engine(num_blocks=16, tiers=[Tier(HostStore(), 64)])
    prompts = [seeded_prompt(20 + i, 29) for i in range(4)]
    for _round in range(2):
        for prompt in prompts:
            assert run_all(engine, [prompt], 6) == [ds.hf_greedy(prompt, 6)]
    assert engine.counters.loaded_prompt_tokens > 0  # evicted prefixes came back from host
    again = ds.engine()
    prompt = seeded_prompt(30, 27)
    run_all(again, [prompt], 4)
    outs = list(again.generate(prompt, greedy_ignoring_eos(4)))
    assert outs[-1].metrics.cached_tokens == 24
    assert [t for o in outs for t in o.token_ids] == ds.hf_greedy(prompt, 4)
    engine.close()


def test_a_kvtier_cache_under_hf_generate(ds: DeepSeek) -> None:
    """transformers caches the latent and the rotary key: the blocks hold both, padded."""
    model = copy.deepcopy(ds.reference)
    attach(model)
    layout = layout_for_model(model.config, BS, torch.float32)
    storage, manager = KVBlockStorage(layout, 64), KVCacheManager(64, BS)
    prompt = seeded_prompt(31, 27)
    for rid in ("cold", "warm"):
        with KvTierCache(storage, manager, rid, prompt) as cache, torch.no_grad():
            out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=8)
        assert out[0, len(prompt) :].tolist() == ds.hf_greedy(prompt, 8)
    assert cache.num_cached_tokens == 24
