"""KvTierConnector inside vLLM 0.33: built by vLLM's connector factory, driven with vLLM Requests.

The connector's scheduler side (vLLM's ``OffloadingConnectorScheduler`` and
``CPUOffloadingManager``, with kvtier's policy on the CPU tier) runs as
vLLM's scheduler calls it (:class:`kvtier.integrations.vllm.driver.ConnectorDriver`);
no GPU: the workers' part is reporting every transfer done. Each request is
a vLLM ``Request`` whose block hashes vLLM's own hasher computed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from needs import need_module

need_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvtier.agents import WorkflowPolicy  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import connector as kc  # noqa: E402
from kvtier.integrations.vllm.driver import ConnectorDriver  # noqa: E402

BS = 4  # tokens per GPU block (one chunk each)


def prompt(tag: int, blocks: int = 4) -> list[int]:
    """``blocks`` full blocks of tokens no other tag shares."""
    return [tag * 1000 + i for i in range(blocks * BS)]


def driver(cpu_chunks: int = 8, **extra: Any) -> ConnectorDriver:
    d = ConnectorDriver(kc.connector_config(1, **extra), cpu_chunks, block_size=BS)
    clock = [0.0]
    bridge = d.connector.kvtier
    assert bridge is not None
    bridge.clock = lambda: clock[0]
    d.clock = clock  # type: ignore[attr-defined]
    return d


def bridge_of(d: ConnectorDriver) -> kc.RequestBridge:
    b = d.connector.kvtier
    assert b is not None
    return b


def run(d: ConnectorDriver, tokens: list[int], hints: dict[str, Any] | None = None,
        at: float | None = None) -> int:  # fmt: skip
    """Serve one request (with ``hints`` in extra_args) at time ``at``; tokens loaded."""
    if at is not None:
        d.clock[0] = at  # type: ignore[attr-defined]
    req = d.request(tokens, extra_args=None if hints is None else {"kvtier": hints})
    loaded, params = d.serve(req)
    assert params is None
    return loaded


def test_vllm_builds_the_connector_by_module_path() -> None:
    cfg = kc.connector_config(1 << 20)
    transfer = KVTransferConfig(**cfg)
    assert KVConnectorFactory.get_connector_class(transfer) is kc.KvTierConnector
    d = driver()
    c = d.connector
    assert isinstance(c, kc.KvTierConnector)
    # vLLM's own scheduler side and CPU manager; kvtier's policy inside it.
    assert isinstance(c.scheduler.manager, CPUOffloadingManager)
    policy = bridge_of(d).policy
    assert isinstance(policy, WorkflowPolicy)
    assert policy.fallback == "learned-reuse"


def test_a_foreign_eviction_policy_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match="kvtier_policy"):
        driver(eviction_policy="lru")
    with pytest.raises(ConfigError, match="kvtier_admission"):
        driver(kvtier_admission="sometimes")


def test_the_policy_hears_each_request_as_one_chain() -> None:
    d = driver(16, kvtier_policy="learned-reuse")
    policy: Any = bridge_of(d).policy
    run(d, prompt(1))
    assert policy.requests == 1
    # The second turn extends the first one's whole chain: the policy sees turn 2.
    assert run(d, prompt(1) + prompt(2)) == 4 * BS
    assert policy.requests == 2
    keys = bridge_of(d).chain(d.request(prompt(1) + prompt(2)))
    assert len(keys) == 8
    # Every stored chunk belongs to a request record (none is "loose"), and the
    # second request's class is a second turn.
    from kvtier.policy.learned import LOOSE, request_class

    bridge_of(d).cache_policy.check()  # type: ignore[union-attr]  # (makes stores resident)
    assert {policy.class_of(k) for k in keys[4:]} == {request_class(2, 4)}
    assert LOOSE not in {policy.class_of(k) for k in keys}
    bridge_of(d).cache_policy.check()  # type: ignore[union-attr]


def _victims_case(hinted: bool) -> int:
    """A's 4 chunks, then B and C (4 each) into an 8-chunk tier; then A again."""
    d = driver(8)
    a = {"session_id": "a", "cache_ttl_s": 60.0} if hinted else None
    run(d, prompt(1), a, at=0.0)
    run(d, prompt(2), at=1.0)
    run(d, prompt(3), at=2.0)
    return run(d, prompt(1), at=3.0)


def test_hints_change_the_victims() -> None:
    # Without hints the oldest chunks (A's) make room for C; a TTL pin keeps them.
    assert _victims_case(hinted=False) == 0
    assert _victims_case(hinted=True) == 4 * BS


def test_a_pin_runs_out_on_the_connector_clock() -> None:
    d = driver(8)
    b = bridge_of(d)
    run(d, prompt(1), {"session_id": "a", "cache_ttl_s": 5.0}, at=0.0)
    run(d, prompt(2), at=1.0)
    assert b.stats()["sessions"]["pinned_blocks"] == 4
    d.clock[0] = 30.0  # type: ignore[attr-defined]
    run(d, prompt(3))
    assert b.stats()["sessions"]["pinned_blocks"] == 0


