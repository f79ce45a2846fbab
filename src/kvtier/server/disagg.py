"""Prefill/decode disaggregation: ``kvtier serve --role prefill|decode|both``.

A prompt's prefill (compute-bound) and its decode (memory-bound) run on
different servers, so long prompts arriving do not stall the token streams
of requests already decoding. The servers speak the request fields vLLM's
P/D proxies and vllm-router (``--vllm-pd-disaggregation``) send, in a
request's ``kv_transfer_params`` object:

1. the router sends the request to a **prefill** server with ``max_tokens``
   1 and ``{"do_remote_decode": true}``. That server computes the prompt's
   KV; every full block is on the shared tier (Redis) as soon as it is
   computed (shared media write through), and before answering it waits
   for those writes (storing from the device any block the tier missed).
   Its answer carries ``kv_transfer_params`` for the decode side:
   ``do_remote_prefill``, ``remote_engine_id`` (the KV namespace both must
   share), ``remote_block_ids`` (the stored blocks' keys, hex),
   ``remote_num_tokens`` (the tokens they cover), ``remote_host`` /
   ``remote_port`` / ``remote_request_id`` (who computed them);
2. the router sends the original request, with those parameters, to a
   **decode** server, which admits it like any other: its prefix lookup
   finds the blocks on the shared tier and loads them (checksums verified),
   computes only the prompt's last partial block (fewer than ``block_size``
   tokens), and decodes.

The partial last block is recomputed on the decode side rather than moved:
the decode server must run the prompt's last token through the model
anyway to get the logits of its first token, and the rest of that block
(under ``block_size`` tokens) rides in the same forward pass for almost
nothing, while a private tail key on the shared medium would need a
lifetime of its own (a request that never reaches a decode server would
leak it).

KV that is missing on the decode side (evicted from Redis, Redis down, a
different model or block size) is a prefix miss like any other: the
decode server computes those tokens itself, so the tokens are always the
ones a single server would produce, and the shortfall is counted
(:class:`PdCounters`, in ``/v1/cache/stats`` under ``disaggregation``).

A server of any role serves plain requests (no ``kv_transfer_params``) as
usual; ``both`` (the default) also honours either kind of P/D request when
it has a shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from kvtier.engine.request import RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import BadRequestError, ConfigError, KvTierError, TierUnavailableError
from kvtier.keys import cache_salt_key

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.engine.worker import EngineWorker, RequestHandle

log = logging.getLogger("kvtier.server.disagg")

Role = Literal["prefill", "decode", "both"]
#: ``--role`` values; ``both`` is a server that prefills and decodes its own requests.
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")
#: Prefix of ``remote_engine_id``: the rest is the hex KV namespace root.
ENGINE_ID_PREFIX = "kvtier:"
#: Seconds the prefill side waits for its stores to reach the shared tier.
HANDOFF_TIMEOUT_S = 30.0
#: The request field, as vLLM and the routers spell it.
FIELD = "kv_transfer_params"


def check_role(role: str, *, shared_tier: bool, writes_through: bool, prefix_caching: bool) -> Role:
    """``role`` checked against the server's configuration; ConfigError says what to change."""
    if role not in ROLES:
        raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "both":
        return "both"
    if not shared_tier:
        raise ConfigError(
            f"--role {role} hands the prompt's KV over through a tier every server shares: "
            "add one, e.g. --tier redis://HOST:6379/0, on the prefill and the decode servers "
            "(or use --role both)"
        )
    if role == "prefill" and not writes_through:
        raise ConfigError(
            "--role prefill needs the shared tier to write through (store each block as it "
            "is computed): drop --write-mode write_back and write=back from the Redis tier"
        )
    if not prefix_caching:
        raise ConfigError(
            f"--role {role} finds the prompt's KV by its prefix keys: drop --no-prefix-caching"
        )
    return cast(Role, role)


@dataclass(frozen=True)
class Transfer:
    """A request's ``kv_transfer_params``, as far as kvtier acts on them."""

    #: This server prefills; another decodes (``do_remote_decode``).
    remote_decode: bool = False
    #: Another server prefilled; this one decodes (``do_remote_prefill``).
    remote_prefill: bool = False
    engine_id: str | None = None
    #: Keys of the blocks the prefill side stored, in order.
    block_keys: tuple[int, ...] = ()
    #: Prompt tokens those blocks cover.
    num_tokens: int = 0


