"""Small helpers shared by the benchmark scripts: timing summaries, tables, JSON."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

#: The repository root, and ``shared/`` beside it (or inside it, for a checkout that has one).
REPO = Path(__file__).resolve().parent.parent
SHARED = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"
CONVERSATION_TRACE = SHARED / "traces" / "mooncake_conversation_dev.jsonl"


def log(message: str) -> None:
    """Progress for the person running the benchmark (stderr, so tables stay clean)."""
    print(message, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence of numbers."""
    return float(statistics.median(values))


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or ``None`` when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }


def git_state(repo: Path) -> dict[str, Any]:
    """The checkout the numbers come from: commit and uncommitted source changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.rstrip("\n") if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "src")
    diff = git("diff", "HEAD", "--", "src")
    return {
        "commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "src_modified": None if status is None else [line[3:] for line in status.splitlines()],
        "src_diff_sha1": hashlib.sha1(diff.encode()).hexdigest() if diff else None,
    }


def disk_bytes(root: Path) -> tuple[int, int]:
    """Bytes and files under ``root`` (what a disk tier or cache directory holds)."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def numeric(text: str) -> bool:
        stripped = text.replace(",", "").replace("%", "").replace("x", "").strip()
        try:
            float(stripped)
        except ValueError:
            return False
        return True

    lines = []
    for n, row in enumerate(cells):
        parts = [
            cell.rjust(w) if n and numeric(cell) else cell.ljust(w)
            for cell, w in zip(row, widths, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The same table as GitHub-flavoured Markdown."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
    return "\n".join(out)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False)
        fh.write("\n")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile of values, linearly interpolated; NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
