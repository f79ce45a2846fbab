"""Observability: Prometheus metric types and text exposition."""

from kvtier.obs.metrics import Counter, Gauge, Histogram, MetricFamily, render_prometheus

__all__ = ["Counter", "Gauge", "Histogram", "MetricFamily", "render_prometheus"]
