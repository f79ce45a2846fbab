"""A vLLM ``CachePolicy`` whose evictions are decided by a kvtier policy.

vLLM 0.33's ``CPUOffloadingManager`` owns the CPU chunk pool, reference
counts, events and the two-phase store/load protocol; it asks a
``CachePolicy`` to keep its chunks and to choose victims. This module's
:class:`KvTierCachePolicy` keeps the chunks and hands every ordering decision
to a kvtier policy (:func:`kvtier.policy.make_policy`), so any kvtier policy,
with or without an admission filter, runs inside vLLM unchanged.

vLLM loads a policy class by name from a module path, constructing it with
``cache_capacity`` only, so the kvtier policy is fixed by the class:

* one class per shipped policy: ``KvTierLRUCachePolicy``,
  ``KvTierARCCachePolicy``, ``KvTierS3FIFOCachePolicy``, ...,
  ``KvTierLearnedReuseCachePolicy``;
* any registered policy (yours too) and admission by name:
  ``"kvtier:<policy>"`` or ``"kvtier:<policy>+<admission>"``, served by this
  module's ``__getattr__`` (``getattr(module, "kvtier:s3fifo+tinylfu")``).

In ``kv_connector_extra_config``::

    "eviction_policy": "kvtier:s3fifo",
    "cache_policy_module_path": "kvtier.integrations.vllm.cache_policy"

How vLLM's chunk states map onto the kvtier protocol:

* a chunk being stored (``ref_cnt == -1``) is not resident in the kvtier
  policy: it can never be chosen, and a failed store only drops the chunk;
* when a store completes the chunk becomes resident (``insert``). A request's
  chunks whose stores complete together enter tails first, so a recency
  policy evicts a chain's leaves before its parents (vLLM's own LRU orders a
  request's chunks the same way); the inserts happen at the next call that
  needs the policy's state;
* a chunk being loaded (``ref_cnt > 0``) is pinned (``pin`` / ``unpin``);
* chunks a request reused are accessed once, when the request finishes
  (vLLM 0.33 commits accesses there); a chunk the request only stored is not
  accessed again, so frequency policies do not count its store as a reuse;
* ``evict(n, protected)`` is atomic: it returns ``None`` and changes nothing
  when fewer than ``n`` unpinned, unprotected ready chunks exist. Protected
  chunks (the keys of the ``prepare_store`` call) are pinned while victims are
  chosen; kvtier policies treat the release as a use, as kvtier's own
  offloading manager does;
* with an admission filter (``"kvtier:lru+tinylfu"``) a chunk it declines is
  still stored (vLLM has already written it) but held outside the policy and
  evicted before any admitted chunk, oldest first; a later reuse that the
  filter admits moves it into the policy. After the first declined chunk of a
  completed batch, the rest of that batch is declined too: a block is useless
  without its parent.

Importing this module needs vLLM 0.33 (see :mod:`.version`); it raises
:class:`~kvtier.integrations.errors.UnsupportedVllmError` otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any, ClassVar

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.integrations.vllm.version import CACHE_POLICY_API, require_vllm
from kvtier.policy import available_policies, make_policy
from kvtier.policy.base import EvictionPolicy, PolicyBase, admit_chain

VLLM = require_vllm(CACHE_POLICY_API)

from vllm.v1.kv_offload.base import OffloadKey, ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import (  # noqa: E402
    CachePolicy,
    ChunkStatus,
    order_request_keys,
)

#: The module path to give vLLM as ``cache_policy_module_path``.
MODULE_PATH = __name__
#: Prefix of the policy names this module resolves by name.
NAME_PREFIX = "kvtier:"


def offload_key_id(key: bytes) -> int:
    """kvtier's int key for a vLLM ``OffloadKey``: one-to-one over byte strings.

    The bit above the key's bytes keeps keys of different lengths apart.
    """
    return int.from_bytes(key, "big") | (1 << (len(key) << 3))


class KvTierCachePolicy(CachePolicy):  # type: ignore[misc]
    """vLLM's ``CachePolicy`` with victims chosen by a kvtier policy (see the module docs).

    ``policy``, ``admission`` and ``options`` (keyword arguments for the
    policy's constructor) default to the class attributes ``kvtier_policy``,
    ``kvtier_admission`` and ``kvtier_options``; vLLM passes only
    ``cache_capacity``.
    """

    kvtier_policy: ClassVar[str] = "lru"
    kvtier_admission: ClassVar[str | None] = None
    kvtier_options: ClassVar[Mapping[str, Any]] = {}
    #: Insert a request's completed chunks in chain order, pinned, then release
    #: them tail first (what kvtier's device pool does). Recency policies end up
    #: with the same order as with the default (tails inserted first), and
    #: policies that keep each request's chain, such as learned-reuse, keep it
    #: head to tail, so they evict its tail first. Set by the connector's classes.
    chain_order_inserts: ClassVar[bool] = False

    def __init__(
        self,
        cache_capacity: int,
        policy: str | None = None,
        admission: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(cache_capacity)
        self.policy_name = policy or self.kvtier_policy
        self.admission_name = admission if admission is not None else self.kvtier_admission
        self.policy_options: dict[str, Any] = dict(options or self.kvtier_options)
        #: Every chunk vLLM handed over (being stored or ready), by offload key.
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.policy: EvictionPolicy = self._new_policy()
        # kvtier's int key of every chunk, both ways.
        self._ids: dict[OffloadKey, int] = {}
        self._key_of: dict[int, OffloadKey] = {}
        # The request that stored each chunk still being written.
        #: Chunks being stored: the request storing each, and when it was inserted.
        self._writer: dict[OffloadKey, tuple[str, int]] = {}
        # Chunks whose store completed since the last other call, in completion
        # order, with the request that stored them and when they were inserted.
        self._ready: list[tuple[OffloadKey, str, int]] = []
        self._inserts = 0
        # Ready chunks the admission filter declined: evictable oldest first, and pinned.
        self._declined: OrderedDict[int, None] = OrderedDict()
        self._declined_pinned: set[int] = set()

    def _new_policy(self) -> EvictionPolicy:
        kwargs = dict(self.policy_options)
        if self.admission_name is not None:
            kwargs["admission"] = self.admission_name
        policy = make_policy(self.policy_name, **kwargs)
        # vLLM may size a pool at 0 chunks (no worker sizes yet); nothing is ever
        # stored then, and a policy needs a positive capacity.
        policy.bind(max(1, self.cache_capacity))
        # Without a filter of its own a policy admits everything: skip the calls.
        self._filtering = getattr(type(policy), "admit", None) is not PolicyBase.admit
        return policy

    # -- deferred inserts ---------------------------------------------------------------------
    def _flush(self) -> None:
        """Make the chunks whose stores completed resident: per request, tails first."""
        batch = self._ready
        if not batch:
            return
        self._ready = []
        start = 0
        for i in range(1, len(batch) + 1):
            if i == len(batch) or batch[i][1] != batch[start][1]:
                # vLLM completes a store job's chunks in the order of a set of their
                # keys, which Python's hash seed decides: back in the order they were
                # inserted (their chain's), so decisions do not depend on the seed.
                run = sorted(batch[start:i], key=itemgetter(2))
                self._admit_run([key for key, _, _ in run])
                start = i

    def _admit_run(self, run: list[OffloadKey]) -> None:
        """One request's newly ready chunks, in chain order."""
        chunks = self.chunks
        ids_of = self._ids
        policy = self.policy
        ids: list[int] = []
        pinned: list[bool] = []
        for key in run:
            chunk = chunks.get(key)
            if chunk is None or chunk.ref_cnt < 0:
                continue
            ids.append(ids_of[key])
            pinned.append(chunk.ref_cnt > 0)
        if not self._filtering and not any(pinned):
            if self.chain_order_inserts:
                policy.insert_many(ids, True)
                ids.reverse()
                policy.unpin_many(ids)
                return
            ids.reverse()
            policy.insert_many(ids)
            return
        cut = admit_chain(policy.admit, ids) if self._filtering else len(ids)
        for i in range(len(ids) - 1, -1, -1):
            kid = ids[i]
            if i < cut:
                policy.insert(kid, pinned[i])
            elif pinned[i]:
                self._declined_pinned.add(kid)
            else:
                self._declined[kid] = None

    def _reuse(self, kid: int) -> None:
        """A ready chunk was used again: tell the policy, or let the filter reconsider it."""
        if kid in self._declined or kid in self._declined_pinned:
            if not self.policy.admit(kid):
                return
            pinned = kid in self._declined_pinned
            if pinned:
                self._declined_pinned.discard(kid)
            else:
                del self._declined[kid]
            self.policy.insert(kid, pinned)
        elif kid in self.policy:
            self.policy.access(kid)

    # -- vLLM's CachePolicy interface ----------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        if key in self.chunks:
            raise InternalInvariantError(f"chunk {key!r} was inserted twice")
        kid = offload_key_id(key)
        self.chunks[key] = chunk
        self._ids[key] = kid
        self._key_of[kid] = key
        writer: str = req_context.req_id
        self._inserts += 1
        if chunk.ref_cnt >= 0:
            # Already readable (vLLM inserts chunks as being stored; a caller may not).
            self._ready.append((key, writer, self._inserts))
        else:
            self._writer[key] = (writer, self._inserts)

    def remove(self, key: OffloadKey) -> None:
        self._flush()
        chunk = self.chunks.pop(key, None)
        if chunk is None:
            return
        self._writer.pop(key, None)
        kid = self._ids.pop(key)
        del self._key_of[kid]
        if kid in self._declined:
            del self._declined[kid]
        elif kid in self._declined_pinned:
            self._declined_pinned.discard(kid)
        else:
            self.policy.remove(kid)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._flush()
        chunks = self.chunks
        ids = self._ids
        # Reversed, so the first key of a chain ends up the most recent.
        for key in reversed(list(keys)):
            chunk = chunks.get(key)
            if chunk is not None and chunk.ref_cnt >= 0:
                self._reuse(ids[key])

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # kvtier policies learn from their ghosts when a key is inserted again.
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        if not reused_keys:
            return
        self._flush()
        chunks = self.chunks
        ids = self._ids
        policy = self.policy
        declined = self._declined
        declined_pinned = self._declined_pinned
        # Tail first, so the chain's head ends up the most recent; one batch call
        # for the keys the policy holds (the filter reconsiders declined ones).
        used: list[int] = []
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in reused_keys:
                chunk = chunks.get(key)
                if chunk is not None and chunk.ref_cnt >= 0:
                    kid = ids[key]
                    if kid in declined or kid in declined_pinned:
                        if used:
                            policy.access_many(used)
                            used = []
                        self._reuse(kid)
                    elif kid in policy:
                        used.append(kid)
        if used:
            policy.access_many(used)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        self._flush()
        chunks = self.chunks
        ids = self._ids
        policy = self.policy
        declined = self._declined
        shielded: list[int] = []
        shielded_declined = 0
        for key in protected:
            chunk = chunks.get(key)
            if chunk is None or chunk.ref_cnt != 0:
                continue
            kid = ids[key]
            if kid in declined:
                shielded_declined += 1
            else:
                shielded.append(kid)
        if policy.num_evictable - len(shielded) + len(declined) - shielded_declined < n:
            return None
        key_of = self._key_of
        victims: list[int] = []
        if declined:
            for kid in declined:
                if len(victims) == n:
                    break
                if key_of[kid] not in protected:
                    victims.append(kid)
            for kid in victims:
                del declined[kid]
        need = n - len(victims)
        if need:
            if shielded:
                # Sorted, so the order they rejoin the policy in does not depend
                # on the set's iteration order.
                shielded.sort()
                policy.pin_many(shielded)
                try:
                    chosen = policy.evict_many(need)
                finally:
                    policy.unpin_many(shielded)
            else:
                chosen = policy.evict_many(need)
            if len(chosen) != need:
                raise InternalInvariantError(
                    f"the {policy.name} policy gave {len(chosen)} victims of {need}"
                )
            victims.extend(chosen)
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for kid in victims:
            key = key_of.pop(kid)
            del ids[key]
            chunk = chunks.pop(key)
            if chunk.ref_cnt != 0:
                raise InternalInvariantError(
                    f"the {policy.name} policy evicted chunk {key!r} with ref_cnt {chunk.ref_cnt}"
                )
            out.append((key, chunk))
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._ids.clear()
        self._key_of.clear()
        self._ready.clear()
        self._writer.clear()
        self._declined.clear()
        self._declined_pinned.clear()
        self.policy = self._new_policy()

    def mark_evictable(self, key: OffloadKey) -> None:
        stored = self._writer.pop(key, None)
        if stored is not None:
            # A store completed (ref_cnt -1 -> 0): resident from the next call on.
            self._ready.append((key, *stored))
            return
        # The last load completed (ref_cnt 1 -> 0).
        self._flush()
        kid = self._ids[key]
        if kid in self._declined_pinned:
            self._declined_pinned.discard(kid)
            self._declined[kid] = None
        else:
            self.policy.unpin(kid)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._flush()
        kid = self._ids[key]
        if kid in self._declined:
            del self._declined[kid]
            self._declined_pinned.add(kid)
        else:
            self.policy.pin(kid)

    # -- introspection --------------------------------------------------------------------------
    def settle(self) -> None:
        """Make the chunks whose stores completed resident now (they are otherwise
        inserted at the next call that needs the policy)."""
        self._flush()

    def resident_keys(self) -> set[OffloadKey]:
        """The ready chunks the kvtier policy holds (declined chunks excluded)."""
        self._flush()
        policy = self.policy
        return {key for key, kid in self._ids.items() if kid in policy}

    def declined_keys(self) -> list[OffloadKey]:
        """Ready chunks the admission filter declined, next victim first (pinned last)."""
        self._flush()
        key_of = self._key_of
        return [key_of[k] for k in self._declined] + sorted(
            key_of[k] for k in self._declined_pinned
        )

    @property
    def num_evictable(self) -> int:
        """Ready chunks with no reader (``ref_cnt == 0``)."""
        self._flush()
        return self.policy.num_evictable + len(self._declined)

    def check(self) -> None:
        """Verify that the chunks and the kvtier policy agree; raises InternalInvariantError."""
        self._flush()
        policy = self.policy
        if not (len(self._ids) == len(self._key_of) == len(self.chunks)):
            raise InternalInvariantError(
                f"{len(self._ids)} / {len(self._key_of)} key ids for {len(self.chunks)} chunks"
            )
        if len(self.chunks) > max(1, self.cache_capacity):
            raise InternalInvariantError(
                f"{len(self.chunks)} chunks exceed the capacity {self.cache_capacity}"
            )
        pending = {key for key, chunk in self.chunks.items() if chunk.ref_cnt < 0}
        if set(self._writer) != pending:
            raise InternalInvariantError(
                f"{len(self._writer)} writers recorded for {len(pending)} chunks being stored"
            )
        resident = evictable = 0
        for key, chunk in self.chunks.items():
            kid = offload_key_id(key)
            if self._ids.get(key) != kid or self._key_of.get(kid) != key:
                raise InternalInvariantError(f"chunk {key!r} has no key id")
            in_policy = kid in policy
            in_declined = kid in self._declined or kid in self._declined_pinned
            if chunk.ref_cnt < 0:
                if in_policy or in_declined:
                    raise InternalInvariantError(f"chunk {key!r} is being stored but resident")
                continue
            if in_policy == in_declined:
                raise InternalInvariantError(
                    f"ready chunk {key!r}: in policy {in_policy}, declined {in_declined}"
                )
            if in_declined and (kid in self._declined_pinned) != (chunk.ref_cnt > 0):
                raise InternalInvariantError(f"declined chunk {key!r} has the wrong pin")
            resident += in_policy
            evictable += in_policy and chunk.ref_cnt == 0
        if len(policy) != resident:
            raise InternalInvariantError(
                f"the policy holds {len(policy)} keys, {resident} ready chunks are admitted"
            )
        if policy.num_evictable != evictable:
            raise InternalInvariantError(
                f"the policy counts {policy.num_evictable} evictable keys, chunks say {evictable}"
            )


# -- one class per policy, for cache_policy_module_path ------------------------------------


class KvTierLRUCachePolicy(KvTierCachePolicy):
    """kvtier's LRU inside vLLM's CPU offloading manager."""

    kvtier_policy = "lru"


class KvTierLFUCachePolicy(KvTierCachePolicy):
    """kvtier's LFU (with aging) inside vLLM's CPU offloading manager."""

    kvtier_policy = "lfu"


class KvTierFIFOCachePolicy(KvTierCachePolicy):
    """kvtier's FIFO inside vLLM's CPU offloading manager."""

    kvtier_policy = "fifo"


class KvTierARCCachePolicy(KvTierCachePolicy):
    """kvtier's ARC inside vLLM's CPU offloading manager."""

    kvtier_policy = "arc"


class KvTierS3FIFOCachePolicy(KvTierCachePolicy):
    """kvtier's S3-FIFO inside vLLM's CPU offloading manager."""

    kvtier_policy = "s3fifo"


class KvTierSIEVECachePolicy(KvTierCachePolicy):
    """kvtier's SIEVE inside vLLM's CPU offloading manager."""

    kvtier_policy = "sieve"


class KvTierGDSFCachePolicy(KvTierCachePolicy):
    """kvtier's GDSF (unit sizes and costs) inside vLLM's CPU offloading manager."""

    kvtier_policy = "gdsf"


class KvTierHybridCachePolicy(KvTierCachePolicy):
    """kvtier's recency/frequency/size hybrid inside vLLM's CPU offloading manager."""

    kvtier_policy = "hybrid"


class KvTierLearnedReuseCachePolicy(KvTierCachePolicy):
    """kvtier's learned-reuse policy inside vLLM's CPU offloading manager.

    vLLM's ``CachePolicy`` hears of no request before its chunks are stored,
    so the policy gets no request classes here: it keeps every chunk in one
    class and evicts the batch stored or used longest ago first.
    """

    kvtier_policy = "learned-reuse"


_CLASSES: dict[str, type[KvTierCachePolicy]] = {
    cls.kvtier_policy: cls
    for cls in (
        KvTierLRUCachePolicy,
        KvTierLFUCachePolicy,
        KvTierFIFOCachePolicy,
        KvTierARCCachePolicy,
        KvTierS3FIFOCachePolicy,
        KvTierSIEVECachePolicy,
        KvTierGDSFCachePolicy,
        KvTierHybridCachePolicy,
        KvTierLearnedReuseCachePolicy,
    )
}


def policy_class_name(policy: str, admission: str | None = None) -> str:
    """The name vLLM's ``eviction_policy`` takes for ``policy`` (and ``admission``)."""
    name = f"{NAME_PREFIX}{policy}"
    return f"{name}+{admission}" if admission not in (None, "none") else name


def cache_policy_class(policy: str, admission: str | None = None) -> type[KvTierCachePolicy]:
    """A ``CachePolicy`` class running kvtier's ``policy`` (validated now)."""
    if admission == "none":
        admission = None
    if admission is None and policy.lower() in _CLASSES:
        return _CLASSES[policy.lower()]
    name = policy_class_name(policy, admission)
    cls = _DYNAMIC.get(name)
    if cls is None:
        # Fails now, with the registry's message, rather than inside vLLM later.
        kwargs: dict[str, Any] = {} if admission is None else {"admission": admission}
        make_policy(policy, **kwargs)
        cls = type(
            name,
            (KvTierCachePolicy,),
            {
                "kvtier_policy": policy,
                "kvtier_admission": admission,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"kvtier's {policy} policy inside vLLM's CPU offloading manager.",
            },
        )
        _DYNAMIC[name] = cls
    return cls


_DYNAMIC: dict[str, type[KvTierCachePolicy]] = {}


def register_policy_class(name: str, cls: type[KvTierCachePolicy]) -> str:
    """Make ``cls`` loadable by vLLM as ``eviction_policy: name`` from this module.

    ``name`` must start with ``kvtier:``; for classes built at run time (the
    connector builds one per instance, with its policy's options).
    """
    if not name.startswith(NAME_PREFIX):
        raise ConfigError(f"a kvtier cache policy name starts with {NAME_PREFIX!r}, got {name!r}")
    _DYNAMIC[name] = cls
    return name


def __getattr__(name: str) -> type[KvTierCachePolicy]:
    """Serve ``kvtier:<policy>[+<admission>]`` to vLLM's ``getattr(module, name)``."""
    if not name.startswith(NAME_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    registered = _DYNAMIC.get(name)
    if registered is not None:
        return registered
    spec = name[len(NAME_PREFIX):]
    policy, _, admission = spec.partition("+")
    if not policy:
        raise AttributeError(
            f"{name!r} names no policy: use 'kvtier:<policy>' with one of "
            f"{available_policies()}, optionally '+tinylfu'"
        )
    try:
        return cache_policy_class(policy, admission or None)
    except ConfigError as exc:
        raise AttributeError(f"{name!r}: {exc}") from exc
