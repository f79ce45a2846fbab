"""Agent- and workflow-aware caching: hints, agent step graphs, the workflow policy, prefetch.

See ``docs/agents.md``. The engine-side parts (:mod:`kvtier.agents.prefetch`,
:mod:`kvtier.agents.attach`) and the workload generators
(:mod:`kvtier.agents.workloads`) are imported from their modules.
"""

from kvtier._lazy import lazy_exports
from kvtier.agents.graph import (
    FAR,
    AgentSpec,
    WorkflowSpec,
    WorkflowState,
    fan_out_in,
    parse_workflow,
    sequential,
)
from kvtier.agents.hints import HINT_NAMES, MAX_TTL_S, Hints, parse_hints
from kvtier.agents.tracker import WorkflowTracker

# The policy module imports kvtier.policy, which registers it: loaded on first
# use so that importing the hints (as the manager does) cannot cycle.
__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "WorkflowPolicy": "kvtier.agents.policy",
        "workflow_policy_of": "kvtier.agents.policy",
    },
)

__all__ = [
    "FAR",
    "HINT_NAMES",
    "MAX_TTL_S",
    "AgentSpec",
    "Hints",
    "WorkflowPolicy",
    "WorkflowSpec",
    "WorkflowState",
    "WorkflowTracker",
    "fan_out_in",
    "parse_hints",
    "parse_workflow",
    "sequential",
    "workflow_policy_of",
]
