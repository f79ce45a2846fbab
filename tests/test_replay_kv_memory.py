"""``kvtier replay --kv-cache-memory``: capacities as the blocks a memory holds per KV dtype."""

from __future__ import annotations

import json

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
