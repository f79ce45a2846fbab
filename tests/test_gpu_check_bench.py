"""The GPU check script (bench/gpu_check.py) runs end to end on a CPU, every part but pytest's.

It runs on a GPU only when one is lent for a few minutes, so a part that
broke on the way must show up here first: each part reports ``ok``, the
JSON holds what the tables print, and the throughput part's loads come
back bit-exact (the script raises otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

pytest.importorskip("torch")
pytest.importorskip("transformers")

gc = load_bench("gpu_check")


def test_every_part_but_the_tests_runs_on_a_cpu(tmp_path: Path) -> None:
    argv = [
        "--device", "cpu", "--out", str(tmp_path),
        "--parts", "correctness,throughput,pressure,ttft",
        "--new-tokens", "4", "--mib", "2", "--repeat", "1", "--pressure-steps", "3",
        "--cpu-pressure-mib", "8", "--ttft-geometries", "tiny-llama", "--ttft-prefixes", "48",
        "--ttft-dtype", "float32",
    ]  # fmt: skip
    assert gc.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for part in ("correctness", "throughput", "pressure", "ttft"):
        assert report[part]["ok"], (part, report[part])
    throughput = report["throughput"]
    for dtype in ("float16", "float32"):
        rates = throughput["results"][dtype]["gb_per_s"]
        assert rates["kvtier"]["store"] > 0 and rates["ceiling"]["load"] > 0
    per_block = throughput["bookkeeping"]
    assert per_block["blocks"] > 0 and per_block["store_us"] > 0 and per_block["load_us"] > 0
    assert [r["prefix_tokens"] for r in report["ttft"]["rows"]] == [48]


def test_a_failed_part_is_reported_and_makes_the_exit_status_nonzero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> dict[str, object]:
        raise RuntimeError("the monitor could not be read")

    monkeypatch.setattr(gc, "pressure", broken)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--parts", "pressure"]
    assert gc.main(argv) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not report["pressure"]["ok"]
    assert "the monitor could not be read" in json.dumps(report["pressure"])


def test_a_prefix_of_no_tokens_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--ttft-prefixes must be positive"):
        gc.main(["--device", "cpu", "--out", str(tmp_path), "--ttft-prefixes", "0"])
    assert not (tmp_path / "gpu_check.json").exists()
