"""Per-key hints of the workflow policy: who used each block, and how.

Every request's hints (``workflow_id``/``agent_id``, ``session_id``,
``reuse``) leave a :class:`Tag` on each of its block keys: the agents that
used the key (its owners), the first session that did, whether two agents
or sessions shared it, and the ``reuse`` hint of the request that made it.
:class:`HintTags` keeps the tags (of every resident key and, bounded, of
keys seen lately) and each key's depth in its chain, indexes resident keys
by owner so that a workflow's progress re-ranks its blocks only, and hands
the policy the resident keys whose rank inputs changed, tail first.

A request's keys mostly carry the same hints, so one :class:`Tag` serves
every key that has the same one: a tag is never changed in place, a key whose
hints change gets a new one (shared by the keys of that call that had the
same old tag), and a request's work is a few passes at C speed over its keys
plus one look at each distinct tag.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import TYPE_CHECKING, NamedTuple

from kvtier.agents.ranks import MAX_OWNERS

#: ``(workflow_id, agent_id)``: an agent that used a block.
Owner = tuple[str, str]


@dataclass(slots=True, eq=False)
class Tag:
    """What the hints said about some keys; shared by them and never changed in place."""

    owners: list[Owner] = field(default_factory=list)
    session: str | None = None
    shared: bool = False
    reuse: str | None = None


#: What one call's hints do to a key with a given old tag: its new tag (None: the
#: hints add nothing), whether the call's owner is new to it and recorded (its
#: owner index grows), and whether its rank inputs changed (it moves).
Change = tuple[Tag, bool, bool, bool] | None


class Said(NamedTuple):
    """What one call's hints say of its keys."""

    owner: Owner | None
    session: str | None
    shared: bool
    reuse: str | None

    def tag(self) -> Tag:
        """The tag of a key these hints are the first to name."""
        owners = [] if self.owner is None else [self.owner]
        return Tag(owners, self.session, self.shared, self.reuse)


def _change(tag: Tag, said: Said) -> Change:
    """What tagging a key whose tag is ``tag`` with ``said`` does to it."""
    owner, session, shared, reuse = said
    was_shared = tag.shared
    was_reuse = tag.reuse
    if (
        (was_shared or not shared)
        and (session is None or tag.session == session or (was_shared and tag.session is not None))
        and (reuse is None or was_shared or was_reuse == reuse)
        and not (was_shared and was_reuse == "never")
        and (owner is None or owner in tag.owners)
    ):
        # The usual case (a session's or an agent's next request over its own
        # chain, an agent's registered prefix): the hints add nothing.
        return None
    owners = tag.owners
    n_owners = len(owners)
    is_shared = was_shared or shared
    new_session = tag.session
    if session is not None:
        if new_session is None:
            new_session = session
        elif new_session != session:
            is_shared = True
    new_reuse = was_reuse
    if reuse is not None and not is_shared:
        new_reuse = reuse
    added = recorded = False
    if owner is not None and owner not in owners:
        added = True
        if owners:
            is_shared = True
        recorded = n_owners < MAX_OWNERS
        if recorded:
            owners = [*owners, owner]
    if is_shared and new_reuse == "never":
        new_reuse = None
    moved = is_shared != was_shared or new_reuse != was_reuse or len(owners) != n_owners
    return Tag(owners, new_session, is_shared, new_reuse), added, recorded, moved


