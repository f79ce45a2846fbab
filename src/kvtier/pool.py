"""The device block pool: physical block ids, free list, ref counts, eviction.

Every physical block is in exactly one state:

* **empty**: on the free list, no key, ref count 0;
* **private**: held by one or more requests (ref > 0) but not published (a
  partial tail, a block admission declined, a duplicate of a cached block);
* **cached**: published under a key. A cached block with ref count 0 is
  *evictable*: it still holds valid KV and a later request can hit it, until
  the eviction policy picks it to make room.

The device is the hot path, so its residency and prefix chains live here in
flat per-block arrays (key, parent block, children) and one ``key -> block``
dict, not in per-key objects: publishing or evicting a block costs a few list
operations and one dict operation. The tiers below the device keep theirs
in their offloading managers (:mod:`kvtier.offload`).

Allocation pops the free list and, when that is empty, asks the policy for
victims (O(1) each for the shipped policies). A victim's cached descendants
are evicted with it, children first, so no cached child outlives its parent.
They are always evictable: a request holds its whole chain, so a held child
implies a held parent.

All methods that can fail check first and then mutate, so a failure leaves
the pool exactly as it was.

Two ports let others follow the pool without reaching into it: any number of
*evict listeners* (:meth:`BlockPool.add_evict_listener`) hear of blocks an
eviction is about to free while their payloads are intact (the tier chain
copies them down), and the *journal* (:attr:`BlockPool.journal`, when
enabled) records every block that becomes cached or leaves, in order, for KV
events; the manager drains it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from mypy_extensions import mypyc_attr

from kvtier.errors import ConfigError, InternalInvariantError, OutOfBlocksError
from kvtier.policy.base import EvictionPolicy, PolicyBase, admit_chain
from kvtier.policy.lru import BlockOrder, LRUPolicy

log = logging.getLogger(__name__)

#: Journal entry kinds: blocks became cached, blocks left, every cached block left.
STORED = 0
REMOVED = 1
CLEARED = 2
#: ``(kind, keys, parent key or -1, token ids)``; tokens only for STORED, filled by the manager.
JournalEntry = tuple[int, list[int], int, list[int]]
EvictListener = Callable[[list[int], list[int]], None]


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` tokens on one device."""

    def __init__(
        self, num_blocks: int, block_size: int, policy: EvictionPolicy | None = None
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.policy.bind(num_blocks)
        # Policies that keep PolicyBase's admit-everything are not asked per block.
        self._admits_all = getattr(type(self.policy), "admit", None) is PolicyBase.admit
        self.ref: list[int] = [0] * num_blocks
        #: Key of each cached block; ``None`` for empty and private blocks.
        self.block_key: list[int | None] = [None] * num_blocks
        #: Bumped each time a block is handed out, so stale ``(block, version)`` is detectable.
        self.version: list[int] = [0] * num_blocks
        #: Parent block of each cached block (-1 for a chain's first block).
        self.parent: list[int] = [-1] * num_blocks
        #: First cached child of each cached block (-1: none); most blocks have
        #: at most one, so further children go to ``_more_children``.
        self.first_child: list[int] = [-1] * num_blocks
        self._more_children: dict[int, list[int]] = {}
        self._cached: dict[int, int] = {}
        # Popping from the end hands out low ids first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictions = 0
        self.cascade_evictions = 0
        self.declined = 0
        #: Blocks left private because their key was cached under another parent.
        self.collisions = 0
        # Called with the ``(keys, blocks)`` that eviction (never a withdrawal)
        # is about to free, while their payloads are still intact.
        self._listeners: list[EvictListener] = []
        #: Evict listeners that raised (the eviction went on without them).
        self.listener_errors = 0
        #: Blocks that became cached or left, in order (``None``: not recorded).
        self.journal: list[JournalEntry] | None = None
        #: The LRU order by block id, when the policy is a plain LRUPolicy: the
        #: pool then drives it directly, never through the policy's key methods.
        self._lru: BlockOrder | None = None
        if type(self.policy) is LRUPolicy:
            self._lru = self.policy.attach_blocks(num_blocks, self.block_key, self._cached)

    # -- ports -------------------------------------------------------------
    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(keys, blocks)`` before an eviction frees cached blocks.

        The keys and blocks come children first, payloads still intact; a
        withdrawal (blocks that hold nothing valid) is never announced.
        """
        self._listeners.append(listener)

    def remove_evict_listener(self, listener: EvictListener) -> None:
        """Stop calling ``listener`` (a listener that is not there is ignored)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def record_journal(self, on: bool = True) -> None:
        """Start (or stop) recording :attr:`journal`; starting clears it."""
        self.journal = [] if on else None

    def take_journal(self) -> list[JournalEntry]:
        """The journal's entries since the last call (empty when not recording)."""
        journal = self.journal
        if not journal:
            return []
        self.journal = []
        return journal

    # -- sizes -------------------------------------------------------------
    @property
    def num_empty(self) -> int:
        """Blocks on the free list (hold nothing)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds: reusable on a hit, reclaimable on demand."""
        lru = self._lru
        if lru is not None:
            return lru.num_evictable
        return self.policy.num_evictable

    @property
    def num_free(self) -> int:
        """Blocks an allocation can obtain right now (empty + evictable)."""
        lru = self._lru
        if lru is not None:
            return len(self._free) + lru.num_evictable
        return len(self._free) + self.policy.num_evictable

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def children_of(self, block: int) -> list[int]:
        """Cached child blocks of a cached ``block``."""
        first = self.first_child[block]
        if first < 0:
            return []
        return [first, *self._more_children.get(block, ())]

    def parent_keys(self, blocks: Sequence[int]) -> list[int | None]:
        """The key of each cached block's parent (``None`` for a chain's first block)."""
        parent = self.parent
        block_key = self.block_key
        out: list[int | None] = []
        for b in blocks:
            p = parent[b]
            out.append(block_key[p] if p >= 0 else None)
        return out

    def _link(self, parent: int, child: int) -> None:
        self.parent[child] = parent
        if self.first_child[parent] < 0:
            self.first_child[parent] = child
        else:
            self._more_children.setdefault(parent, []).append(child)

    def _unlink(self, child: int) -> None:
        """Detach ``child`` from its parent's children (it keeps no parent)."""
        p = self.parent[child]
        if p < 0:
            return
        self.parent[child] = -1
        more = self._more_children
        if self.first_child[p] == child:
            rest = more.get(p)
            if rest:
                self.first_child[p] = rest.pop()
                if not rest:
                    del more[p]
            else:
                self.first_child[p] = -1
        else:
            rest = more[p]
            rest.remove(child)
            if not rest:
                del more[p]

    # -- lookup and references ---------------------------------------------
    def cached_block(self, key: int) -> int | None:
        """The block cached under ``key``, if any."""
        return self._cached.get(key)

    def lookup(self, keys: Sequence[int], limit: int = -1) -> list[int]:
        """Block ids of the longest prefix of ``keys`` cached on this device, as one chain.

        The first block must be cached as a chain's first block and each
        block after it as the child of the one before: keys that come from
        outside (a trace's hash ids, an engine's own hashes) may name a block
        cached under another parent, and a hit there would hold a block
        whose ancestors nobody holds.
        ``limit`` (when not negative) caps how many leading keys are looked at.
        """
        ks: list[int] = keys if isinstance(keys, list) else list(keys)
        n = len(ks) if limit < 0 else min(limit, len(ks))
        cached = self._cached
        parent = self.parent
        out: list[int] = []
        prev = -1
        for i in range(n):
            b = cached.get(ks[i], -1)
            # The first block must start a chain too (its parent is -1).
            if b < 0 or parent[b] != prev:
                break
            out.append(b)
            prev = b
        return out

    def count_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` (cached blocks) are evictable now."""
        ref = self.ref
        return [ref[b] for b in block_ids].count(0)

    def acquire(self, block_ids: Iterable[int], *, hit: bool = True) -> None:
        """Take a reference on cached or held blocks.

        ``hit`` says the blocks are being reused by a lookup (the policy hears
        an access); a fork or a shadow hold is not a use.
        """
        ref = self.ref
        keys = self.block_key
        lru = self._lru
        # A list is walked by index when compiled; other iterables are copied once.
        blocks: list[int] = block_ids if isinstance(block_ids, list) else list(block_ids)
        pinned: list[int] = []
        for b in blocks:
            count = ref[b]
            if count == 0:
                key = keys[b]
                if key is None:
                    raise InternalInvariantError(f"acquire of empty block {b}")
                pinned.append(b if lru is not None else key)
            ref[b] = count + 1
        if lru is not None:
            # A hit on a block just pinned does not move it in an LRU order.
            if pinned:
                lru.pin(pinned)
        elif pinned:
            self.policy.pin_many(pinned)
            if hit:
                self.policy.access_many(pinned)

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a request's blocks tail first, so that under LRU a chain's
        leaves become older than its root and are reclaimed first.
        """
        ref = self.ref
        keys = self.block_key
        free = self._free
        lru = self._lru
        blocks: list[int] = block_ids if isinstance(block_ids, list) else list(block_ids)
        unpinned: list[int] = []
        for b in blocks:
            count = ref[b] - 1
            if count < 0:
                raise InternalInvariantError(f"release of unreferenced block {b}")
            ref[b] = count
            if count == 0:
                key = keys[b]
                if key is None:
                    free.append(b)
                elif lru is not None:
                    unpinned.append(b)
                else:
                    unpinned.append(key)
        if unpinned:
            if lru is not None:
                lru.unpin(unpinned)
            else:
                self.policy.unpin_many(unpinned)

    # -- allocation ----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh private blocks (ref 1 each), evicting cached ones if needed."""
        if n <= 0:
            return []
        free = self._free
        if n > len(free):
            available = self.num_free
            if n > available:
                raise OutOfBlocksError(n, available, self.num_blocks)
            self._reclaim(n)
        out = free[-n:]
        del free[-n:]
        out.reverse()
        ref = self.ref
        version = self.version
        for b in out:
            ref[b] = 1
            version[b] += 1
        return out

    def _reclaim(self, target: int, announce: bool = True) -> None:
        """Evict until the free list holds at least ``target`` blocks."""
        free = self._free
        lru = self._lru
        if lru is not None:
            while len(free) < target:
                blocks = lru.evict(target - len(free))
                if not blocks:
                    raise InternalInvariantError(
                        "the LRU order found no victim although blocks are evictable"
                    )
                self._drop_victim_blocks(blocks, announce)
            return
        policy = self.policy
        while len(free) < target:
            victims = policy.evict_many(target - len(free))
            if not victims:
                raise InternalInvariantError("policy found no victim although blocks are evictable")
            self._drop_victims(victims, announce)

    def _drop_victim_blocks(self, victims: list[int], announce: bool = True) -> None:
        """:meth:`_drop_victims` for victims the LRU order named by block id."""
        block_key = self.block_key
        keys: list[int] = []
        for b in victims:
            key = block_key[b]
            if key is None:
                raise InternalInvariantError(f"the LRU order evicted block {b}, which holds no key")
            keys.append(key)
        if announce and self._listeners:
            self._announce(keys)
        cached = self._cached
        parent = self.parent
        first_child = self.first_child
        more = self._more_children
        free = self._free
        dropped = keys
        for i, b in enumerate(victims):
            if block_key[b] is None:
                # An earlier victim's cascade took it (and recorded it).
                if dropped is keys:
                    dropped = keys[:i]
                continue
            if first_child[b] >= 0:
                self._evict_subtree(b)
            if dropped is not keys:
                dropped.append(keys[i])
            del cached[keys[i]]
            block_key[b] = None
            p = parent[b]
            if p >= 0:
                # The common case inline: b is its parent's only child.
                if first_child[p] == b and (not more or p not in more):
                    parent[b] = -1
                    first_child[p] = -1
                else:
                    self._unlink(b)
            free.append(b)
        self.evictions += len(dropped)
        journal = self.journal
        if journal is not None and dropped:
            journal.append((REMOVED, dropped, -1, []))

    def _drop_victims(self, victims: list[int], announce: bool = True) -> None:
        """Free the victims' blocks, and their cached subtrees (children first)."""
        cached = self._cached
        block_key = self.block_key
        parent = self.parent
        first_child = self.first_child
        more = self._more_children
        free = self._free
        cascaded = False
        if announce and self._listeners:
            self._announce(victims)
        journal = self.journal
        dropped: list[int] = []
        missing = 0
        for key in victims:
            b = cached.pop(key, -1)
            if b < 0:
                if not cascaded:  # else an earlier victim's subtree may have taken it
                    raise InternalInvariantError(
                        f"policy evicted key {key:#x}, which the device does not hold"
                    )
                missing += 1
                continue
            if first_child[b] >= 0:
                self._evict_subtree(b)
                cascaded = True
            block_key[b] = None
            p = parent[b]
            if p >= 0:
                # The common case inline: b is its parent's only child.
                if first_child[p] == b and (not more or p not in more):
                    parent[b] = -1
                    first_child[p] = -1
                else:
                    self._unlink(b)
            free.append(b)
            if journal is not None:
                dropped.append(key)
        self.evictions += len(victims) - missing
        if journal is not None and dropped:
            journal.append((REMOVED, dropped, -1, []))

    def _announce(self, victims: list[int]) -> None:
        """Tell the listeners about ``victims`` and their cached subtrees, children first."""
        cached = self._cached
        block_key = self.block_key
        keys: list[int] = []
        blocks: list[int] = []
        seen: set[int] = set()
        for key in victims:
            b = cached.get(key, -1)
            if b < 0 or b in seen:
                continue
            order: list[int] = []
            stack = [b]
            while stack:
                x = stack.pop()
                order.append(x)
                stack.extend(self.children_of(x))
            for x in reversed(order):
                if x not in seen:
                    seen.add(x)
                    k = block_key[x]
                    if k is not None:
                        keys.append(k)
                        blocks.append(x)
        if keys:
            for listener in list(self._listeners):
                try:
                    listener(keys, blocks)
                except Exception:  # a listener must never break the pool's eviction
                    self.listener_errors += 1
                    log.exception("an evict listener failed on %d blocks", len(keys))

    def _evict_subtree(self, root: int) -> None:
        """Evict the cached descendants of block ``root`` to the free list, children first."""
        order: list[int] = []
        stack = self.children_of(root)
        while stack:
            b = stack.pop()
            order.append(b)
            stack.extend(self.children_of(b))
        ref = self.ref
        if any(ref[b] for b in order):
            raise InternalInvariantError("a cascade would evict a block that a request holds")
        remove = self.policy.remove
        lru = self._lru
        gone: list[int] = []
        for b in reversed(order):
            key = self.block_key[b]
            assert key is not None
            if lru is not None:
                lru.remove(b)
            else:
                remove(key)
            del self._cached[key]
            gone.append(key)
            self.block_key[b] = None
            self._unlink(b)
            self._free.append(b)
        self.cascade_evictions += len(order)
        if self.journal is not None and gone:
            self.journal.append((REMOVED, gone, -1, []))

    def evict(self, n: int, announce: bool = True) -> int:
        """Reclaim up to ``n`` evictable blocks now, in the policy's order; returns how many.

        ``announce=False`` skips the eviction listener: the blocks are dropped,
        not demoted.
        """
        before = len(self._free)
        n = min(n, self.num_evictable)
        if n > 0:
            self._reclaim(before + n, announce)
        return len(self._free) - before

    def clear_cache(self) -> int:
        """Evict every cached block that no request holds; returns how many."""
        n = self.evict(self.num_blocks)
        if self.journal is not None and not self._cached:
            self.journal.append((CLEARED, [], -1, []))
        return n

    def withdraw(self, blocks: Sequence[int]) -> int:
        """Unpublish cached ``blocks`` whose payload is not valid; returns how many.

        An engine whose forward pass failed withdraws the blocks it published
        for tokens it never computed, so no later request can hit them. The
        blocks stay allocated to their holders (now private); cached
        descendants that nobody holds are evicted with them. Raises, changing
        nothing, if a descendant outside ``blocks`` is held by a request.
        """
        block_key = self.block_key
        targets = [b for b in blocks if block_key[b] is not None]
        if not targets:
            return 0
        inside = set(targets)
        ref = self.ref
        stack: list[int] = []
        for b in targets:
            stack.extend(c for c in self.children_of(b) if c not in inside)
        while stack:
            c = stack.pop()
            if ref[c]:
                raise InternalInvariantError(
                    f"cannot withdraw: cached descendant block {c} is held by a request"
                )
            stack.extend(self.children_of(c))
        remove = self.policy.remove
        lru = self._lru
        cached = self._cached
        gone: list[int] = []
        for b in reversed(targets):
            if self.first_child[b] >= 0:
                self._evict_subtree(b)
            key = block_key[b]
            assert key is not None
            if lru is not None:
                lru.remove(b)
            else:
                remove(key)
            del cached[key]
            gone.append(key)
            block_key[b] = None
            self._unlink(b)
            if not ref[b]:
                self._free.append(b)
        if self.journal is not None:
            self.journal.append((REMOVED, gone, -1, []))
        return len(targets)

    # -- committing -----------------------------------------------------------
    def commit(self, block: int, key: int, parent: int | None) -> int:
        """Publish a full private ``block`` under ``key``; see :meth:`commit_chain`."""
        results = self.commit_chain((block,), (key,), parent)
        return results[0]

    def commit_chain(
        self, blocks: Sequence[int], keys: Sequence[int], parent: int | None
    ) -> list[int]:
        """Publish a run of full private blocks forming a chain under key ``parent``.

        Returns, per block: the block itself when it became the cached copy;
        the id of the block already cached under its key when it is a
        duplicate (it stays private; the caller may hold the cached copy to
        keep the chain); or ``-1`` when admission declined it, which ends the
        run (later blocks would have no cached parent).
        """
        if len(blocks) != len(keys):
            raise InternalInvariantError("commit_chain needs one key per block")
        if not blocks:
            return []
        block_list = list(blocks)
        results = self.commit_run(block_list, list(keys), 0, len(block_list), parent)
        return block_list if results is None else results

    def commit_run(
        self, blocks: list[int], keys: list[int], start: int, upto: int, parent: int | None
    ) -> list[int] | None:
        """:meth:`commit_chain` of ``blocks[start:upto]`` under ``keys[start:upto]``.

        Returns ``None`` when every block became the cached copy (the common
        case, with no per-block result list to build and read back), else
        :meth:`commit_chain`'s results for the run.
        """
        cached = self._cached
        if parent is None:
            pb = -1
        else:
            found = cached.get(parent)
            if found is None:
                raise InternalInvariantError(
                    f"commit under parent {parent:#x}, which is not cached"
                )
            pb = found
        block_key = self.block_key
        parents = self.parent
        first_child = self.first_child
        # How many of the run's new keys may be published (all, without a filter).
        admitted = -1 if self._admits_all else self._admitted_new(keys[start:upto])
        # Built only once a block is not published in place (a duplicate, a
        # decline); until then the results are the blocks themselves and the
        # published keys the run's keys.
        results: list[int] | None = None
        published: list[int] = []
        published_blocks: list[int] = []
        n_published = 0
        for i in range(start, upto):
            block = blocks[i]
            key = keys[i]
            # One dict operation for the common case, a new key: map it now.
            existing = cached.setdefault(key, block)
            if existing != block or block_key[block] is not None:
                if existing == block and block_key[block] != key:
                    del cached[key]  # mapped just now, to a block cached under another key
                    raise InternalInvariantError(
                        f"commit of block {block}, which is already cached"
                    )
                if results is None:
                    results = blocks[start:i]
                    published = keys[start:i]
                    published_blocks = blocks[start:i]
                if parents[existing] != pb:
                    # The key is cached under another parent (keys that are not
                    # chained): holding that copy would hold a block whose
                    # ancestors nobody holds, so the run ends here, private.
                    self.collisions += 1
                    results.append(-1)
                    break
                results.append(existing)
                pb = existing
                continue
            if n_published == admitted:
                del cached[key]
                if results is None:
                    results = blocks[start:i]
                    published = keys[start:i]
                    published_blocks = blocks[start:i]
                self.declined += 1
                results.append(-1)
                break
            block_key[block] = key
            if pb >= 0:
                parents[block] = pb
                if first_child[pb] < 0:
                    first_child[pb] = block
                else:
                    self._more_children.setdefault(pb, []).append(block)
            n_published += 1
            if results is not None:
                results.append(block)
                published.append(key)
                published_blocks.append(block)
            pb = block
        if n_published:
            lru = self._lru
            if lru is not None:
                if results is None:
                    lru.insert_pinned(blocks, start, upto)
                else:
                    lru.insert_pinned(published_blocks, 0, len(published_blocks))
            else:
                self.policy.insert_many(keys[start:upto] if results is None else published, True)
        return results

    def _admitted_new(self, keys: Sequence[int]) -> int:
        """How many of the keys not cached yet the policy admits, cut at the first decline."""
        cached = self._cached
        seen: set[int] = set()
        new: list[int] = []
        for key in keys:
            if key not in cached and key not in seen:
                seen.add(key)
                new.append(key)
        return admit_chain(self.policy.admit, new)

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
                if self.parent[b] != -1 or self.first_child[b] != -1 or b in self._more_children:
                    raise InternalInvariantError(f"private block {b} has chain links")
                continue
            n_cached += 1
            if self._cached.get(key) != b:
                raise InternalInvariantError(f"cached block {b} is not mapped from its key")
            if key not in self.policy:
                raise InternalInvariantError(f"cached block {b} is unknown to the policy")
            p = self.parent[b]
            if p >= 0:
                if self.block_key[p] is None:
                    raise InternalInvariantError(f"cached block {b} is orphaned: parent {p} gone")
                if b not in self.children_of(p):
                    raise InternalInvariantError(f"parent {p} does not list its child {b}")
            for c in self.children_of(b):
                if self.parent[c] != b:
                    raise InternalInvariantError(f"block {b} lists {c}, whose parent differs")
            if r == 0:
                n_evictable += 1
            elif p >= 0 and self.ref[p] == 0:
                raise InternalInvariantError(
                    f"held block {b} has a parent that is not held: it could be stranded"
                )
        for b, rest in self._more_children.items():
            if not rest or self.first_child[b] < 0:
                raise InternalInvariantError(f"block {b} has a malformed children list")
        if n_cached != len(self._cached):
            raise InternalInvariantError("the key map holds blocks that are not cached")
        if n_cached != len(self.policy):
            raise InternalInvariantError(
                f"{n_cached} cached blocks but the policy tracks {len(self.policy)}"
            )
        if self.policy.used != n_cached:
            raise InternalInvariantError(
                f"{n_cached} cached blocks of size 1 but the policy counts {self.policy.used} used"
            )
        if n_evictable != self.policy.num_evictable:
            raise InternalInvariantError(
                f"{n_evictable} evictable blocks but the policy counts {self.policy.num_evictable}"
            )
        if holders is not None:
            counts: Counter[int] = Counter()
            for held in holders:
                counts.update(held)
            for b in range(self.num_blocks):
                if self.ref[b] != counts.get(b, 0):
                    raise InternalInvariantError(
                        f"block {b}: ref count {self.ref[b]} but {counts.get(b, 0)} holders"
                    )
