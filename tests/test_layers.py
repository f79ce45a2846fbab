"""The layers at run time: what importing and using a layer loads (lint-imports reads the code).

Each check runs in a fresh interpreter, so that nothing another test imported
hides what the layer itself pulls in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvtier import ConfigError, KVCacheManager
from kvtier.events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    MemorySink,
    event_sink_schemes,
    make_event_sink,
    register_event_sink,
)
from kvtier.offload import OffloadingEvent


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


def test_a_replay_loads_neither_torch_nor_the_engine() -> None:
    done = _run(
        """
        import sys
        from kvtier.replay import load_sample_trace
        from kvtier.replay.capacity import parse_capacity
        from kvtier.replay.report import run_replay

        trace = load_sample_trace(limit=40)
        report = run_replay(trace, ["lru", "workflow"], [parse_capacity("64")])
        assert len(report.results) == 2, report.results
        heavy = sorted(
            m for m in sys.modules
            if m == "torch" or m.startswith(("torch.", "kvtier.engine", "kvtier.server",
                                             "kvtier.storage", "kvtier.integrations."))
        )
        heavy.remove("kvtier.integrations.errors")  # the package's error types
        assert not heavy, heavy
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_workflow_policy_is_made_by_name_without_importing_agents_first() -> None:
    # ``import kvtier`` loads the replay, which loads the policy; forget both first.
    done = _run(
        """
        import sys
        from kvtier.policy import registry

        del registry._REGISTRY["workflow"]
        del sys.modules["kvtier.agents.policy"]
        assert "workflow" in registry.available_policies()
        policy = registry.make_policy("workflow", fallback="lru")
        module = sys.modules["kvtier.agents.policy"]
        assert isinstance(policy, module.WorkflowPolicy), policy
        assert registry.make_policy("workflow", admission="tinylfu").policy.name == "workflow"
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_core_loads_no_integration() -> None:
    done = _run(
        """
        import sys
        import kvtier, kvtier.events, kvtier.hints, kvtier.manager, kvtier.policy
        loaded = sorted(m for m in sys.modules if m.startswith("kvtier.integrations."))
        assert loaded == ["kvtier.integrations.errors"], loaded
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_hints_keep_their_earlier_import_path() -> None:
    import kvtier.agents.hints as old
    import kvtier.hints as new

    assert old.Hints is new.Hints and old.parse_hints is new.parse_hints


def test_a_memory_sink_drains_the_device_and_the_tiers() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2)
    manager.record_events()
    sink = make_event_sink("memory://test", topic="kv-events", block_size=2)
    assert isinstance(sink, MemorySink) and sink.endpoint == "memory://test"
    manager.allocate("a", [1, 2, 3, 4, 5])
    assert sink.drain_device(manager) == 1
    stored = sink.pending[0]
    assert isinstance(stored, BlocksStored)
    assert len(stored.keys) == 2 and stored.parent is None
    assert stored.token_ids == (1, 2, 3, 4) and stored.block_size == 2
    events = [
        OffloadingEvent(keys=(7,), medium="host", removed=False),
        OffloadingEvent(keys=(), medium="host", removed=True),
        OffloadingEvent(keys=(7,), medium="host", removed=True),
    ]

    class Tiers:
        def take_events(self) -> list[OffloadingEvent]:
            return events

    assert sink.drain(Tiers()) == 2
    assert sink.pending[1:] == [
        BlocksStored((7,), "host", block_size=2),
        BlocksRemoved((7,), "host"),
    ]
    sink.cleared()
    assert isinstance(sink.pending[-1], AllCleared)
    assert sink.flush() == 0 and sink.flush() is None
    assert len(sink.batches[0]) == 4
    sink.close()
    with pytest.raises(ConfigError):
        sink.flush()


def test_event_sinks_are_chosen_by_scheme() -> None:
    assert {"memory", "tcp", "ipc", "inproc"} <= set(event_sink_schemes())
    with pytest.raises(ConfigError, match="no KV event sink"):
        make_event_sink("carrier-pigeon://loft")
    with pytest.raises(ConfigError, match="is a URL"):
        make_event_sink("localhost:5557")
    with pytest.raises(ConfigError, match="already registered"):
        register_event_sink("memory", lambda url, **options: MemorySink(url, **options))


def test_zeromq_endpoints_get_the_vllm_publisher() -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvtier.integrations.vllm.events import KvEventPublisher

    sink = make_event_sink("inproc://kvtier-layers", topic="kv-events", block_size=4)
    try:
        assert isinstance(sink, KvEventPublisher)
        assert sink.block_size == 4 and sink.topic == "kv-events"
    finally:
        sink.close()
