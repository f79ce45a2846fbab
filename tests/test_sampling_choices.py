"""The OpenAI sampling surface in the engine: logprobs, n choices, penalties, logit_bias, seed.

Every expectation comes from the plain model run without kvtier (a full
forward pass over prompt + generated tokens), so these tests check the
engine against the model, not against itself.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import tiny_engine  # noqa: E402

from kvtier import BadRequestError  # noqa: E402
from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.sampling import Sampler, TokenLogprob  # noqa: E402


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine(num_blocks=256, block_size=8, max_num_seqs=4)


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def _run(engine: Engine, ids: list[int], params: SamplingParams) -> dict[int, list]:
    """Every output of one request, per choice."""
    by_choice: dict[int, list] = {}
    for out in engine.generate(ids, params):
        by_choice.setdefault(out.index, []).append(out)
    return by_choice


def _full_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_match_a_full_forward_pass(engine: Engine) -> None:
    ids = _prompt(engine, "logprobs please")
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    outs = _run(engine, ids, params)[0]
    tokens = [t for o in outs for t in o.token_ids]
    entries = [lp for o in outs for lp in o.logprobs]
    assert len(tokens) == len(entries) == 6
    ref = _full_logprobs(engine, ids + tokens)
    for i, (tok, e) in enumerate(zip(tokens, entries, strict=True)):
        row = ref[len(ids) - 1 + i]
        assert e.token_id == tok
        assert e.logprob == pytest.approx(float(row[tok]), abs=1e-4)
        want = torch.topk(row, 3)
        assert [t for t, _ in e.top] == want.indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert e.top[0][0] == tok  # greedy picks the most likely token


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    outs = _run(engine, _prompt(engine, "quiet"), SamplingParams(max_tokens=3, temperature=0))[0]
    assert all(o.logprobs == () for o in outs)


def test_n_choices_fork_the_prompt_once(engine: Engine) -> None:
    ids = _prompt(engine, "three choices from one prompt, computed once")
    before = engine.counters.computed_prompt_tokens
    forked = engine.counters.forked_sequences
    cow = engine.manager.stats().cow_copies
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, ignore_eos=True)
    outs = _run(engine, ids, params)
    assert sorted(outs) == [0, 1, 2]
    # The prompt went through the model once; two choices were forked from it.
    assert engine.counters.computed_prompt_tokens - before == len(ids)
    assert engine.counters.forked_sequences - forked == 2
    # The shared partial last block was copied on write when the choices diverged.
    assert engine.manager.stats().cow_copies > cow
    texts = {i: [t for o in v for t in o.token_ids] for i, v in outs.items()}
    assert all(len(t) == 5 for t in texts.values())
    assert len({tuple(t) for t in texts.values()}) > 1, "seeded choices should differ"
    again = _run(engine, ids, params)
    assert {i: [t for o in v for t in o.token_ids] for i, v in again.items()} == texts
    engine.manager.check()


def test_greedy_choices_are_identical_to_a_single_greedy_run(engine: Engine) -> None:
    ids = _prompt(engine, "greedy twins")
    one = _run(engine, ids, SamplingParams(max_tokens=6, temperature=0))[0]
    many = _run(engine, ids, SamplingParams(max_tokens=6, temperature=0, n=3))
    want = [t for o in one for t in o.token_ids]
    for choice in many.values():
        assert [t for o in choice for t in o.token_ids] == want


def _penalized_greedy(
    engine: Engine, ids: list[int], steps: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding with OpenAI's penalties, by full forward passes of the plain model."""
    out: list[int] = []
    counts: dict[int, int] = {}
    for _ in range(steps):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        for tok, c in counts.items():
            logits[tok] -= frequency * c + presence
        tok = int(torch.argmax(logits))
        out.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (1.5, 0.0), (-1.0, 0.5)])
def test_penalties_match_the_reference(engine: Engine, presence: float, frequency: float) -> None:
    ids = _prompt(engine, "repeat repeat repeat")
    params = SamplingParams(
        max_tokens=10,
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        ignore_eos=True,
    )
    got = [t for o in _run(engine, ids, params)[0] for t in o.token_ids]
    assert got == _penalized_greedy(engine, ids, 10, presence, frequency)


def test_logit_bias_forces_a_token(engine: Engine) -> None:
    ids = _prompt(engine, "bias")
    target = engine.tokenizer.convert_tokens_to_ids("Q")
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={target: 100.0})
    got = [t for o in _run(engine, ids, params)[0] for t in o.token_ids]
    assert got == [target] * 5
    banned = SamplingParams(max_tokens=5, temperature=0, logit_bias={target: -100.0})
    plain = [t for o in _run(engine, ids, SamplingParams(max_tokens=5, temperature=0))[0]
             for t in o.token_ids]
    assert target not in [t for o in _run(engine, ids, banned)[0] for t in o.token_ids]
    assert plain  # the unbiased run is the control


def test_seed_reproduces_and_differs(engine: Engine) -> None:
    ids = _prompt(engine, "seeded")
    runs = [
        [t for o in _run(engine, ids, SamplingParams(max_tokens=12, temperature=2.0, seed=s))[0]
         for t in o.token_ids]
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 0])
def test_seeds_at_the_int64_bounds_sample(seed: int) -> None:
    s = Sampler(SamplingParams(temperature=1.0, seed=seed))
    token, _ = s.sample(torch.zeros(10))
    assert 0 <= token < 10


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", True),
        ("n", 0),
        ("n", 17),
        ("presence_penalty", 2.5),
        ("frequency_penalty", math.nan),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logit_bias", {1: 200.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
    ],
)
def test_bad_sampling_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(BadRequestError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert (info.value.param or "").startswith(field)


def test_engine_refuses_more_choices_than_it_runs_at_once(engine: Engine) -> None:
    with pytest.raises(BadRequestError, match="max_num_seqs"):
        engine.add_request([1, 2, 3], SamplingParams(n=5))
    with pytest.raises(BadRequestError, match="vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))


def test_token_logprob_is_plain_data() -> None:
    e = TokenLogprob(3, -0.5, ((3, -0.5), (1, -1.0)))
    assert e.top[1] == (1, -1.0)
