"""``kvtier top URL``: a live terminal view of a running ``kvtier serve``.

Every ``--interval`` seconds it scrapes the server's ``/metrics`` (parsed
with ``prometheus_client``'s parser) and reads ``/v1/cache/stats`` for the
model's name and the eviction policy; rates (tokens/s, evictions/s, the hit
ratio of the last interval) are the counters' change between two scrapes.
The view is a ``rich`` table redrawn in place; ``--once`` prints one
snapshot as plain text (two scrapes ``--interval`` apart, so the rates are
real) and exits.

``--api-key`` (or ``KVTIER_API_KEY``, ``KEY`` or ``KEY:TENANT`` as
``kvtier serve`` takes it) is sent as ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

DEFAULT_INTERVAL = 1.0
API_KEY_ENV = "KVTIER_API_KEY"
#: Seconds one HTTP read may take.
HTTP_TIMEOUT_S = 10.0

#: A view: sections of (name, value) rows, in display order.
Rows = list[tuple[str, list[tuple[str, str]]]]


class TopError(Exception):
    """A server that cannot be read; the message is one line."""


def base_url(url: str) -> str:
    """``URL`` as given (``host:port``, ``http://host:port/``, ``.../v1``) without its path."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def fetch(url: str, api_key: str | None, timeout: float = HTTP_TIMEOUT_S) -> bytes:
    """``GET url``; any failure is a :class:`TopError` that says what went wrong."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain, application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body
    except urllib.error.HTTPError as exc:
        hint = ""
        if exc.code in (401, 403):
            hint = f" (pass --api-key or set {API_KEY_ENV})"
        raise TopError(f"{url} answered HTTP {exc.code} {exc.reason}{hint}") from None
    except urllib.error.URLError as exc:
        raise TopError(f"cannot reach {url}: {exc.reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        raise TopError(f"cannot reach {url}: {exc}") from None


@dataclass
class Sample:
    """One scrape: every sample of ``/metrics`` and, when readable, ``/v1/cache/stats``."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    stats: dict[str, Any] | None = None

    def has(self, name: str) -> bool:
        return name in self.samples

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples carrying ``labels`` (``None``: not exposed)."""
        found = [
            v
            for have, v in self.samples.get(name, [])
            if all(have.get(k) == want for k, want in labels.items())
        ]
        return sum(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed per value of ``label``."""
        out: dict[str, float] = {}
        for have, v in self.samples.get(name, []):
            if label in have:
                out[have[label]] = out.get(have[label], 0.0) + v
        return out


def parse_metrics(text: str, at: float) -> Sample:
    """The samples of a Prometheus text exposition, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    sample = Sample(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sample.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return sample


def scrape(base: str, api_key: str | None) -> Sample:
    """Read ``/metrics`` (required) and ``/v1/cache/stats`` (when it answers)."""
    text = fetch(f"{base}/metrics", api_key).decode("utf-8", "replace")
    try:
        sample = parse_metrics(text, time.monotonic())
    except ValueError as exc:
        raise TopError(f"{base}/metrics is not Prometheus text: {exc}") from None
    if not sample.has("kvtier_kv_blocks_total"):
        raise TopError(f"{base}/metrics has no kvtier metrics: is this a kvtier server?")
    try:
        stats = json.loads(fetch(f"{base}/v1/cache/stats", api_key))
        sample.stats = stats if isinstance(stats, dict) else None
    except (TopError, ValueError):
        sample.stats = None
    return sample


# -- what is shown ---------------------------------------------------------------------


def _int(v: float | None) -> str:
    return "-" if v is None else f"{round(v)}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover


def _delta(prev: Sample | None, cur: Sample, name: str, **labels: str) -> float | None:
    """``name``'s increase since ``prev`` (``None``: no previous scrape, or a reset)."""
    if prev is None:
        return None
    a, b = prev.get(name, **labels), cur.get(name, **labels)
    if a is None or b is None or b < a:
        return None
    return b - a


def _rate(prev: Sample | None, cur: Sample, name: str, **labels: str) -> str:
    d = _delta(prev, cur, name, **labels)
    if d is None or prev is None or cur.at <= prev.at:
        return "-"
    return f"{d / (cur.at - prev.at):.1f}/s"


def rows(prev: Sample | None, cur: Sample) -> Rows:
    """The sections of the view, from the last two scrapes."""
    g = cur.get
    out: Rows = []
    out.append(
        (
            "requests",
            [
                ("running", _int(g("kvtier_requests_running"))),
                ("waiting", _int(g("kvtier_requests_waiting"))),
                ("accepted", _int(g("kvtier_requests_total"))),
                ("finished", _int(g("kvtier_requests_finished_total"))),
                ("finished/s", _rate(prev, cur, "kvtier_requests_finished_total")),
                ("preemptions", _int(g("kvtier_preemptions_total"))),
            ],
        )
    )
    out.append(
        (
            "tokens",
            [
                ("prompt tokens/s", _rate(prev, cur, "kvtier_prompt_tokens_total")),
                ("computed tokens/s", _rate(prev, cur, "kvtier_prompt_tokens_computed_total")),
                ("generation tokens/s", _rate(prev, cur, "kvtier_generation_tokens_total")),
                ("prompt tokens", _int(g("kvtier_prompt_tokens_total"))),
                ("generation tokens", _int(g("kvtier_generation_tokens_total"))),
            ],
        )
    )
    hit = _delta(prev, cur, "kvtier_prefix_cache_hit_tokens_total")
    queried = _delta(prev, cur, "kvtier_prefix_cache_queried_tokens_total")
    recent = _pct(hit / queried) if hit is not None and queried else "-"
    out.append(
        (
            "prefix cache",
            [
                ("hit ratio", _pct(g("kvtier_prefix_cache_hit_ratio"))),
                ("hit ratio (interval)", recent),
                ("hit tokens", _int(g("kvtier_prefix_cache_hit_tokens_total"))),
                ("queried tokens", _int(g("kvtier_prefix_cache_queried_tokens_total"))),
            ],
        )
    )
    out.append(
        (
            "KV blocks",
            [
                ("used", _int(g("kvtier_kv_blocks_used"))),
                ("free", _int(g("kvtier_kv_blocks_free"))),
                ("cached", _int(g("kvtier_kv_blocks_cached"))),
                ("total", _int(g("kvtier_kv_blocks_total"))),
                ("usage", _pct(g("kvtier_kv_cache_usage"))),
                ("evictions", _int(g("kvtier_kv_evictions_total"))),
                ("evictions/s", _rate(prev, cur, "kvtier_kv_evictions_total")),
            ],
        )
    )
    if cur.has("kvtier_pressure_mode"):
        modes = cur.by("kvtier_pressure_mode", "mode")
        mode = next((m for m, v in modes.items() if v == 1), "-")
        usage = cur.samples.get("kvtier_memory_usage_ratio", [])
        memory = "-"
        if usage:
            labels, value = usage[0]
            memory = f"{_pct(value)} ({labels.get('source', '?')})"
        out.append(
            (
                "memory pressure",
                [
                    ("mode", mode),
                    ("memory used", memory),
                    ("mode changes", _int(g("kvtier_pressure_mode_changes_total"))),
                    ("rejections", _int(g("kvtier_pressure_rejections_total"))),
                    ("pressure evictions", _int(g("kvtier_pressure_evictions_total"))),
                ],
            )
        )
    tiers = cur.by("kvtier_tier_blocks", "tier")
    if tiers:
        capacity = cur.by("kvtier_tier_capacity_blocks", "tier")
        tier_rows: list[tuple[str, str]] = []
        for tier, used in tiers.items():
            cap = capacity.get(tier)
            share = f" ({_pct(used / cap)})" if cap else ""
            tier_rows.append((f"{tier} blocks", f"{_int(used)} / {_int(cap)}{share}"))
            loaded = _int(g("kvtier_tier_loaded_blocks_total", tier=tier))
            stored = _int(g("kvtier_tier_stored_blocks_total", tier=tier))
            tier_rows.append((f"{tier} loaded / stored", f"{loaded} / {stored}"))
            tier_rows.append(
                (f"{tier} loads/s", _rate(prev, cur, "kvtier_tier_loaded_blocks_total", tier=tier))
            )
        tier_rows.append(("prompt tokens loaded", _int(g("kvtier_loaded_prompt_tokens_total"))))
        out.append(("tiers", tier_rows))
    if cur.has("kvtier_encoder_cache_entries"):
        enc: list[tuple[str, str]] = []
        hits = cur.by("kvtier_encoder_cache_hits_total", "modality")
        misses = cur.by("kvtier_encoder_cache_misses_total", "modality")
        for modality in sorted({*hits, *misses}):
            h, m = hits.get(modality, 0.0), misses.get(modality, 0.0)
            ratio = f" ({_pct(h / (h + m))})" if h + m else ""
            enc.append((f"{modality} hits / misses", f"{_int(h)} / {_int(m)}{ratio}"))
        enc.append(("entries", _int(g("kvtier_encoder_cache_entries"))))
        held, cap = g("kvtier_encoder_cache_bytes"), g("kvtier_encoder_cache_capacity_bytes")
        enc.append(("memory", f"{_bytes(held)} / {_bytes(cap)}"))
        enc.append(("evictions", _int(g("kvtier_encoder_cache_evictions_total"))))
        out.append(("encoder cache", enc))
    return out


def title(base: str, cur: Sample) -> str:
    """``kvtier top URL`` and, when ``/v1/cache/stats`` answered, the model and policy."""
    parts = [f"kvtier top  {base}"]
    if cur.stats is not None:
        model = (cur.stats.get("engine") or {}).get("model")
        if model:
            parts.append(f"model {model}")
        if cur.stats.get("policy"):
            parts.append(f"policy {cur.stats['policy']}")
    return "  ".join(parts)


def plain(heading: str, view: Rows) -> str:
    """The view as plain text: a heading, then each section's ``name  value`` lines."""
    lines = [heading]
    for section, items in view:
        lines.append("")
        lines.append(section)
        lines.extend(f"  {name:<24}{value}" for name, value in items)
    return "\n".join(lines)


def table(heading: str, view: Rows, note: str = "") -> Any:
    """The view as a ``rich`` table (sections separated by rules)."""
    from rich.table import Table

    t = Table(title=heading, caption=note or None, show_header=False, min_width=len(heading))
    t.add_column("section", style="bold cyan", no_wrap=True)
    t.add_column("metric", no_wrap=True)
    t.add_column("value", justify="right", style="bold", no_wrap=True)
    for i, (section, items) in enumerate(view):
        if i:
            t.add_section()
        for j, (name, value) in enumerate(items):
            t.add_row(section if j == 0 else "", name, value)
    return t


# -- the command -----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    base = base_url(args.url)
    api_key = (args.api_key or os.environ.get(API_KEY_ENV) or "").strip().partition(":")[0]
    api_key = api_key or None
    interval = args.interval
    if not interval > 0:
        print("kvtier top: --interval must be above 0", file=sys.stderr)
        return 2
    try:
        import prometheus_client  # noqa: F401

        if not args.once:
            import rich  # noqa: F401
    except ImportError as exc:
        print(f"kvtier top: needs the {exc.name} package", file=sys.stderr)
        return 1
    try:
        prev = scrape(base, api_key)
        if args.once:
            time.sleep(interval)
            cur = scrape(base, api_key)
            print(plain(title(base, cur), rows(prev, cur)))
            return 0
    except TopError as exc:
        print(f"kvtier top: {exc}", file=sys.stderr)
        return 1
    return _live(base, api_key, interval, prev)


def _live(base: str, api_key: str | None, interval: float, first: Sample) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    prev, cur = None, first
    note = f"every {interval:g} s; Ctrl-C to quit"
    with Live(
        table(title(base, cur), rows(prev, cur), note), console=console, auto_refresh=False
    ) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    nxt = scrape(base, api_key)
                except TopError as exc:
                    live.update(table(title(base, cur), rows(prev, cur), f"{exc}"), refresh=True)
                    continue
                prev, cur = cur, nxt
                live.update(table(title(base, cur), rows(prev, cur), note), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser(
        "top",
        help="a live view of a running kvtier server (requests, tokens/s, cache, tiers)",
        description="Poll a kvtier server's /metrics and /v1/cache/stats and show requests, "
        "tokens/s, the prefix-cache hit ratio, KV blocks, evictions, the memory-pressure "
        "mode, tiers and the encoder cache.",
    )
    top.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    top.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"seconds between scrapes (default {DEFAULT_INTERVAL:g})",
    )
    top.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot as plain text and exit (rates over one --interval)",
    )
    top.add_argument(
        "--api-key",
        default=None,
        help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    top.set_defaults(func=run)
