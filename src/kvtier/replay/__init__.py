"""Trace replay: run recorded request traces through kvtier's cache and policies.

``kvtier replay`` loads a trace (:mod:`~kvtier.replay.traces`), replays it
through a real :class:`~kvtier.manager.KVCacheManager` or the block-level
model (:mod:`~kvtier.replay.simulator`), compares every policy with Belady's
offline optimum (:mod:`~kvtier.replay.belady`) and prints a table, JSON or a
plot (:mod:`~kvtier.replay.report`, :mod:`~kvtier.replay.plot`).
``kvtier replay --engines N`` replays over several engines with a routing
rule, local tiers and a shared one (:mod:`~kvtier.replay.cluster`).
"""

from kvtier.replay.belady import MinResult, belady_min
from kvtier.replay.capacity import Capacity, parse_capacity
from kvtier.replay.cluster import ROUTES, ClusterConfig, ClusterResult, simulate_cluster
from kvtier.replay.simulator import (
    MODELS,
    Model,
    RunResult,
    simulate,
    simulate_block,
    simulate_min,
    simulate_prefix,
)
from kvtier.replay.traces import Trace, TraceRequest, load_sample_trace, load_trace

__all__ = [
    "MODELS",
    "ROUTES",
    "Capacity",
    "ClusterConfig",
    "ClusterResult",
    "MinResult",
    "Model",
    "RunResult",
    "Trace",
    "TraceRequest",
    "belady_min",
    "load_sample_trace",
    "load_trace",
    "parse_capacity",
    "simulate",
    "simulate_block",
    "simulate_cluster",
    "simulate_min",
    "simulate_prefix",
]
