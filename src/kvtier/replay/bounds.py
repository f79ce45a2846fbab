"""An upper bound on prompt hits in the prefix model, for agents taking turns in a fixed cycle.

Belady's MIN (:mod:`kvtier.replay.belady`) may bypass a block: it never has
to hold a request's blocks. A serving cache (the replay's prefix model, a real
:class:`~kvtier.manager.KVCacheManager`) must hold every block of a request
while it is admitted, so on a cyclic agent loop whose cache holds most but
not all prompts, MIN is out of any policy's reach. This module computes how
far out.

The argument. Let agents take turns in a fixed cycle of ``N`` (request ``s``
is agent ``s mod N``'s turn), and let an agent's prompt blocks be its own
(no other agent's request names them). A block agent ``a`` hits at request
``s`` was computed or hit at ``a``'s previous turn ``s - N`` and stayed
cached through every request in between, each of which held all of its own
``B_t`` blocks at once. So for every request ``t``, the hits ``h_s`` of the
next ``N - 1`` turns fit beside it::

    B_t + sum(h_s for s in t+1 .. t+N-1) <= capacity

and ``h_s`` is at most the prefix request ``s`` shares with request ``s-N``
(less its last token, which the manager never reports cached). Maximising
``sum(h_s)`` under these window constraints is a linear program whose rows
are equal-length windows of consecutive variables; taking each ``h_s`` as
large as the constraints left by earlier ones allow, in order, solves it
(checked against exhaustive search in the tests). No policy in the prefix
model can hit more.
"""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.replay.traces import Trace


def cyclic_prefix_bound(trace: Trace, capacity: int) -> float:
    """The most prompt tokens any policy can serve from a ``capacity``-block cache, as a share.

    ``trace`` must be one cyclic agent loop (every request hinted with an
    ``agent_id``, the agents taking turns in a fixed order, each agent's
    shared prefix named by no other request in between); otherwise a
    :class:`ConfigError` says which request breaks it.
    """
    if capacity < 1:
        raise ConfigError(f"capacity must be at least 1 block, got {capacity}")
    bs = trace.block_size
    reqs = trace.requests
    agents: list[str] = []
    for i, r in enumerate(reqs):
        agent = (r.hints or {}).get("agent_id")
        if not isinstance(agent, str):
            raise ConfigError(f"request {i} has no agent_id hint: the bound needs an agent loop")
        agents.append(agent)
    n = len(dict.fromkeys(agents))
    for i, agent in enumerate(agents):
        if i >= n and agents[i - n] != agent:
            raise ConfigError(
                f"request {i} is {agent!r}'s turn, not {agents[i - n]!r}'s: the agents do "
                "not take turns in a fixed cycle"
            )
    keys = [r.full_keys(bs) for r in reqs]
    limits = [0] * len(reqs)
    for s in range(n, len(reqs)):
        now, before = keys[s], keys[s - n]
        shared = 0
        for a, b in zip(now, before, strict=False):
            if a != b:
                break
            shared += 1
        limits[s] = min(shared, (reqs[s].input_length - 1) // bs)
        mine = set(now[: limits[s]])
        for t in range(s - n + 1, s):
            if mine.intersection(keys[t]):
                raise ConfigError(
                    f"request {t} reads blocks of request {s}'s prefix: the bound needs "
                    "each agent's prompt blocks to be its own"
                )
    # Room beside each request: what it holds itself is never available to others.
    room = [capacity - -(-r.input_length // bs) for r in reqs]
    hits = max_window_hits(n, limits, room)
    total = sum(r.input_length for r in reqs)
    return hits * bs / total if total else 0.0


def max_window_hits(cycle: int, limits: list[int], room: list[int]) -> int:
    """Max ``sum(h)`` with ``0 <= h[s] <= limits[s]`` (``h[s] = 0`` for ``s < cycle``) and,
    for every ``t``, ``sum(h[t+1 .. t+cycle-1]) <= room[t]`` (a negative room is a full one).

    Each ``h[s]`` in turn takes all the room its windows have left: with
    windows of equal length this greedy order is optimal.
    """
    if cycle < 1 or len(limits) != len(room):
        raise ConfigError("max_window_hits needs a cycle of 1+ and one room per limit")
    left = list(room)
    total = 0
    for s in range(cycle, len(limits)):
        between = range(s - cycle + 1, s)
        h = max(0, min([limits[s], *(left[t] for t in between)]))
        for t in between:
            left[t] -= h
        total += h
    return total
