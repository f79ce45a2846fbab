"""kvtier's offloading manager behind the ``OffloadingManager`` API of vLLM 0.12 - 0.16.

Those releases had the scheduler call an ``OffloadingManager`` directly, with
block hashes (``bytes``) as keys, and left allocation to a ``Backend``
(``block_size``, ``medium``, ``get_num_free_blocks()``,
``get_load_store_spec(block_hashes, blocks)``). :class:`LegacyOffloadingManager`
implements that manager on top of :class:`kvtier.offload.OffloadingManager`, so
any kvtier policy (and admission filter) decides what the CPU tier keeps:

* ``lookup(block_hashes)``: the number of leading blocks stored and ready
  (with ``retry_pending=True``, ``None`` when the first block that is not
  ready is still being stored: the releases whose connector understood
  "retry later");
* ``prepare_load`` pins, ``complete_load`` unpins, ``touch`` records a use;
* ``prepare_store`` returns the blocks to write, where (the backend's
  ``LoadStoreSpec`` over kvtier's slots) and the blocks evicted for room, or
  ``None`` with nothing changed when room cannot be made;
* ``complete_store(block_hashes, success)``; ``take_events()`` yields
  ``OffloadingEvent(block_hashes, block_size, medium, removed)``.

kvtier's manager hands out the slots (``0 .. capacity-1``, the capacity being
the backend's free blocks at construction), so the backend is only asked for
its specs: ``get_load_store_spec`` receives block objects with ``block_id``
(the slot) and ``ref_cnt``, which is what vLLM's ``CPUBackend`` reads.

The return types are vLLM's own ``PrepareStoreOutput`` and ``OffloadingEvent``
(``vllm.v1.kv_offload.abstract``) when an old vLLM is installed, otherwise
local dataclasses of the same fields. This adapter is tested against that
protocol in plain Python; no vLLM 0.12 - 0.16 is installed where its tests run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.errors import BadRequestError, InternalInvariantError
from kvtier.integrations.vllm.version import MANAGER_API, detect_vllm
from kvtier.offload.manager import OffloadingManager
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import make_policy

BlockHash = bytes


class LegacyBackend(Protocol):
    """What the adapter uses of vLLM 0.12 - 0.16's ``Backend``."""

    block_size: int
    medium: str

    def get_num_free_blocks(self) -> int: ...

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[Any]
    ) -> Any: ...


@dataclass
class LegacyPrepareStoreOutput:
    """The shape of vLLM 0.12 - 0.16's ``PrepareStoreOutput``."""

    block_hashes_to_store: list[BlockHash]
    store_spec: Any
    block_hashes_evicted: list[BlockHash]


@dataclass
class LegacyOffloadingEvent:
    """The shape of vLLM 0.12 - 0.16's ``OffloadingEvent``."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    #: True if the blocks were removed, False if stored.
    removed: bool


class SlotBlock:
    """A block handed to ``Backend.get_load_store_spec``: ``block_id`` is kvtier's slot."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int, ref_cnt: int = 0) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"SlotBlock({self.block_id}, ref_cnt={self.ref_cnt})"


def block_hash_key(block_hash: object) -> int:
    """kvtier's int key for a block hash (``bytes``, or an ``int`` key as is)."""
    if isinstance(block_hash, bytes | bytearray):
        # The bit above the bytes keeps hashes of different lengths apart.
        return int.from_bytes(block_hash, "big") | (1 << (len(block_hash) << 3))
    if isinstance(block_hash, int) and not isinstance(block_hash, bool) and block_hash >= 0:
        return block_hash
    raise BadRequestError(f"a block hash must be bytes or a non-negative int, got {block_hash!r}")


def _vllm_types() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """vLLM's own output and event classes when an old vLLM is installed, else local ones."""
    if detect_vllm().api == MANAGER_API:
        try:
            abstract = importlib.import_module("vllm.v1.kv_offload.abstract")
            return abstract.PrepareStoreOutput, abstract.OffloadingEvent
        except (ImportError, AttributeError):
            pass
    return LegacyPrepareStoreOutput, LegacyOffloadingEvent


