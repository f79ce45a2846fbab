"""Which token prefixes each instance holds in its device cache, from its KV events.

An instance publishes a ``BlocksStored`` event for each chain of blocks it
caches: their keys, the key of the block before the first, their token ids
and the block size. This index turns that into the router's own picture: a
block is named by a hash of its tokens chained to its parent's hash
(:func:`block_hashes`), so a prompt's blocks get the same names without
knowing how an instance computes its keys. For each instance it keeps the
instance's key -> chain hash of every block held, and how many of its keys
name each chain hash; ``BlocksRemoved`` and ``AllCleared`` take blocks out.

:meth:`PrefixIndex.match` answers the routing question: for a prompt's
tokens, how many leading full blocks each instance holds.

A stored chain whose parent key the index does not know (the instance
stored the parent before the router listened, or the events in between were
lost) cannot be named and is skipped: the index then under-reports what an
instance holds, which costs a cache hit, never a wrong answer.

Blocks on an instance's tiers (events whose medium is not the device: host,
disk, redis) are kept as plain key sets per medium (:attr:`InstanceIndex.tiers`):
they carry no tokens, so :meth:`PrefixIndex.match` does not count them, but
they say what the instance can load back. ``AllCleared`` empties every
medium: a publisher that clears the device only tells the tiers again
(``kvtier serve`` does, :mod:`kvtier.server.cache_events`).

After lost event batches, :meth:`InstanceIndex.retain` applies a view of what
the instance holds (its ``GET /admin/cache/blocks``): what the view lacks
leaves the index, so the index again under-reports at worst.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent

#: The parent hash of a chain's first block.
ROOT_HASH = 0
#: The medium indexed: kvtier's name for an instance's device cache.
DEVICE = "device"


def _chain(parent: int, tokens: Sequence[int]) -> int:
    # 'q' holds any token id (int64); the parent's 8 bytes make each hash depend on the
    # whole prefix before the block, not only on the block's own tokens.
    data = parent.to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chain hashes of the full blocks of ``tokens`` (a partial last block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _chain(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


@dataclass
class IndexCounters:
    """What an instance's index did with the events it was given."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    #: Blocks skipped: their chain's parent was unknown.
    orphan_blocks: int = 0
    #: Stored events skipped: no tokens, a token count that is not blocks x block_size,
    #: a LoRA adapter's blocks, or a block size unlike the instance's first.
    skipped_events: int = 0
    #: Events on another medium than the device (tiers): kept as keys, not matched.
    other_medium: int = 0
    #: Views of what the instance holds applied after lost event batches (:meth:`retain`),
    #: and the blocks they showed were gone.
    resyncs: int = 0
    resync_removed: int = 0


