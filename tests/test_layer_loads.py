"""Tier loads that land layer by layer while the forward pass that needs them starts.

A :class:`LayerFill` makes its copies in layer order and a read of layer
``l`` waits for layer ``l`` only; the storage routes its row reads and writes
through that wait and lands a fill whole before any whole-block access; a
host-tier load lands that way with ``layer_loads`` on, its tier items held
until the fill has settled; and the engine serves the same tokens with it
as without (the bytes are copied, not recomputed, so the comparison is exact).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from needs import hardware_mark
from tiny_model import solo_greedy, tiny_model_and_tokenizer

from kvtier import KVCacheManager
from kvtier.costs import CostModel
from kvtier.engine import Engine, SamplingParams
from kvtier.errors import InternalInvariantError
from kvtier.layout import KVLayout
from kvtier.offload.chain import TierChain
from kvtier.offload.host import HostStore
from kvtier.offload.tier import Tier
from kvtier.storage import KVBlockStorage
from kvtier.storage.fill import LayerFill

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=hardware_mark(torch.cuda.is_available(), "no CUDA device")),
]


class GatedFill(LayerFill):
    """A fill whose copy of layer ``gated`` waits until the test opens the gate."""

    def __init__(self, *args: Any, gated: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gated = gated
        self.gate = threading.Event()

    def _copy_layer(self, layer: int) -> None:
        if layer == self.gated:
            assert self.gate.wait(30)
        super()._copy_layer(layer)


def layer_copies(storage: KVBlockStorage, blocks: list[int], payload: torch.Tensor) -> list[Any]:
    """``payload`` ([n, bytes_per_block] uint8) into ``blocks``, by layer: a view copy for
    consecutive blocks, a row copy for scattered ones."""
    width = storage.bytes_per_block // LAYOUT.num_layers
    target = storage.fill_target()
    if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        dst, rows = target[blocks[0] : blocks[0] + len(blocks)], None
    else:
        dst, rows = target, torch.tensor(blocks)
    cuts = [slice(lay * width, (lay + 1) * width) for lay in range(LAYOUT.num_layers)]
    return [[(dst[:, cut], payload[:, cut], rows)] for cut in cuts]


def random_payload(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((n, *KVBlockStorage(LAYOUT, 1).block_shape), generator=g)
    return values.view(n, -1).view(torch.uint8).clone()


def test_a_read_waits_for_its_own_layer_only() -> None:
    storage = KVBlockStorage(LAYOUT, 8)
    payload = random_payload(2, seed=1)
    fill = GatedFill(layer_copies(storage, [3, 4], payload), storage.device, gated=2)
    fill.start()
    fill.wait(0)
    fill.wait(1)  # the layers before the gate land and are read while layer 2 is held
    reader = threading.Thread(target=fill.wait, args=(2,))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not fill.done
    fill.gate.set()
    reader.join(30)
    assert not reader.is_alive()
    fill.settle()
    assert fill.done and fill.blocked_reads >= 1
    assert torch.equal(storage.fill_target()[3:5], payload)


def test_a_failed_copy_is_an_error_at_the_read_not_a_half_written_layer() -> None:
    storage = KVBlockStorage(LAYOUT, 8)
    payload = random_payload(2, seed=2)
    copies = layer_copies(storage, [0, 1], payload)
    dst, src, rows = copies[1][0]
    copies[1][0] = (dst, src[:, :-1], rows)  # a copy whose shapes differ fails
    fill = LayerFill(copies, storage.device).start()
    fill.wait(0)
    with pytest.raises(InternalInvariantError, match="layer-by-layer load failed"):
        fill.wait(1)
    with pytest.raises(InternalInvariantError):
        fill.settle()


def test_the_storage_reads_a_landing_layer_after_it_lands_and_whole_blocks_after_all() -> None:
    storage = KVBlockStorage(LAYOUT, 8)
    payload = random_payload(3, seed=3)
    expected = KVBlockStorage(LAYOUT, 8)
    expected.import_blocks([2, 3, 4], payload.view(-1))
    rows = storage.slot_rows(list(range(8, 20)))  # every token of blocks 2, 3 and 4
    storage.begin_fill(layer_copies(storage, [2, 3, 4], payload))
    assert storage.filling and storage.fills == 1
    for layer in range(LAYOUT.num_layers):
        k, v = storage.read_rows(layer, rows)
        want_k, want_v = expected.read_rows(layer, rows)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # A whole-block access lands the fill first.
    assert torch.equal(storage.export_blocks([2, 3, 4]), expected.export_blocks([2, 3, 4]))
    assert not storage.filling


def test_a_second_fill_lands_the_first_one_first() -> None:
    storage = KVBlockStorage(LAYOUT, 8)
    a, b = random_payload(2, seed=4), random_payload(3, seed=5)
    storage.begin_fill(layer_copies(storage, [0, 1], a))
    storage.begin_fill(layer_copies(storage, [6, 2, 4], b))  # scattered blocks
    storage.settle_fill()
    target = storage.fill_target()
    assert torch.equal(target[0:2], a)
    assert torch.equal(target[[6, 2, 4]], b)
    assert not target[[3, 5, 7]].any()
    assert storage.fills == 2 and not storage.filling


def test_only_plain_block_storage_takes_fills() -> None:
    assert KVBlockStorage(LAYOUT, 4).fillable
    assert not KVBlockStorage(LAYOUT, 4, layout_kind="layer").fillable


# -- the tier chain ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(list(range(6))),
    stored_in_reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("device", DEVICES)
def test_a_host_load_lands_by_layer_into_any_blocks_as_a_whole_load_does(
    device: str, order: list[int], stored_in_reverse: bool, seed: int
) -> None:
    # Six blocks stored to a host tier, then loaded into six of the other blocks in any
    # order: consecutive runs as views, the rest row by row. Same bytes either way.
    got: dict[bool, torch.Tensor] = {}
    for layered in (False, True):
        storage = KVBlockStorage(LAYOUT, 12, device=device)
        storage.tensor[:6].copy_(torch.randn(storage.tensor[:6].shape, generator=_gen(seed)))
        manager = KVCacheManager(12, LAYOUT.block_size)
        tier = Tier(HostStore(pin_memory=device == "cuda"), 6, codec="raw")
        chain = TierChain(storage, manager, [tier], write_mode="write_through", layer_loads=layered)
        keys = [random.Random(seed).getrandbits(128) + i for i in range(6)]
        src = list(range(6))[:: -1 if stored_in_reverse else 1]
        chain.store_blocks(0, [keys[b] for b in src], src)
        chain.flush()
        dst = [6 + o for o in order]
        assert chain.load(keys, dst) == 6
        assert storage.fills == (1 if layered else 0)
        assert storage.filling == layered  # in flight until something reads it
        got[layered] = storage.tensor.clone()
        assert torch.equal(got[layered][dst], got[layered][:6])
        chain.poll()
        assert not any(tier.offload_manager.is_pinned(k) for k in keys)
        chain.check()
        chain.close()
    assert torch.equal(got[True], got[False])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def engine(model_tok: tuple[Any, Any], layer_loads: bool, num_blocks: int) -> Engine:
    model, tok = model_tok
    e = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=num_blocks,
        tiers=[Tier(HostStore(), 96)],
        tier_layer_loads=layer_loads,
    )
    # Computing is made to look slow, so every prefix a tier holds is loaded.
    costs = CostModel(decay=1.0)
    for n in (16, 64, 256):
        costs.observe_pass([(0, n)], 1.0 * n)
    e.connector.costs = costs
    return e


def serve(e: Engine, prompts: list[list[int]], rounds: int, new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [
        [t for o in e.generate(p, params) for t in o.token_ids]
        for _ in range(rounds)
        for p in prompts
    ]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stems=st.lists(
        st.lists(st.integers(5, 60), min_size=24, max_size=40),
        min_size=3,
        max_size=3,
        unique_by=lambda stem: stem[0],  # three stems, no block in common
    ),
    tails=st.lists(st.lists(st.integers(5, 60), min_size=1, max_size=6), min_size=3, max_size=5),
    num_blocks=st.integers(14, 18),
)
def test_the_engine_serves_the_same_tokens_with_layer_loads(
    model_tok: tuple[Any, Any], stems: list[list[int]], tails: list[list[int]], num_blocks: int
) -> None:
    # Three stems of 6-10 blocks with different tails, twice over, through a pool of 14-18
    # blocks: later requests find their stems on the host tier.
    prompts = [stems[i % len(stems)] + tail for i, tail in enumerate(tails)]
    plain = engine(model_tok, False, num_blocks)
    layered = engine(model_tok, True, num_blocks)
    try:
        want = serve(plain, prompts, 2, 3)
        got = serve(layered, prompts, 2, 3)
        assert got == want
        assert layered.counters.loaded_prompt_tokens == plain.counters.loaded_prompt_tokens
        assert layered.counters.loaded_prompt_tokens > 0  # the stems did come back
        assert layered.storage.fills > 0
        assert plain.storage.fills == 0
        assert not layered.storage.filling  # every pass lands what it read
        chain = layered.tier_chain
        assert chain is not None
        chain.poll()
        tier = chain.tiers[0].offload_manager
        assert not any(tier.is_pinned(k) for k in tier.ready_keys())  # all released
        chain.check()
    finally:
        plain.close()
        layered.close()


def test_a_prefix_from_the_host_tier_lands_by_layer_and_matches_generate(
    model_tok: tuple[Any, Any],
) -> None:
    model, _ = model_tok
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(5, 60, (32,), generator=g).tolist()
    first, second = [*prefix, 11, 12, 13], [*prefix, 21, 22]
    e = engine(model_tok, True, 64)
    try:
        assert serve(e, [first], 1, 4) == [solo_greedy(model, first, 4)]
        assert e.tier_chain is not None
        e.tier_chain.flush()
        e.manager.reset_prefix_cache()  # the blocks demote to the host tier
        e.tier_chain.flush()
        assert serve(e, [second], 1, 4) == [solo_greedy(model, second, 4)]
        assert e.counters.loaded_prompt_tokens == 32 and e.storage.fills == 1
    finally:
        e.close()


def test_the_serve_flag_reaches_the_engine_and_is_off_by_default() -> None:
    import argparse

    from kvtier.cli.serve import add_parser, engine_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert not engine_config(parser.parse_args(["serve"])).tier_layer_loads
    args = parser.parse_args(["serve", "--tier", "host:1GiB", "--tier-layer-loads"])
    assert engine_config(args).tier_layer_loads


def test_the_serve_flag_without_a_host_tier_is_refused_with_what_to_do(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    assert main(["serve", "--tier-layer-loads", "--port", "0"]) == 1
    assert "add one (--tier host:SIZE)" in capsys.readouterr().err
    disk = f"disk:{tmp_path}?size=1MiB"
    assert main(["serve", "--tier", disk, "--tier-layer-loads", "--port", "0"]) == 1
    assert "none of the tiers is one" in capsys.readouterr().err
