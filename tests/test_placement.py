"""One manager over several devices' pools: placement, moves, pressure, rebalancing.

Real CPU block storages stand for the devices. Every token's K/V is a value
derived from the token ids up to it, written as an engine's forward pass
would; after any operation each request's blocks, read back on whatever
device it now lives, must hold exactly its tokens' values (so moves and
prefix copies moved the right bytes). A state machine drives placement,
growth, moves, rebalancing and pinned passes at random; the tiny Llama
generates through the pools while requests move and must produce the plain
model's greedy tokens. CUDA copies are checked when a GPU is present.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvtier.block_table import blocks_needed  # noqa: E402
from kvtier.errors import MigrationError, OutOfBlocksError  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.placement import MultiDeviceManager  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

BS = 4
LAYOUT = KVLayout(1, 1, 2, BS, "float32")


def make(*blocks: int, device: str = "cpu", max_moves: int = 8) -> MultiDeviceManager:
    return MultiDeviceManager.on_devices(
        [KVBlockStorage(LAYOUT, n, device) for n in blocks],
        names=[f"dev{i}" for i in range(len(blocks))],
        max_moves=max_moves,
    )


def values(tokens: list[int]) -> list[float]:
    """What each position's K holds: a rolling function of the tokens up to it."""
    out = []
    v = 0
    for t in tokens:
        v = (v * 31 + t + 1) % 65521
        out.append(float(v))
    return out


def write(m: MultiDeviceManager, rid: str, tokens: list[int], start: int) -> None:
    """Write the K/V of positions ``start ..`` as a forward pass over them would."""
    n = len(tokens)
    if start >= n:
        return
    storage = m.pools[m.device_of(rid)].storage
    assert storage is not None
    slots = m.block_table(rid).slot_mapping(start, n)
    vals = torch.tensor(values(tokens)[start:], dtype=torch.float32)
    pos = torch.arange(start, n, dtype=torch.float32)
    k = torch.stack([vals, pos], dim=1).view(-1, 1, 2).to(storage.device)
    v = torch.stack([pos, -vals], dim=1).view(-1, 1, 2).to(storage.device)
    storage.write(0, slots, k, v)


def verify(m: MultiDeviceManager, rid: str, tokens: list[int]) -> None:
    storage = m.pools[m.device_of(rid)].storage
    assert storage is not None
    table = m.block_table(rid)
    assert table.num_tokens == len(tokens)
    assert len(table.blocks) == blocks_needed(len(tokens), BS)
    k, v = storage.read(0, table)
    want = torch.tensor(values(tokens))
    assert torch.equal(k[:, 0, 0].cpu(), want), rid
    assert torch.equal(v[:, 0, 1].cpu(), -want), rid
    assert torch.equal(k[:, 0, 1].cpu(), torch.arange(len(tokens), dtype=torch.float32))


def start(m: MultiDeviceManager, rid: str, tokens: list[int], **kw: Any) -> Any:
    placed = m.allocate(rid, tokens, pin=True, **kw)
    write(m, rid, tokens, placed.num_cached_tokens)
    m.unpin(rid)
    return placed


DOC = list(range(100, 124))  # 6 full blocks


def test_a_request_goes_where_its_prefix_is_cached() -> None:
    m = make(16, 16)
    start(m, "a", [*DOC, 1, 2], device=1)
    placed = start(m, "b", [*DOC, 3])
    assert placed.device == 1 and placed.num_cached_tokens == len(DOC)
    # Unrelated: the emptier device.
    assert start(m, "c", [5, 6, 7, 8, 9]).device == 0
    for rid, toks in (("a", [*DOC, 1, 2]), ("b", [*DOC, 3]), ("c", [5, 6, 7, 8, 9])):
        verify(m, rid, toks)
    m.check()


def test_a_full_prefix_device_sends_the_prefix_over_instead_of_recomputing() -> None:
    m = make(10, 16)
    start(m, "doc", [*DOC, 1], device=0)  # 7 blocks of device 0, held
    start(m, "filler", list(range(1, 9)), device=0)  # 2 more
    m.pin("doc", "filler")
    q = [*DOC, 2, 3, 4, 5, 6, 7, 8, 9]
    placed = start(m, "q", q)
    # Device 0 holds the prefix but has 1 block left for the 2 more q needs:
    # device 1 gets it, and the prefix blocks are copied over, not recomputed.
    assert placed.device == 1 and not placed.moves
    assert placed.peer_blocks == 6 and placed.num_cached_tokens == len(DOC)
    verify(m, "q", q)
    assert m.peer_blocks == 6
    m.check()


