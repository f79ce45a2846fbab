"""The long-prefix TTFT benchmark (bench/gpu_ttft.py) measures what it says, checked on a CPU.

Each case must serve its prefix from where its name says (computed, the
device's pool, the host tier, the disk tier), or the figures compare the
wrong things; and the real geometries must be the published models' KV
shapes, which decide how many bytes a load moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

gt = load_bench("gpu_ttft")


def test_each_case_serves_its_prefix_from_where_it_says(tmp_path: Path) -> None:
    argv = [
        "--device", "cpu", "--geometries", "tiny-llama", "tiny-moe",
        "--prefixes", "64", "200", "--dtype", "float32", "--out", str(tmp_path),
    ]  # fmt: skip
    assert gt.main(argv) == 0
    result = json.loads((tmp_path / "gpu_ttft.json").read_text())["ttft"]
    assert result["ok"]
    rows = result["rows"]
    assert [(r["geometry"], r["prefix_tokens"]) for r in rows] == [
        ("tiny-llama", 64), ("tiny-llama", 200), ("tiny-moe", 64), ("tiny-moe", 200),
    ]  # fmt: skip
    for r in rows:
        prefix = r["prefix_tokens"]
        whole = prefix // 16 * 16  # the prefix's full blocks
        assert r["recompute"]["device_tokens"] == r["recompute"]["loaded_tokens"] == 0
        assert r["device"]["device_tokens"] >= whole and r["device"]["loaded_tokens"] == 0
        for tier in ("host", "host-layers", "disk"):
            assert r[tier]["loaded_tokens"] >= whole, (tier, r[tier])
            assert r[tier]["plans"]["load_all"] == 1, (tier, r[tier])
        assert r["host-layers"]["layer_fills"] >= 1 and r["host"]["layer_fills"] == 0
        assert all(r[c]["ttft_s"] > 0 for c in gt.CASES)
        assert r["copy_ceiling_s"] is None  # no CUDA: nothing to compare a load with
        assert r["host_vs_device"] == r["host"]["ttft_s"] / r["device"]["ttft_s"]


@pytest.mark.parametrize(
    ("name", "layers", "kv_bytes_per_token"),
    [
        # layers x KV heads x head size x (K, V) x 2 bytes (bfloat16)
        ("llama-3.1-8b", 32, 32 * 8 * 128 * 2 * 2),
        ("qwen3-30b-a3b", 48, 48 * 4 * 128 * 2 * 2),
    ],
)
def test_the_real_geometries_have_the_published_kv_shape(
    name: str, layers: int, kv_bytes_per_token: int
) -> None:
    from transformers import AutoConfig

    from kvtier.engine.hf_cache import layout_for_model

    model_type, fields = gt.GEOMETRIES[name]
    config = AutoConfig.for_model(model_type, **fields)
    assert config.num_hidden_layers == layers
    layout = layout_for_model(config, 16, torch.bfloat16)
    assert layout.bytes_per_block == 16 * kv_bytes_per_token


def test_layers_keeps_the_first_n() -> None:
    model = gt.build_model("tiny-moe", torch.device("cpu"), torch.float32, layers=1)
    assert model.config.num_hidden_layers == 1
    assert len(model.model.layers) == 1


def test_a_prompt_holding_the_vocabularys_last_token_is_served(tmp_path: Path) -> None:
    # The warm-up prompt is derived from the first one; it must stay inside the vocabulary.
    model = gt.build_model("tiny-llama", torch.device("cpu"), torch.float32, layers=1)
    from tiny_model import tiny_tokenizer

    last = int(model.config.vocab_size) - 1
    shared = [last] * 40
    prompts = (shared + [7] * gt.SUFFIX, shared + [9] * gt.SUFFIX)
    got = gt.run_case(
        "host", model, tiny_tokenizer(), prompts, block_size=16, batch_tokens=256, tmp=tmp_path
    )
    assert got["as_planned"] and got["loaded_tokens"] >= 32


def test_a_cpu_run_defaults_to_the_tiny_geometries_and_a_gpu_run_to_the_real_ones() -> None:
    import argparse

    p = argparse.ArgumentParser()
    gt.add_arguments(p)
    args = p.parse_args([])
    assert args.geometries is None and args.prefixes is None
    cpu_geometries, cpu_prefixes = gt.defaults_for(torch.device("cpu"))
    assert all(name.startswith("tiny-") for name in cpu_geometries)
    assert max(cpu_prefixes) <= 1024
    gpu_geometries, gpu_prefixes = gt.defaults_for(torch.device("cuda"))
    assert set(gpu_geometries) == {"llama-3.1-8b", "qwen3-30b-a3b"}
    assert gpu_prefixes == (2048, 8192, 32768)
