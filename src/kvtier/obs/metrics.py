"""Small Prometheus metric types and the text exposition format (version 0.0.4).

kvtier's numbers mostly live in its own counters (the manager's stats, the
engine's per-request records); these types hold the few that need
bucketing, and :func:`render_prometheus` writes families in the format a
Prometheus server scrapes. Writers are one thread; readers may be another:
each update is a single attribute or list-item store, so a scrape sees a
consistent-enough snapshot without locks on the serving path.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


@dataclass
class Counter:
    value: float = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


@dataclass
class Gauge:
    value: float = 0.0

    def set(self, value: float) -> None:
        self.value = value


class Histogram:
    """Cumulative-bucket histogram with fixed upper bounds."""

    def __init__(self, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        """An independent copy (a consistent snapshot for a reader on another thread)."""
        out = Histogram(self.bounds)
        out.counts = list(self.counts)
        out.sum = self.sum
        out.count = self.count
        return out

    def cumulative(self) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        total = 0
        for bound, c in zip(self.bounds, list(self.counts), strict=True):
            total += c
            out.append((bound, total))
        return out


@dataclass
class MetricFamily:
    """One named metric with its help text and samples (label set -> value)."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    samples: list[tuple[Labels, float | Histogram]] = field(default_factory=list)

    def add(self, value: float | Histogram, **labels: str) -> MetricFamily:
        self.samples.append((tuple(sorted(labels.items())), value))
        return self


def render_prometheus(families: Iterable[MetricFamily]) -> str:
    """The Prometheus text exposition of ``families``."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if isinstance(value, Histogram):
                for bound, total in value.cumulative():
                    le = (*labels, ("le", _fmt(bound)))
                    lines.append(f"{fam.name}_bucket{_labels(le)} {total}")
                lines.append(f"{fam.name}_sum{_labels(labels)} {_fmt(value.sum)}")
                lines.append(f"{fam.name}_count{_labels(labels)} {value.count}")
            else:
                lines.append(f"{fam.name}{_labels(labels)} {_fmt(value)}")
    return "\n".join(lines) + "\n"
