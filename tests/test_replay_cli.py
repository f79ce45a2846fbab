"""``kvtier replay`` end to end: defaults, JSON, plots, errors, progress."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from needs import need_module

from kvtier.cli import main
from kvtier.policy import available_policies

FIELDS = {
    "policy", "capacity_blocks", "capacity_pct_unique", "block_hit_ratio", "prefix_hit_ratio",
    "token_hit_ratio", "evictions", "ops_per_s", "min_block_hit_ratio", "gap_to_min_points",
    "skipped_requests", "seconds",
}


def test_replay_json_has_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--json", "--limit", "200", "-c", "5%", "300", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["format"] == "mooncake" and data["trace"]["requests"] == 200
    assert data["model"] == "prefix" and data["policies"] == ["lru"]
    assert [c["capacity"] for c in data["capacities"]] == ["5%", "300"]
    assert len(data["results"]) == 2 and len(data["min"]) == 2
    for row in data["results"]:
        assert set(row) >= FIELDS
        assert row["block_hit_ratio"] <= row["min_block_hit_ratio"]


def test_replay_all_policies_block_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["replay", "--policy", "all", "--model", "block", "--limit", "150", "-c", "3%",
            "--json-out", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for name in available_policies():
        assert name in table
    data = json.loads(out.read_text())
    assert sorted(r["policy"] for r in data["results"]) == sorted(available_policies())
    assert data["model"] == "block"


def test_replay_token_trace_and_capacity_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "tok.jsonl"
    rows = [{"tokens": list(range(i % 3, 40 + i % 3))} for i in range(12)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(trace), "--block-size", "8", "-c", "64t", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["format"] == "tokens" and data["trace"]["block_size"] == 8
    assert [r["capacity_blocks"] for r in data["results"]] == [8, 16]
    # Three distinct prompts of 5 full blocks repeat; 16 blocks hold all three.
    assert data["results"][1]["prefix_hit_ratio"] > 0.5


def test_replay_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_module("matplotlib", "install the dev extra")
    png = tmp_path / "hits.png"
    argv = ["replay", "--limit", "200", "-p", "lru", "-c", "2%", "5%", "10%", "--plot", str(png)]
    assert main(argv) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    assert f"plot written to {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail, as if not installed.
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["replay", "--limit", "20", "--plot", str(tmp_path / "x.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope"], "unknown policy"),
        (["--capacity", "lots"], "cannot parse capacity"),
        (["--capacity", "0"], "at least 1"),
        (["/no/such/trace.jsonl"], "not found"),
        (["--model", "block", "--window", "2"], "prefix model only"),
        (["--window", "0"], "--window"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_replay_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error:") and message in err


def test_malformed_trace_error_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1], "input_length": 10}\n{"hash_ids": [1, 2]\n')
    assert main(["replay", str(bad)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_oversized_requests_warn(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--limit", "100", "-c", "10", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "count as misses" in captured.out


def test_progress_flag_draws_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--limit", "300", "-c", "5%", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "lru @" in err and "100%" in err


def test_help_documents_formats_capacities_and_models() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", "--help"],
        capture_output=True, text=True, check=True,
    )
    for needle in ("hash_ids", '"tokens"', "64kt", "5%", "prefix", "block", "MIN"):
        assert needle in res.stdout


def test_trace_after_a_multi_value_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [1, 2], "input_length": 1024}\n' * 3)
    assert main(["replay", "-c", "5", "2", str(trace), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["name"] == "t.jsonl" and len(data["results"]) == 2
    assert main(["replay", "-p", "lru", "lru", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"] == ["lru"]
