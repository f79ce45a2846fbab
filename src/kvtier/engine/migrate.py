"""Moving a running (or waiting) request from one engine to another with its KV cache.

As Llumnix moves requests between instances, a request leaves one
:class:`~kvtier.engine.Engine` and resumes on another, producing the tokens
it would have produced had it never moved: its prompt and generated tokens,
its sampler (the random generator's state and penalty counts, so seeded
sampling continues where it was) and its detokenizer travel with it, and so
does the KV of every token it computed, so nothing is recomputed:

* **direct** (both engines in one process): the computed blocks are copied
  into blocks the destination allocates (device to device when the engines
  sit on different devices), except those whose prefix the destination
  already caches;
* **through a shared tier** (engines in different processes sharing Redis):
  the source stores the computed full blocks under their prefix keys and the
  partial last block under a key private to the request, waits for the
  writes, and hands over the request's state as JSON (:meth:`Departure.state`);
  the destination queues the request first in line and loads the blocks
  back as it resumes, the way a preempted request swapped to a tier does.

A move has three steps, each run on its engine's thread between steps
(:meth:`EngineWorker.call <kvtier.engine.EngineWorker.call>`):
:func:`detach` takes the request out of the source's schedule (it keeps its
blocks), :func:`attach` / :func:`attach_state` start it on the destination,
then :func:`release` frees it on the source, or :func:`restore`, after a
failed attach, puts it back where it was, as if nothing had happened.
:func:`migrate` does all three for two engines driven from one thread, and
:func:`migrate_between` for two :class:`~kvtier.engine.EngineWorker` s,
forwarding the outputs (and a cancel) between their handles.

Only requests generating one choice move (``n == 1``); a failure is a
:class:`~kvtier.errors.MigrationError` and leaves the request running on
its source.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.queues import Slot
from kvtier.engine.request import RequestMetrics, RequestOutput
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.errors import (
    AdmissionRejectedError,
    BadRequestError,
    KvTierError,
    MigrationError,
    OutOfBlocksError,
)
from kvtier.offload.swap import SwappedRequest

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.engine.worker import EngineWorker

#: Version of :meth:`Departure.state`'s format; an engine refuses others.
STATE_VERSION = 1

Via = Literal["direct", "tier"]


@dataclass(eq=False)
class Departure:
    """A request detached from its source engine, until :func:`release` or :func:`restore`."""

    seq: Seq
    #: Where it was: ``"running"`` (it holds blocks) or ``"waiting"``.
    where: Literal["running", "waiting"]
    #: Its place in the waiting queue (waiting requests only).
    index: int
    #: Tokens whose KV it has (0 for a waiting request).
    computed: int
    via: Via
    #: Namespace root of the source's block keys: engines must share the model and layout.
    root: int
    block_size: int
    layout: str
    #: The computed blocks' KV (direct moves).
    payload: torch.Tensor | None = None
    #: Per payload block: whether it is whole (windowed storage drops sliding layers of
    #: blocks no window sees; the destination marks those blocks the same way).
    whole: list[bool] = field(default_factory=list)
    #: Where the KV went (moves through a shared tier).
    swapped: SwappedRequest | None = None

    def state(self) -> dict[str, Any]:
        """The request as JSON-able data for :func:`attach_state` in another process."""
        seq = self.seq
        m = seq.metrics
        now = time.perf_counter()
        swapped = self.swapped
        return {
            "version": STATE_VERSION,
            "request_id": seq.request_id,
            "seq_id": seq.seq_id,
            "prompt_ids": list(seq.prompt_ids),
            "generated": list(seq.generated),
            "params": _params_json(seq.params),
            "sampler": seq.sampler.get_state(),
            "detok": seq.detok.get_state(),
            "metrics": {
                "age_s": now - m.arrival_time,
                "prompt_tokens": m.prompt_tokens,
                "cached_tokens": m.cached_tokens,
                "completion_tokens": m.completion_tokens,
                "preemptions": m.preemptions,
                "scheduled": m.first_scheduled_time is not None,
                "ttft_s": m.ttft,
            },
            "admissions": seq.admissions,
            "admit_len": seq.admit_len,
            "computed": self.computed,
            "tail_key": None
            if swapped is None or swapped.tail_key is None
            else f"{swapped.tail_key:x}",
            "namespace": f"{self.root:x}",
            "block_size": self.block_size,
            "layout": self.layout,
        }


def _params_json(p: SamplingParams) -> dict[str, Any]:
    # A decoding constraint (a compiled grammar) lives in this process only; a
    # constrained request never moves (see _find).
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "constraint"}
    out["stop"] = list(p.stop)
    out["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    return out


def _identity(engine: Engine) -> tuple[int, int, str]:
    return engine.manager.namespace_root, engine.manager.block_size, engine.layout.canonical()


def _check_fits(engine: Engine, root: int, block_size: int, layout: str) -> None:
    mine = _identity(engine)
    if (root, block_size, layout) != mine:
        raise MigrationError(
            f"the engines are not alike (model namespace {root:x}/{mine[0]:x}, block size "
            f"{block_size}/{mine[1]}, layout {layout}/{mine[2]}): a request moves only between "
            "engines serving the same model with the same KV layout and block size"
        )


def _find(engine: Engine, request_id: str) -> Seq:
    group = engine.queues.group(request_id)
    if not group:
        raise MigrationError(f"request {request_id!r} is not on this engine (it may have finished)")
    if len(group) != 1 or group[0].params.n != 1:
        raise MigrationError(f"request {request_id!r} generates several choices; it cannot move")
    seq = group[0]
    if seq.cancelled:
        raise MigrationError(f"request {request_id!r} was cancelled")
    if seq.mm is not None:
        # Its images' features live in this process; the destination would
        # recompute placeholder tokens without them.
        raise MigrationError(f"request {request_id!r} carries images; it cannot move")
    if seq.params.constraint is not None:
        raise MigrationError(f"request {request_id!r} decodes under a grammar; it cannot move")
    if not engine.queues.is_running(seq) and not engine.queues.is_waiting(seq):
        raise MigrationError(f"request {request_id!r} is already moving")
    return seq


def detach(engine: Engine, request_id: str, *, via: Via = "direct") -> Departure:
    """Take ``request_id`` out of ``engine``'s schedule, keeping its blocks (engine thread).

    ``via="direct"`` copies the KV of its computed tokens; ``via="tier"``
    stores it on the engine's shared tier (Redis) and waits for the writes.
    """
    seq = _find(engine, request_id)
    root, bs, layout = _identity(engine)
    if engine.queues.is_waiting(seq):
        slot = engine.queues.detach(seq)
        return Departure(seq, "waiting", slot.index, 0, via, root, bs, layout)
    if seq.load is not None:
        engine.scheduler.complete_load(seq)
    assert seq.table is not None
    computed = seq.computed
    dep = Departure(seq, "running", 0, computed, via, root, bs, layout)
    if computed:
        if via == "direct":
            n_blocks = -(-computed // bs)
            dep.payload, dep.whole = engine.storage.export_partial(seq.table.blocks[:n_blocks])
        else:
            tiers = engine.tier_chain
            shared = None if tiers is None else tiers.shared_tier()
            if tiers is None or shared is None:
                raise MigrationError(
                    "this engine has no shared tier (Redis) to move a request through: "
                    "configure one on both engines, or move within one process"
                )
            try:
                dep.swapped = tiers.store_request(seq.seq_id, seq.tokens, computed, tier=shared)
                tiers.flush()
            except KvTierError as exc:
                raise MigrationError(f"storing the request's blocks failed: {exc}") from exc
    engine.queues.detach(seq)
    return dep


def restore(engine: Engine, dep: Departure) -> None:
    """Put a detached request back where it was on its source (after a failed move)."""
    engine.queues.restore(dep.seq, Slot(dep.where, dep.index))


def release(engine: Engine, dep: Departure) -> None:
    """Free a moved request on its source; its computed blocks stay cached there."""
    seq = dep.seq
    if dep.where == "running":
        engine.scheduler.release(seq, keep=engine.prefix_caching)
    for swapped in (dep.swapped, seq.swapped):
        # A partial last block this engine stored for the request is no use to it now
        # (the destination loads it from the shared medium, or recomputes it).
        if swapped is not None and swapped.tail_key is not None and engine.tier_chain is not None:
            engine.tier_chain.tiers[swapped.tail_tier].offload_manager.remove([swapped.tail_key])
    engine.queues.forget(seq.request_id)
    engine.counters.migrated_out += 1


def _join(engine: Engine, seq: Seq, request_id: str) -> None:
    if request_id in engine.queues:
        raise MigrationError(f"request id {request_id!r} is already in use on the destination")
    try:
        engine.check_request(seq.prompt_ids, seq.params)
    except BadRequestError as exc:
        raise MigrationError(f"the destination cannot run this request: {exc}") from exc
    seq.request_id = request_id
    seq.seq_id = request_id


def _queue(engine: Engine, seq: Seq) -> None:
    """A request with no KV here: first in line if it had started, else last."""
    engine.queues.add(seq, front=seq.admissions > 0)
    engine.counters.migrated_in += 1


def attach(engine: Engine, dep: Departure, request_id: str | None = None) -> str:
    """Start a request detached from an engine in this process; returns its id here.

    The destination allocates the request's computed tokens (hitting what it
    caches of their prefix) and copies the rest of the KV in; the request
    runs in its next step. Raises :class:`MigrationError` (nothing changed
    here) when it cannot take the request now.
    """
    if dep.via != "direct":
        raise MigrationError("a request detached through a tier attaches with attach_state()")
    _check_fits(engine, dep.root, dep.block_size, dep.layout)
    src = dep.seq
    rid = request_id or src.request_id
    seq = dataclasses.replace(
        src,
        prompt_ids=list(src.prompt_ids),
        generated=list(src.generated),
        metrics=dataclasses.replace(src.metrics),
        swapped=None,
        table=None,
        known=0,
        computed=0,
        load=None,
        unready=[],
        match=None,
    )
    _join(engine, seq, rid)
    if dep.computed == 0:
        _queue(engine, seq)
        return rid
    if engine.queues.num_running >= engine.max_num_seqs:
        raise MigrationError(
            f"the destination already runs {engine.max_num_seqs} requests (max_num_seqs)"
        )
    manager = engine.manager
    bs = manager.block_size
    tokens = seq.tokens[: dep.computed]
    n = len(tokens)
    extra: tuple[str, ...] = () if engine.prefix_caching else (f"private:{rid}:migrated",)
    items = seq.mm.item_keys if seq.mm is not None else ()
    match = manager.match(tokens, extra_keys=extra, item_keys=items)
    keys = match.keys
    cached = match.device_blocks if engine.prefix_caching else 0
    if engine.queues.unready.any(keys[:cached]):
        raise MigrationError(
            "the destination is still computing part of this request's prefix; try again"
        )
    try:
        alloc = manager.allocate(rid, tokens, match=match)
    except (OutOfBlocksError, AdmissionRejectedError) as exc:
        raise MigrationError(f"the destination cannot take the request now: {exc}") from exc
    hit = alloc.num_cached_tokens // bs
    blocks = alloc.block_table.blocks
    assert dep.payload is not None
    try:
        if hit < len(blocks):
            engine.connector.demote_pending()  # the imported blocks may be just-evicted ones
            engine.storage.import_partial(
                blocks[hit:], dep.payload[hit : len(blocks)], dep.whole[hit : len(blocks)]
            )
    except (BadRequestError, RuntimeError) as exc:
        manager.abort(rid, hit * bs)
        raise MigrationError(f"copying the request's KV failed: {exc}") from exc
    seq.table = alloc.block_table
    seq.known = seq.computed = n
    seq.admissions = max(seq.admissions, 1)
    engine.queues.add_running(seq)
    engine.counters.migrated_in += 1
    return rid


def attach_state(engine: Engine, state: dict[str, Any], request_id: str | None = None) -> str:
    """Queue a request moved through a shared tier (:meth:`Departure.state`); its id here.

    It goes first in line and, as it resumes, loads its blocks from the
    shared tier (those the device does not cache already). Raises
    :class:`MigrationError` when the state does not fit this engine.
    """
    try:
        if state.get("version") != STATE_VERSION:
            raise MigrationError(
                f"request state version {state.get('version')!r} is not {STATE_VERSION}: "
                "run the same kvtier version on both engines"
            )
        _check_fits(engine, int(state["namespace"], 16), int(state["block_size"]),
                    str(state["layout"]))  # fmt: skip
        computed = int(state["computed"])
        tail = state.get("tail_key")
        tiers = engine.tier_chain
        shared = None if tiers is None else tiers.shared_tier()
        if computed and shared is None:
            raise MigrationError(
                "the destination has no shared tier (Redis) to load the request's blocks from"
            )
        seq = _seq_from_state(engine, state)
    except (KeyError, TypeError, ValueError) as exc:
        raise MigrationError(f"malformed request state: {exc!r}") from exc
    _join(engine, seq, request_id or str(state["request_id"]))
    if computed and shared is not None:
        seq.swapped = SwappedRequest(
            state["seq_id"],
            tuple(seq.tokens),
            (),
            computed,
            None if tail is None else int(tail, 16),
            shared,
        )
    _queue(engine, seq)
    return seq.request_id


def _seq_from_state(engine: Engine, state: dict[str, Any]) -> Seq:
    raw = dict(state["params"])
    raw["stop"] = tuple(raw.get("stop", ()))
    raw["logit_bias"] = {int(k): float(v) for k, v in dict(raw.get("logit_bias", {})).items()}
    params = SamplingParams(**raw)
    prompt = [int(t) for t in state["prompt_ids"]]
    generated = [int(t) for t in state["generated"]]
    sampler = Sampler(params)
    sampler.set_state(state["sampler"])
    detok = IncrementalDetokenizer(engine.tokenizer, params.stop)
    detok.set_state(state["detok"])
    m = state["metrics"]
    now = time.perf_counter()
    metrics = RequestMetrics(
        now - float(m["age_s"]),
        int(m["prompt_tokens"]),
        cached_tokens=int(m["cached_tokens"]),
        completion_tokens=int(m["completion_tokens"]),
        preemptions=int(m["preemptions"]),
    )
    if m.get("scheduled"):
        metrics.first_scheduled_time = metrics.arrival_time
    if m.get("ttft_s") is not None:
        metrics.first_token_time = metrics.arrival_time + float(m["ttft_s"])
    return Seq(
        str(state["request_id"]),
        prompt,
        params,
        sampler,
        detok,
        metrics,
        generated=generated,
        forked=True,
        admissions=int(state["admissions"]),
        admit_len=int(state["admit_len"]),
    )


def migrate(src: Engine, dst: Engine, request_id: str, *, new_id: str | None = None) -> str:
    """Move ``request_id`` from ``src`` to ``dst`` (both driven by the calling thread).

    Returns its id on ``dst`` (``new_id``, or the same id). On failure it
    raises :class:`MigrationError` and the request runs on ``src`` as before.
    """
    dep = detach(src, request_id)
    try:
        rid = attach(dst, dep, new_id)
    except BaseException:
        restore(src, dep)
        raise
    release(src, dep)
    return rid


def migrate_between(
    src: EngineWorker, dst: EngineWorker, request_id: str, *, timeout: float = 30.0
) -> str:
    """Move ``request_id`` from ``src``'s engine to ``dst``'s; returns its id on ``dst``.

    The caller's handle (from ``src.submit``) keeps streaming: ``dst``'s
    outputs are forwarded to it under its old id, and cancelling it cancels
    the request on ``dst``. On failure the request runs on ``src`` as before.
    """
    dep = src.call(lambda e: detach(e, request_id), timeout)

    def forward(out: RequestOutput) -> None:
        src.deliver([dataclasses.replace(out, request_id=request_id)])

    handle = dst.open_handle(sink=forward)
    try:
        new_id = dst.call(lambda e: attach(e, dep, handle.request_id), timeout)
    except BaseException as exc:
        dst.close_handle(handle)
        src.call(lambda e: restore(e, dep), timeout)
        if isinstance(exc, MigrationError):
            raise
        raise MigrationError(f"the destination failed to take the request: {exc}") from exc
    src.forward(request_id, lambda: dst.cancel(new_id))
    src.call(lambda e: release(e, dep), timeout)
    if dep.seq.cancelled:
        dst.cancel(new_id)
    return new_id