class LegacyOffloadingManager:
    """vLLM 0.12 - 0.16's ``OffloadingManager`` over a kvtier offloading manager.

    ``policy`` is a kvtier policy name (with ``admission``, e.g. ``"tinylfu"``)
    or a policy instance. Pass ``manager`` to wrap an existing kvtier manager
    instead (its capacity must not exceed the backend's blocks).
    """

    def __init__(
        self,
        backend: LegacyBackend,
        policy: str | EvictionPolicy = "lru",
        *,
        admission: str | None = None,
        enable_events: bool = False,
        retry_pending: bool = False,
        manager: OffloadingManager | None = None,
    ) -> None:
        self.backend = backend
        self.block_size = int(backend.block_size)
        self.medium = str(backend.medium)
        if manager is None:
            if isinstance(policy, str):
                kwargs: dict[str, Any] = {} if admission is None else {"admission": admission}
                policy = make_policy(policy, **kwargs)
            manager = OffloadingManager(
                int(backend.get_num_free_blocks()), policy, medium=self.medium
            )
        self.manager = manager
        self.retry_pending = retry_pending
        self._hash_of: dict[int, BlockHash] = {}
        self.events: list[Any] | None = [] if enable_events else None
        self._output_cls, self._event_cls = _vllm_types()

    # -- helpers ------------------------------------------------------------------------
    def _spec(self, block_hashes: Sequence[BlockHash], slots: Sequence[int], ref: int) -> Any:
        return self.backend.get_load_store_spec(
            block_hashes, [SlotBlock(slot, ref) for slot in slots]
        )

    def _collect_events(self) -> None:
        """Turn the kvtier manager's events into the old event type (hashes still known)."""
        hash_of = self._hash_of
        for ev in self.manager.take_events():
            if self.events is not None:
                self.events.append(
                    self._event_cls(
                        block_hashes=[hash_of[k] for k in ev.keys],
                        block_size=self.block_size,
                        medium=self.medium,
                        removed=ev.removed,
                    )
                )

    # -- the OffloadingManager protocol -------------------------------------------------
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int | None:
        manager = self.manager
        n = 0
        for h in block_hashes:
            key = block_hash_key(h)
            if manager.is_ready(key):
                n += 1
                continue
            if self.retry_pending and key in manager:
                return None  # being stored: ask again later
            break
        return n

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> Any:
        hashes = list(block_hashes)
        slots = self.manager.prepare_load([block_hash_key(h) for h in hashes])
        return self._spec(hashes, slots, 1)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self.manager.touch([block_hash_key(h) for h in block_hashes])

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        self.manager.complete_load([block_hash_key(h) for h in block_hashes])

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> Any | None:
        hashes = list(block_hashes)
        keys = [block_hash_key(h) for h in hashes]
        out = self.manager.prepare_store(keys)
        if out is None:
            return None
        hash_of = self._hash_of
        by_key = dict(zip(keys, hashes, strict=True))
        to_store = [by_key[k] for k in out.keys_to_store]
        for k, h in zip(out.keys_to_store, to_store, strict=True):
            hash_of[k] = h
        self._collect_events()
        evicted = [hash_of.pop(k) for k in out.evicted_keys]
        return self._output_cls(
            block_hashes_to_store=to_store,
            store_spec=self._spec(to_store, out.slots, -1),
            block_hashes_evicted=evicted,
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        keys = [block_hash_key(h) for h in block_hashes]
        manager = self.manager
        failed = [] if success else [k for k in keys if k in manager and not manager.is_ready(k)]
        manager.complete_store(keys, success)
        self._collect_events()
        for k in failed:
            self._hash_of.pop(k, None)

    def take_events(self) -> Iterator[Any]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events

    # -- introspection ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.manager)

    def __contains__(self, block_hash: object) -> bool:
        try:
            return block_hash_key(block_hash) in self.manager
        except BadRequestError:
            return False

    def check(self) -> None:
        """The kvtier manager's own check, plus: every held key has its block hash."""
        self.manager.check()
        held = {k for k in self._hash_of if k in self.manager}
        if held != set(self._hash_of) or len(self._hash_of) != len(self.manager):
            raise InternalInvariantError(
                f"{len(self._hash_of)} block hashes known for {len(self.manager)} held keys"
            )
