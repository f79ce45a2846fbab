"""KVCacheManager: the request-level facade an engine calls.

``allocate`` finds the longest cached prefix of a new request, takes
references on those blocks, allocates the rest and publishes the prompt's
full blocks for reuse; ``extend`` appends tokens (copy-on-write for
a shared partial block); ``free`` releases; ``fork`` shares a request's blocks
with a new one. Blocks are published as soon as they are allocated, as in a
step-synchronous engine: the caller writes the KV of every token it was given
slots for before another request's forward pass reads them.

Every operation checks capacity and input before it mutates anything, so a
failure (out of blocks, bad input) leaves the manager exactly as it was.
The manager is not thread-safe: one scheduler thread drives it.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from mypy_extensions import mypyc_attr

from kvtier._tokpack import pack_u32
from kvtier.block_table import BlockTable, blocks_needed
from kvtier.errors import (
    BadRequestError,
    ConfigError,
    DuplicateRequestError,
    InternalInvariantError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvtier.hints import Hints, parse_hints
from kvtier.keys import (
    BlockHasher,
    ExtraKey,
    ItemKey,
    Namespace,
    check_item_keys,
    item_block_extra,
)
from kvtier.policy.base import EvictionPolicy, RequestHook, request_hook
from kvtier.policy.registry import make_policy
from kvtier.pool import STORED, BlockPool, EvictListener, JournalEntry
from kvtier.pressure.ladder import ModeActions

log = logging.getLogger(__name__)


class PressureGate(Protocol):
    """What the manager asks of a pressure controller (never a blocking call)."""

    @property
    def actions(self) -> ModeActions: ...

    def check_admission(self) -> None: ...


class ResumeCheck(Protocol):
    """What the manager asks of storage that may not keep every layer of a cached block.

    ``resumable(block_ids)`` is how many of a cached prefix's leading blocks a
    request can resume after (windowed storage: those whose last window
    still holds its sliding layers' K/V).
    """

    def resumable(self, block_ids: list[int]) -> int: ...


RequestId = Hashable
_MAX_TOKEN_ID = 2**32
#: Read once: a module attribute lookup per call is measurable on the hot path.
_BIG_ENDIAN: Final = sys.byteorder == "big"


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate`` returns: reuse found and where the request's tokens go."""

    request_id: RequestId
    #: Leading prompt tokens whose KV is already cached: compute from here on.
    num_cached_tokens: int
    block_table: BlockTable
    #: Physical blocks newly allocated for this request (the rest were hits).
    new_blocks: list[int]


class TierIndex(Protocol):
    """What :meth:`KVCacheManager.match` asks of the tiers below the device (a ``TierChain``)."""

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """For each leading key some tier holds ready, the index of the first such tier."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A request's prefix as :meth:`KVCacheManager.match` found it.

    The block keys are computed once, here, and kept with the request:
    :meth:`KVCacheManager.allocate` takes the match instead of hashing the
    tokens again, and :meth:`KVCacheManager.rematch` refreshes the hits of
    a request that waited without hashing anything.
    """

    #: Tokens matched (the request's whole prompt, or its tokens so far).
    num_tokens: int
    #: Keys of every full block of those tokens.
    keys: tuple[int, ...]
    extra: tuple[ExtraKey, ...]
    items: tuple[ItemKey, ...]
    #: The agent hints, parsed and checked once (``None``: none given).
    hints: Mapping[str, object] | None
    #: Leading blocks cached on the device (never the block of the last token).
    device_blocks: int
    #: Blocks after those that a tier below the device holds ready (0 without tiers).
    tier_blocks: int
    #: For each of those tier blocks, the index of the first tier holding it.
    tier_plan: tuple[int, ...] = ()

    @property
    def hit_blocks(self) -> int:
        """Leading blocks whose K/V need not be computed (device and tiers)."""
        return self.device_blocks + self.tier_blocks


@dataclass(frozen=True, slots=True)
class Extension:
    """What ``extend`` returns."""

    block_table: BlockTable
    new_blocks: list[int]
    #: ``(src, dst)`` block pairs whose KV the engine must copy before writing
    #: (copy-on-write of a partial block shared with a fork).
    copies: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class PressureEvent:
    """Passed to the pressure callback."""

    reason: Literal["out_of_blocks", "high_watermark"]
    usage: float
    free_blocks: int
    total_blocks: int
    needed_blocks: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the manager's counters."""

    hit_tokens: int
    queried_tokens: int
    hit_ratio: float
    evictions: int
    cascade_evictions: int
    usage: float
    used_blocks: int
    free_blocks: int
    empty_blocks: int
    cached_blocks: int
    total_blocks: int
    num_requests: int
    allocations: int
    allocation_failures: int
    declined_blocks: int
    duplicate_blocks: int
    cow_copies: int
    callback_errors: int
    policy: str
    #: Blocks evicted to reach a pressure mode's free target (included in ``evictions``).
    pressure_evictions: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class _Request:
    __slots__ = ("chain_open", "extra", "items", "keys", "shadow", "table", "tail")

    def __init__(
        self,
        table: BlockTable,
        extra: tuple[ExtraKey, ...],
        items: tuple[ItemKey, ...] = (),
        keys: list[int] | None = None,
        tail: array[int] | None = None,
    ) -> None:
        self.table = table
        self.extra = extra
        #: Multimodal items (first placeholder position, content key), by position.
        self.items = items
        #: Keys of the leading full blocks published (or held as shadows).
        self.keys: list[int] = [] if keys is None else keys
        #: Tokens after the last keyed block: what the next block key hashes.
        self.tail: array[int] = array("I") if tail is None else tail
        #: False once admission declined a block: later blocks stay private.
        self.chain_open = True
        #: position -> cached block held in place of this request's duplicate.
        self.shadow: dict[int, int] = {}

    def held_blocks(self) -> list[int]:
        """Every block this request holds a reference on, tail first."""
        blocks = self.table.blocks
        if not self.shadow:
            return blocks[::-1]
        out: list[int] = []
        for i in range(len(blocks) - 1, -1, -1):
            out.append(blocks[i])
            if i in self.shadow:
                out.append(self.shadow[i])
        return out


def _token_array(
    token_ids: Sequence[int], what: str, allow_empty: bool = False, start: int = 0
) -> array[int]:
    """``token_ids[start:]`` as a uint32 array; rejects empty or bad ids.

    Bad ids are negative, non-integer or too large:
    :func:`~kvtier._tokpack.pack_u32` (lists and tuples, read in place) and
    ``array("I")`` accept exactly the integers in ``[0, 2**32)``, in one pass
    in C; the slower scan for a precise message runs only on bad input.
    """
    given: object = token_ids  # a plain object: mypyc narrows str|bytes wrongly
    if isinstance(given, (str, bytes)):
        raise BadRequestError(
            f"{what} must be a sequence of integer token ids, not {type(given).__name__}"
        )
    if not allow_empty and len(token_ids) == start:
        raise BadRequestError(f"{what} is empty: give at least one token id")
    try:
        if isinstance(given, (list, tuple)):
            arr = array("I", pack_u32(token_ids, start, len(token_ids)))
            if _BIG_ENDIAN:  # pragma: no cover - big-endian hosts only
                arr.byteswap()
            return arr
        return array("I", token_ids[start:] if start else token_ids)
    except (OverflowError, TypeError) as exc:
        # objects: bad input may hold anything
        items: Sequence[object] = token_ids[start:] if start else token_ids
        for t in items:
            if not isinstance(t, int) or isinstance(t, bool):
                raise BadRequestError(
                    f"{what} must hold integer token ids, got {type(t).__name__}"
                ) from None
            if t < 0:
                raise BadRequestError(f"{what} holds a negative token id ({t})") from None
            if t >= _MAX_TOKEN_ID:
                raise BadRequestError(
                    f"{what} holds token id {t}, above the limit 2**32 - 1"
                ) from None
        raise BadRequestError(f"{what} holds invalid token ids: {exc}") from exc


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """Prefix-caching KV block manager over one device pool.

    ``policy`` is a registered policy name (``"lru"``), an import path, or an
    :class:`EvictionPolicy` instance. ``namespace`` isolates keys per model,
    layout and tenant. ``high_watermark`` is the pool usage at which the
    pressure callback hears about it (before blocks run out). ``clock`` (seconds,
    ``time.monotonic`` by default) is what a request-aware policy's
    ``on_request`` is told the time is; a replay injects the trace's.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        policy: str | EvictionPolicy = "lru",
        namespace: Namespace | None = None,
        hash_algorithm: str = "xxh3_128",
        hash_secret: bytes | None = None,
        high_watermark: float = 0.95,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 0.0 < high_watermark <= 1.0:
            raise ConfigError(f"high_watermark must be in (0, 1], got {high_watermark}")
        policy_obj = make_policy(policy) if isinstance(policy, str) else policy
        self.pool = BlockPool(num_blocks, block_size, policy_obj)
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self._request_hook: RequestHook | None = request_hook(policy_obj)
        self.block_size = block_size
        self.hasher = BlockHasher(
            namespace or Namespace("default"), block_size, hash_algorithm, hash_secret
        )
        self.high_watermark = high_watermark
        self._requests: dict[RequestId, _Request] = {}
        self._pressure_cb: Callable[[PressureEvent], None] | None = None
        self._above_watermark = False
        self._gate: PressureGate | None = None
        self._resume: ResumeCheck | None = None
        self._target_evictions = 0
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._allocations = 0
        self._failures = 0
        self._duplicates = 0
        self._cow_copies = 0
        self._callback_errors = 0

    # -- introspection --------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool."""
        return self.pool.num_blocks

    @property
    def namespace_root(self) -> int:
        """The root every block key chains from (model, KV layout, tenant)."""
        return self.hasher.root

    def keys_for(self, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> list[int]:
        """The keys this manager gives the full blocks of ``token_ids`` (nothing is looked up)."""
        return self.hasher.chain(token_ids, extra=tuple(extra_keys))

    def request_ids(self) -> Iterator[RequestId]:
        return iter(list(self._requests))

    def _get(self, request_id: RequestId) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(request_id) from None

    def block_table(self, request_id: RequestId) -> BlockTable:
        """A copy of the request's current block table."""
        return self._get(request_id).table.copy()

    def num_tokens(self, request_id: RequestId) -> int:
        return self._get(request_id).table.num_tokens

    def held_blocks(self, request_id: RequestId) -> list[int]:
        """Every block the request holds a reference on (table and shadow holds)."""
        return self._get(request_id).held_blocks()

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens' worth of new blocks can be had now."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise BadRequestError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        return blocks_needed(num_tokens, self.block_size) <= self.pool.num_free

    # -- pressure ---------------------------------------------------------------
    def set_pressure_callback(self, callback: Callable[[PressureEvent], None] | None) -> None:
        """Called when usage crosses ``high_watermark`` and before an out-of-blocks error.

        On ``out_of_blocks`` the callback may free or preempt requests; the
        manager checks capacity once more before giving up. Exceptions raised
        by the callback are logged and counted, never propagated.
        """
        self._pressure_cb = callback

    def set_pressure_gate(self, gate: PressureGate | None) -> None:
        """Consult ``gate`` (a :class:`~kvtier.pressure.PressureController`) on allocation.

        Before a new request changes anything, ``gate.check_admission()`` may
        raise :class:`~kvtier.errors.AdmissionRejectedError`. After every
        allocation and extension, cached blocks are evicted in the policy's
        order until the mode's ``free_target`` share of the pool is empty;
        with ``offload`` they go through the pool's eviction listener (the
        tier chain demotes them) first, else they are dropped.
        """
        self._gate = gate

    def set_resume_check(self, check: ResumeCheck | None) -> None:
        """Count a cached prefix as a hit only as far as ``check.resumable`` allows.

        Windowed storage (:mod:`kvtier.storage.windowed`) drops the sliding
        layers of blocks no query sees any more; a request may resume only
        after a block whose last window is whole. :meth:`match`,
        :meth:`rematch` and :meth:`allocate` then cut the device hit there
        (and look nothing up in the tiers past a cut).
        """
        self._resume = check

    def _reach_target(self, gate: PressureGate) -> None:
        actions = gate.actions
        pool = self.pool
        short = actions.target_blocks(pool.num_blocks) - pool.num_empty
        if short > 0 and pool.num_evictable > 0:
            self._target_evictions += pool.evict(short, announce=actions.offload)

    def _notify(self, reason: Literal["out_of_blocks", "high_watermark"], needed: int) -> None:
        cb = self._pressure_cb
        if cb is None:
            return
        pool = self.pool
        event = PressureEvent(reason, pool.usage, pool.num_free, pool.num_blocks, needed)
        try:
            cb(event)
        except Exception:
            self._callback_errors += 1
            log.exception("pressure callback raised on %s", reason)

    def _ensure_capacity(self, needed: int, reserved: int) -> None:
        """Raise OutOfBlocksError (nothing changed) unless ``needed`` blocks can be had.

        ``reserved`` counts evictable blocks the caller is about to take as hits.
        """
        pool = self.pool
        if needed <= pool.num_free - reserved:
            return
        self._notify("out_of_blocks", needed)
        available = pool.num_free - reserved
        if needed > available:
            self._failures += 1
            raise OutOfBlocksError(needed, max(available, 0), pool.num_blocks)

    def _after_growth(self) -> None:
        gate = self._gate
        if gate is not None:
            self._reach_target(gate)
        if self._pressure_cb is None:
            return
        above = self.pool.usage >= self.high_watermark
        if above and not self._above_watermark:
            self._above_watermark = True
            self._notify("high_watermark", 0)
        elif not above:
            self._above_watermark = False

    # -- the request lifecycle ----------------------------------------------------
    def match(
        self,
        token_ids: Sequence[int],
        *,
        extra_keys: Sequence[ExtraKey] = (),
        item_keys: Sequence[ItemKey] = (),
        hints: Mapping[str, object] | Hints | None = None,
        tiers: TierIndex | None = None,
    ) -> PrefixMatch:
        """Hash a request's tokens once and find its cached prefix on the device and tiers.

        Bad input (empty or invalid token ids, malformed item keys or hints)
        raises :class:`BadRequestError`; nothing changes either way. Pass the
        result to :meth:`allocate` (which then hashes nothing) and keep it:
        :meth:`rematch` refreshes its hits later.
        """
        extra = tuple(extra_keys)
        items = check_item_keys(item_keys) if item_keys else ()
        checked: Mapping[str, object] | None = None
        if hints is not None:
            parsed = parse_hints(hints, where="hints")
            checked = None if parsed is None else parsed.as_dict()
        if isinstance(token_ids, (str, bytes)) or len(token_ids) == 0:
            _token_array(token_ids, "token_ids")  # raises the right error
        n = len(token_ids)
        bs = self.block_size
        try:
            keys = self.hasher.chain(
                token_ids, extra=extra, block_extra=item_block_extra(items, 0, n // bs, bs)
            )
        except BadRequestError:
            _token_array(token_ids, "token_ids")  # a precise message
            raise
        _token_array(token_ids, "token_ids", allow_empty=True, start=(n // bs) * bs)
        return self._hits(PrefixMatch(n, tuple(keys), extra, items, checked, 0, 0), tiers)

    def rematch(self, match: PrefixMatch, tiers: TierIndex | None = None) -> PrefixMatch:
        """``match`` with its device and tier hits as they are now (nothing is hashed)."""
        return self._hits(match, tiers)

    def _hits(self, match: PrefixMatch, tiers: TierIndex | None) -> PrefixMatch:
        limit = (match.num_tokens - 1) // self.block_size
        keys = match.keys
        hits = self.pool.lookup(keys[:limit])
        device = len(hits)
        whole = True
        resume = self._resume
        if resume is not None and hits:
            device = resume.resumable(hits)
            whole = device == len(hits)
        plan: list[int] = []
        if tiers is not None and device < limit and whole:
            plan = tiers.lookup(keys[device:limit])
        return PrefixMatch(
            match.num_tokens,
            keys,
            match.extra,
            match.items,
            match.hints,
            device,
            len(plan),
            tuple(plan),
        )

    def allocate(
        self,
        request_id: RequestId,
        token_ids: Sequence[int],
        *,
        extra_keys: Sequence[ExtraKey] = (),
        block_keys: Sequence[int] | None = None,
        hints: Mapping[str, object] | None = None,
        request_keys: Sequence[int] | None = None,
        item_keys: Sequence[ItemKey] = (),
        match: PrefixMatch | None = None,
    ) -> Allocation:
        """Start a request: reuse its longest cached prefix and allocate the rest.

        ``extra_keys`` (a LoRA id, a per-request cache salt) are mixed into every
        block key. ``block_keys`` may carry keys the caller already computed with
        ``self.hasher.chain`` for the full blocks of ``token_ids`` (a scheduler
        hashes a request once, on arrival); only the partial tail is then read.
        ``hints`` (the agent hints of :mod:`kvtier.hints`; unknown or
        malformed ones raise :class:`BadRequestError` before anything changes)
        go to a request-aware policy's ``on_request`` with the keys;
        an engine that allocates a long prompt chunk by chunk passes the whole
        prompt's keys as ``request_keys``, so the policy hears of the request
        as it is, not of its first chunk. ``item_keys`` are the prompt's
        multimodal items, ``(position of the first placeholder token, content
        key)``: each is mixed into the block holding that position and every
        later block (:func:`~kvtier.keys.item_block_extra`), for the blocks
        allocated now and those later tokens fill. The last prompt token is never
        reported cached: the engine needs at least one token to compute logits
        from.

        ``match`` (from :meth:`match` over these tokens, or over tokens they
        begin) replaces ``extra_keys``, ``item_keys``, ``hints``,
        ``block_keys`` and ``request_keys``: its keys, already checked input
        and parsed hints are used as they are.
        """
        try:
            live = request_id in self._requests
        except TypeError:
            raise BadRequestError(f"request id {request_id!r} is not hashable") from None
        if live:
            raise DuplicateRequestError(request_id)
        bs = self.block_size
        checked: Mapping[str, object] | None = None
        if match is not None:
            if len(token_ids) > match.num_tokens or len(token_ids) == 0:
                raise BadRequestError(
                    f"allocate got {len(token_ids)} tokens for a match of "
                    f"{match.num_tokens}: give the matched tokens or a non-empty prefix of them"
                )
            checked = match.hints
            extra = match.extra
            items = match.items
            block_keys = match.keys[: len(token_ids) // bs]
            request_keys = match.keys
        else:
            if hints is not None:
                parsed = parse_hints(hints, where="hints")
                checked = None if parsed is None else parsed.as_dict()
            extra = tuple(extra_keys)
            items = check_item_keys(item_keys) if item_keys else ()
        if isinstance(token_ids, (str, bytes)) or len(token_ids) == 0:
            _token_array(token_ids, "token_ids")  # raises the right error
        n = len(token_ids)
        n_full = n // bs
        # Validating the tail doubles as storing it; hashing validates the rest.
        tail = _token_array(token_ids, "token_ids", allow_empty=True, start=n_full * bs)
        if block_keys is None:
            try:
                keys = self.hasher.chain(
                    token_ids, extra=extra, block_extra=item_block_extra(items, 0, n_full, bs)
                )
            except BadRequestError:
                _token_array(token_ids, "token_ids")  # a precise message
                raise
        else:
            keys = list(block_keys)
            if len(keys) != n_full:
                raise BadRequestError(
                    f"block_keys has {len(keys)} keys but token_ids has {n_full} full blocks"
                )
        gate = self._gate
        if gate is not None:
            gate.check_admission()
        pool = self.pool
        hits = pool.lookup(keys, (n - 1) // bs)
        resume = self._resume
        if resume is not None and hits:
            del hits[resume.resumable(hits) :]
        n_hit = len(hits)
        needed = -(-n // bs) - n_hit
        self._ensure_capacity(needed, pool.count_evictable(hits) if hits else 0)

        hook = self._request_hook
        if hook is not None:
            # A copy: ``keys`` becomes the request's own list, which grows with it.
            hook(list(keys) if request_keys is None else request_keys, n_hit, self.clock(), checked)
        pool.acquire(hits)
        new_blocks = pool.allocate(needed)
        hits.extend(new_blocks)
        table = BlockTable(bs, hits, n)
        # The tail is the request's from the start: a declined block empties it.
        req = _Request(table, extra, items, keys, tail)
        self._requests[request_id] = req
        if n_full > n_hit:
            tokens = None
            if pool.journal is not None:
                tokens = token_ids[n_hit * bs : n_full * bs]
            self._publish(req, keys, n_hit, n_full, tokens)
        self._allocations += 1
        self._queried_tokens += n
        self._hit_tokens += n_hit * bs
        self._after_growth()
        return Allocation(request_id, n_hit * bs, table.copy(), new_blocks)

    def _publish(
        self,
        req: _Request,
        keys: list[int],
        start: int,
        upto: int,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Publish the request's full blocks ``start .. upto-1``.

        ``keys`` holds the keys of the request's blocks ``0 .. upto-1`` (the
        first ``start`` published already); it becomes ``req.keys``, cut
        short if admission declines a block. ``tokens`` (the token ids of the
        blocks published now) are needed only while the pool keeps a journal:
        the stored event carries them.
        """
        req.keys = keys
        parent = keys[start - 1] if start else None
        blocks = req.table.blocks
        pool = self.pool
        results = pool.commit_run(blocks, keys, start, upto, parent)
        journal = pool.journal
        if journal is not None and tokens is not None:
            done = blocks[start:upto] if results is None else results
            self._journal_stored(journal, done, blocks, keys, start, parent, tokens)
        if results is None:
            return  # every block became the cached copy: nothing held in its place
        for i, cached in enumerate(results, start):
            if cached < 0:
                # Admission declined this block: the ones before it are published.
                del keys[i:]
                req.chain_open = False
                req.tail = array("I")
                return
            if cached != blocks[i]:
                # Same content is cached elsewhere: hold that copy so the chain
                # this request publishes under it can never be stranded.
                self.pool.acquire((cached,), hit=False)
                req.shadow[i] = cached
                self._duplicates += 1

    def _journal_stored(
        self,
        journal: list[JournalEntry],
        results: list[int],
        blocks: list[int],
        keys: Sequence[int],
        start: int,
        parent: int | None,
        tokens: Sequence[int],
    ) -> None:
        """Record the blocks ``commit_chain`` made cached (not duplicates or declines).

        One entry per unbroken run, each with its parent key, as KV events carry them.
        """
        bs = self.block_size
        run: list[int] = []
        run_tokens: list[int] = []
        run_parent = -1 if parent is None else parent
        for j, cached in enumerate(results):
            i = start + j
            if cached < 0:
                break
            if cached == blocks[i]:
                if not run:
                    run_parent = keys[i - 1] if i > 0 else run_parent
                run.append(keys[i])
                run_tokens.extend(tokens[j * bs : (j + 1) * bs])
            elif run:
                journal.append((STORED, run, run_parent, run_tokens))
                run, run_tokens = [], []
        if run:
            journal.append((STORED, run, run_parent, run_tokens))

    def extend(
        self,
        request_id: RequestId,
        new_token_ids: Sequence[int],
        *,
        block_keys: Sequence[int] | None = None,
    ) -> Extension:
        """Append tokens (prompt continuation or generated tokens) to a request.

        ``block_keys`` may carry the keys of the blocks these tokens fill,
        chained from the request's previous full block and computed with
        ``self.hasher`` (as for :meth:`allocate`); otherwise they are hashed here.
        """
        req = self._get(request_id)
        bs = self.block_size
        table = req.table
        old_n = table.num_tokens
        n_new = len(new_token_ids)
        new_n = old_n + n_new
        n_full = new_n // bs
        new_tokens = _token_array(new_token_ids, "new_token_ids")
        if block_keys is not None:
            expected = n_full - old_n // bs
            if len(block_keys) != expected:
                raise BadRequestError(
                    f"block_keys has {len(block_keys)} keys but these tokens fill {expected} blocks"
                )
        pool = self.pool
        grow = -(-new_n // bs) - len(table.blocks)
        cow = old_n % bs != 0 and pool.ref[table.blocks[-1]] > 1
        self._ensure_capacity(grow + cow, 0)

        copies: list[tuple[int, int]] = []
        if cow:
            src = table.blocks[-1]
            (dst,) = pool.allocate(1)
            pool.release((src,))
            table.blocks[-1] = dst
            copies.append((src, dst))
            self._cow_copies += 1
        new_blocks = pool.allocate(grow)
        table.blocks.extend(new_blocks)
        table.num_tokens = new_n
        if req.chain_open:
            if n_full == len(req.keys):
                req.tail.extend(new_tokens)
            elif block_keys is not None:
                rest = new_n % bs
                filled = None
                if pool.journal is not None:
                    filled = list(req.tail) + list(new_tokens[: n_new - rest])
                req.tail = new_tokens[n_new - rest :] if rest else array("I")
                start = len(req.keys)
                req.keys.extend(block_keys)
                self._publish(req, req.keys, start, n_full, filled)
            else:
                req.tail.extend(new_tokens)
                filled = None
                if pool.journal is not None:
                    filled = list(req.tail[: (n_full - len(req.keys)) * bs])
                start = len(req.keys)
                self._publish(req, self._extend_keys(req, n_full), start, n_full, filled)
        self._after_growth()
        return Extension(table.copy(), new_blocks, copies)

    def _extend_keys(self, req: _Request, n_full: int) -> list[int]:
        """The request's keys, extended (in place) with keys for its newly full blocks."""
        bs = self.block_size
        cut = (n_full - len(req.keys)) * bs
        parent = req.keys[-1] if req.keys else None
        first = len(req.keys)
        block_extra = item_block_extra(req.items, first, n_full - first, bs)
        more = self.hasher.chain(req.tail[:cut], parent, extra=req.extra, block_extra=block_extra)
        del req.tail[:cut]
        req.keys.extend(more)
        return req.keys

    def block_keys(self, request_id: RequestId) -> list[int]:
        """Keys of the request's leading full blocks that are published (a copy)."""
        return list(self._get(request_id).keys)

    def free(self, request_id: RequestId) -> None:
        """End a request; its published blocks stay cached until evicted."""
        req = self._get(request_id)
        del self._requests[request_id]
        # Tail first, as held_blocks() lists them.
        self.pool.release(req.held_blocks() if req.shadow else req.table.blocks[::-1])
        self._after_growth()

    def free_and_drop(self, request_id: RequestId) -> int:
        """End a request and drop its blocks that no other request holds; returns how many.

        For a request whose blocks were copied elsewhere (swapped out to a
        tier): they leave the device now instead of waiting to be evicted,
        and are not announced to the evict listeners (they are stored already).
        """
        req = self._get(request_id)
        held = req.held_blocks()
        self.free(request_id)
        ref = self.pool.ref
        return self.pool.withdraw([b for b in reversed(held) if ref[b] == 0])

    def abort(self, request_id: RequestId, num_computed_tokens: int) -> int:
        """End a request whose KV was written only for its first ``num_computed_tokens`` tokens.

        Blocks are published when their tokens are allocated, before the
        forward pass fills them; after a failed pass this withdraws every
        block the request published past its computed tokens (so they can
        never be hit with garbage in them), then frees the request like
        :meth:`free`. The computed blocks stay cached. Returns how many blocks
        were withdrawn.
        """
        req = self._get(request_id)
        if (
            not isinstance(num_computed_tokens, int)
            or num_computed_tokens < 0
            or num_computed_tokens > req.table.num_tokens
        ):
            raise BadRequestError(
                f"num_computed_tokens must be an integer in [0, {req.table.num_tokens}], "
                f"got {num_computed_tokens!r}"
            )
        blocks = req.table.blocks
        block_key = self.pool.block_key
        bad: list[int] = []
        for i in range(num_computed_tokens // self.block_size, len(req.keys)):
            b = blocks[i]
            # A shadowed position's cached copy belongs to another request.
            if i not in req.shadow and block_key[b] == req.keys[i]:
                bad.append(b)
        withdrawn = self.pool.withdraw(bad)
        del self._requests[request_id]
        self.pool.release(req.held_blocks())
        self._after_growth()
        return withdrawn

    def fork(self, src_id: RequestId, dst_id: RequestId) -> BlockTable:
        """Start ``dst_id`` as a copy of ``src_id`` sharing every block (copy-on-write)."""
        src = self._get(src_id)
        try:
            live = dst_id in self._requests
        except TypeError:
            raise BadRequestError(f"request id {dst_id!r} is not hashable") from None
        if live:
            raise DuplicateRequestError(dst_id)
        dst = _Request(src.table.copy(), src.extra, src.items)
        dst.tail = array("I", src.tail)
        dst.keys = list(src.keys)
        dst.chain_open = src.chain_open
        dst.shadow = dict(src.shadow)
        self.pool.acquire(dst.held_blocks(), hit=False)
        self._requests[dst_id] = dst
        return dst.table.copy()

    # -- maintenance -------------------------------------------------------------
    def gc(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` unreferenced cached blocks (all if None)."""
        if num_blocks is not None and num_blocks < 0:
            raise BadRequestError(f"num_blocks must be non-negative, got {num_blocks}")
        freed = self.pool.evict(self.pool.num_blocks if num_blocks is None else num_blocks)
        self._after_growth()
        return freed

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (e.g. after a weight update)."""
        freed = self.pool.clear_cache()
        self._after_growth()
        return freed

    # -- what other levels ask of the device cache -----------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy of the device's cached blocks."""
        return self.pool.policy

    @property
    def num_free(self) -> int:
        """Blocks an allocation can obtain right now (empty, or cached and evictable)."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of the blocks requests hold, 0..1 (cached free blocks count as free)."""
        return self.pool.usage

    def cached_block(self, key: int) -> int | None:
        """The device block cached under ``key``, or ``None``."""
        return self.pool.cached_block(key)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.pool.num_used

    @property
    def num_empty(self) -> int:
        """Blocks that hold nothing (neither a request's nor cached)."""
        return self.pool.num_empty

    def device_hits(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the device holds (a prefix match without tiers)."""
        return len(self.pool.lookup(keys))

    def prefix_blocks(self, keys: Sequence[int]) -> list[int]:
        """The device blocks cached under the leading ``keys`` (stops at the first miss)."""
        return self.pool.lookup(keys)

    def ref_count(self, block: int) -> int:
        """How many requests hold ``block`` (0: cached, evictable)."""
        return self.pool.ref[block]

    def count_evictable(self, blocks: Sequence[int]) -> int:
        """How many of the cached ``blocks`` no request holds."""
        return self.pool.count_evictable(blocks)

    def is_shared(self, block: int) -> bool:
        """Whether more than one request holds ``block`` (writing it needs a copy)."""
        return self.pool.ref[block] > 1

    def compression_plan(self, keys: Sequence[int], fraction: float) -> tuple[list[int], list[int]]:
        """The cached blocks of a prefix chain that may leave the device: the last
        ``fraction`` of the chain's device blocks no request holds, with every cached
        descendant, children first (the order demotions go in); and their keys."""
        pool = self.pool
        chain = pool.lookup(keys)
        # Held blocks are a prefix of the chain (a request holds all of its
        # blocks' parents), so the free ones are its tail.
        first = len(chain)
        while first > 0 and not pool.ref[chain[first - 1]]:
            first -= 1
        want = len(chain) - math.ceil(len(chain) * fraction - 1e-9)
        first = max(first, want)
        if first >= len(chain):
            return [], []
        order: list[int] = []
        stack = [chain[first]]
        while stack:
            b = stack.pop()
            order.append(b)
            stack.extend(pool.children_of(b))
        order.reverse()
        out_keys: list[int] = []
        for b in order:
            key = pool.block_key[b]
            assert key is not None
            out_keys.append(key)
        return order, out_keys

    def withdraw_stored(
        self, blocks: Sequence[int], keys: Sequence[int], stored: Callable[[int], bool]
    ) -> list[int]:
        """Free the ``blocks`` (children first, as :meth:`compression_plan` lists them)
        whose key another level now holds (``stored(key)``), whole subtrees only: a block
        leaves with its descendants. Returns them, parents first. A withdrawal is not
        an eviction: evict listeners do not hear of it."""
        pool = self.pool
        gone: set[int] = set()
        for b, key in zip(blocks, keys, strict=True):
            if stored(key) and all(c in gone for c in pool.children_of(b)):
                gone.add(b)
        leaving = [b for b in reversed(blocks) if b in gone]
        pool.withdraw(leaving)
        return leaving

    # -- ports -----------------------------------------------------------------------
    def add_evict_listener(self, listener: EvictListener) -> None:
        """Hear of cached blocks an eviction is about to free (see :class:`BlockPool`)."""
        self.pool.add_evict_listener(listener)

    def remove_evict_listener(self, listener: EvictListener) -> None:
        self.pool.remove_evict_listener(listener)

    def record_events(self, on: bool = True) -> None:
        """Start (or stop) recording KV events for :meth:`take_events`."""
        self.pool.record_journal(on)

    def take_events(self) -> list[JournalEntry]:
        """KV events since the last call: ``(kind, keys, parent key or -1, token ids)``.

        ``kind`` is :data:`kvtier.pool.STORED` (blocks became cached, with
        their token ids), ``REMOVED`` (blocks left the device) or ``CLEARED``
        (every cached block left). Empty unless :meth:`record_events` is on.
        """
        return self.pool.take_journal()

    def stats(self) -> CacheStats:
        pool = self.pool
        q = self._queried_tokens
        return CacheStats(
            hit_tokens=self._hit_tokens,
            queried_tokens=q,
            hit_ratio=self._hit_tokens / q if q else 0.0,
            evictions=pool.evictions,
            cascade_evictions=pool.cascade_evictions,
            usage=pool.usage,
            used_blocks=pool.num_used,
            free_blocks=pool.num_free,
            empty_blocks=pool.num_empty,
            cached_blocks=pool.num_cached,
            total_blocks=pool.num_blocks,
            num_requests=len(self._requests),
            allocations=self._allocations,
            allocation_failures=self._failures,
            declined_blocks=pool.declined,
            duplicate_blocks=self._duplicates,
            cow_copies=self._cow_copies,
            callback_errors=self._callback_errors,
            policy=getattr(pool.policy, "name", type(pool.policy).__name__),
            pressure_evictions=self._target_evictions,
        )

    def check(self) -> None:
        """Verify every bookkeeping invariant (for tests and debugging)."""
        self.pool.check(r.held_blocks() for r in self._requests.values())
        for rid, req in self._requests.items():
            table = req.table
            if len(table.blocks) != blocks_needed(table.num_tokens, self.block_size):
                raise InternalInvariantError(f"request {rid!r}: table size does not fit its tokens")
            if req.chain_open and len(req.keys) * self.block_size + len(req.tail) != (
                table.num_tokens
            ):
                raise InternalInvariantError(f"request {rid!r}: keyed and tail tokens mismatch")
