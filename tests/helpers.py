"""Shared test helpers: snapshots of manager state for rollback checks; agent hints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier import KVCacheManager, PolicyBase


def snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything observable about a manager's bookkeeping, as plain data.

    The policy's part is its own :meth:`~kvtier.PolicyBase.snapshot`: every
    list, ghost, count and admission sketch, whatever the policy.
    """
    pool = m.pool
    return {
        "ref": list(pool.ref),
        "keys": list(pool.block_key),
        "free": list(pool._free),
        "version": list(pool.version),
        "cached": dict(pool._cached),
        "parent": list(pool.parent),
        "children": [pool.children_of(b) for b in range(pool.num_blocks)],
        "declined": pool.declined,
        "policy": pool.policy.snapshot(),
        "requests": {
            rid: (
                list(r.table.blocks), r.table.num_tokens, list(r.tail), list(r.keys),
                dict(r.shadow), r.chain_open,
            )
            for rid, r in m._requests.items()
        },
        "stats": m.stats(),
    }


class InsertionOrderPolicy(PolicyBase):
    """Evicts in insertion order, so parents go before their children (forces cascades)."""

    name = "test-insertion-order"

    def __init__(self) -> None:
        super().__init__()
        self.order: dict[int, bool] = {}  # key -> pinned, in insertion order
        self._evictable = 0

    def _pinned_keys(self) -> Iterable[int]:
        return [k for k, pinned in self.order.items() if pinned]

    def snapshot(self) -> dict[str, Any]:
        return {**self._state(), "order": list(self.order.items()), "evictable": self._evictable}

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        self.order[key] = pinned
        self._evictable += not pinned

    def access(self, key: int) -> None:
        pass

    def pin(self, key: int) -> None:
        assert self.order[key] is False
        self.order[key] = True
        self._evictable -= 1

    def unpin(self, key: int) -> None:
        assert self.order[key] is True
        self.order[key] = False
        self._evictable += 1

    def remove(self, key: int) -> None:
        pinned = self.order.pop(key, None)
        if pinned is not None:
            self._evictable -= not pinned
            self._forget_size(key)

    def evict(self) -> int | None:
        for key, pinned in self.order.items():  # a scan is fine for a test policy
            if not pinned:
                del self.order[key]
                self._evictable -= 1
                self._forget_size(key)
                return key
        return None

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order

    @property
    def num_evictable(self) -> int:
        return self._evictable


def agent_hints(
    agent: str | None,
    step: int,
    session: str | None,
    ttl: float | None,
    reuse: str | None,
    end: bool,
) -> dict[str, object]:
    """The hints of a request of ``agent`` (of workflow ``"w"``, at ``step``) in
    ``session`` (``end``: its last), with ``cache_ttl_s`` and ``reuse``; any may be None."""
    hints: dict[str, object] = {}
    if agent is not None:
        hints.update(workflow_id="w", agent_id=agent, step=step)
    if session is not None:
        hints["session_id"] = session
        if end:
            hints["session_end"] = True
    if ttl is not None:
        hints["cache_ttl_s"] = ttl
    if reuse is not None:
        hints["reuse"] = reuse
    return hints
