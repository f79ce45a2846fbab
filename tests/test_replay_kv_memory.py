"""``kvtier replay --kv-cache-memory``: capacities as the blocks a memory holds per KV dtype."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtier import ConfigError
from kvtier.cli import main
from kvtier.cli.replay import memory_capacities
from kvtier.engine.model import probe_model
from kvtier.layout import cache_layout


def test_memory_capacities_follow_the_block_size_of_each_dtype() -> None:
    caps = memory_capacities([2**30], ["auto", "bfloat16", "int8"], None, 512)
    layout = probe_model(None).layout(512, "float32")
    assert [c.text for c in caps] == ["1GiB auto", "1GiB bfloat16", "1GiB int8"]
    blocks = [int(c.value) for c in caps]
    dtypes = ("auto", "bfloat16", "int8")
    assert blocks == [2**30 // cache_layout(layout, d).bytes_per_block for d in dtypes]
    assert blocks[2] >= 3.5 * blocks[0] and blocks[2] >= 1.8 * blocks[1]
    with pytest.raises(ConfigError, match="hold no"):
        memory_capacities([1000], ["auto"], None, 512)


def test_replay_sizes_the_cache_from_memory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "replay", "--json", "--limit", "300", "--no-progress",
        "--kv-cache-memory", "16GiB", "--kv-cache-dtype", "auto", "int8",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    caps = {c["capacity"]: c["blocks"] for c in data["capacities"]}
    assert set(caps) == {"16GiB auto", "16GiB int8"}
    assert caps["16GiB int8"] >= 3.5 * caps["16GiB auto"]
    hits = {r["capacity_blocks"]: r["prefix_hit_ratio"] for r in data["results"]}
    assert hits[caps["16GiB int8"]] >= hits[caps["16GiB auto"]]
    assert main(["replay", "--limit", "50", "--no-progress", "--kv-cache-memory", "1GiB"]) == 0
    assert "KV memory 1GiB auto:" in capsys.readouterr().out


def test_a_hybrid_models_blocks_include_its_state_checkpoints(tmp_path: Path) -> None:
    """A linear-attention hybrid's blocks carry one state per linear layer: the replay's
    capacity counts those bytes, and rounded dtypes, which kvtier refuses to serve such a
    model with, are refused here too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig()  # Qwen3-Next-80B-A3B's own sizes
    config.save_pretrained(tmp_path)
    (cap,) = memory_capacities([128 * 2**30], ["auto"], str(tmp_path), 1056)
    info = probe_model(str(tmp_path))
    assert info.state is not None
    block = info.layout(1056, "float32").bytes_per_block
    # float32: a linear layer's share of a 1,056-token block (2 x 1,056 x 2 heads x 256 x 4
    # bytes = 4.1 MiB) holds its 2.1 MiB state as it is; at 512 tokens (2 MiB) it widens.
    assert block == 48 * 2 * 1056 * 2 * 256 * 4
    assert info.layout(512, "float32").bytes_per_block > 48 * 2 * 512 * 2 * 256 * 4
    # The engine keeps the 36 linear layers' checkpoints in slots, 0.05 per block: a block
    # costs its 12 attention layers and a twentieth of the rest.
    assert info.windows is not None and info.windows.ratio == 0.05
    per_block = block // 48 * 12 + math.ceil(0.05 * (block // 48 * 36))
    assert int(cap.value) == 128 * 2**30 // per_block
    with pytest.raises(ConfigError, match="states"):
        memory_capacities([2**30], ["auto", "int8"], str(tmp_path), 1056)