def parse_transfer(raw: Any) -> Transfer | None:
    """A request's ``kv_transfer_params`` (``None``: a plain request); malformed ones are a 400."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequestError(f"{FIELD} must be a JSON object", param=FIELD)

    def flag(name: str) -> bool:
        value = raw.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise BadRequestError(f"{FIELD}.{name} must be true or false", param=FIELD)
        return value

    remote_decode, remote_prefill = flag("do_remote_decode"), flag("do_remote_prefill")
    if remote_decode and remote_prefill:
        raise BadRequestError(
            f"{FIELD} asks for both do_remote_decode and do_remote_prefill: a request is "
            "prefilled on one server and decoded on another, so set one of them",
            param=FIELD,
        )
    if not remote_decode and not remote_prefill:
        return None
    if remote_decode:
        return Transfer(remote_decode=True)
    engine_id = raw.get("remote_engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise BadRequestError(f"{FIELD}.remote_engine_id must be a string", param=FIELD)
    keys: tuple[int, ...] = ()
    ids = raw.get("remote_block_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequestError(f"{FIELD}.remote_block_ids must be a list", param=FIELD)
        try:
            keys = tuple(int(k, 16) for k in ids if isinstance(k, str))
        except ValueError:
            raise BadRequestError(
                f"{FIELD}.remote_block_ids must be the hex block keys a kvtier prefill server "
                "answered with",
                param=FIELD,
            ) from None
    num = raw.get("remote_num_tokens", 0)
    if not isinstance(num, int) or isinstance(num, bool) or num < 0:
        raise BadRequestError(
            f"{FIELD}.remote_num_tokens must be a non-negative integer", param=FIELD
        )
    return Transfer(remote_prefill=True, engine_id=engine_id, block_keys=keys, num_tokens=num)


@dataclass
class PdCounters:
    """What this server did as either side of a prefill/decode pair."""

    #: Requests prefilled here for another server to decode.
    prefill_requests: int = 0
    #: Prompt tokens they handed over on the shared tier (full blocks).
    prefill_handed_tokens: int = 0
    #: Blocks the write-through stores had missed, stored from the device before answering.
    prefill_restored_blocks: int = 0
    #: Prompt blocks that could not be handed over (neither on the tier nor on the device).
    prefill_unhanded_blocks: int = 0
    #: Requests decoded here after another server prefilled them.
    decode_requests: int = 0
    #: Prompt tokens the prefill side said it handed over (at most the decode side can use).
    decode_expected_tokens: int = 0
    #: Of those, tokens found here (loaded from the shared tier, or already on the device).
    decode_found_tokens: int = 0
    #: Of those, tokens this server had to compute again because their KV was missing.
    decode_recomputed_tokens: int = 0
    #: Requests that recomputed some handed-over tokens.
    decode_kv_missing: int = 0
    #: Requests whose prefill side had another KV namespace or other prompt blocks.
    decode_mismatched: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _engine_id(engine: Engine) -> str:
    return f"{ENGINE_ID_PREFIX}{engine.manager.namespace_root:x}"


def _extra_keys(salt: str | None) -> tuple[str, ...]:
    # The scheduler's own keys for a request: a salted prompt shares only with its salt.
    return () if salt is None else (cache_salt_key(salt),)


def _has_shared_tier(engine: Engine) -> bool:
    chain = engine.tier_chain
    return chain is not None and chain.shared_tier() is not None


@dataclass(frozen=True)
class _Handoff:
    keys: list[int]
    handed: int
    restored: int


def _hand_over(engine: Engine, ids: Sequence[int], salt: str | None) -> _Handoff:
    """Engine thread: the prompt's full blocks on the shared tier, waited for."""
    chain = engine.tier_chain
    assert chain is not None
    t = chain.shared_tier()
    assert t is not None
    manager = engine.manager
    keys = manager.keys_for(ids, _extra_keys(salt))
    if not keys:
        return _Handoff([], 0, 0)
    chain.flush(HANDOFF_TIMEOUT_S)
    tier = chain.tiers[t]
    mgr = tier.offload_manager
    with chain.locked():
        # The medium is asked, not the bookkeeping: Redis may have evicted a block
        # since it was stored (its maxmemory policy), and a block the prompt hit on
        # the device may predate an outage of the tier. What it lacks is stored again
        # from the device copy, if there is one.
        try:
            present = tier.medium.contains(keys)
        except TierUnavailableError as exc:
            tier.health.failed(exc)
            return _Handoff(keys, 0, 0)
        gone = [k for k, here in zip(keys, present, strict=True) if not here]
        mgr.remove([k for k in gone if mgr.is_ready(k) and not mgr.is_pinned(k)])
        lost: list[int] = []
        blocks: list[int] = []
        for k in gone:
            block = manager.cached_block(k)
            if block is not None:
                lost.append(k)
                blocks.append(block)
        if lost:
            chain.store_blocks(t, lost, blocks)
    if lost:
        chain.flush(HANDOFF_TIMEOUT_S)
    handed = 0
    for k, here in zip(keys, present, strict=True):
        if not (here or mgr.is_ready(k)):
            break
        handed += 1
    return _Handoff(keys, handed, len(lost))


