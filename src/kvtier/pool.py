"""The device block pool: physical block ids, free list, ref counts, eviction.

Every physical block is in exactly one state:

* **empty**: on the free list, no key, ref count 0;
* **private**: held by one or more requests (ref > 0) but not in the prefix
  index (a partial tail, a block admission declined, a duplicate);
* **cached**: committed under a key in the prefix index. A cached block with
  ref count 0 is *evictable*: it still holds valid KV and a later request can
  hit it, until the eviction policy picks it to make room.

Allocation pops the free list and, when that is empty, asks the policy for a
victim (O(1) for the shipped policies). A victim's cached descendants are
evicted with it, children first, so no cached child outlives its parent. They
are always evictable: a request holds its whole chain, so a pinned child
implies a pinned parent.

All methods that can fail check first and then mutate, so a failure leaves
the pool exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvtier.errors import ConfigError, InternalInvariantError, OutOfBlocksError
from kvtier.index import PrefixIndex, Tier
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy

_DEVICE = int(Tier.DEVICE)


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` tokens on one device."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: EvictionPolicy | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.index = index if index is not None else PrefixIndex()
        self.ref: list[int] = [0] * num_blocks
        #: Key of each cached block; ``None`` for empty and private blocks.
        self.block_key: list[int | None] = [None] * num_blocks
        #: Bumped each time a block is handed out, so stale ``(block, version)`` is detectable.
        self.version: list[int] = [0] * num_blocks
        # Popping from the end hands out low ids first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictions = 0
        self.cascade_evictions = 0
        self.declined = 0

    # -- sizes -------------------------------------------------------------
    @property
    def num_empty(self) -> int:
        """Blocks on the free list (hold nothing)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds: reusable on a hit, reclaimable on demand."""
        return self.policy.num_evictable

    @property
    def num_free(self) -> int:
        """Blocks an allocation can obtain right now (empty + evictable)."""
        return len(self._free) + self.policy.num_evictable

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    # -- lookup and references ---------------------------------------------
    def lookup(self, keys: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of ``keys`` cached on this device."""
        entries_get = self.index.get
        out: list[int] = []
        for key in keys:
            entry = entries_get(key)
            if entry is None or entry.block_id < 0:
                break
            out.append(entry.block_id)
        return out

    def count_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are evictable now (would stop being so if acquired)."""
        ref = self.ref
        key = self.block_key
        return sum(1 for b in block_ids if ref[b] == 0 and key[b] is not None)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached or held blocks (a hit, a fork, a shadow hold)."""
        ref = self.ref
        keys = self.block_key
        policy = self.policy
        for b in block_ids:
            if ref[b] == 0:
                key = keys[b]
                if key is None:
                    raise InternalInvariantError(f"acquire of empty block {b}")
                policy.access(key)
                policy.pin(key)
            ref[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a request's blocks tail first, so that under LRU a chain's
        leaves become older than its root and are reclaimed first.
        """
        ref = self.ref
        keys = self.block_key
        free = self._free
        unpin = self.policy.unpin
        for b in block_ids:
            count = ref[b] - 1
            if count < 0:
                raise InternalInvariantError(f"release of unreferenced block {b}")
            ref[b] = count
            if count == 0:
                key = keys[b]
                if key is None:
                    free.append(b)
                else:
                    unpin(key)

    # -- allocation ----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh private blocks (ref 1 each), evicting cached ones if needed."""
        if n <= 0:
            return []
        available = len(self._free) + self.policy.num_evictable
        if n > available:
            raise OutOfBlocksError(n, available, self.num_blocks)
        free = self._free
        ref = self.ref
        version = self.version
        out: list[int] = []
        for _ in range(n):
            b = free.pop() if free else self._evict_one()
            ref[b] = 1
            version[b] += 1
            out.append(b)
        return out

    def _evict_one(self) -> int:
        """Evict the policy's victim (and its cached subtree); return the victim's block."""
        victim = self.policy.evict()
        if victim is None:
            raise InternalInvariantError("policy found no victim although blocks are evictable")
        index = self.index
        entry = index.get(victim)
        if entry is None or entry.block_id < 0:
            raise InternalInvariantError(f"policy evicted key {victim:#x} the device does not hold")
        if entry.children:
            for key in index.resident_subtree(victim, _DEVICE):
                child = index.get(key)
                assert child is not None
                b = child.block_id
                if self.ref[b]:
                    raise InternalInvariantError(
                        f"cascade would evict block {b}, which a request holds"
                    )
                self.policy.remove(key)
                index.drop(key, _DEVICE)
                self.block_key[b] = None
                self._free.append(b)
                self.cascade_evictions += 1
        block = entry.block_id
        index.drop(victim, _DEVICE)
        self.block_key[block] = None
        self.evictions += 1
        return block

    def evict(self, n: int) -> int:
        """Reclaim up to ``n`` evictable blocks now (garbage collection); returns how many."""
        freed = 0
        while freed < n and self.policy.num_evictable:
            before = len(self._free)
            self._free.append(self._evict_one())
            freed += len(self._free) - before
        return freed

    def clear_cache(self) -> int:
        """Evict every cached block that no request holds; returns how many."""
        return self.evict(self.num_blocks)

    # -- committing -----------------------------------------------------------
    def commit(self, block: int, key: int, parent: int | None) -> int:
        """Publish a full private ``block`` under ``key``.

        Returns ``block`` when it became the cached copy; the id of the block
        already cached under ``key`` when this one is a duplicate (it stays
        private; the caller may hold the cached copy to keep the chain); or
        ``-1`` when admission declined the key (the chain stops here).
        """
        index = self.index
        entry = index.get(key)
        if entry is not None and entry.block_id >= 0:
            return entry.block_id
        if self.block_key[block] is not None or self.ref[block] <= 0:
            raise InternalInvariantError(f"commit of block {block}, which is not private")
        if parent is not None:
            parent_entry = index.get(parent)
            if parent_entry is None or parent_entry.block_id < 0:
                raise InternalInvariantError(
                    f"commit of block {block} whose parent {parent:#x} is not cached"
                )
        if not self.policy.admit(key):
            self.declined += 1
            return -1
        index.add(key, parent, _DEVICE, block)
        self.block_key[block] = key
        self.policy.insert(key, True)
        return block

    # -- checking --------------------------------------------------------------
    def check(self, holders: Iterable[Iterable[int]] | None = None) -> None:
        """Verify every invariant; ``holders`` lists each holder's blocks (for ref counts)."""
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            raise InternalInvariantError("a block is on the free list twice")
        n_cached = n_evictable = 0
        for b in range(self.num_blocks):
            r = self.ref[b]
            key = self.block_key[b]
            if r < 0:
                raise InternalInvariantError(f"block {b} has ref count {r}")
            if b in free_set:
                if r or key is not None:
                    raise InternalInvariantError(f"block {b} is both free and referenced/cached")
                continue
            if key is None:
                if r == 0:
                    raise InternalInvariantError(f"block {b} leaked: private, unreferenced")
                continue
            n_cached += 1
            entry = self.index.get(key)
            if entry is None or entry.block_id != b or not entry.tiers & _DEVICE:
                raise InternalInvariantError(f"cached block {b} is not indexed as such")
            if key not in self.policy:
                raise InternalInvariantError(f"cached block {b} is unknown to the policy")
            if r == 0:
                n_evictable += 1
            elif entry.parent is not None:
                parent = self.index.get(entry.parent)
                if parent is None or parent.block_id < 0 or self.ref[parent.block_id] == 0:
                    raise InternalInvariantError(
                        f"held block {b} has a parent that is not held: it could be stranded"
                    )
        if n_cached != len(self.policy):
            raise InternalInvariantError(
                f"{n_cached} cached blocks but the policy tracks {len(self.policy)}"
            )
        if n_evictable != self.policy.num_evictable:
            raise InternalInvariantError(
                f"{n_evictable} evictable blocks but the policy counts "
                f"{self.policy.num_evictable}"
            )
        device_entries = sum(1 for e in self.index if e.tiers & _DEVICE)
        if device_entries != n_cached:
            raise InternalInvariantError("index and pool disagree on the cached blocks")
        self.index.check()
        if holders is not None:
            counts: Counter[int] = Counter()
            for held in holders:
                counts.update(held)
            for b in range(self.num_blocks):
                if self.ref[b] != counts.get(b, 0):
                    raise InternalInvariantError(
                        f"block {b}: ref count {self.ref[b]} but {counts.get(b, 0)} holders"
                    )
