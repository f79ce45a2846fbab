"""An engine's agent support: its workflows, request hints, TTL pins on finish, prefetch.

Every :class:`~kvtier.engine.Engine` has one :class:`AgentSupport` as
``engine.agents``. It owns the engine's :class:`WorkflowTracker` (the
workflow policy's own, when the device runs ``policy="workflow"``), registers
workflows (hashing agents' prompt prefixes with the engine's block keys),
tells the policy when a hinted request finishes (so ``cache_ttl_s`` pins its
blocks, generated ones included, from that moment), remembers each agent's
and each session's last prompt, and runs the
:class:`~kvtier.agents.prefetch.Prefetcher` when prefetch is on
(:meth:`enable_prefetch`; it needs tiers): for agents due within a number of
workflow steps, and for paused sessions due back within a lead time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

from kvtier.agents.graph import AgentSpec, WorkflowSpec, WorkflowState
from kvtier.agents.pinstats import TOP_SESSIONS, pin_report
from kvtier.agents.policy import workflow_policy_of
from kvtier.agents.prefetch import DEFAULT_PREFETCH_BYTES, Prefetcher, SessionTarget
from kvtier.agents.tracker import WorkflowTracker
from kvtier.errors import BadRequestError, ConfigError
from kvtier.hints import Hints
from kvtier.keys import cache_salt_key

#: Agents and sessions whose last prompt is remembered for prefetch, at most.
MAX_REMEMBERED = 10_000


class AgentSupport:
    """The agent-aware parts of one engine (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.policy = workflow_policy_of(engine.manager.policy)
        self.tracker: WorkflowTracker = (
            self.policy.tracker if self.policy is not None else WorkflowTracker()
        )
        if self.policy is not None and self.policy.clock is None:
            # Read through the manager each time, so the policy's pins and the manager's
            # requests always share one clock (a caller may replace the manager's).
            manager = engine.manager
            self.policy.clock = lambda: manager.clock()
        if self.policy is not None and getattr(engine, "tier_chain", None) is not None:
            # An ended session's own blocks are freed on the tiers too (release_ended).
            self.policy.collect_released = True
        self.prefetcher: Prefetcher | None = None
        #: Released keys a tier was still loading: freed at a later release_ended.
        self._release_later: list[int] = []
        #: The last prompt (token ids, block keys) of each agent ``(workflow, agent)`` and
        #: each :class:`SessionTarget`, for prefetch.
        self._last: dict[Hashable, tuple[list[int], list[int]]] = {}
        #: Seconds before a paused session is due back that its blocks are prefetched
        #: (None: sessions are not prefetched).
        self.session_lead: float | None = None

    # -- workflows ------------------------------------------------------------------
    def register(self, spec: WorkflowSpec, *, cache_salt: str | None = None) -> WorkflowState:
        """Register ``spec``; agents' ``prefix`` text and tokens become block keys here.

        ``cache_salt`` keys the prefixes as a request with that salt keys its blocks.
        """
        agents = []
        manager = self.engine.manager
        extra = () if cache_salt is None else (cache_salt_key(cache_salt),)
        for a in spec.agents:
            tokens = a.prefix_tokens
            if a.prefix is not None and not tokens:
                tokens = tuple(self.engine.encode_prompt(a.prefix))
            keys = a.prefix_keys
            if tokens and not keys:
                keys = tuple(manager.keys_for(list(tokens), extra))
            agents.append(replace(a, prefix_tokens=tuple(tokens), prefix_keys=tuple(keys)))
        return self.tracker.register(WorkflowSpec(spec.workflow_id, tuple(agents)))

    def prefix_from_messages(self, messages: Sequence[dict[str, Any]]) -> tuple[int, ...]:
        """Token ids of chat ``messages`` as the template renders them at a prompt's start."""
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise BadRequestError(
                f"model {self.engine.model_id} has no chat template: give the prefix as text",
                param="prefix_messages",
            )
        text = tok.apply_chat_template(list(messages), add_generation_prompt=False, tokenize=False)
        return tuple(tok.encode(text, add_special_tokens=False))

    # -- requests ---------------------------------------------------------------------
    def arrived(self, seq: Any) -> None:
        """A request was queued: a session it continues is back (its blocks are held
        until the request is served, not only until its TTL ran out)."""
        self.hold_waiting((seq,))

    def hold_waiting(self, waiting: Sequence[Any]) -> None:
        """Renew the holds of sessions whose requests still wait (before a step admits):
        a hold is short, so it ranks the session as due soon, and lasts as long as
        the wait does because it is renewed here; a request cancelled while it
        waited stops renewing it."""
        policy = self.policy
        if policy is None or not waiting:
            return
        now = self.engine.manager.clock()
        for seq in waiting:
            hints: Hints | None = seq.hints
            if hints is not None and hints.session_id is not None and not seq.admissions:
                policy.on_arrival(hints, now)

    def finished(self, seq: Any) -> None:
        """A request ended normally: its blocks join its agent, TTL pins start now."""
        hints: Hints | None = getattr(seq, "hints", None)
        if hints is None or seq.table is None:
            return
        manager = self.engine.manager
        keys = manager.block_keys(seq.seq_id)
        if self.policy is not None:
            self.policy.on_finish(keys, manager.clock(), hints)
        what: list[Hashable] = []
        if hints.workflow_id and hints.agent_id:
            what.append((hints.workflow_id, hints.agent_id))
        if self.session_lead is not None and hints.session_id and not hints.session_end:
            what.append(SessionTarget(hints.session_id))
        if what:
            last = (list(seq.tokens[: len(keys) * manager.block_size]), keys)
            for target in what:
                self._last.pop(target, None)
                self._last[target] = last
            while len(self._last) > MAX_REMEMBERED:
                self._last.pop(next(iter(self._last)))

    def target(self, what: Hashable) -> tuple[Sequence[int], Sequence[int]] | None:
        """Token ids and block keys to prefetch for ``what`` (an agent's ``(workflow,
        agent)`` or a :class:`SessionTarget`): its last prompt, or an agent's prefix."""
        last = self._last.get(what)
        if last is not None and last[1]:
            return last
        if not isinstance(what, tuple) or len(what) != 2:
            return None
        agent: tuple[str, str] = what
        state = self.tracker.get(agent[0])
        spec: AgentSpec | None = state.agent(agent[1]) if state is not None else None
        if spec is None or not spec.prefix_tokens or not spec.prefix_keys:
            return None
        n = len(spec.prefix_keys)
        return spec.prefix_tokens[: n * self.engine.manager.block_size], spec.prefix_keys

    # -- prefetch ----------------------------------------------------------------------
    # -- sessions -------------------------------------------------------------------
    def end_session(self, session_id: str) -> bool:
        """End ``session_id`` (as ``session_end`` does): its pins go, its own blocks are
        evicted first on the device and freed on every tier. False if it is unknown."""
        if self.policy is None:
            return False
        ended = self.policy.end_session(session_id)
        self._last.pop(SessionTarget(session_id), None)
        self.release_ended()
        return ended

    def release_ended(self) -> None:
        """Free the own blocks of sessions ended since the last call on every tier (a
        shared medium's copy too); a block a load is reading goes at a later call."""
        chain = self.engine.tier_chain
        if self.policy is None or chain is None:
            return
        keys = self._release_later + self.policy.take_released()
        self._release_later = chain.release(keys) if keys else []

    def pin_stats(
        self,
        *,
        top: int = TOP_SESSIONS,
        keep: Callable[[str], bool] | None = None,
        shown: Callable[[str], str] | None = None,
    ) -> dict[str, Any] | None:
        """Blocks retention pins keep on the device and each tier, in all and for the
        ``top`` sessions that pinned the most (:func:`~kvtier.agents.pinstats.pin_report`);
        ``None`` without the workflow policy. Call it on the engine thread."""
        if self.policy is None:
            return None
        chain = self.engine.tier_chain
        tiers = chain.pins() if chain is not None else {}
        now = self.engine.manager.clock()
        return pin_report(self.policy, tiers, now, top=top, keep=keep, shown=shown)

    def enable_prefetch(
        self,
        lookahead: int = 2,
        max_bytes: int = DEFAULT_PREFETCH_BYTES,
        session_lead: float | None = None,
    ) -> None:
        """Prefetch blocks of agents due within ``lookahead`` steps and, with
        ``session_lead`` (seconds; needs the workflow policy), of paused sessions due
        back within that long (needs tiers)."""
        if self.engine.tier_chain is None:
            raise ConfigError("prefetch brings blocks back from tiers: configure a tier first")
        policy = self.policy
        if session_lead is not None:
            if not session_lead >= 0.0 or session_lead == float("inf"):
                raise ConfigError(
                    f"the session prefetch lead must be seconds >= 0, got {session_lead!r}"
                )
            if policy is None:
                raise ConfigError(
                    "session prefetch follows the workflow policy's sessions: serve with "
                    "--policy workflow"
                )
            policy.sessions.expect_returns = True
        self.session_lead = session_lead
        self.prefetcher = Prefetcher(
            self.engine,
            self.target,
            self.due,
            policy.evictable_due_after if policy is not None else (lambda _d: 0),
            lookahead,
            max_bytes,
        )

    def due(self, within: int) -> list[tuple[int, Hashable]]:
        """Prefetch targets due soon: agents within ``within`` steps, soonest first, then
        paused sessions due back within the session lead, soonest first (each at
        distance 0: it may take blocks only of what is due later than any agent)."""
        out: list[tuple[int, Hashable]] = [(d, (w, a)) for d, w, a in self.tracker.due(within)]
        policy, lead = self.policy, self.session_lead
        if policy is not None and lead is not None:
            now = self.engine.manager.clock()
            out.extend((0, SessionTarget(s)) for s in policy.sessions.returning(now, lead))
        return out

    def next_due_in(self) -> float | None:
        """Seconds until a paused session comes within the session lead of its return
        (0.0: one has), for an idle server to wake then; None when none is expected."""
        policy, lead = self.policy, self.session_lead
        if self.prefetcher is None or policy is None or lead is None:
            return None
        back = policy.sessions.next_return()
        if back is None:
            return None
        now: float = self.engine.manager.clock()
        return max(back - lead - now, 0.0)

    def poll(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.poll()

    def deferred(self, keys: Sequence[int]) -> bool:
        """Whether a request needing ``keys`` should let ready requests go first."""
        return self.prefetcher is not None and self.prefetcher.loading(keys)

    def wait(self) -> bool:
        """Wait for one prefetch to land; False if none is in flight."""
        p = self.prefetcher
        return p is not None and p.busy and p.finish(wait=True) > 0

    def drain(self) -> bool:
        """Land every prefetch in flight (their blocks become evictable); False if none was."""
        p = self.prefetcher
        if p is None or not p.busy:
            return False
        while p.busy:
            p.finish(wait=True)
        return True

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
