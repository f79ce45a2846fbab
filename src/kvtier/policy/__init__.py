"""Eviction and admission policies, shared by every cache level and the replay."""

from kvtier.policy.base import EvictionPolicy, PolicyBase
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.registry import available_policies, make_policy, register_policy

register_policy("lru", LRUPolicy)

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyBase",
    "available_policies",
    "make_policy",
    "register_policy",
]
