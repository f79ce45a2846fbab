"""A model check of KvTierCachePolicy inside vLLM's real CPUOffloadingManager.

Random interleavings of lookups, loads, stores (some failing), request ends
and cache resets on prefix-sharing chains. After every step: the capacity
holds, no chunk being loaded or stored was evicted, vLLM's manager and a
plain model agree on every chunk's state, and the kvtier policy's resident
set is exactly the ready chunks (KvTierCachePolicy.check).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)
from needs import need_module

need_module("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvtier.integrations.vllm import cache_policy as cp  # noqa: E402
from kvtier.policy import available_policies  # noqa: E402

POLICIES = [*available_policies(), "lru+tinylfu", "s3fifo+tinylfu"]

# A chain is a path in a small tree, so chains share prefixes: block i of path
# (2, 0, 1) is the key of (2,), (2, 0), (2, 0, 1).
paths = st.lists(st.integers(0, 2), min_size=1, max_size=4)


def chain(path: list[int]) -> list[Any]:
    return [make_offload_key(bytes([9, *path[: i + 1]]), 0) for i in range(len(path))]


class Job:
    def __init__(self, keys: list[Any], ctx: ReqContext, generation: int) -> None:
        self.keys = keys
        self.ctx = ctx
        self.generation = generation


class AdapterMachine(RuleBasedStateMachine):
    stores = Bundle("stores")
    loads = Bundle("loads")

    @initialize(policy=st.sampled_from(POLICIES), capacity=st.integers(1, 6))
    def setup(self, policy: str, capacity: int) -> None:
        name = f"kvtier:{policy}"
        self.m = CPUOffloadingManager(
            capacity, cache_policy=name, cache_policy_module_path=cp.MODULE_PATH,
            enable_events=True,
        )
        self.p: cp.KvTierCachePolicy = self.m._policy
        self.capacity = capacity
        # The model: key -> "pending" | "ready", and readers per ready key.
        self.state: dict[Any, str] = {}
        self.readers: dict[Any, int] = {}
        self.generation = 0
        self.n = 0
        self.ops = 0

    def _ctx(self, keys: list[Any]) -> ReqContext:
        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        # Token positions, as vLLM's scheduler records them (every other request).
        if self.n % 2:
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, 16 * (i + 1))
        self.m.on_new_request(ctx)
        return ctx

    def _expected_lookup(self, key: Any) -> LookupResult:
        s = self.state.get(key)
        if s is None:
            return LookupResult.MISS
        return LookupResult.HIT if s == "ready" else LookupResult.HIT_PENDING

    def _events(self) -> list[Any]:
        return list(self.m.take_events())


    def _prepare_store(self, keys: list[Any], ctx: ReqContext) -> list[Any]:
        before = (dict(self.state), dict(self.readers))
        resident_before = self.p.resident_keys()
        out = self.m.prepare_store(keys, ctx)
        self.ops += 1
        if out is None:
            # Refused: nothing changed, and there really was no room.
            assert (self.state, self.readers) == before
            assert self.p.resident_keys() == resident_before
            new = [k for k in dict.fromkeys(keys) if k not in self.state]
            free = self.capacity - len(self.state)
            evictable = [
                k for k, s in self.state.items()
                if s == "ready" and not self.readers.get(k) and k not in keys
            ]
            assert len(new) - free > len(evictable)
            assert self._events() == []
            return []
        assert out.keys_to_store == [k for k in dict.fromkeys(keys) if k not in self.state]
        for k in out.evicted_keys:
            assert self.state.get(k) == "ready", "evicted a chunk being stored"
            assert not self.readers.get(k), "evicted a chunk being loaded"
            assert k not in keys, "evicted a chunk of the same store call"
            del self.state[k]
            self.readers.pop(k, None)
        for k in out.keys_to_store:
            self.state[k] = "pending"
        assert len(self.state) <= self.capacity
        events = self._events()
        if out.evicted_keys:
            assert [list(e.keys) for e in events] == [out.evicted_keys]
            assert events[0].removed and not events[0].metadata_only
        else:
            assert events == []
        return list(out.keys_to_store)

    def _complete_store(self, keys: list[Any], ctx: ReqContext, success: bool) -> None:
        self.m.complete_store(keys, ctx, success=success)
        for k in keys:
            assert self.state.get(k) == "pending"
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]
        events = self._events()
        if keys:
            assert len(events) == 1 and list(events[0].keys) == keys
            assert events[0].removed is not success
        else:
            assert events == []

    def _prepare_load(self, keys: list[Any], ctx: ReqContext) -> list[Any]:
        hits = []
        for k in keys:
            result = self.m.lookup(k, ctx)
            assert result == self._expected_lookup(k)
            if result != LookupResult.HIT:
                break
            hits.append(k)
        if hits:
            self.m.prepare_load(hits, ctx)
            for k in hits:
                self.readers[k] = self.readers.get(k, 0) + 1
        return hits

    def _complete_load(self, keys: list[Any], ctx: ReqContext) -> None:
        self.m.complete_load(keys, ctx)
        for k in keys:
            self.readers[k] -= 1

    @rule(path=paths, success=st.booleans(), reuse=st.booleans())
    def request(self, path: list[int], success: bool, reuse: bool) -> None:
        """A whole request: load its cached prefix, store the rest, finish."""
        keys = chain(path)
        ctx = self._ctx(keys)
        hits = self._prepare_load(keys, ctx) if reuse else []
        stored = self._prepare_store(keys, ctx)
        self._complete_store(stored, ctx, success)
        if hits:
            self._complete_load(hits, ctx)
        self.m.on_request_finished(ctx)

    @rule(target=stores, path=paths)
    def begin_store(self, path: list[int]) -> Job:
        keys = chain(path)
        ctx = self._ctx(keys)
        return Job(self._prepare_store(keys, ctx), ctx, self.generation)

    @rule(job=consumes(stores), success=st.booleans())
    def end_store(self, job: Job, success: bool) -> None:
        if job.generation != self.generation:
            return  # vLLM never completes a job from before a reset
        self._complete_store(job.keys, job.ctx, success)
        self.m.on_request_finished(job.ctx)

    @rule(target=loads, path=paths)
    def begin_load(self, path: list[int]) -> Job:
        keys = chain(path)
        ctx = self._ctx(keys)
        return Job(self._prepare_load(keys, ctx), ctx, self.generation)

    @rule(job=consumes(loads))
    def end_load(self, job: Job) -> None:
        if job.generation == self.generation:
            self._complete_load(job.keys, job.ctx)
        self.m.on_request_finished(job.ctx)

    @precondition(lambda self: self.ops >= 15)
    @rule()
    def reset(self) -> None:
        self.m.reset_cache()
        self.generation += 1
        self.ops = 0
        self.state.clear()
        self.readers.clear()
        self._events()

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "m"):
            return
        p = self.p
        assert len(p.chunks) <= self.capacity
        assert {k: ("ready" if c.is_ready else "pending") for k, c in p.chunks.items()} == (
            self.state
        )
        for k, c in p.chunks.items():
            if c.is_ready:
                assert c.ref_cnt == self.readers.get(k, 0)
        ready = {k for k, s in self.state.items() if s == "ready"}
        assert p.resident_keys() | set(p.declined_keys()) == ready
        assert self.m._num_evictable_cache_chunks == p.num_evictable == sum(
            1 for k in ready if not self.readers.get(k)
        )
        assert self.m._num_write_pending_chunks == len(self.state) - len(ready)
        assert self.m._get_num_free_chunks() == self.capacity - len(self.state)
        p.check()


AdapterMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdapter = AdapterMachine.TestCase
