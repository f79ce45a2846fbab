"""Hit ratio against cache size, one line per policy, MIN as the dashed upper bound.

matplotlib is optional (``pip install matplotlib``, or the ``dev``/``bench``
extras) and imported only when a plot is asked for. The figure is drawn with
the Agg canvas directly, so no GUI backend or global pyplot state is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.replay.report import ReplayReport


def plot_report(report: ReplayReport, path: str | Path) -> Path:
    """Write the report's block hit ratio curves to ``path`` (PNG, or any format by suffix)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise ConfigError(f"cannot write plot {out}: directory {out.parent} does not exist")
    points = sorted(report.capacities, key=lambda p: p.blocks)
    xs = [p.percent for p in points]

    fig = Figure(figsize=(9.5, 5.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    best = [100.0 * report.mins[p.blocks].block_hit_ratio for p in points]
    ax.plot(xs, best, linestyle="--", color="black", marker="o", markersize=4,
            label="MIN (offline optimum)")
    markers = "sD^vP*Xoh<>"
    for i, name in enumerate(report.policies):
        runs = [report.cells[(name, p.blocks)] for p in points]
        ys = [100.0 * r.block_hit_ratio for r in runs]
        # The policy's own name (an import path's class reports a short one).
        label = runs[0].policy if runs else name
        ax.plot(xs, ys, marker=markers[i % len(markers)], markersize=4, label=label)
    trace = report.trace
    ax.set_xlabel(
        f"cache capacity (% of the trace's {trace.unique_blocks:,} unique blocks "
        f"of {trace.block_size} tokens)"
    )
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(f"{trace.name}: {report.model} model, {len(trace.requests):,} requests")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    # Outside the axes: at large capacities the curves reach every corner.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", borderaxespad=0.0)
    # A second axis in blocks, so absolute sizes can be read off too.
    unique = trace.unique_blocks or 1

    def to_blocks(pct: Any) -> Any:
        return np.asarray(pct, dtype=float) * (unique / 100.0)

    def to_percent(blocks: Any) -> Any:
        return np.asarray(blocks, dtype=float) * (100.0 / unique)

    top = ax.secondary_xaxis("top", functions=(to_blocks, to_percent))
    top.set_xlabel("cache capacity (blocks)")
    fig.tight_layout()
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot write plot {out}: {exc}") from None
    return out
