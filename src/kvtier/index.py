"""The prefix index: which block keys exist, on which tiers, and how they chain.

Each entry records its parent key, its depth in the chain, a bit per tier
that holds the block, the device block id when the device holds it, external
pins (pending transfers) and a version that changes whenever the key is
re-created, so a stale ``(key, version)`` handle is detectable.

The index keeps children sets so that an eviction can remove a block's whole
resident subtree (children first): a cached child whose parent is gone is
useless for prefix reuse and is never left behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from enum import IntFlag

from kvtier.errors import BadRequestError, InternalInvariantError


class Tier(IntFlag):
    """Storage tiers, fastest first. An entry's ``tiers`` is a bit set of these."""

    DEVICE = 1
    HOST = 2
    DISK = 4
    REMOTE = 8


# Plain ints for the hot paths: IntFlag arithmetic costs a Python call per use.
DEVICE = 1
HOST = 2
DISK = 4
REMOTE = 8


class IndexEntry:
    """One key's record. Mutated only through :class:`PrefixIndex`."""

    __slots__ = ("block_id", "children", "depth", "key", "parent", "pins", "tiers", "version")

    def __init__(
        self,
        key: int,
        parent: int | None,
        depth: int,
        version: int,
        tiers: int = 0,
        block_id: int = -1,
    ) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.version = version
        self.tiers = tiers
        self.pins = 0
        self.block_id = block_id
        self.children: set[int] | None = None

    def __repr__(self) -> str:
        return (
            f"IndexEntry(key={self.key:#x}, depth={self.depth}, tiers={Tier(self.tiers)!r}, "
            f"block_id={self.block_id}, pins={self.pins}, version={self.version})"
        )