def test_a_pinned_prefix_being_written_is_never_copied() -> None:
    m = make(10, 16)
    m.allocate("doc", [*DOC, 1], device=0, pin=True)  # published, not written yet
    m.allocate("filler", list(range(1, 9)), device=0, pin=True)
    placed = m.allocate("q", [*DOC, 2, 3, 4, 5, 6, 7, 8, 9], pin=True)
    assert placed.device == 1 and placed.peer_blocks == 0 and placed.num_cached_tokens == 0


def test_pressure_moves_requests_instead_of_refusing() -> None:
    m = make(8, 8)
    start(m, "x", list(range(1, 21)), device=0)  # 5 blocks: 3 left on device 0
    start(m, "y", list(range(30, 42)), device=1)  # 3 blocks: 5 left on device 1
    # 6 blocks fit on neither device, but y fits in device 0's 3 free blocks:
    # it moves there, and the new request gets device 1.
    placed = start(m, "z", list(range(50, 74)))
    assert [(mv.request_id, mv.src, mv.dst) for mv in placed.moves] == [("y", 1, 0)]
    assert placed.device == 1 and m.device_of("x") == 0
    verify(m, "x", list(range(1, 21)))
    verify(m, "y", list(range(30, 42)))
    verify(m, "z", list(range(50, 74)))
    assert m.moves == 1
    m.check()


def test_pinned_requests_are_not_moved_and_then_it_is_refused_unchanged() -> None:
    m = make(8, 8)
    start(m, "x", list(range(1, 21)), device=0)
    start(m, "y", list(range(30, 42)), device=1)
    m.pin("x", "y")
    before = [s.used_blocks for s in m.stats()]
    with pytest.raises(OutOfBlocksError):
        m.allocate("z", list(range(50, 74)))
    assert [s.used_blocks for s in m.stats()] == before
    assert "z" not in m and m.device_of("x") == 0
    with pytest.raises(MigrationError, match="pinned"):
        m.move("x", 1)
    m.check()


def test_a_request_that_cannot_grow_moves_to_a_device_with_room() -> None:
    m = make(4, 8)
    toks = list(range(1, 17))  # 4 blocks: device 0 is full
    start(m, "r", toks, device=0)
    grown = m.extend("r", [99])
    assert grown.device == 1 and grown.moves[0].request_id == "r"
    write(m, "r", [*toks, 99], 16)
    verify(m, "r", [*toks, 99])
    m.check()


def test_rebalance_evens_usage_and_keeps_pinned_requests() -> None:
    m = make(16, 16)
    for i in range(4):
        start(m, f"r{i}", [i * 40 + j for j in range(10)], device=0)
    m.pin("r0")
    moves = m.rebalance()
    assert moves and all(mv.request_id != "r0" for mv in moves)
    assert m.device_of("r0") == 0
    used = [s.used_blocks for s in m.stats()]
    assert abs(used[0] - used[1]) <= 3
    for i in range(4):
        verify(m, f"r{i}", [i * 40 + j for j in range(10)])
    m.check()


def test_moving_to_a_device_without_room_changes_nothing() -> None:
    m = make(16, 4)
    start(m, "big", list(range(1, 30)), device=0)
    with pytest.raises(MigrationError, match="no room"):
        m.move("big", 1)
    assert m.device_of("big") == 0 and len(m.pools[1].manager) == 0
    verify(m, "big", list(range(1, 30)))
    m.check()


def test_moves_between_cuda_and_the_cpu_copy_the_bytes() -> None:
    if not torch.cuda.is_available():
        from needs import skip_for_hardware

        skip_for_hardware("no CUDA device")
    storages = [KVBlockStorage(LAYOUT, 16, "cuda:0"), KVBlockStorage(LAYOUT, 16, "cpu")]
    if torch.cuda.device_count() > 1:
        storages.append(KVBlockStorage(LAYOUT, 16, "cuda:1"))
    m = MultiDeviceManager.on_devices(storages)
    start(m, "r", [*DOC, 1, 2], device=0)
    for d in [*range(1, len(storages)), 0]:
        m.move("r", d)
        verify(m, "r", [*DOC, 1, 2])
    placed = start(m, "s", [*DOC, 7], device=1)  # prefix copied from cuda:0
    verify(m, "s", [*DOC, 7])
    assert placed.num_cached_tokens == len(DOC)
    m.check()