@dataclass
class InstanceIndex:
    """One instance's device blocks: its key -> chain hash, and each chain hash's key count."""

    block_size: int | None = None
    keys: dict[int, int] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    counters: IndexCounters = field(default_factory=IndexCounters)
    #: Per tier medium (kvtier's names: host, disk, redis), the keys it holds.
    tiers: dict[str, set[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def holds(self, chain_hash: int) -> bool:
        return chain_hash in self.counts

    def apply(self, event: KvEvent) -> None:
        """Update the index with one of the instance's events."""
        if isinstance(event, BlocksStored):
            self.stored(event)
        elif isinstance(event, BlocksRemoved):
            if event.medium != DEVICE:
                self.counters.other_medium += 1
                held = self.tiers.get(event.medium)
                if held is not None:
                    held.difference_update(event.keys)
                return
            self.removed(event.keys)
        elif isinstance(event, AllCleared):
            self.clear()

    def stored(self, event: BlocksStored) -> None:
        counters = self.counters
        if event.medium != DEVICE:
            counters.other_medium += 1
            self.tiers.setdefault(event.medium, set()).update(event.keys)
            return
        size = event.block_size
        keys = event.keys
        if (
            not size
            or event.lora_id is not None
            or len(event.token_ids) != len(keys) * size
            or (self.block_size is not None and size != self.block_size)
        ):
            counters.skipped_events += 1
            return
        if event.parent is None:
            parent = ROOT_HASH
        else:
            found = self.keys.get(event.parent)
            if found is None:
                counters.orphan_blocks += len(keys)
                return
            parent = found
        self.block_size = size
        hashes = block_hashes(event.token_ids, size, parent)
        for key, chain_hash in zip(keys, hashes, strict=True):
            old = self.keys.get(key)
            if old == chain_hash:
                continue
            if old is not None:  # a key reused for other tokens: the old block is gone
                self._forget(old)
            self.keys[key] = chain_hash
            self.counts[chain_hash] = self.counts.get(chain_hash, 0) + 1
            counters.stored_blocks += 1

    def removed(self, keys: Iterable[int]) -> None:
        for key in keys:
            chain_hash = self.keys.pop(key, None)
            if chain_hash is not None:
                self._forget(chain_hash)
                self.counters.removed_blocks += 1

    def clear(self) -> None:
        # The block size goes too: a restarted instance may use another.
        self.block_size = None
        self.keys.clear()
        self.counts.clear()
        self.tiers.clear()
        self.counters.clears += 1

    def retain(self, held: Mapping[str, Iterable[int]]) -> int:
        """Bring the index in line with a view of what the instance holds, per medium (its
        ``GET /admin/cache/blocks``), after event batches were lost: device keys the view
        lacks are dropped (a key it has that the index lacks cannot be named without its
        tokens, and stays unknown until stored again), and each tier medium becomes the
        view's. A medium the view leaves out (one it could not list whole) is left as the
        events built it. Returns how many device blocks were dropped."""
        gone: list[int] = []
        if DEVICE in held:
            device = set(held[DEVICE])
            gone = [k for k in self.keys if k not in device]
            for key in gone:
                self._forget(self.keys.pop(key))
        for medium, keys in held.items():
            if medium != DEVICE:
                self.tiers[medium] = set(keys)
        self.counters.resyncs += 1
        self.counters.resync_removed += len(gone)
        return len(gone)

    def held(self, medium: str = DEVICE) -> set[int]:
        """The keys indexed on ``medium`` (a copy)."""
        if medium == DEVICE:
            return set(self.keys)
        return set(self.tiers.get(medium, ()))

    def _forget(self, chain_hash: int) -> None:
        left = self.counts[chain_hash] - 1
        if left:
            self.counts[chain_hash] = left
        else:
            del self.counts[chain_hash]

    def leading(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a prompt's blocks, in order) it holds, from the first on."""
        counts = self.counts
        n = 0
        for chain_hash in hashes:
            if chain_hash not in counts:
                break
            n += 1
        return n


class PrefixIndex:
    """The :class:`InstanceIndex` of every instance, by name (see the module docstring)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.instances: dict[str, InstanceIndex] = {name: InstanceIndex() for name in names}

    def instance(self, name: str) -> InstanceIndex:
        found = self.instances.get(name)
        if found is None:
            found = self.instances[name] = InstanceIndex()
        return found

    def apply(self, name: str, events: Iterable[KvEvent]) -> None:
        """Apply one instance's events, in the order it published them."""
        index = self.instance(name)
        for event in events:
            index.apply(event)

    def clear(self, name: str) -> None:
        """Forget what ``name`` holds (it restarted, or its events were lost)."""
        self.instance(name).clear()

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """For each instance, how many leading full blocks of ``tokens`` it holds."""
        by_size: dict[int, list[int]] = {}
        out: dict[str, int] = {}
        for name, index in self.instances.items():
            size = index.block_size
            if size is None:
                out[name] = 0
                continue
            hashes = by_size.get(size)
            if hashes is None:
                hashes = by_size[size] = block_hashes(tokens, size)
            out[name] = index.leading(hashes)
        return out


__all__ = [
    "DEVICE",
    "ROOT_HASH",
    "IndexCounters",
    "InstanceIndex",
    "PrefixIndex",
    "block_hashes",
]
