"""Least-recently-used eviction: the victim is the key released longest ago.

An :class:`LRUPolicy` keeps its keys in an ordered dict and a set. When it
orders the blocks of one device pool (``BlockPool`` attaches it, see
:meth:`LRUPolicy.attach_blocks`), the order lives in a :class:`BlockOrder`
instead: a doubly linked list threaded through per-block arrays, which the
pool drives by block id. Pinning, releasing and evicting a block then cost a
few list stores, with no hashing of its 128-bit key and no node object;
the policy's key methods reach the same list through the pool's key index.
Both forms evict in the same order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Final, final

from mypy_extensions import mypyc_attr

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase

#: A block's place in a :class:`BlockOrder`.
_ABSENT: Final = 0
_EVICTABLE: Final = 1
_PINNED: Final = 2


@final
class BlockOrder:
    """LRU order of a block pool's cached blocks, by block id.

    ``prev``/``next`` link the evictable blocks oldest first through a
    sentinel slot (index ``num_blocks``); ``state`` says whether a block is
    absent, evictable (linked) or pinned. ``block_key`` and ``index`` are the
    pool's own block -> key list and key -> block dict, read only: they turn
    a block into the key a caller of the policy's key methods expects, and
    back.
    """

    def __init__(self, num_blocks: int, block_key: list[int | None], index: dict[int, int]) -> None:
        self.sentinel = num_blocks
        self.prev: list[int] = [num_blocks] * (num_blocks + 1)
        self.next: list[int] = [num_blocks] * (num_blocks + 1)
        self.state: list[int] = [_ABSENT] * num_blocks
        self.num_evictable = 0
        self.num_pinned = 0
        self.block_key = block_key
        self.index = index

    # -- by block id (the pool's calls) ------------------------------------------
    def insert_pinned(self, blocks: list[int], start: int, upto: int) -> None:
        """``blocks[start:upto]`` became cached, held by a request."""
        state = self.state
        for i in range(start, upto):
            state[blocks[i]] = _PINNED
        self.num_pinned += upto - start

    def insert_evictable(self, block: int) -> None:
        self.state[block] = _EVICTABLE
        self._push(block)
        self.num_evictable += 1

    def pin(self, blocks: list[int]) -> None:
        """The blocks' first holder took them: out of the order."""
        state = self.state
        prev = self.prev
        nxt = self.next
        for b in blocks:
            if state[b] != _EVICTABLE:
                raise InternalInvariantError(f"pin of block {b}, which is not evictable")
            p = prev[b]
            n = nxt[b]
            nxt[p] = n
            prev[n] = p
            state[b] = _PINNED
        self.num_evictable -= len(blocks)
        self.num_pinned += len(blocks)

    def unpin(self, blocks: list[int]) -> None:
        """The blocks' last holder released them: most recent first in line last."""
        state = self.state
        prev = self.prev
        nxt = self.next
        s = self.sentinel
        last = prev[s]
        for b in blocks:
            if state[b] != _PINNED:
                raise InternalInvariantError(f"unpin of block {b}, which is not pinned")
            state[b] = _EVICTABLE
            prev[b] = last
            nxt[last] = b
            last = b
        nxt[last] = s
        prev[s] = last
        self.num_evictable += len(blocks)
        self.num_pinned -= len(blocks)

    def access(self, block: int) -> None:
        """A hit: an evictable block becomes the most recent (pinned ones are not in line)."""
        if self.state[block] == _EVICTABLE:
            self._unlink(block)
            self._push(block)

    def evict(self, n: int) -> list[int]:
        """Up to ``n`` evictable blocks, oldest first, taken out of the order."""
        s = self.sentinel
        nxt = self.next
        state = self.state
        out: list[int] = []
        b = nxt[s]
        while b != s and len(out) < n:
            state[b] = _ABSENT
            out.append(b)
            b = nxt[b]
        nxt[s] = b
        self.prev[b] = s
        self.num_evictable -= len(out)
        return out

    def remove(self, block: int) -> None:
        """The pool dropped ``block`` itself (a cascade, a withdrawal)."""
        st = self.state[block]
        if st == _EVICTABLE:
            self._unlink(block)
            self.num_evictable -= 1
        elif st == _PINNED:
            self.num_pinned -= 1
        self.state[block] = _ABSENT

    def _push(self, block: int) -> None:
        s = self.sentinel
        last = self.prev[s]
        self.prev[block] = last
        self.next[block] = s
        self.next[last] = block
        self.prev[s] = block

    def _unlink(self, block: int) -> None:
        p = self.prev[block]
        n = self.next[block]
        self.next[p] = n
        self.prev[n] = p

    # -- by key (the policy's protocol) --------------------------------------------
    def block_of(self, key: int) -> int:
        block = self.index.get(key, -1)
        if block < 0:
            raise InternalInvariantError(f"key {key:#x} is not cached on the device")
        return block

    def resident(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        block = self.index.get(key, -1)
        return block >= 0 and self.state[block] != _ABSENT

    def is_pinned(self, block: int) -> bool:
        return self.state[block] == _PINNED

    def key_of(self, block: int) -> int:
        key = self.block_key[block]
        if key is None:
            raise InternalInvariantError(f"block {block} in the LRU order holds no key")
        return key

    def order_keys(self) -> list[int]:
        """The evictable blocks' keys, oldest first."""
        out: list[int] = []
        s = self.sentinel
        nxt = self.next
        b = nxt[s]
        while b != s:
            out.append(self.key_of(b))
            b = nxt[b]
        return out

    def pinned_keys(self) -> list[int]:
        state = self.state
        return [self.key_of(b) for b in range(len(state)) if state[b] == _PINNED]


@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(PolicyBase):
    """LRU over unpinned resident keys; a release (``unpin``) counts as a use.

    ``_order`` holds the evictable keys oldest first; pinned keys sit in
    ``_pinned`` and rejoin the order at the most-recent end when unpinned.
    """

    name: ClassVar[str] = "lru"

    __slots__ = (
        "_blocks",
        "_order",
        "_pinned",
        "_size_extra",
        "_sizes",
        "capacity",
        "key_capacity",
    )

    def __init__(self) -> None:
        # Assigned here, not by PolicyBase.__init__: mypyc compiles this class
        # and needs every attribute it touches declared in it.
        self.capacity = 0
        self.key_capacity = 0
        self._sizes: dict[int, int] = {}
        self._size_extra = 0
        self._order: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()
        #: The block-indexed order, once a device pool attached this policy.
        self._blocks: BlockOrder | None = None

    def attach_blocks(
        self, num_blocks: int, block_key: list[int | None], index: dict[int, int]
    ) -> BlockOrder | None:
        """Keep the order by block id for a pool of ``num_blocks`` (see the module docs).

        ``block_key`` and ``index`` are the pool's block -> key list and key
        -> block dict. Returns the order the pool then drives directly, or
        ``None`` (the policy stays keyed) when it holds keys already or is
        attached to another pool.
        """
        if self._blocks is not None or self._order or self._pinned or self._sizes:
            return None
        self._blocks = BlockOrder(num_blocks, block_key, index)
        return self._blocks

    def _pinned_keys(self) -> Iterable[int]:
        blocks = self._blocks
        if blocks is not None:
            return blocks.pinned_keys()
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        blocks = self._blocks
        if blocks is not None:
            order = blocks.order_keys()
            pinned = sorted(blocks.pinned_keys())
        else:
            order = list(self._order)
            pinned = sorted(self._pinned)
        return {**self._state(), "order": order, "pinned": pinned}

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        blocks = self._blocks
        if blocks is not None:
            if size != 1:
                raise ConfigError(f"a device block has size 1, got {size!r}")
            b = blocks.block_of(key)
            if pinned:
                blocks.insert_pinned([b], 0, 1)
            else:
                blocks.insert_evictable(b)
            return
        # The owner guarantees a key is inserted once (its index deduplicates);
        # check() verifies it, the hot path does not.
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._pinned.add(key)
        else:
            self._order[key] = None

    def access(self, key: int) -> None:
        blocks = self._blocks
        if blocks is not None:
            b = blocks.index.get(key, -1)
            if b >= 0:
                blocks.access(b)
            return
        if key in self._order:
            self._order.move_to_end(key)

    def access_many(self, keys: Sequence[int]) -> None:
        if self._blocks is not None:
            for key in keys:
                self.access(key)
            return
        order = self._order
        # Hits are usually pinned already (outside the order): nothing to move.
        for key in order.keys() & keys:
            order.move_to_end(key)

    def pin(self, key: int) -> None:
        blocks = self._blocks
        if blocks is not None:
            blocks.pin([blocks.block_of(key)])
            return
        try:
            del self._order[key]
        except KeyError:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable") from None
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        blocks = self._blocks
        if blocks is not None:
            blocks.unpin([blocks.block_of(key)])
            return
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._order[key] = None

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        blocks = self._blocks
        if blocks is not None:
            if sizes is not None and any(size != 1 for size in sizes):
                raise ConfigError("a device block has size 1")
            for key in keys:
                self.insert(key, pinned)
            return
        if sizes is not None:
            self._record_sizes(keys, sizes)
        if pinned:
            self._pinned.update(keys)
        else:
            self._order.update(dict.fromkeys(keys))

    def pin_many(self, keys: Sequence[int]) -> None:
        blocks = self._blocks
        if blocks is not None:
            blocks.pin([blocks.block_of(key) for key in keys])
            return
        try:
            # A C-level loop: deque(maxlen=0) consumes the map without a Python frame.
            deque(map(self._order.__delitem__, keys), maxlen=0)
        except KeyError as exc:
            raise InternalInvariantError(f"pin of key {exc} that is not evictable") from None
        self._pinned.update(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        blocks = self._blocks
        if blocks is not None:
            blocks.unpin([blocks.block_of(key) for key in keys])
            return
        pinned = self._pinned
        before = len(pinned)
        pinned.difference_update(keys)
        if before - len(pinned) != len(keys):
            raise InternalInvariantError("unpin of a key that is not pinned")
        order = self._order
        # A plain loop: cheaper than building a dict of the keys to update from.
        for key in keys:
            order[key] = None

    def remove(self, key: int) -> None:
        blocks = self._blocks
        if blocks is not None:
            b = blocks.index.get(key, -1)
            if b >= 0:
                blocks.remove(b)
            return
        if key in self._order:
            del self._order[key]
        elif key in self._pinned:
            self._pinned.remove(key)
        else:
            return
        if self._sizes:
            self._forget_size(key)

    def evict(self) -> int | None:
        blocks = self._blocks
        if blocks is not None:
            victims = blocks.evict(1)
            return blocks.key_of(victims[0]) if victims else None
        if not self._order:
            return None
        key = self._order.popitem(last=False)[0]
        if self._sizes:
            self._forget_size(key)
        return key

    def evict_many(self, n: int) -> list[int]:
        blocks = self._blocks
        if blocks is not None:
            return [blocks.key_of(b) for b in blocks.evict(n)]
        popitem = self._order.popitem
        victims = [popitem(False)[0] for _ in range(min(n, len(self._order)))]
        if self._sizes:
            for key in victims:
                self._forget_size(key)
        return victims

    @property
    def used(self) -> int:
        # PolicyBase.used without the call to __len__ (workflow admission asks per key).
        blocks = self._blocks
        if blocks is not None:
            return blocks.num_evictable + blocks.num_pinned
        return len(self._order) + len(self._pinned) + self._size_extra

    def __len__(self) -> int:
        blocks = self._blocks
        if blocks is not None:
            return blocks.num_evictable + blocks.num_pinned
        return len(self._order) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        blocks = self._blocks
        if blocks is not None:
            return blocks.resident(key)
        return key in self._order or key in self._pinned

    @property
    def num_evictable(self) -> int:
        blocks = self._blocks
        if blocks is not None:
            return blocks.num_evictable
        return len(self._order)