# -- the state machine --------------------------------------------------------------------

PREFIXES = [DOC, list(range(200, 212)), list(range(300, 316))]


class Placements(RuleBasedStateMachine):
    """Requests placed, grown, moved, rebalanced and freed over three small devices."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.m = make(9, 6, 11, max_moves=3)
        self.tokens: dict[str, list[int]] = {}
        self.n = 0

    def _snapshot(self) -> Any:
        return (
            {rid: self.m.device_of(rid) for rid in self.tokens},
            [(s.used_blocks, s.free_blocks, s.num_requests) for s in self.m.stats()],
        )

    @rule(target=live, p=st.integers(0, 2), cut=st.integers(0, 24), tail=st.lists(
        st.integers(0, 50), max_size=12), device=st.none() | st.integers(0, 2))  # fmt: skip
    def allocate(self, p: int, cut: int, tail: list[int], device: int | None) -> Any:
        toks = PREFIXES[p][:cut] + tail
        if not toks:
            toks = [1]
        rid = f"r{self.n}"
        self.n += 1
        before = self._snapshot()
        try:
            placed = self.m.allocate(rid, toks, device=device, pin=True)
        except OutOfBlocksError:
            event("allocate: refused")
            assert self._snapshot() == before
            if device is None:
                # Refused only when no device had room for all of it.
                need = blocks_needed(len(toks), BS)
                assert all(p.manager.pool.num_free < need for p in self.m.pools)
            return multiple()
        for mv in placed.moves:
            assert not self.m.is_pinned(mv.request_id)
        event(f"allocate: {len(placed.moves)} moves, peer copy {placed.peer_blocks > 0}")
        write(self.m, rid, toks, placed.num_cached_tokens)
        self.m.unpin(rid)
        self.tokens[rid] = toks
        return rid

    @rule(rid=live, more=st.lists(st.integers(0, 50), min_size=1, max_size=10))
    def extend(self, rid: str | None, more: list[int]) -> None:
        if rid is None or rid not in self.tokens:
            return
        before = self._snapshot()
        try:
            grown = self.m.extend(rid, more, pin=True)
        except OutOfBlocksError:
            assert self._snapshot() == before
            return
        event(f"extend: {len(grown.moves)} moves")
        for mv in grown.moves:
            assert mv.request_id == rid or not self.m.is_pinned(mv.request_id)
        old = len(self.tokens[rid])
        self.tokens[rid] = self.tokens[rid] + more
        write(self.m, rid, self.tokens[rid], old)
        self.m.unpin(rid)

    @rule(rid=consumes(live))
    def free(self, rid: str | None) -> None:
        if rid is None or rid not in self.tokens:
            return
        self.m.free(rid)
        del self.tokens[rid]

    @rule(rid=live, device=st.integers(0, 2))
    def move(self, rid: str | None, device: int) -> None:
        if rid is None or rid not in self.tokens:
            return
        blocks = len(self.m.block_table(rid).blocks)
        before = self._snapshot()
        try:
            mv = self.m.move(rid, device)
        except MigrationError:
            assert self._snapshot() == before
            assert self.m.pools[device].manager.pool.num_free < blocks
            return
        assert self.m.device_of(rid) == device
        assert mv.copied_blocks <= blocks
        assert len(self.m.block_table(rid).blocks) == blocks

    @precondition(lambda self: len(self.tokens) >= 2)
    @rule(data=st.data())
    def pass_with_rebalance_and_a_newcomer(self, data: st.DataObject) -> None:
        """A forward pass in flight: its requests are pinned while others rebalance."""
        rids = sorted(self.tokens)
        batch = data.draw(st.lists(st.sampled_from(rids), unique=True, max_size=len(rids)))
        where = {rid: self.m.device_of(rid) for rid in batch}
        with self.m.pinned(batch):
            p = data.draw(st.integers(0, 2))
            toks = [*PREFIXES[p][:data.draw(st.integers(4, 24))], 7, 7]
            rid = f"r{self.n}"
            self.n += 1
            placed = None
            with contextlib.suppress(OutOfBlocksError):
                placed = self.m.allocate(rid, toks, pin=True)
            self.m.rebalance()
            assert {r: self.m.device_of(r) for r in batch} == where
            if placed is not None:
                assert self.m.device_of(rid) == placed.device
                write(self.m, rid, toks, placed.num_cached_tokens)
                self.m.unpin(rid)
                self.tokens[rid] = toks

    @rule()
    def rebalance(self) -> None:
        pools = [p.manager.pool for p in self.m.pools]
        before = sum(p.usage**2 for p in pools)
        total = sum(p.num_used for p in pools)
        event(f"rebalance: {len(self.m.rebalance())} moves")
        assert sum(p.usage**2 for p in pools) <= before + 1e-9
        # Moves never lose blocks a request holds (duplicated prefixes aside, never fewer).
        assert sum(p.num_used for p in pools) >= total - sum(
            len(self.m.block_table(r).blocks) for r in self.tokens
        )

    @invariant()
    def consistent(self) -> None:
        self.m.check()
        assert set(self.m.request_ids()) == set(self.tokens)
        for rid, toks in self.tokens.items():
            verify(self.m, rid, toks)


Placements.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
TestPlacements = Placements.TestCase


# -- the tiny model generating through the pools ------------------------------------------


def test_generation_through_moving_requests_gives_the_plain_models_tokens() -> None:
    pytest.importorskip("transformers")
    from tiny_model import solo_greedy, tiny_model_and_tokenizer

    from kvtier.engine.hf_cache import layout_for_model
    from kvtier.engine.paged import install
    from kvtier.layers.batch import BatchMeta, SeqSlice

    model, _ = tiny_model_and_tokenizer()
    install(model)
    layout = layout_for_model(model.config, 4, torch.float32)
    m = MultiDeviceManager.on_devices(
        [KVBlockStorage(layout, 11, "cpu"), KVBlockStorage(layout, 13, "cpu")],
        names=["dev0", "dev1"],
    )
    shared = [7, 21, 33, 40, 8, 9, 60, 61, 62, 5, 17, 29]
    prompts = {
        "a": [*shared, 31, 44],
        "b": [*shared, 50, 52, 70, 3],
        "c": [90, 91, 92, 93, 94, 95, 96],
    }
    want = {rid: solo_greedy(model, p, 14) for rid, p in prompts.items()}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool)

    def forward(rid: str, begin: int) -> int:
        """One pass over ``rid``'s tokens from ``begin``, on the device it is on now."""
        toks = tokens[rid]
        storage = m.pools[m.device_of(rid)].storage
        slots = m.block_table(rid).slot_mapping(0, len(toks))
        meta = BatchMeta(storage, [SeqSlice(begin, len(toks) - begin, slots)])
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([toks[begin:]]),
                position_ids=torch.tensor([list(range(begin, len(toks)))]),
                attention_mask=no_mask,
                use_cache=False,
                logits_to_keep=torch.tensor([len(toks) - begin - 1]),
                kvtier_batch=meta,
            )
        m.unpin(rid)
        return int(torch.argmax(out.logits[0, -1]))

    # a and b share a prompt prefix; the devices are too small to grow them side by side.
    moved = 0
    for rid in prompts:
        placed = m.allocate(rid, tokens[rid], pin=True)
        got[rid].append(forward(rid, placed.num_cached_tokens))
        moved += len(placed.moves)
    for step in range(13):
        for rid in prompts:
            tokens[rid].append(got[rid][-1])
            grown = m.extend(rid, [got[rid][-1]], pin=True)
            moved += len(grown.moves)
            got[rid].append(forward(rid, len(tokens[rid]) - 1))
        if step == 9:
            moved += 1
            m.move("a", 1 - m.device_of("a"))
        if step == 11:
            moved += len(m.rebalance())
    assert got == want
    # b found a's prompt cached; a moved on request, and c moved to give a room to grow.
    assert sum(p.manager.stats().hit_tokens for p in m.pools) >= len(shared)
    assert moved >= 2 and m.moves >= 2
    m.check()
