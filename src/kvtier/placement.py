"""One KV cache manager over several devices' block pools: placement, moves, rebalancing.

:class:`MultiDeviceManager` holds one :class:`~kvtier.manager.KVCacheManager`
(and, optionally, the :class:`~kvtier.storage.KVBlockStorage` behind it) per
device, all with the same block size and key namespace, so a block key means
the same tokens on every device. Each request lives on exactly one device.

* **Placement**: a new request goes to the device caching the longest prefix
  of it among those with room for the rest; when the device holding a longer
  prefix has no room, the blocks of that prefix are copied from it (device to
  device) instead of being recomputed.
* **Pressure**: a device's unreferenced cached blocks are reclaimed first (by
  its policy; through the device's eviction listener they are demoted to its
  tiers). When no device has room even so, requests not pinned are moved off
  one device to others with room until the new request fits; only when no
  such moves exist is the request refused (:class:`~kvtier.errors.OutOfBlocksError`,
  nothing changed). A request that cannot grow on its device makes room the
  same way, or moves itself to a device with room.
* **Moves**: :meth:`MultiDeviceManager.move` allocates the request on the
  target (hitting what the target caches of its prefix), copies the other
  blocks' payloads (``KVBlockStorage.export_blocks`` then ``import_blocks``:
  a device-to-device copy between CUDA devices, or to and from the CPU),
  then frees it on the source, so a failure leaves it where it was.
  :meth:`~MultiDeviceManager.rebalance` moves requests from the fullest device
  to the emptiest while that lowers the spread of usage.

The caller drives requests as it would drive one manager, with one rule
more: a request whose blocks are being written (from allocation or
extension until its forward pass is done) must be pinned (``pin=True`` on
:meth:`~MultiDeviceManager.allocate` and :meth:`~MultiDeviceManager.extend`,
:meth:`~MultiDeviceManager.unpin` after the pass). Pinned requests are never
moved, and blocks they have not written yet are never copied; after any
call the caller reads a request's device and block table again, since
unpinned requests may have moved.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.block_table import BlockTable, blocks_needed
from kvtier.errors import (
    BadRequestError,
    ConfigError,
    DuplicateRequestError,
    InternalInvariantError,
    MigrationError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvtier.keys import ExtraKey, Namespace
from kvtier.manager import Allocation, CacheStats, Extension, KVCacheManager

if TYPE_CHECKING:  # storages need torch; bookkeeping alone does not
    from kvtier.storage import KVBlockStorage

RequestId = Hashable


@dataclass
class DevicePool:
    """One device: its manager and, to move payloads, its block storage."""

    manager: KVCacheManager
    storage: KVBlockStorage | None = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class Move:
    """A request moved between devices."""

    request_id: RequestId
    src: int
    dst: int
    #: Blocks whose payload was copied (the rest were cached on ``dst`` already).
    copied_blocks: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where :meth:`MultiDeviceManager.allocate` put a request, and what it took."""

    device: int
    allocation: Allocation
    #: Leading tokens whose KV is in place: the device's own prefix hit plus
    #: blocks copied from another device that cached a longer prefix.
    num_cached_tokens: int
    #: Prefix blocks copied from another device's cache.
    peer_blocks: int = 0
    #: Requests moved to other devices to make room.
    moves: tuple[Move, ...] = ()

    @property
    def block_table(self) -> BlockTable:
        return self.allocation.block_table


@dataclass(frozen=True, slots=True)
class Growth:
    """What :meth:`MultiDeviceManager.extend` did: the request's device and extension."""

    device: int
    extension: Extension
    moves: tuple[Move, ...] = ()

    @property
    def block_table(self) -> BlockTable:
        return self.extension.block_table


@dataclass(slots=True)
class _Live:
    device: int
    tokens: array[int]
    extra: tuple[ExtraKey, ...]
    #: Tokens whose KV is written (meaningful while pinned).
    valid: int = 0
    pinned: bool = False


@dataclass(slots=True)
class _Fit:
    """A request sized on one device: its prefix hit there, blocks it needs, room it has."""

    device: int
    hit: int
    need: int
    room: int
    #: The device blocks of the hit (they stay reserved while room is made).
    hit_blocks: set[int] = field(default_factory=set)


