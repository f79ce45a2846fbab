"""``kvtier serve --kv-cache-dtype`` and ``--tier device:SIZE``: flags to configuration, checks."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.cli import build_parser, main
from kvtier.cli.serve import engine_config, preflight


def config_of(*args: str) -> object:
    parser, _ = build_parser()
    return engine_config(parser.parse_args(["serve", *args]))


def test_flags_become_the_cache_dtype_and_a_device_tier() -> None:
    config = config_of(
        "--kv-cache-dtype", "int8", "--tier", "device:1MiB?codec=fp8", "--tier", "host:2MiB"
    )
    assert config.cache.kv_cache_dtype == "int8"  # type: ignore[attr-defined]
    tiers = config.tiers  # type: ignore[attr-defined]
    assert [(t.medium, t.codec) for t in tiers] == [("device", "fp8"), ("host", "raw")]
    assert config_of().cache.kv_cache_dtype == "auto"  # type: ignore[attr-defined]


def test_the_startup_line_counts_the_narrower_blocks(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = {}
    for dtype in ("auto", "int8"):
        config = config_of("--model", str(model_dir), "--kv-cache-memory", "4MiB",
                           "--kv-cache-dtype", dtype, "--tier", "device:1MiB")
        preflight(config)
        line = capsys.readouterr().out.splitlines()[0]
        counts[dtype] = int(line.split(" KV blocks")[0].rsplit(" ", 1)[1])
    assert "int8 with per-head scales" in line
    assert counts["int8"] >= 3.5 * counts["auto"]


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["--tier", "host:1MiB", "--tier", "device:1MiB"], "fastest first (device, host", 1),
        (["--tier", "device:1MiB?codec=raw"], "codec int8 or fp8", 1),
        (["--kv-cache-dtype", "int4"], "invalid choice", 2),
    ],
)
def test_bad_device_settings_fail_before_the_model_loads(
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
    code: int,
) -> None:
    argv = ["serve", "--model", str(model_dir), "--port", "0", "--pressure", "off", *args]
    if code == 2:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    else:
        assert main(argv) == 1
    out, err = capsys.readouterr()
    assert needle in err, err
    assert "kvtier: loading" not in out
