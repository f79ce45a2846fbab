"""Belady's MIN with bypass: the offline optimum hit count for a block access sequence.

At each access the cache knows every future access. On a miss it keeps the
key only if that key is read again sooner than some resident key; then it
evicts the resident key read farthest in the future (or never). A missed key
read later than every resident key, or never again, bypasses the cache.
With bypass allowed this maximises hits for a cache of ``capacity`` equal-
sized blocks, so every online policy's hit ratio is at most MIN's.

Accesses can be *reads* (they count as hits or misses) or *writes* (a
request's generated blocks: the content arrives for free and the cache may
keep it, but nothing is counted). A key's next use is its next read, unless a
write comes first: then keeping it until the write gains nothing, because the
write brings it back for free, so it counts as never used.

Cost: O(n log n) for n accesses: one pass back to front for next-use times,
then a max-heap of resident keys by next use, invalidated lazily (a popped
entry whose next use no longer matches the key's current one is stale).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class MinResult:
    """What :func:`belady_min` found."""

    #: 1 where a read hit, 0 elsewhere (misses and writes), one per access.
    hits: bytearray
    num_hits: int
    num_reads: int
    evictions: int
    #: Misses (or writes) that were not cached because they were needed too late.
    bypasses: int


def next_reads(keys: Sequence[int], reads: Sequence[int] | None = None) -> list[int]:
    """For each access, when keeping its key next pays off: the index of the key's
    next access if that is a read, else ``len(keys)`` (never).

    A key whose next access is a write is worth nothing until then: the write
    brings it back for free.
    """
    n = len(keys)
    nxt = [n] * n
    if reads is None:
        last: dict[int, int] = {}
        get = last.get
        for i in range(n - 1, -1, -1):
            k = keys[i]
            nxt[i] = get(k, n)
            last[k] = i
        return nxt
    # Remember each key's next access as a read index, or ``n`` for a write.
    upcoming: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = keys[i]
        nxt[i] = upcoming.get(k, n)
        upcoming[k] = i if reads[i] else n
    return nxt


def belady_min(
    keys: Sequence[int], capacity: int, reads: Sequence[int] | None = None
) -> MinResult:
    """Run MIN with bypass over ``keys``; ``reads[i]`` false marks access ``i`` a write."""
    if capacity <= 0:
        raise ConfigError(f"capacity must be a positive number of blocks, got {capacity}")
    n = len(keys)
    nxt = next_reads(keys, reads)
    never = n
    resident: dict[int, int] = {}  # key -> index of its next read
    heap: list[tuple[int, int]] = []  # (-next read, key); stale entries are skipped
    push, pop = heapq.heappush, heapq.heappop
    flags = bytearray(n)
    hits = evictions = bypasses = 0
    for i in range(n):
        k = keys[i]
        nu = nxt[i]
        if k in resident:
            if reads is None or reads[i]:
                flags[i] = 1
                hits += 1
            resident[k] = nu
            push(heap, (-nu, k))
            continue
        if nu == never:
            bypasses += 1  # never read again: caching it cannot help
            continue
        if len(resident) >= capacity:
            while True:  # the farthest live entry; drop stale ones on the way
                neg, victim = heap[0]
                if resident.get(victim) == -neg:
                    break
                pop(heap)
            if -neg <= nu:
                bypasses += 1  # every resident key is read sooner than this one
                continue
            pop(heap)
            del resident[victim]
            evictions += 1
        resident[k] = nu
        push(heap, (-nu, k))
    num_reads = n if reads is None else sum(1 for r in reads if r)
    return MinResult(flags, hits, num_reads, evictions, bypasses)
