"""Eviction and admission policies, shared by every cache level and the replay.

Every shipped policy is registered through :func:`with_admission`, so any of
them takes ``admission="tinylfu"`` in :func:`make_policy` (or the ``policy``
config); without it the bare policy is returned.
"""

from kvtier.policy.admission import (
    AdmissionFilter,
    Admitted,
    TinyLFUAdmission,
    make_admission,
    with_admission,
)
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy, PolicyBase, admit_chain
from kvtier.policy.fifo import FIFOPolicy
from kvtier.policy.gdsf import GDSFPolicy
from kvtier.policy.hybrid import HybridPolicy
from kvtier.policy.learned import LearnedReusePolicy
from kvtier.policy.lfu import LFUPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.registry import available_policies, make_policy, register_policy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.sieve import SIEVEPolicy

for _cls in (
    LRUPolicy,
    LFUPolicy,
    FIFOPolicy,
    ARCPolicy,
    S3FIFOPolicy,
    SIEVEPolicy,
    GDSFPolicy,
    HybridPolicy,
    LearnedReusePolicy,
):
    register_policy(_cls.name, with_admission(_cls))
del _cls
# The workflow policy (kvtier.agents.policy) registers itself; see registry.PLUGIN_MODULES.

__all__ = [
    "ARCPolicy",
    "AdmissionFilter",
    "Admitted",
    "EvictionPolicy",
    "FIFOPolicy",
    "GDSFPolicy",
    "HybridPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "LearnedReusePolicy",
    "PolicyBase",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "TinyLFUAdmission",
    "admit_chain",
    "available_policies",
    "make_admission",
    "make_policy",
    "register_policy",
    "with_admission",
]
