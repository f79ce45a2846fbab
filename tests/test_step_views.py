"""The per-step views the runner builds without listing a whole context.

``Sequence.token_range`` must be the same tokens as slicing ``tokens`` (prompt
plus generated), and ``TableSlots`` the same slots as the block table's
``slot_mapping``, for every range; the batched greedy pick must be each
row's own sampler's pick.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.block_table import BlockTable
from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.request import RequestMetrics, Sequence
from kvtier.engine.runner import TableSlots
from kvtier.engine.sampling import Sampler, SamplingParams


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    generated=st.lists(st.integers(0, 1000), max_size=40),
    data=st.data(),
)
def test_token_range_is_a_slice_of_tokens(
    prompt: list[int], generated: list[int], data: st.DataObject
) -> None:
    params = SamplingParams(temperature=0)
    seq = Sequence(
        "r", prompt, params, Sampler(params), IncrementalDetokenizer(None), RequestMetrics(0.0, 0)
    )
    seq.generated.extend(generated)
    n = seq.num_tokens
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    assert seq.token_range(start, end) == seq.tokens[start:end]


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 16),
    blocks=st.lists(st.integers(0, 500), min_size=1, max_size=12, unique=True),
    data=st.data(),
)
def test_table_slots_are_the_tables_slot_mapping(
    block_size: int, blocks: list[int], data: st.DataObject
) -> None:
    capacity = len(blocks) * block_size
    length = data.draw(st.integers(1, capacity))
    table = BlockTable(block_size, list(blocks), length)
    slots = TableSlots(table.blocks, block_size, length)
    want = table.slot_mapping(0, length)
    assert len(slots) == length
    assert list(slots) == want
    start = data.draw(st.integers(0, length))
    end = data.draw(st.integers(start, length))
    assert slots[start:end] == want[start:end]
    i = data.draw(st.integers(-length, length - 1))
    assert slots[i] == want[i]
    with pytest.raises(IndexError):
        slots[length]


def test_plain_greedy_is_only_the_unadorned_argmax() -> None:
    assert Sampler(SamplingParams(temperature=0)).plain_greedy
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0, presence_penalty=0.5),
    ):
        assert not Sampler(params).plain_greedy, params


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(2, 50), seed=st.integers(0, 2**31))
def test_a_batched_argmax_picks_what_each_sampler_picks(rows: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are common: both must take the first maximum.
    logits = torch.randint(0, 3, (rows, vocab), generator=g).float()
    batched = torch.argmax(logits, dim=-1).tolist()
    for i in range(rows):
        assert Sampler(SamplingParams(temperature=0)).sample(logits[i])[0] == batched[i]


def test_the_worker_counts_what_its_steps_cost() -> None:
    from tiny_model import tiny_engine

    from kvtier.engine.worker import EngineWorker, StepStats

    engine = tiny_engine(num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with EngineWorker(engine) as worker:
        handles = [worker.submit(engine.encode_prompt(f"q{i}"), params) for i in range(3)]
        texts = [h.result()[1] for h in handles]
    assert all(out.finished for out in texts)
    stats = worker.step_stats
    assert stats.steps >= 5  # at least one step per generated token
    assert stats.sequences == engine.runner.pass_sequences >= 3 * 5
    assert 0 < stats.forward_seconds <= stats.step_seconds
    assert stats.gap_seconds >= 0
    line = stats.since(StepStats())
    assert line.startswith(f"{stats.steps} steps of ") and "in the model's forward" in line
