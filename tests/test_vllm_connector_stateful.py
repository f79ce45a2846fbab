"""A model check of KvTierConnector's request bookkeeping inside vLLM's scheduler side.

Random interleavings of requests (prefix-sharing prompts, with good, bad or
no hints, sessions with TTL pins and session ends), finishes in any order,
the clock moving and sessions ended out of band, on a small CPU tier, with
predicted admission on or off. After every step: vLLM's CPU manager and the
kvtier policy agree (``KvTierCachePolicy.check``, vLLM's evictable count),
the tier never holds more than its size, the connector holds state for
exactly the requests in flight, and every refused request got its error back.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from needs import need_module

need_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")

from kvtier.integrations.vllm import connector as kc  # noqa: E402
from kvtier.integrations.vllm.driver import ConnectorDriver  # noqa: E402

BS = 4
HINTS: list[dict[str, Any] | None] = [
    None,
    {"session_id": "a", "cache_ttl_s": 5.0},
    {"session_id": "b", "cache_ttl_s": 60.0},
    {"session_id": "a", "session_end": True},
    {"session_id": "b", "reuse": "never"},
    {"cache_ttl_s": 2.0},
    {"session_id": 7},  # refused
    {"bogus": 1},  # refused
]


def tokens(path: list[int]) -> list[int]:
    """A prompt whose blocks are the path's prefixes: paths sharing a prefix share blocks."""
    out: list[int] = []
    for i in range(len(path)):
        tag = hash(tuple(path[: i + 1])) % 10_000
        out += [tag * 10 + j for j in range(BS)]
    return out


class ConnectorMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(2, 10),
        policy=st.sampled_from(["workflow", "learned-reuse", "lru"]),
        predicted=st.booleans(),
    )
    def setup(self, capacity: int, policy: str, predicted: bool) -> None:
        extra: dict[str, Any] = {"kvtier_policy": policy}
        if predicted:
            extra["kvtier_admission"] = "predicted"
        self.d = ConnectorDriver(kc.connector_config(1, **extra), capacity, block_size=BS)
        self.capacity = capacity
        bridge = self.d.connector.kvtier
        assert bridge is not None
        self.bridge = bridge
        self.now = 0.0
        bridge.clock = lambda: self.now
        self.running: dict[str, tuple[Any, bool]] = {}

    @rule(
        path=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        hints=st.sampled_from(range(len(HINTS))),
    )
    def start(self, path: list[int], hints: int) -> None:
        h = HINTS[hints]
        req = self.d.request(tokens(path), extra_args=None if h is None else {"kvtier": h})
        loaded = self.d.start(req)
        assert 0 <= loaded <= len(path) * BS
        self.running[req.request_id] = (req, hints >= 6)

    @precondition(lambda self: bool(self.running))
    @rule(which=st.integers(0, 100), out=st.integers(0, 2 * BS))
    def finish(self, which: int, out: int) -> None:
        rid = sorted(self.running)[which % len(self.running)]
        req, refused = self.running.pop(rid)
        params = self.d.finish(req, [1] * out)
        assert (params is not None and kc.ERROR_KEY in params) == refused

    @rule(dt=st.floats(0.0, 30.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(session=st.sampled_from(["a", "b", "c"]))
    def end_session(self, session: str) -> None:
        self.bridge.end_session(session)

    @invariant()
    def agree(self) -> None:
        cp = self.bridge.cache_policy
        assert cp is not None
        cp.check()
        assert len(cp.chunks) <= self.capacity
        assert self.bridge.tracked == set(self.running)
        m: Any = cp  # vLLM's manager counts the same evictable chunks
        manager = self.d.connector.scheduler.manager
        inner = getattr(manager, "_inner", manager)
        assert inner._num_evictable_cache_chunks == m.num_evictable


TestConnectorMachine = ConnectorMachine.TestCase
TestConnectorMachine.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