class MultiDeviceManager:
    """Several devices' pools behind one request-level interface (see the module docstring).

    ``max_moves`` bounds the requests moved to make room for one request.
    """

    def __init__(self, pools: Sequence[DevicePool], *, max_moves: int = 8) -> None:
        if not pools:
            raise ConfigError("a multi-device manager needs at least one device pool")
        first = pools[0].manager
        for i, p in enumerate(pools):
            m = p.manager
            if m.block_size != first.block_size or m.namespace_root != first.namespace_root:
                raise ConfigError(
                    f"device {i} keys blocks differently (block size {m.block_size}, "
                    "namespace): every device needs the same block size, model and layout"
                )
            if (p.storage is None) != (pools[0].storage is None):
                raise ConfigError("give every device a storage, or none (bookkeeping only)")
            if p.storage is not None and p.storage.num_blocks != m.num_blocks:
                raise ConfigError(f"device {i}: storage and manager disagree on the block count")
        given = [p.storage.device if p.storage is not None else None for p in pools]
        for i, p in enumerate(pools):
            if not p.name:
                # The device's name, numbered where several pools share one device.
                dev = given[i]
                p.name = f"{dev}" if dev is not None and given.count(dev) == 1 else f"{dev}#{i}"
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ConfigError(f"device names must be distinct, got {names}")
        if not isinstance(max_moves, int) or max_moves < 0:
            raise ConfigError(f"max_moves must be a non-negative integer, got {max_moves!r}")
        self.pools = list(pools)
        self.block_size = first.block_size
        self.max_moves = max_moves
        self._live: dict[RequestId, _Live] = {}
        self.moves = 0
        self.peer_blocks = 0

    @classmethod
    def on_devices(
        cls,
        storages: Sequence[KVBlockStorage],
        *,
        policy: str = "lru",
        namespace: Namespace | None = None,
        names: Sequence[str] | None = None,
        max_moves: int = 8,
    ) -> MultiDeviceManager:
        """One pool per storage (one per device), each with a fresh :class:`KVCacheManager`."""
        pools = [
            DevicePool(
                KVCacheManager(
                    s.num_blocks, s.layout.block_size, policy=policy, namespace=namespace
                ),
                s,
                names[i] if names else "",
            )
            for i, s in enumerate(storages)
        ]
        return cls(pools, max_moves=max_moves)

    # -- introspection --------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def request_ids(self) -> Iterator[RequestId]:
        return iter(list(self._live))

    def _get(self, request_id: RequestId) -> _Live:
        try:
            return self._live[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(request_id) from None

    def device_of(self, request_id: RequestId) -> int:
        return self._get(request_id).device

    def block_table(self, request_id: RequestId) -> BlockTable:
        live = self._get(request_id)
        return self.pools[live.device].manager.block_table(request_id)

    def on_device(self, device: int) -> list[RequestId]:
        return [rid for rid, live in self._live.items() if live.device == device]

    def is_pinned(self, request_id: RequestId) -> bool:
        return self._get(request_id).pinned

    def usage(self, device: int) -> float:
        """Share of the device's blocks that requests hold."""
        return self.pools[device].manager.usage

    def stats(self) -> list[CacheStats]:
        return [p.manager.stats() for p in self.pools]

    # -- pinning --------------------------------------------------------------------------
    def pin(self, *request_ids: RequestId) -> None:
        """Keep requests where they are while their blocks are written (a forward pass)."""
        for rid in request_ids:
            self._get(rid).pinned = True

    def unpin(self, *request_ids: RequestId) -> None:
        """Their blocks are written: they may move again."""
        for rid in request_ids:
            live = self._get(rid)
            live.pinned = False
            live.valid = len(live.tokens)

    @contextmanager
    def pinned(self, request_ids: Iterable[RequestId]) -> Iterator[None]:
        """Pin ``request_ids`` for the body of a ``with`` (one forward pass)."""
        rids = list(request_ids)
        self.pin(*rids)
        try:
            yield
        finally:
            self.unpin(*(r for r in rids if r in self._live))

    # -- sizing ---------------------------------------------------------------------------
    def _fit(self, d: int, keys: Sequence[int], n: int) -> _Fit:
        manager = self.pools[d].manager
        hits = manager.prefix_blocks(keys[: (n - 1) // self.block_size])
        reserved = manager.count_evictable(hits) if hits else 0
        need = blocks_needed(n, self.block_size) - len(hits)
        return _Fit(d, len(hits), need, manager.num_free - reserved, set(hits))

    def _exclusive(self, request_id: RequestId, keep: set[int]) -> int:
        """Blocks moving ``request_id`` off its device gives back there (``keep`` aside)."""
        live = self._live[request_id]
        manager = self.pools[live.device].manager
        held = manager.held_blocks(request_id)
        return sum(1 for b in held if manager.ref_count(b) == 1 and b not in keep)

    def _cost(self, request_id: RequestId, t: int) -> int:
        """Blocks of device ``t`` that moving ``request_id`` there would take from its free ones.

        New blocks for what ``t`` does not cache, plus cached blocks nobody
        holds that the request would hold: its prefix hits, and copies of its
        later full blocks that ``t`` caches (held as duplicates).
        """
        live = self._live[request_id]
        manager = self.pools[t].manager
        n = len(live.tokens)
        bs = self.block_size
        keys = manager.keys_for(live.tokens, live.extra)
        hits = manager.prefix_blocks(keys[: (n - 1) // bs])
        cost = blocks_needed(n, bs) - len(hits) + manager.count_evictable(hits)
        for key in keys[len(hits) : n // bs]:
            b = manager.cached_block(key)
            if b is not None and manager.ref_count(b) == 0:
                cost += 1
        return cost

    def _unready(self, d: int) -> set[int]:
        """Keys on device ``d`` whose blocks a pinned request has not written yet."""
        bs = self.block_size
        out: set[int] = set()
        manager = self.pools[d].manager
        for rid, live in self._live.items():
            if live.device == d and live.pinned:
                out.update(manager.block_keys(rid)[live.valid // bs :])
        return out

    # -- the request lifecycle --------------------------------------------------------------
    def allocate(
        self,
        request_id: RequestId,
        token_ids: Sequence[int],
        *,
        extra_keys: Sequence[ExtraKey] = (),
        device: int | None = None,
        pin: bool = False,
    ) -> Placement:
        """Start a request on the best device (see the module docstring), or on ``device``."""
        try:
            live = request_id in self._live
        except TypeError:
            raise BadRequestError(f"request id {request_id!r} is not hashable") from None
        if live:
            raise DuplicateRequestError(request_id)
        if device is not None and not 0 <= device < len(self.pools):
            raise BadRequestError(f"device {device} is not one of the {len(self.pools)} devices")
        extra = tuple(extra_keys)
        tokens = array("I", token_ids) if len(token_ids) else array("I")
        n = len(tokens)
        if n == 0:
            raise BadRequestError("token_ids is empty: give at least one token id")
        keys = self.pools[0].manager.keys_for(tokens, extra)
        candidates = [device] if device is not None else range(len(self.pools))
        fits = [self._fit(d, keys, n) for d in candidates]
        roomy = [f for f in fits if f.need <= f.room]
        moves: list[Move] = []
        if roomy:
            best = max(roomy, key=lambda f: (f.hit, f.room - f.need, -f.device))
        else:
            best, moves = self._make_room_for(fits, keys, n)
        d = best.device
        manager = self.pools[d].manager
        alloc = manager.allocate(
            request_id, tokens, extra_keys=extra, block_keys=keys[: n // self.block_size]
        )
        cached = alloc.num_cached_tokens
        self._live[request_id] = _Live(d, tokens, extra, cached, pin)
        peer = self._copy_prefix(request_id, d, keys, n, cached // self.block_size)
        cached += peer * self.block_size
        self._live[request_id].valid = cached if pin else n
        return Placement(d, alloc, cached, peer, tuple(moves))

    def _make_room_for(
        self, fits: list[_Fit], keys: Sequence[int], n: int
    ) -> tuple[_Fit, list[Move]]:
        """Move requests off the device that can be made roomy with the longest prefix.

        Raises :class:`OutOfBlocksError`, having moved nothing, when no device can.
        """
        for f in sorted(fits, key=lambda f: (-f.hit, f.need - f.room, f.device)):
            plan = self._plan_room(f.device, f.need - f.room, f.hit_blocks)
            if plan is None:
                continue
            moves = [self._move(rid, dst) for rid, dst in plan]
            again = self._fit(f.device, keys, n)
            if again.need > again.room:
                raise InternalInvariantError(f"making room on device {f.device} fell short")
            return again, moves
        short = min(fits, key=lambda f: f.need - f.room)
        total = sum(p.manager.num_blocks for p in self.pools)
        raise OutOfBlocksError(short.need, max(short.room, 0), total)

    def _plan_room(self, d: int, short: int, keep: set[int]) -> list[tuple[RequestId, int]] | None:
        """Unpinned requests on ``d`` and where to send them to free ``short`` blocks there.

        Each move is charged what it takes from its target's free blocks, so
        carrying the plan out cannot run out of room.
        """
        if short <= 0:
            return []
        rooms = [p.manager.num_free if e != d else -1 for e, p in enumerate(self.pools)]
        movable = [
            (self._exclusive(rid, keep), rid)
            for rid, live in self._live.items()
            if live.device == d and not live.pinned
        ]
        movable.sort(key=lambda x: -x[0])
        plan: list[tuple[RequestId, int]] = []
        for freed, rid in movable:
            if len(plan) >= self.max_moves:
                break
            if freed <= 0:
                continue
            costs = {e: self._cost(rid, e) for e in range(len(self.pools)) if e != d}
            fit = [e for e, c in costs.items() if c <= rooms[e]]
            if not fit:
                continue
            dst = max(fit, key=lambda e: rooms[e] - costs[e])
            rooms[dst] -= costs[dst]
            plan.append((rid, dst))
            short -= freed
            if short <= 0:
                return plan
        return None

    def _copy_prefix(
        self, request_id: RequestId, d: int, keys: Sequence[int], n: int, hit: int
    ) -> int:
        """Copy prefix blocks another device caches beyond ``d``'s own hit; returns how many."""
        if self.pools[d].storage is None:
            return 0
        limit = keys[: (n - 1) // self.block_size]
        best, best_blocks = -1, list[int]()
        for e, p in enumerate(self.pools):
            if e == d:
                continue
            found = p.manager.prefix_blocks(limit)
            if len(found) <= hit or len(found) <= len(best_blocks):
                continue
            unready = self._unready(e)
            ok = 0
            while ok < len(found) and keys[ok] not in unready:
                ok += 1
            if ok > max(hit, len(best_blocks)):
                best, best_blocks = e, found[:ok]
        if best < 0:
            return 0
        mine = self.pools[d].manager.block_table(request_id).blocks
        src = self.pools[best].storage
        dst = self.pools[d].storage
        assert src is not None and dst is not None
        dst.import_blocks(mine[hit : len(best_blocks)], src.export_blocks(best_blocks[hit:]))
        copied = len(best_blocks) - hit
        self.peer_blocks += copied
        return copied

    def extend(
        self, request_id: RequestId, new_token_ids: Sequence[int], *, pin: bool = False
    ) -> Growth:
        """Append tokens; when the device is full, make room there or move the request."""
        live = self._get(request_id)
        new = array("I", new_token_ids) if len(new_token_ids) else array("I")
        if not new:
            raise BadRequestError("new_token_ids is empty: give at least one token id")
        moves: list[Move] = []
        try:
            ext = self.pools[live.device].manager.extend(request_id, new)
        except OutOfBlocksError as exc:
            moves = self._room_to_grow(request_id, len(new), exc)
            ext = self.pools[live.device].manager.extend(request_id, new)
        storage = self.pools[live.device].storage
        if ext.copies and storage is not None:
            storage.copy_blocks(ext.copies)
        live.tokens.extend(new)
        if pin:
            if not live.pinned:
                live.valid = len(live.tokens) - len(new)
            live.pinned = True
        elif not live.pinned:
            live.valid = len(live.tokens)
        return Growth(live.device, ext, tuple(moves))

    def _room_to_grow(self, request_id: RequestId, k: int, exc: OutOfBlocksError) -> list[Move]:
        """Make ``k`` more tokens fit: move others off the request's device, or move it."""
        live = self._live[request_id]
        d = live.device
        manager = self.pools[d].manager
        table = manager.block_table(request_id)
        n = table.num_tokens + k
        grow = blocks_needed(n, self.block_size) - len(table.blocks)
        cow = table.num_tokens % self.block_size != 0 and manager.is_shared(table.blocks[-1])
        short = grow + cow - manager.num_free
        plan = self._plan_room(d, short, set(manager.held_blocks(request_id)))
        if plan is not None:
            return [self._move(rid, dst) for rid, dst in plan]
        if not live.pinned:
            more = blocks_needed(n, self.block_size) - len(table.blocks)
            room = {
                e: p.manager.num_free - self._cost(request_id, e) - more
                for e, p in enumerate(self.pools)
                if e != d
            }
            targets = [e for e, r in room.items() if r >= 0]
            if targets:
                return [self._move(request_id, max(targets, key=lambda e: room[e]))]
        raise exc

    def free(self, request_id: RequestId) -> None:
        """End a request; its published blocks stay cached on its device."""
        live = self._get(request_id)
        self.pools[live.device].manager.free(request_id)
        del self._live[request_id]

    def abort(self, request_id: RequestId, num_computed_tokens: int) -> int:
        """End a request whose KV was written for its first ``num_computed_tokens`` only."""
        live = self._get(request_id)
        out = self.pools[live.device].manager.abort(request_id, num_computed_tokens)
        del self._live[request_id]
        return out

    def fork(self, src_id: RequestId, dst_id: RequestId) -> BlockTable:
        """Start ``dst_id`` sharing every block of ``src_id``, on its device."""
        live = self._get(src_id)
        table = self.pools[live.device].manager.fork(src_id, dst_id)
        self._live[dst_id] = _Live(
            live.device, array("I", live.tokens), live.extra, live.valid, live.pinned
        )
        return table

    # -- moving ------------------------------------------------------------------------------
    def move(self, request_id: RequestId, device: int) -> Move:
        """Move a request (not pinned) to ``device`` with its KV; see the module docstring.

        Raises :class:`MigrationError`, leaving it where it was, when it is
        pinned or ``device`` has no room for it.
        """
        live = self._get(request_id)
        if not 0 <= device < len(self.pools):
            raise BadRequestError(f"device {device} is not one of the {len(self.pools)} devices")
        if live.pinned:
            raise MigrationError(
                f"request {request_id!r} is pinned (its blocks are being written); "
                "move it after its forward pass"
            )
        return self._move(request_id, device)

    def _move(self, request_id: RequestId, dst: int) -> Move:
        live = self._live[request_id]
        src = live.device
        if src == dst:
            return Move(request_id, src, dst, 0)
        bs = self.block_size
        source = self.pools[src]
        target = self.pools[dst]
        tokens = live.tokens
        n = len(tokens)
        keys = self.pools[0].manager.keys_for(tokens, live.extra)
        try:
            alloc = target.manager.allocate(
                request_id, tokens, extra_keys=live.extra, block_keys=keys[: n // bs]
            )
        except OutOfBlocksError as exc:
            raise MigrationError(
                f"device {target.name} has no room for request {request_id!r}: {exc}"
            ) from exc
        hit = alloc.num_cached_tokens // bs
        mine = source.manager.block_table(request_id).blocks
        theirs = alloc.block_table.blocks
        copied = len(theirs) - hit
        if source.storage is not None and target.storage is not None and copied:
            try:
                target.storage.import_blocks(
                    theirs[hit:], source.storage.export_blocks(mine[hit : len(theirs)])
                )
            except (BadRequestError, RuntimeError) as exc:
                target.manager.abort(request_id, hit * bs)
                raise MigrationError(f"copying request {request_id!r}'s KV failed: {exc}") from exc
        source.manager.free(request_id)
        live.device = dst
        self.moves += 1
        return Move(request_id, src, dst, copied)

    def rebalance(self) -> list[Move]:
        """Move unpinned requests off the fullest device while that evens usage out.

        Each move is the one that lowers the sum of squared usages the most
        (counting the blocks it frees and takes exactly, so the loop ends) to
        a device with room; pinned requests never move.
        """
        moves: list[Move] = []
        for _ in range(len(self._live) * len(self.pools) + 1):
            best = self._best_rebalance_move()
            if best is None:
                break
            moves.append(self._move(*best))
        return moves

    def _best_rebalance_move(self) -> tuple[RequestId, int] | None:
        """The move off the fullest device that lowers the sum of squared usages most."""
        pools = [p.manager for p in self.pools]
        used = [p.num_used for p in pools]
        size = [p.num_blocks for p in pools]
        hi = max(range(len(pools)), key=lambda e: used[e] / size[e])
        best: tuple[float, RequestId, int] | None = None
        for rid, live in self._live.items():
            if live.device != hi or live.pinned:
                continue
            freed = self._exclusive(rid, set())
            out = ((used[hi] - freed) ** 2 - used[hi] ** 2) / size[hi] ** 2
            for t in range(len(pools)):
                if t == hi:
                    continue
                cost = self._cost(rid, t)
                if cost > pools[t].num_free:
                    continue
                delta = out + ((used[t] + cost) ** 2 - used[t] ** 2) / size[t] ** 2
                if delta < -1e-12 and (best is None or delta < best[0]):
                    best = (delta, rid, t)
        return None if best is None else (best[1], best[2])

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Every device's invariants, and every request on exactly one device."""
        for p in self.pools:
            p.manager.check()
        for rid, live in self._live.items():
            where = [d for d, p in enumerate(self.pools) if rid in p.manager]
            if where != [live.device]:
                raise InternalInvariantError(f"request {rid!r} is on devices {where}")
            manager = self.pools[live.device].manager
            if manager.num_tokens(rid) != len(live.tokens):
                raise InternalInvariantError(f"request {rid!r}: token count mismatch")
        held = sum(len(p.manager) for p in self.pools)
        if held != len(self._live):
            raise InternalInvariantError(
                f"the devices hold {held} requests, the manager knows {len(self._live)}"
            )
