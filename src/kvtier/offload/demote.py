"""Demotion: device blocks encoded for a tier, stored, and cascaded down the tiers.

A :class:`Demoter` owns every write the tier chain makes: it encodes device
blocks in a tier's codec (a quantized pool's own payloads go as they are),
reserves room in the tier's offloading manager (keeping the chain's parents
when not everything fits), moves what that tier evicts down to the next
write-back tier, and writes either at once (memory media) or in the
background from a snapshot (disk, Redis), finishing background writes as
their results come back (:meth:`Demoter.finish`). The chain decides what to
store and when; this module only stores.

A store may carry retention pins (key -> when the pin ends): the tier keeps
them with the blocks, and what it evicts goes down with the pins it had.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from kvtier.errors import KvTierError
from kvtier.offload.codec import RawCodec
from kvtier.offload.media import BlockStore, PutItem, stage
from kvtier.offload.tier import Tier
from kvtier.offload.transfer import TransferEngine, TransferResult, chunks
from kvtier.storage import KVBlockStorage, QuantizedKVBlockStorage


class Demoter:
    """Stores device blocks and payloads on a chain's ``tiers`` (see the module docstring)."""

    def __init__(
        self, storage: KVBlockStorage, tiers: Sequence[Tier], transfer: TransferEngine
    ) -> None:
        self.storage = storage
        self.tiers = list(tiers)
        self.transfer = transfer
        #: Background writes in flight: job id -> (tier, keys, bytes).
        self.pending: dict[int, tuple[int, list[int], int]] = {}
        #: Told ``(tier, keys)`` when a store makes a tier evict keys (tier admission learns
        #: from blocks that leave unread).
        self.on_evicted: Callable[[int, list[int]], None] | None = None

    def store_blocks(
        self,
        t: int,
        keys: list[int],
        blocks: list[int],
        *,
        cascade: bool = True,
        pins: Mapping[int, float] | None = None,
    ) -> None:
        """Store device ``blocks`` under ``keys`` on tier ``t`` (``pins``: the retention
        pins some of them carry, key -> end).

        Blocks the device cannot export whole (a windowed storage's blocks
        whose sliding layers were reclaimed) are left out: a tier never holds
        a block it could not give back exactly.
        """
        whole = self.storage.exportable(blocks)
        if not all(whole):
            keys = [k for k, ok in zip(keys, whole, strict=True) if ok]
            blocks = [b for b, ok in zip(blocks, whole, strict=True) if ok]
            if not blocks:
                return
        payloads = self.encode_device(t, blocks)
        self.store_payloads(t, keys, payloads, cascade=cascade, pins=pins)

    def encode_device(self, t: int, blocks: list[int]) -> list[torch.Tensor]:
        tier = self.tiers[t]
        codec = tier.codec
        storage = self.storage
        started = time.perf_counter()
        if isinstance(storage, QuantizedKVBlockStorage):
            if codec.codec_id == storage.codec.codec_id:
                # The pool already holds this codec's payloads: no decode, no re-encode.
                return list(storage.export_payloads(blocks))
            exported = storage.export_blocks(blocks)
            out = [codec.encode(exported[i]) for i in range(len(blocks))]
        elif storage.layout_kind == "block":
            # Views of the device blocks: the host tier copies straight from them.
            data = storage.tensor
            if codec.codec_id == RawCodec.codec_id and data.is_contiguous():
                # A raw payload is the block's bytes: one view each, not three.
                rows = data.view(data.shape[0], -1).view(torch.uint8)
                return [rows[b] for b in blocks]
            out = [codec.encode(data[b]) for b in blocks]
        else:
            exported = storage.export_blocks(blocks)
            out = [codec.encode(exported[i]) for i in range(len(blocks))]
        if codec.codec_id != RawCodec.codec_id or storage.codec is not None:
            tier.counters.encode_seconds += time.perf_counter() - started
        return out

    def store_payloads(
        self,
        t: int,
        keys: list[int],
        payloads: list[torch.Tensor],
        *,
        cascade: bool = True,
        pins: Mapping[int, float] | None = None,
    ) -> None:
        tier = self.tiers[t]
        mgr = tier.offload_manager
        out = mgr.prepare_store(keys, pins)
        # More than the tier can make room for: keep the last keys (a demoted
        # batch lists children before parents, and parents serve more prefixes).
        kept = len(keys)
        while out is None and kept > 1:
            kept //= 2
            out = mgr.prepare_store(keys[-kept:], pins)
        if out is None:
            tier.counters.dropped_blocks += len(keys)
            return
        tier.counters.dropped_blocks += len(keys) - kept
        if not out.keys_to_store and not out.evicted_keys:
            return
        if out.evicted_keys and self.on_evicted is not None:
            self.on_evicted(t, out.evicted_keys)
        # Evicted blocks go down a tier, with their pins; read them before their slots
        # are reused.
        if out.evicted_keys and cascade and self.next_writes_back(t):
            self.cascade(t, out.evicted_keys, out.evicted_slots, out.evicted_pins)
        elif out.evicted_keys and tier.medium.caps.background:
            try:
                tier.medium.delete(list(zip(out.evicted_keys, out.evicted_slots, strict=True)))
            except KvTierError as exc:
                tier.health.failed(exc)
        index = {k: i for i, k in enumerate(keys)}
        fmt = tier.fmt
        assert fmt is not None
        items: list[PutItem] = [
            (k, s, payloads[index[k]], fmt)
            for k, s in zip(out.keys_to_store, out.slots, strict=True)
        ]
        nbytes = sum(int(p.numel()) for _, _, p, _ in items)
        if not tier.medium.caps.background:
            try:
                tier.medium.put(items)
            except Exception as exc:
                mgr.complete_store(out.keys_to_store, success=False)
                tier.counters.store_failures += len(items)
                tier.health.store_failed(exc)
                return
            tier.health.store_ok()
            mgr.complete_store(out.keys_to_store, success=True)
            tier.counters.stored_blocks += len(items)
            tier.counters.stored_bytes += nbytes
            return
        # Raw payloads are views of device blocks (or host slots) that may be
        # reused before the write runs: snapshot them, hashed as they are copied
        # and with their header in front, so a one-value medium writes header
        # and payload without another copy. int8/fp8 encodes are already fresh
        # memory. A large batch goes out in parts: the first part's writes run
        # while the next one is copied.
        raw = tier.codec.codec_id == RawCodec.codec_id
        sizes = [int(p.numel()) for _, _, p, _ in items]
        for first, count in chunks(sizes):
            part = items[first : first + count]
            if raw:
                part = [(k, s, stage(p, k, f), f) for k, s, p, f in part]
            job = self.transfer.submit("store", Writer(tier.medium, part), t)
            self.pending[job] = (t, [k for k, _, _, _ in part], sum(sizes[first : first + count]))

    def next_writes_back(self, t: int) -> bool:
        """Whether tier ``t + 1`` exists and takes what tier ``t`` evicts (write-back)."""
        return t + 1 < len(self.tiers) and self.tiers[t + 1].writes_back

    def cascade(
        self,
        t: int,
        keys: list[int],
        slots: list[int],
        pins: Mapping[int, float] | None = None,
    ) -> None:
        """Move blocks tier ``t`` evicted (still in their slots) to tier ``t + 1``, with
        the retention ``pins`` they had there."""
        tier = self.tiers[t]
        if not self.next_writes_back(t):
            if tier.medium.caps.background:
                try:
                    tier.medium.delete(list(zip(keys, slots, strict=True)))
                except KvTierError as exc:
                    tier.health.failed(exc)
            return
        if tier.medium.caps.background:
            # Payloads on disk or in Redis would need a read to move down;
            # the lower tier keeps what write-through or earlier demotions put there.
            return
        try:
            got = tier.medium.get(list(zip(keys, slots, strict=True)))
        except KvTierError:
            return
        fmt = tier.fmt
        assert fmt is not None
        below = self.tiers[t + 1]
        down_keys: list[int] = []
        down: list[torch.Tensor] = []
        for key, stored in zip(keys, got, strict=True):
            if stored is None:
                continue
            payload = stored[1]
            if below.codec.codec_id == tier.codec.codec_id:
                down.append(payload.clone())
            else:
                started = time.perf_counter()
                block = tier.codec.decode(payload, fmt.shape, fmt.dtype)
                down.append(below.codec.encode(block).clone())
                below.counters.encode_seconds += time.perf_counter() - started
            down_keys.append(key)
        if down_keys:
            self.store_payloads(t + 1, down_keys, down, pins=pins)

    def finish(self, result: TransferResult) -> int | None:
        """Complete the background write ``result`` reports (if it is one of ours).

        Returns the tier index when the write succeeded (the medium answered),
        else ``None``.
        """
        meta = self.pending.pop(result.job_id, None)
        if meta is None:
            return None
        t, keys, nbytes = meta
        tier = self.tiers[t]
        if result.ok:
            tier.offload_manager.complete_store(keys, success=True)
            tier.counters.stored_blocks += len(keys)
            tier.counters.stored_bytes += nbytes
            tier.health.store_ok()
            return t
        tier.offload_manager.complete_store(keys, success=False)
        tier.counters.store_failures += len(keys)
        tier.health.store_failed(result.error)
        return None


class Writer:
    """A store job: write payload snapshots to a medium."""

    def __init__(self, store: BlockStore, items: list[PutItem]) -> None:
        self.store = store
        self.items = items

    def __call__(self) -> None:
        self.store.put(self.items)
