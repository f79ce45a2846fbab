"""Incremental detokenization, stop strings, sampling parameters and the Prometheus renderer."""

from __future__ import annotations

import math

import pytest
from needs import need_module

torch = need_module("torch")
tokenizers = need_module("tokenizers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier import BadRequestError  # noqa: E402
from kvtier.engine.detok import IncrementalDetokenizer  # noqa: E402
from kvtier.engine.sampling import Sampler, SamplingParams  # noqa: E402
from kvtier.obs.metrics import Histogram, MetricFamily, render_prometheus  # noqa: E402

CORPUS = [
    "Caches keep hot blocks close; naïve eviction thrashes. Größe, café, 東京, 😀 emoji!",
    "The quick brown fox jumps over the lazy dog. Prefix caching reuses blocks.",
    "Ünïcödé text with accents: é è ê ë, and CJK 日本語の文章, plus 🚀🔥 symbols.",
]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A real byte-level BPE tokenizer: multi-byte characters split across tokens."""
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 5, vocab_size=300, min_frequency=2, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def _stream(
    tok, ids: list[int], stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", CORPUS)
def test_streamed_text_equals_the_full_decode(byte_tokenizer, text: str) -> None:
    ids = byte_tokenizer.encode(text)
    assert len(ids) > 10
    deltas, _ = _stream(byte_tokenizer, ids)
    assert "".join(deltas) == byte_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), "a split character was streamed"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stop_strings_are_cut_and_never_streamed(byte_tokenizer, data) -> None:
    text = data.draw(st.sampled_from(CORPUS))
    start = data.draw(st.integers(0, len(text) - 2))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    ids = byte_tokenizer.encode(text)
    deltas, d = _stream(byte_tokenizer, ids, (stop,))
    streamed = "".join(deltas)
    assert streamed == text[: text.index(stop)]
    assert d.stopped
    assert stop not in streamed


def test_text_held_back_for_a_possible_stop_is_released(byte_tokenizer) -> None:
    text = CORPUS[1]
    ids = byte_tokenizer.encode(text)
    deltas, d = _stream(byte_tokenizer, ids, ("The quick brown cat",))
    assert "".join(deltas) == text and not d.stopped
    # The tail of the first sentence looked like the stop's start: held, then released.
    assert not any(x.startswith("The quick brown fox") for x in deltas[:-1] if x)


def test_sampling_params_validate_with_the_field_named() -> None:
    cases = {
        "max_tokens": {"max_tokens": -1},
        "temperature": {"temperature": 2.5},
        "top_p": {"top_p": 0.0},
        "stop": {"stop": ["a", "b", "c", "d", "e"]},
        "seed": {"seed": 1.5},
    }
    for param, kwargs in cases.items():
        with pytest.raises(BadRequestError) as info:
            SamplingParams(**kwargs)  # type: ignore[arg-type]
        assert info.value.param == param
    with pytest.raises(BadRequestError):
        SamplingParams(temperature=math.nan)
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]


def test_greedy_and_nucleus_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1
    # top_p below the top token's probability keeps only it.
    narrow = Sampler(SamplingParams(temperature=1.0, top_p=0.05, seed=0))
    assert {narrow(logits) for _ in range(50)} == {1}
    # Probabilities 0.024, 0.478, 0.065, 0.433: sorted cumulative 0.478, 0.911, 0.976.
    # top_p = 0.9 keeps tokens 1 and 3; top_p = 0.95 also 2; token 0 never.
    for top_p, want in ((0.9, {1, 3}), (0.95, {1, 2, 3})):
        nucleus = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0))
        assert {nucleus(logits) for _ in range(400)} == want
    # A top_p below float32's smallest number still keeps the most likely token.
    assert Sampler(SamplingParams(temperature=1.0, top_p=5e-324, seed=0))(logits) == 1


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, 0.0])
    s = Sampler(SamplingParams(temperature=0.7, seed=42))
    n = 6000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[s(logits)] += 1
    probs = torch.softmax(logits / 0.7, dim=-1).tolist()
    for c, p in zip(counts, probs, strict=True):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [a(logits) for _ in range(30)] == [b(logits) for _ in range(30)]


def test_prometheus_rendering() -> None:
    h = Histogram([0.1, 1.0])
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    text = render_prometheus(
        [
            MetricFamily("x_total", "counter", "Things.").add(3, reason='a"b\\c\nd'),
            MetricFamily("lat_seconds", "histogram", "Latency.").add(h),
            MetricFamily("ratio", "gauge", "A ratio.").add(0.25),
        ]
    )
    lines = text.splitlines()
    assert "# TYPE x_total counter" in lines
    assert 'x_total{reason="a\\"b\\\\c\\nd"} 3' in lines
    assert 'lat_seconds_bucket{le="0.1"} 1' in lines
    assert 'lat_seconds_bucket{le="1"} 3' in lines
    assert 'lat_seconds_bucket{le="+Inf"} 4' in lines
    assert "lat_seconds_count 4" in lines and "lat_seconds_sum 4.05" in lines
    assert "ratio 0.25" in lines
    assert text.endswith("\n")