class Disaggregation:
    """One server's side of prefill/decode disaggregation (see the module docstring)."""

    def __init__(self, worker: EngineWorker, role: str = "both") -> None:
        engine = worker.engine
        self.worker = worker
        chain = engine.tier_chain
        self.role: Role = check_role(
            role,
            shared_tier=_has_shared_tier(engine),
            writes_through=chain is not None and chain.writes_through,
            prefix_caching=engine.prefix_caching,
        )
        self.counters = PdCounters()
        self._shared = _has_shared_tier(engine)
        if self.role == "decode":
            # The prefill side computed the prompt: load its KV rather than compute it again.
            engine.connector.load_all = True
        self._warned_mismatch = False

    # -- a request arrives ---------------------------------------------------------------
    def transfer(self, raw: Any, *, streaming: bool) -> Transfer | None:
        """The request's P/D part, checked against this server; a 400 for what it cannot do."""
        transfer = parse_transfer(raw)
        if transfer is None:
            return None
        side = "prefill" if transfer.remote_decode else "decode"
        if self.role not in (side, "both"):
            raise BadRequestError(
                f"this server runs with --role {self.role}; it does not {side} requests for "
                f"another server: send it to a --role {side} (or both) server",
                param=FIELD,
            )
        if not self._shared:
            raise BadRequestError(
                f"this server has no shared tier to hand KV over through, so it cannot {side} "
                "for another server: give both servers the same --tier redis://...",
                param=FIELD,
            )
        if transfer.remote_decode and streaming:
            raise BadRequestError(
                f"a prefill request ({FIELD}.do_remote_decode) answers with the parameters "
                "for the decode side in one JSON body: send it with stream false",
                param="stream",
            )
        return transfer

    def sampling(self, transfer: Transfer | None, params: SamplingParams) -> SamplingParams:
        """A prefill computes the prompt and one token (the decode side makes the rest)."""
        if transfer is None or not transfer.remote_decode or params.max_tokens <= 1:
            return params
        return dataclasses.replace(params, max_tokens=1)

    def observe(
        self,
        handle: RequestHandle,
        transfer: Transfer | None,
        ids: Sequence[int],
        salt: str | None,
    ) -> RequestHandle:
        """``handle``, counting on a decode request what it found of the handed-over KV."""
        if transfer is None or not transfer.remote_prefill:
            return handle
        self.counters.decode_requests += 1
        engine = self.worker.engine
        bs = engine.manager.block_size
        # The decode side always computes the prompt's last token (for its logits), so
        # it can use at most the full blocks before it.
        usable = (len(ids) - 1) // bs
        mine = engine.manager.keys_for(ids, _extra_keys(salt))[:usable]
        theirs = transfer.block_keys[:usable]
        if transfer.engine_id not in (None, _engine_id(engine)) or mine[: len(theirs)] != list(
            theirs
        ):
            self.counters.decode_mismatched += 1
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning(
                    "a decode request's KV was prefilled under another namespace (%s, here "
                    "%s) or for other prompt blocks: this server computes the prompt itself. "
                    "Serve the same model, dtype and --block-size on both sides",
                    transfer.engine_id,
                    _engine_id(engine),
                )
            return handle
        expected = min(transfer.num_tokens, len(theirs) * bs, usable * bs)
        self.counters.decode_expected_tokens += expected

        def on_end(out: RequestOutput) -> None:
            found = min(out.metrics.cached_tokens, expected)
            self.counters.decode_found_tokens += found
            if found < expected:
                self.counters.decode_recomputed_tokens += expected - found
                self.counters.decode_kv_missing += 1

        return cast("RequestHandle", _Observed(handle, on_end))

    # -- the answer ---------------------------------------------------------------------
    def answer(
        self,
        transfer: Transfer | None,
        ids: Sequence[int],
        salt: str | None,
        *,
        request_id: str,
        host: str | None,
        port: int | None,
    ) -> Callable[[], Awaitable[dict[str, Any]]] | None:
        """For a prefill request, what adds ``kv_transfer_params`` to its answer."""
        if transfer is None or not transfer.remote_decode:
            return None

        async def extra() -> dict[str, Any]:
            return {FIELD: await self._handed(ids, salt, request_id, host, port)}

        return extra

    async def _handed(
        self, ids: Sequence[int], salt: str | None, request_id: str, host: str | None,
        port: int | None,
    ) -> dict[str, Any]:  # fmt: skip
        worker = self.worker
        try:
            hand = await asyncio.to_thread(
                worker.call, lambda e: _hand_over(e, ids, salt), HANDOFF_TIMEOUT_S * 2
            )
        except KvTierError as exc:
            # The decode side then computes the prompt itself: slower, still right.
            log.warning("handing a prompt's KV over failed (%s): the decode side recomputes", exc)
            hand = _Handoff([], 0, 0)
        engine = worker.engine
        c = self.counters
        c.prefill_requests += 1
        c.prefill_handed_tokens += hand.handed * engine.manager.block_size
        c.prefill_restored_blocks += hand.restored
        c.prefill_unhanded_blocks += len(hand.keys) - hand.handed
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": _engine_id(engine),
            "remote_block_ids": [f"{k:x}" for k in hand.keys[: hand.handed]],
            "remote_num_tokens": hand.handed * engine.manager.block_size,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "shared_tier": self._shared, **self.counters.as_dict()}

    def collect(self) -> list[Any]:
        """The counters as ``kvtier_pd_*_total`` (a ``prometheus_client`` collector)."""
        from prometheus_client.metrics_core import CounterMetricFamily

        families = []
        for name, value in self.counters.as_dict().items():
            help_text = _HELP[name]
            family = CounterMetricFamily(f"kvtier_pd_{name}", help_text, labels=["role"])
            family.add_metric([self.role], value)
            families.append(family)
        return families


