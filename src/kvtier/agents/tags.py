"""Per-key hints of the workflow policy: who used each block, and how.

Every request's hints (``workflow_id``/``agent_id``, ``session_id``,
``reuse``) leave a :class:`Tag` on each of its block keys: the agents that
used the key (its owners), the first session that did, whether two agents
or sessions shared it, and the ``reuse`` hint of the request that made it.
:class:`HintTags` keeps the tags (of every resident key and, bounded, of
keys seen lately), indexes resident keys by owner so that a workflow's
progress re-ranks its blocks only, and hands the policy the resident keys
whose rank inputs changed, tail first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.agents.ranks import MAX_OWNERS
from kvtier.policy.base import EvictionPolicy

#: ``(workflow_id, agent_id)``: an agent that used a block.
Owner = tuple[str, str]


@dataclass(slots=True)
class Tag:
    """What the hints said about one key."""

    owners: list[Owner] = field(default_factory=list)
    session: str | None = None
    shared: bool = False
    reuse: str | None = None
    #: The key's position in its chain (fixed: keys are chained to their prefix).
    depth: int = 0


class HintTags:
    """The tags of the workflow policy's keys, and its resident keys by owner."""

    _tags: OrderedDict[int, Tag]
    #: Keys whose tags are remembered at most (resident keys' tags are always kept).
    _history: int
    #: Every resident key, in the fallback's global order.
    _global: EvictionPolicy
    #: (workflow, agent) -> resident keys it owns, in chain order (moves keep it).
    _by_agent: dict[Owner, dict[int, None]]
    #: workflow -> its agents seen so far, in first-seen order (a dict, not a set: the
    #: order re-ranking visits them must not depend on string hashing).
    _by_workflow: dict[str, dict[str, None]]

    if TYPE_CHECKING:

        def _move(self, key: int) -> None: ...

    def _depth(self, key: int) -> int:
        tag = self._tags.get(key)
        return 0 if tag is None else tag.depth

    def _index(self, key: int, tag: Tag) -> None:
        for owner in tag.owners:
            self._by_agent.setdefault(owner, {})[key] = None
            self._by_workflow.setdefault(owner[0], {})[owner[1]] = None

    def _unindex_owners(self, key: int, owners: list[Owner]) -> None:
        by_agent = self._by_agent
        for owner in owners:
            keys = by_agent.get(owner)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del by_agent[owner]

    def _tag_keys(
        self,
        keys: Sequence[int],
        owner: Owner | None,
        session: str | None,
        *,
        shared: bool = False,
        reuse: str | None = None,
        depths: Iterable[int] | None = None,
    ) -> None:
        """Tag ``keys`` (a chain, or part of one) with a request's hints.

        ``depths`` gives each key's place in its chain (by default its index).
        Resident keys whose rank inputs changed move to their new class, tail first.
        """
        tags = self._tags
        get = tags.get
        resident = self._global
        moved: list[int] = []
        touch = tags.move_to_end
        by_agent = self._by_agent
        by_workflow = self._by_workflow
        for key, depth in zip(keys, range(len(keys)) if depths is None else depths, strict=True):
            tag = get(key)
            if tag is None:
                owners = [] if owner is None else [owner]
                tag = tags[key] = Tag(owners, session, shared, reuse, depth)
                if key in resident:
                    if owner is not None:
                        keys_of = by_agent.get(owner)
                        if keys_of is None:
                            by_agent[owner] = {key: None}
                        else:
                            keys_of[key] = None
                        by_workflow.setdefault(owner[0], {})[owner[1]] = None
                    moved.append(key)
                continue
            touch(key)
            was_shared = tag.shared
            was_reuse = tag.reuse
            if (
                (was_shared or not shared)
                and (
                    session is None
                    or tag.session == session
                    or (was_shared and tag.session is not None)
                )
                and (reuse is None or was_shared or was_reuse == reuse)
                and not (was_shared and was_reuse == "never")
                and (owner is None or owner in tag.owners)
            ):
                # The usual case (a session's or an agent's next request over its own
                # chain, an agent's registered prefix): the hints add nothing.
                continue
            owners = tag.owners
            n_owners = len(owners)
            is_shared = was_shared or shared
            if session is not None:
                if tag.session is None:
                    tag.session = session
                elif tag.session != session:
                    is_shared = True
            new_reuse = was_reuse
            if reuse is not None and not is_shared:
                new_reuse = reuse
            if owner is not None and owner not in owners:
                if owners:
                    is_shared = True
                recorded = n_owners < MAX_OWNERS
                if recorded:
                    owners.append(owner)
                if key in resident:
                    # Only a recorded owner indexes the key: the key leaves the index
                    # of the owners it records, so an agent past the cap would keep a
                    # key that is gone and its workflow's progress would re-rank it.
                    if recorded:
                        keys_of = by_agent.get(owner)
                        if keys_of is None:
                            by_agent[owner] = {key: None}
                        else:
                            keys_of[key] = None
                    # Seen all the same: its workflow visits its agents in the order
                    # they were first seen, whatever the cap left out.
                    by_workflow.setdefault(owner[0], {})[owner[1]] = None
            if is_shared and new_reuse == "never":
                new_reuse = None
            tag.shared = is_shared
            tag.reuse = new_reuse
            # A resident key is always in the class its rank names: it moves only
            # when what its rank reads of its tag changed.
            if (
                is_shared != was_shared or new_reuse != was_reuse or len(owners) != n_owners
            ) and key in resident:
                moved.append(key)
        # Tail first, so a class evicts the chain's tail first.
        move = self._move
        for key in reversed(moved):
            move(key)
        excess = len(tags) - self._history
        tries = 4 * excess + 8
        while excess > 0 and tries > 0:
            tries -= 1
            old, tag = tags.popitem(last=False)
            if old in resident:
                tags[old] = tag  # a resident key keeps its hints
            else:
                excess -= 1