class HintTags:
    """The tags of the workflow policy's keys, and its resident keys by owner."""

    _tags: OrderedDict[int, Tag]
    #: Each tagged key's position in its chain (fixed: keys are chained to their
    #: prefix); the same keys as ``_tags``.
    _depth_of: dict[int, int]
    #: Keys whose tags are remembered at most (resident keys' tags are always kept).
    _history: int
    #: Every resident key.
    _resident: set[int]
    #: Resident keys first tagged while resident (their depth changed).
    _redepth: set[int]
    #: (workflow, agent) -> resident keys it owns, in chain order (moves keep it).
    _by_agent: dict[Owner, dict[int, None]]
    #: workflow -> its agents seen so far, in first-seen order (a dict, not a set: the
    #: order re-ranking visits them must not depend on string hashing).
    _by_workflow: dict[str, dict[str, None]]

    if TYPE_CHECKING:

        def _move(self, key: int) -> None: ...

    def sessions_of(self, keys: Iterable[int]) -> dict[int, str]:
        """The session that first used each of ``keys``, for those whose tag is remembered
        and names one."""
        get = self._tags.get
        return {k: t.session for k in keys if (t := get(k)) is not None and t.session is not None}

    def _depth(self, key: int) -> int:
        return self._depth_of.get(key, 0)

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

    def _index_owner(self, key: int, owner: Owner, recorded: bool) -> None:
        """A resident ``key`` gained ``owner`` (indexed only if its tag records it)."""
        if recorded:
            # Only a recorded owner indexes the key: the key leaves the index of the
            # owners it records, so an agent past the cap would keep a key that is
            # gone and its workflow's progress would re-rank it.
            keys_of = self._by_agent.get(owner)
            if keys_of is None:
                self._by_agent[owner] = {key: None}
            else:
                keys_of[key] = None
        # Seen all the same: its workflow visits its agents in the order they were
        # first seen, whatever the cap left out.
        self._by_workflow.setdefault(owner[0], {})[owner[1]] = None

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
        Every key's tag becomes the most recently used one. Resident keys whose
        rank inputs changed move to their new class, tail first.
        """
        n = len(keys)
        said = Said(owner, session, shared, reuse)
        if n and len(set(keys)) == n:
            moved = self._tag_distinct(keys, list(map(self._tags.get, keys)), said, depths)
        else:
            moved = self._tag_each(keys, said, depths)
        # Tail first, so a class evicts the chain's tail first.
        move = self._move
        for key in reversed(moved):
            move(key)
        self._trim_history()

    def _tag_distinct(
        self, keys: Sequence[int], found: list[Tag | None], said: Said, depths: Iterable[int] | None
    ) -> list[int]:
        """:meth:`_tag_keys` for keys that are all different: one look at each distinct
        tag, then passes over the keys at C speed. Returns the keys to move, in order."""
        tags = self._tags
        changes: dict[Tag, Change] = {}
        fresh: Tag | None = None
        for tag in set(found):
            if tag is None:
                fresh = said.tag()
            else:
                changes[tag] = _change(tag, said)
        moved: list[int] = []
        resident = self._resident
        at = range(len(keys)) if depths is None else depths
        if fresh is not None and not changes:
            # Every key is new (the usual second half of a request): appended in order,
            # they are the most recent already.
            self._depth_of.update(zip(keys, at, strict=True))
            tags.update(zip(keys, repeat(fresh)))
            if not resident.isdisjoint(keys):
                for key in [k for k in keys if k in resident]:
                    self._first_tag(key, said.owner, moved)
            return moved
        if fresh is not None:
            is_new = [t is None for t in found]
            new = list(compress(keys, is_new))
            self._depth_of.update(zip(new, compress(at, is_new), strict=True))
            tags.update(zip(new, repeat(fresh)))
        # Every key to the most recent end, in order (the new ones were appended).
        deque(map(tags.move_to_end, keys), maxlen=0)
        if not any(changes.values()) and (fresh is None or resident.isdisjoint(new)):
            return moved  # the usual case: nothing changes
        for key, tag in zip(keys, found, strict=True):
            if tag is None:
                if key in resident:
                    self._first_tag(key, said.owner, moved)
                continue
            change = changes[tag]
            if change is not None:
                self._retag(key, change, said.owner, moved)
        return moved

    def _first_tag(self, key: int, owner: Owner | None, moved: list[int]) -> None:
        """A resident key got its first tag: index it, and move it (its depth changed)."""
        if owner is not None:
            self._index_owner(key, owner, True)
        moved.append(key)
        self._redepth.add(key)

    def _retag(self, key: int, change: Change, owner: Owner | None, moved: list[int]) -> None:
        """Give ``key`` the tag ``change`` names; index and move it if it is resident."""
        assert change is not None
        new_tag, added, recorded, moves = change
        self._tags[key] = new_tag
        if key in self._resident:
            if added:
                assert owner is not None
                self._index_owner(key, owner, recorded)
            if moves:
                moved.append(key)

    def _tag_each(self, keys: Sequence[int], said: Said, depths: Iterable[int] | None) -> list[int]:
        """:meth:`_tag_keys` one key after another (a key may come twice: its second
        turn sees what its first did). Returns the keys to move, in order."""
        tags = self._tags
        resident = self._resident
        changes: dict[Tag, Change] = {}
        fresh: Tag | None = None
        moved: list[int] = []
        at = range(len(keys)) if depths is None else depths
        for key, depth in zip(keys, at, strict=True):
            tag = tags.get(key)
            if tag is None:
                if fresh is None:
                    fresh = said.tag()
                tags[key] = fresh
                self._depth_of[key] = depth
                if key in resident:
                    self._first_tag(key, said.owner, moved)
                continue
            tags.move_to_end(key)
            if tag in changes:
                change = changes[tag]
            else:
                change = changes[tag] = _change(tag, said)
            if change is not None:
                self._retag(key, change, said.owner, moved)
        return moved

    def _trim_history(self) -> None:
        """Forget the least recently used tags past the history (resident keys keep theirs)."""
        tags = self._tags
        excess = len(tags) - self._history
        if excess <= 0:
            return
        resident = self._resident
        depth_of = self._depth_of
        tries = 4 * excess + 8
        while excess > 0 and tries > 0:
            tries -= 1
            old, tag = tags.popitem(last=False)
            if old in resident:
                tags[old] = tag  # a resident key keeps its hints
            else:
                del depth_of[old]
                excess -= 1

    def _never_reused(self, key: int, tag: Tag, memo: dict[Tag, Tag]) -> None:
        """Mark ``key`` (tagged ``tag``) ``reuse="never"``; ``memo`` shares one new tag
        among the keys that had the same old one."""
        new = memo.get(tag)
        if new is None:
            new = memo[tag] = Tag(tag.owners, tag.session, tag.shared, "never")
        self._tags[key] = new