_HELP = {
    "prefill_requests": "Requests prefilled here for another server to decode",
    "prefill_handed_tokens": "Prompt tokens handed over on the shared tier by prefills here",
    "prefill_restored_blocks": "Blocks stored again at hand-over because the shared tier lacked "
    "them",
    "prefill_unhanded_blocks": "Prompt blocks a prefill here could not hand over",
    "decode_requests": "Requests decoded here after another server prefilled them",
    "decode_expected_tokens": "Handed-over prompt tokens decodes here could use",
    "decode_found_tokens": "Handed-over prompt tokens decodes here found (loaded or cached)",
    "decode_recomputed_tokens": "Handed-over prompt tokens decodes here computed again",
    "decode_kv_missing": "Decodes here that computed some handed-over tokens again",
    "decode_mismatched": "Decodes here whose prefill side had another KV namespace or prompt",
}


class _Observed:
    """A request handle whose last output is also shown to ``on_end``."""

    def __init__(self, handle: RequestHandle, on_end: Callable[[RequestOutput], None]) -> None:
        self._handle = handle
        self._on_end = on_end

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    async def stream(self) -> AsyncGenerator[RequestOutput, None]:
        async with contextlib.aclosing(self._handle.stream()) as outs:
            async for out in outs:
                if out.finished and out.index == 0:
                    self._on_end(out)
                yield out


__all__ = [
    "ENGINE_ID_PREFIX",
    "FIELD",
    "ROLES",
    "Disaggregation",
    "PdCounters",
    "Role",
    "Transfer",
    "check_role",
    "parse_transfer",
]
