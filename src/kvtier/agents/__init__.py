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
from kvtier.agents.tracker import WorkflowTracker
from kvtier.hints import HINT_NAMES, MAX_TTL_S, Hints, parse_hints

# The workflow policy registers itself with kvtier.policy when its module is
# imported (make_policy("workflow") imports it); loaded here on first use.
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