class PrefixIndex:
    """Key -> :class:`IndexEntry`, with longest-prefix lookup and chain upkeep."""

    __slots__ = ("_entries", "_version")

    def __init__(self) -> None:
        self._entries: dict[int, IndexEntry] = {}
        self._version = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[IndexEntry]:
        return iter(self._entries.values())

    def get(self, key: int) -> IndexEntry | None:
        return self._entries.get(key)

    def is_current(self, key: int, version: int) -> bool:
        """Whether a handle taken as ``(key, version)`` still names the same block."""
        entry = self._entries.get(key)
        return entry is not None and entry.version == version

    def longest_prefix(self, keys: Sequence[int], tier: int = DEVICE) -> int:
        """Number of leading ``keys`` held by any tier in the mask ``tier``; one pass."""
        entries = self._entries
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.tiers & tier:
                break
            n += 1
        return n

    def add(self, key: int, parent: int | None, tier: int, block_id: int = -1) -> IndexEntry:
        """Record that ``tier`` holds ``key`` (child of ``parent``; ``None`` = root)."""
        self.add_chain(((key, parent, block_id),), tier)
        return self._entries[key]

    def add_chain(self, items: Iterable[tuple[int, int | None, int]], tier: int) -> None:
        """Record ``(key, parent, block_id)`` items on ``tier``, parents before children.

        ``block_id`` is the device block (ignored for other tiers). A parent
        must already be indexed (or come earlier in ``items``).
        """
        entries = self._entries
        on_device = tier & DEVICE
        version = self._version
        prev: IndexEntry | None = None
        try:
            for key, parent, block_id in items:
                entry = entries.get(key)
                if entry is None:
                    if parent is None:
                        depth = 1
                    else:
                        # In a chain the parent is usually the previous item.
                        parent_entry = (
                            prev if prev is not None and prev.key == parent
                            else entries.get(parent)
                        )
                        if parent_entry is None:
                            raise BadRequestError(
                                f"cannot index block {key:#x}: its parent {parent:#x} is not "
                                "cached; blocks must be added in chain order"
                            )
                        depth = parent_entry.depth + 1
                        children = parent_entry.children
                        if children is None:
                            parent_entry.children = {key}
                        else:
                            children.add(key)
                    version += 1
                    entry = IndexEntry(
                        key, parent, depth, version, tier, block_id if on_device else -1
                    )
                    entries[key] = entry
                else:
                    if entry.parent != parent:
                        raise InternalInvariantError(
                            f"block {key:#x} re-added under a different parent: "
                            "hash collision or bad keys"
                        )
                    entry.tiers |= tier
                    if on_device:
                        entry.block_id = block_id
                prev = entry
        finally:
            self._version = version

    def drop(self, key: int, tier: int) -> None:
        """Record that ``tier`` no longer holds ``key``; see :meth:`drop_many`."""
        self.drop_many((key,), tier)

    def drop_many(self, keys: Iterable[int], tier: int) -> None:
        """Record that ``tier`` no longer holds ``keys``; forget a key once no tier does.

        Dropping a key whose child is held on a tier that would then have no
        parent above it would strand the child, so that is refused (that key is
        left unchanged): evict the subtree first (see :meth:`resident_subtree`).
        """
        entries = self._entries
        on_device = tier & DEVICE
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                raise InternalInvariantError(f"drop of unknown key {key:#x}")
            remaining = entry.tiers & ~tier
            if entry.children:
                for child in entry.children:
                    child_tiers = entries[child].tiers
                    fastest = child_tiers & -child_tiers
                    if not remaining & ((fastest << 1) - 1):
                        raise InternalInvariantError(
                            f"dropping key {key:#x} from tier {tier} would strand its child "
                            f"{child:#x}: evict the subtree first"
                        )
            entry.tiers = remaining
            if on_device:
                entry.block_id = -1
            if remaining:
                continue
            del entries[key]
            parent = entry.parent
            if parent is not None:
                parent_entry = entries.get(parent)
                if parent_entry is not None:
                    children = parent_entry.children
                    if children is not None:
                        children.discard(key)
                        if not children:
                            parent_entry.children = None

    def evict_many(self, keys: Iterable[int], tier: int) -> tuple[list[int], list[int]]:
        """Drop ``keys`` from ``tier``, each with its subtree held on ``tier`` (children first).

        Keys already dropped as part of an earlier key's subtree are skipped.
        Returns the device block ids freed (victims and descendants; empty for
        other tiers) and the descendants dropped along (the cascade).
        """
        entries = self._entries
        on_device = tier & DEVICE
        blocks: list[int] = []
        cascaded: list[int] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.tiers & tier:
                if key in cascaded:
                    continue
                raise InternalInvariantError(f"evict of key {key:#x}, which tier {tier} lacks")
            if entry.children:
                subtree = self.resident_subtree(key, tier)
                if subtree:
                    if on_device:
                        blocks.extend(entries[k].block_id for k in subtree)
                    self.drop_many(subtree, tier)
                    cascaded.extend(subtree)
            if on_device:
                blocks.append(entry.block_id)
            self.drop_many((key,), tier)
        return blocks, cascaded

    def resident_subtree(self, key: int, tier: int) -> list[int]:
        """Descendants of ``key`` held on ``tier``, children before parents (``key`` excluded)."""
        entries = self._entries
        out: list[int] = []
        stack: list[tuple[int, bool]] = []
        root = entries[key]
        if root.children:
            stack.extend((c, False) for c in root.children)
        while stack:
            k, expanded = stack.pop()
            if expanded:
                out.append(k)
                continue
            child = entries[k]
            stack.append((k, True))
            if child.children:
                stack.extend((c, False) for c in child.children)
        return [k for k in out if entries[k].tiers & tier]

    def has_children_on(self, key: int, tier: int) -> bool:
        entry = self._entries[key]
        if not entry.children:
            return False
        entries = self._entries
        return any(entries[c].tiers & tier for c in entry.children)

    def pin(self, key: int) -> None:
        """An external pin (a pending load or store); pinned keys are not evicted."""
        entry = self._entries.get(key)
        if entry is None:
            raise BadRequestError(f"cannot pin block {key:#x}: it is not cached")
        entry.pins += 1

    def unpin(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.pins <= 0:
            raise BadRequestError(f"unpin of block {key:#x} that is not pinned")
        entry.pins -= 1

    def check(self) -> None:
        """Verify every structural invariant; raises :class:`InternalInvariantError`."""
        entries = self._entries
        for key, entry in entries.items():
            if entry.key != key:
                raise InternalInvariantError(f"entry under {key:#x} names {entry.key:#x}")
            if not entry.tiers:
                raise InternalInvariantError(f"entry {key:#x} is on no tier")
            if entry.pins < 0:
                raise InternalInvariantError(f"entry {key:#x} has negative pins")
            if (entry.block_id >= 0) != bool(entry.tiers & DEVICE):
                raise InternalInvariantError(f"entry {key:#x}: device bit and block id disagree")
            if entry.parent is None:
                if entry.depth != 1:
                    raise InternalInvariantError(f"root child {key:#x} has depth {entry.depth}")
            else:
                parent = entries.get(entry.parent)
                if parent is None:
                    raise InternalInvariantError(f"entry {key:#x} is orphaned")
                if parent.children is None or key not in parent.children:
                    raise InternalInvariantError(f"parent of {key:#x} does not list it")
                if entry.depth != parent.depth + 1:
                    raise InternalInvariantError(f"entry {key:#x} has a wrong depth")
                # A child on a tier needs its parent on that tier or a faster one.
                lowest_child_tier = entry.tiers & -entry.tiers
                if not parent.tiers & ((lowest_child_tier << 1) - 1):
                    raise InternalInvariantError(
                        f"entry {key:#x} is held on a tier whose parent chain is gone"
                    )
            for child in entry.children or ():
                if child not in entries or entries[child].parent != key:
                    raise InternalInvariantError(f"entry {key:#x} lists a bad child {child:#x}")
