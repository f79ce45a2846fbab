"""Every family kvtier admits is exact in the conformance sweep, run again here.

``kvtier/layers/families.json`` is the record kvtier admits models by: the
conformance sweep's outcome for every causal-LM family of the installed
transformers (``python bench/families.py --write`` writes it). These tests
are the evidence behind it: each family the record calls exact is built tiny
from its own config and served through the engine in the conformance cases,
every token equal to transformers' own greedy ``generate``; the record
covers every family transformers has; the support check admits exactly what
the record says, within the features each family was exercised with; and a
refusal names the feature and what to use instead.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: Engine code is the same compiled or not: these run in the compiled pass only.
pytestmark = pytest.mark.families

from kvtier.conformance.sweep import (  # noqa: E402
    EXACT,
    REFUSED,
    UNBUILT,
    causal_lm_types,
    run_family,
    run_family_in_process,
)
from kvtier.conformance.tiny import char_tokenizer, tiny_config  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.layers import support  # noqa: E402
from kvtier.layers.support import RECORD, SUPPORTED_MODEL_TYPES, check_supported  # noqa: E402

FAMILIES: dict[str, dict[str, Any]] = RECORD["families"]
EXACT_TYPES = sorted(t for t, e in FAMILIES.items() if e["outcome"] == EXACT)
SAME_TRANSFORMERS = RECORD.get("transformers") == transformers.__version__


def test_the_record_is_for_the_installed_transformers() -> None:
    assert SAME_TRANSFORMERS, (
        f"the record is for transformers {RECORD.get('transformers')}, this is "
        f"{transformers.__version__}: rerun `python bench/families.py --write`"
    )


def test_the_record_covers_every_causal_lm_family() -> None:
    if not SAME_TRANSFORMERS:
        pytest.skip("another transformers: its families differ from the record's")
    assert sorted(FAMILIES) == causal_lm_types()
    for model_type, entry in FAMILIES.items():
        assert entry["outcome"] in (EXACT, REFUSED, UNBUILT), model_type
        if entry["outcome"] == EXACT:
            assert set(entry["features"]) <= set(support.FEATURES), model_type
        else:
            assert entry["reason"], model_type


def test_the_families_people_run_are_exact() -> None:
    wanted = {
        "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "gemma", "gemma2", "phi", "phi3", "phimoe",
        "granite", "granitemoe", "olmo2", "olmo3", "olmoe", "glm4", "glm4_moe", "smollm3",
        "cohere", "cohere2", "exaone4", "ministral", "ernie4_5", "ernie4_5_moe", "seed_oss",
        "hunyuan_v1_dense", "apertus", "arcee", "helium", "starcoder2", "gpt2", "minimax_m2",
        "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "nemotron", "falcon",
        "stablelm",
    }  # fmt: skip
    assert not wanted - set(EXACT_TYPES), sorted(wanted - set(EXACT_TYPES))
    assert len(EXACT_TYPES) >= 60
    # Attention code of their own, adding ALiBi biases: refused, saying so.
    for model_type in ("bloom", "mpt"):
        assert FAMILIES[model_type]["outcome"] == REFUSED
        assert "ALiBi" in FAMILIES[model_type]["reason"]


def test_the_support_check_admits_what_the_record_says() -> None:
    assert set(EXACT_TYPES) == SUPPORTED_MODEL_TYPES
    tok = char_tokenizer()
    for model_type, entry in FAMILIES.items():
        if entry["outcome"] != REFUSED:
            continue
        with pytest.raises(ConfigError) as info:
            check_supported({"model_type": model_type, "num_hidden_layers": 2}.get)
        message = str(info.value)
        assert repr(model_type) in message and "Instead:" in message, message
    # A family it admits passes with the tiny config the sweep exercised.
    for model_type in ("gemma2", "gpt_oss", "smollm3"):
        check_supported(tiny_config(model_type, len(tok)).to_dict().get)


def test_a_switch_the_sweep_did_not_exercise_is_refused() -> None:
    """Llama was swept as full attention: a Llama config with sliding layers is refused,
    naming the feature, what the sweep checked and what to use instead."""
    assert "sliding" not in FAMILIES["llama"]["features"]
    fields = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512,
    }
    with pytest.raises(ConfigError, match="sliding-window attention") as info:
        check_supported(fields.get)
    assert "full attention" in str(info.value) and "Instead:" in str(info.value)
    # A window at least as long as the context hides nothing: plain full attention.
    check_supported({**fields, "layer_types": None, "sliding_window": 512}.get)
    # Soft-capping is only admitted where the sweep saw it (Gemma 2).
    with pytest.raises(ConfigError, match="soft-capping"):
        check_supported({"model_type": "llama", "attn_logit_softcapping": 50.0}.get)
    # Falcon is served with rotary positions; its ALiBi form is refused, saying so.
    with pytest.raises(ConfigError, match=r"ALiBi position biases \(alibi is true\)") as info:
        check_supported({"model_type": "falcon", "num_hidden_layers": 2, "alibi": True}.get)
    assert "Instead:" in str(info.value)


def test_an_unknown_family_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"bench/families\.py --write") as info:
        check_supported({"model_type": "brand_new_arch", "num_hidden_layers": 2}.get)
    assert "Instead:" in str(info.value)


@pytest.mark.parametrize("model_type", EXACT_TYPES)
def test_an_admitted_family_gives_transformers_tokens(model_type: str) -> None:
    """Every conformance case (a few seconds a family on one core)."""
    result = run_family(model_type)
    if result.outcome == UNBUILT:
        # Built in this test process, a config class can meet state other tests left in
        # transformers; the sweep builds each family in a fresh process, so check there.
        result = run_family_in_process(model_type)
    assert result.outcome == EXACT, result.reason
    assert list(result.features) == FAMILIES[model_type]["features"]