@pytest.mark.parametrize("end", [False, True])
def test_session_end_releases_the_sessions_blocks(end: bool) -> None:
    d = driver(8)
    b = bridge_of(d)
    run(d, prompt(1), {"session_id": "a", "cache_ttl_s": 600.0}, at=0.0)
    run(d, prompt(2), at=1.0)
    assert b.stats()["sessions"]["pinned_blocks"] == 4
    # A's last turn (all hits): with session_end its pins end and its chunks go first.
    last: dict[str, Any] = {"session_id": "a"}
    last.update({"session_end": True} if end else {"cache_ttl_s": 600.0})
    assert run(d, prompt(1), last, at=2.0) == 4 * BS
    assert b.stats()["sessions"]["pinned_blocks"] == (0 if end else 4)
    run(d, prompt(3), at=3.0)  # a full tier: 4 chunks must go
    if end:
        assert run(d, prompt(2), at=5.0) == 4 * BS
        assert run(d, prompt(1), at=6.0) == 0
    else:
        assert run(d, prompt(1), at=5.0) == 4 * BS


def test_end_session_out_of_band() -> None:
    d = driver(8)
    b = bridge_of(d)
    run(d, prompt(1), {"session_id": "a", "cache_ttl_s": 600.0}, at=0.0)
    assert b.end_session("a") and not b.end_session("nobody")
    assert b.stats()["sessions"]["pinned_blocks"] == 0


BAD = [
    ({"sesion_id": "a"}, "extra_args.kvtier.sesion_id"),
    ({"step": -1, "workflow_id": "w", "agent_id": "x"}, "extra_args.kvtier.step"),
    ({"cache_ttl_s": "long"}, "extra_args.kvtier.cache_ttl_s"),
    ({"session_end": True}, "extra_args.kvtier.session_end"),
    ({"reuse": "often"}, "extra_args.kvtier.reuse"),
    ("{not json", "extra_args.kvtier"),
    (["session_id", "a"], "extra_args.kvtier"),
]


@pytest.mark.parametrize(("hints", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_hints_are_refused_naming_the_field(
    hints: Any, param: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = driver(8)
    b = bridge_of(d)
    req = d.request(prompt(1), extra_args={"kvtier": hints})
    with caplog.at_level(logging.WARNING, logger=kc.__name__):
        loaded, params = d.serve(req)
    # Served (stored like any request), the hints dropped, the field named.
    assert loaded == 0
    assert params is not None and params[kc.ERROR_KEY]["param"] == param
    assert any(param in r.getMessage() for r in caplog.records)
    assert b.refused == 1 and b.hinted == 0
    # The engine goes on: the next request hits what the refused one stored.
    assert run(d, prompt(1)) == 4 * BS
    assert b.stats()["sessions"]["tracked"] == 0


def test_hints_from_kv_transfer_params_and_as_a_json_string() -> None:
    d = driver(8)
    b = bridge_of(d)
    req = d.request(prompt(1), kv_transfer_params={"kvtier": {"session_id": "a"}})
    d.serve(req)
    req = d.request(prompt(2), extra_args={"kvtier": json.dumps({"session_id": "b"})})
    d.serve(req)
    assert b.hinted == 2 and b.refused == 0
    assert b.stats()["sessions"]["tracked"] == 2


def skipped(d: ConnectorDriver) -> int:
    """vLLM's ``vllm:kv_offload_stores_skipped`` counter, as the connector reports it."""
    stats = d.connector.get_kv_connector_stats()
    data = {} if stats is None else stats.data.get("data", {})
    return int(sum(data.get("vllm:kv_offload_stores_skipped", {}).values()))


def test_predicted_admission_stops_storing_what_is_never_read() -> None:
    d = driver(16, kvtier_admission="predicted", kvtier_policy="learned-reuse")
    for i in range(400):
        run(d, prompt(10 + i), at=float(i))
    assert skipped(d) > 0
    # A prompt that is reused is still stored and hit.
    for t in range(3):
        run(d, prompt(1), at=500.0 + t)
    assert run(d, prompt(1), at=510.0) == 4 * BS
    bridge_of(d).cache_policy.check()  # type: ignore[union-attr]


def test_write_all_admission_stores_every_chunk() -> None:
    d = driver(16, kvtier_policy="learned-reuse")
    for i in range(40):
        run(d, prompt(10 + i), at=float(i))
    assert skipped(d) == 0


def test_with_secondary_tiers_the_cpu_tier_runs_the_kvtier_policy() -> None:
    from kvtier.integrations.vllm.driver import kvtier_tier

    d = driver(
        8, spec_name="TieringOffloadingSpec",
        secondary_tiers=[kvtier_tier("host:1MiB")],
    )  # fmt: skip
    assert isinstance(bridge_of(d).policy, WorkflowPolicy)
    run(d, prompt(1), {"session_id": "a", "cache_ttl_s": 60.0}, at=0.0)
    assert bridge_of(d).stats()["sessions"]["pinned_blocks"] == 4
    assert run(d, prompt(1), at=1.0) == 4 * BS
