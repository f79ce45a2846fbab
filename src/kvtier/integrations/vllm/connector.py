"""``KvTierConnector``: vLLM 0.33's offloading connector with kvtier's request-aware policies.

vLLM's ``CachePolicy`` (what :mod:`.cache_policy` plugs kvtier into) is called
with chunk keys only, so a policy that ranks blocks by the requests that use
them (``learned-reuse``) or by what the application says about them (the
``workflow`` policy: sessions, TTL pins, session end, workflow steps) learns
nothing there. The connector's scheduler side does see every request.
:class:`KvTierConnector` is vLLM's own ``OffloadingConnector`` (subclassed,
every transfer and every manager call unchanged) that also tells the kvtier
policy of its CPU tier about each request:

* when vLLM first asks how many tokens a request can load
  (``get_num_new_matched_tokens``), the policy's ``on_request`` gets the
  request's chunk keys as one chain, how many of them are cached (on the GPU
  or in the CPU tier), the clock and the request's hints;
* when the request finishes (``request_finished``), the end of the turn: the
  workflow policy's ``on_finish`` with every full chunk the request computed,
  generated tokens included, so ``cache_ttl_s`` pins start then, as in
  ``kvtier serve``.

Hints come from ``sampling_params.extra_args["kvtier"]`` (a mapping, or a JSON
object as a string: what an OpenAI client's ``extra_body={"vllm_xargs":
{"kvtier": "..."}}`` carries) or from ``kv_transfer_params["kvtier"]``
(``extra_body={"kv_transfer_params": {"kvtier": {...}}}``), and are checked by
:func:`kvtier.hints.parse_hints`, the validation ``kvtier serve`` applies.

Bad hints never reach the policy and never stop the engine: the request is
served without them, a warning naming the field is logged, and the error
comes back in the finished request's ``kv_transfer_params`` as
``{"kvtier_error": {"param": ..., "message": ...}}``. The connector runs inside
vLLM's scheduler, where an exception ends the engine core and every request
in it, and it has no way to fail one request on its own; hints only steer
what is cached, so dropping them costs hit ratio, never a wrong answer.

With ``kvtier_admission: "predicted"`` the connector also decides which
computed chunks the CPU tier stores: a chunk whose predicted chance of being
read again while the tier would keep it is too low is not written
(:class:`kvtier.offload.admission.PredictedReuse`, the rule of ``kvtier
serve --tier-admission predicted``, learning from the tier's hits, misses and
evictions). The chunks it skips are counted under vLLM's own
``vllm:kv_offload_stores_skipped`` in the connector's stats (vLLM exports
that counter to Prometheus only when ``store_threshold`` is 2 or more).

Settings, in ``kv_connector_extra_config`` next to vLLM's own
(``cpu_bytes_to_use``, ``spec_name``, ``secondary_tiers``, ...):

* ``kvtier_policy``: the CPU tier's policy (default ``workflow``);
* ``kvtier_fallback``: the workflow policy's fallback, which orders blocks
  without hints (default ``learned-reuse``, ``kvtier serve``'s default);
* ``kvtier_pin_fraction``: the share of the CPU tier TTL pins may hold
  (default 0.5);
* ``kvtier_admission``: ``write-all`` (default) or ``predicted``;
* ``kvtier_admission_threshold``: predicted admission's threshold.

Importing this module needs vLLM 0.33 (see :mod:`.version`).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvtier.agents.policy import WorkflowPolicy, workflow_policy_of
from kvtier.errors import BadRequestError, ConfigError
from kvtier.hints import Hints, parse_hints
from kvtier.integrations.vllm.cache_policy import (
    MODULE_PATH,
    NAME_PREFIX,
    KvTierCachePolicy,
    offload_key_id,
    register_policy_class,
)
from kvtier.offload.admission import ADMISSIONS, PredictedReuse
from kvtier.policy import make_policy
from kvtier.policy.base import EvictionPolicy, RequestHook, request_hook

# isort: split
# Imported after cache_policy, which raises UnsupportedVllmError without vLLM 0.33.
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import LookupResult, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

logger = logging.getLogger(__name__)

#: The module path to give vLLM as ``kv_connector_module_path``.
CONNECTOR_MODULE_PATH = __name__
#: Where the hints are read from, in both ``extra_args`` and ``kv_transfer_params``.
HINTS_KEY = "kvtier"
#: Key of the error report in a finished request's ``kv_transfer_params``.
ERROR_KEY = "kvtier_error"
#: ``kv_connector_extra_config`` keys the connector reads, with their defaults.
EXTRA_CONFIG_KEYS: dict[str, Any] = {
    "kvtier_policy": "workflow",
    "kvtier_fallback": "learned-reuse",
    "kvtier_pin_fraction": 0.5,
    "kvtier_admission": "write-all",
    "kvtier_admission_threshold": None,
}
_HIT: Any = LookupResult.HIT
_MISS: Any = LookupResult.MISS
_ids = itertools.count(1)


def hints_of(request: Any) -> Hints | None:
    """A vLLM request's kvtier hints, validated; raises BadRequestError naming the field.

    Read from ``sampling_params.extra_args["kvtier"]`` first, then
    ``kv_transfer_params["kvtier"]``; a string is parsed as a JSON object.
    """
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    where = f"extra_args.{HINTS_KEY}"
    value = extra.get(HINTS_KEY) if isinstance(extra, Mapping) else None
    if value is None:
        transfer = getattr(request, "kv_transfer_params", None) or {}
        if isinstance(transfer, Mapping):
            value = transfer.get(HINTS_KEY)
            where = f"kv_transfer_params.{HINTS_KEY}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRequestError(
                f"{where} must be a JSON object of hints: {exc}", param=where
            ) from None
    return parse_hints(value, where=where)


class _Settings:
    """The connector's keys of ``kv_connector_extra_config``, checked at start-up."""

    def __init__(self, extra: Mapping[str, Any]) -> None:
        get = extra.get
        d = EXTRA_CONFIG_KEYS
        self.policy = get("kvtier_policy", d["kvtier_policy"])
        self.fallback = get("kvtier_fallback", d["kvtier_fallback"])
        self.pin_fraction = get("kvtier_pin_fraction", d["kvtier_pin_fraction"])
        self.admission = get("kvtier_admission", d["kvtier_admission"])
        self.threshold = get("kvtier_admission_threshold", d["kvtier_admission_threshold"])
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"kvtier_policy must be a policy name, got {self.policy!r}")
        if self.admission not in ADMISSIONS:
            raise ConfigError(
                f"kvtier_admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}"
            )
        if self.threshold is not None and not isinstance(self.threshold, int | float):
            raise ConfigError(
                f"kvtier_admission_threshold must be a number, got {self.threshold!r}"
            )
        theirs = get("eviction_policy")
        if theirs is not None and not str(theirs).startswith(NAME_PREFIX):
            raise ConfigError(
                f"KvTierConnector runs a kvtier policy on the CPU tier; drop eviction_policy "
                f"{theirs!r} and name the policy with kvtier_policy"
            )

    def options(self) -> dict[str, Any]:
        if self.policy.lower() != "workflow":
            return {}
        return {"fallback": self.fallback, "pin_fraction": float(self.pin_fraction)}

    def check(self) -> None:
        """Build the policy once, so a bad name fails at start-up with kvtier's error."""
        policy = make_policy(self.policy, **self.options())
        close = getattr(policy, "close", None)
        if callable(close):
            close()


class _AdmittingManager:
    """vLLM's offloading manager with predicted admission in front of ``prepare_store``.

    Every other call goes to vLLM's manager unchanged. Store offers are
    decided per request batch, in chain order (a chunk declined ends the
    rest of the batch); lookups, loads and evictions teach the rule.
    """

    def __init__(self, inner: Any, bridge: RequestBridge, admission: PredictedReuse) -> None:
        self._inner = inner
        self._bridge = bridge
        self.admission = admission
        self._skipped = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def lookup(self, key: Any, req_context: Any) -> Any:
        result = self._inner.lookup(key, req_context)
        if result is _MISS:
            self.admission.missed(offload_key_id(key))
        return result

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        self.admission.hit([offload_key_id(k) for k in keys])
        return self._inner.prepare_load(keys, req_context)

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        offered = list(keys)
        # Only chunks the CPU tier does not hold are new writes; the rest pass as
        # offered. Asked of the tier's CachePolicy, not lookup(), which with
        # secondary tiers would start promotions.
        cp = self._bridge.cache_policy
        new = offered if cp is None else [k for k in offered if cp.get(k) is None]
        if new:
            ids = [offload_key_id(k) for k in new]
            parents: list[int | None] = [None, *ids[:-1]]
            # The rule takes children before parents.
            write = self.admission.decide(
                ids[::-1], parents[::-1], [1] * len(ids), self._bridge.clock()
            )[::-1]
            if not all(write):
                cut = write.index(False)
                dropped = set(new[cut:])
                self._skipped += len(dropped)
                offered = [k for k in offered if k not in dropped]
        out = self._inner.prepare_store(offered, req_context)
        if out is not None:
            if out.keys_to_store:
                self.admission.stored(
                    [offload_key_id(k) for k in out.keys_to_store], self._bridge.clock()
                )
            if out.evicted_keys:
                self.admission.left([offload_key_id(k) for k in out.evicted_keys])
        return out

    def get_stats(self) -> Any:
        stats = self._inner.get_stats()
        if self._skipped and stats is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, self._skipped)
            self._skipped = 0
        return stats


class RequestBridge:
    """What the connector's scheduler side tells the kvtier policy, request by request."""

    def __init__(
        self,
        settings: _Settings,
        policies: list[KvTierCachePolicy],
        group_idx: int,
        hashes_per_chunk: int,
        tokens_per_chunk: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._policies = policies
        self.group_idx = group_idx
        self.hashes_per_chunk = hashes_per_chunk
        self.tokens_per_chunk = tokens_per_chunk
        self.clock = clock
        self._hints: dict[str, Hints | None] = {}
        self._errors: dict[str, BadRequestError] = {}
        self._announced: set[str] = set()
        #: Requests whose hints were refused, requests announced, and hinted ones.
        self.refused = 0
        self.requests = 0
        self.hinted = 0
        #: The learner predicted admission asks (``None`` without it).
        self.predictor: EvictionPolicy | None = None

    # -- the CPU tier's kvtier policy ------------------------------------------------------
    @property
    def cache_policy(self) -> KvTierCachePolicy | None:
        """The CPU tier's ``CachePolicy`` (``None`` before vLLM built it)."""
        return self._policies[-1] if self._policies else None

    @property
    def policy(self) -> EvictionPolicy | None:
        """The kvtier policy choosing the CPU tier's victims."""
        cp = self.cache_policy
        return None if cp is None else cp.policy

    def _workflow(self) -> WorkflowPolicy | None:
        policy = self.policy
        if policy is None:
            return None
        wp = workflow_policy_of(policy)
        if wp is not None and wp.clock is None:
            # Pins then run out on the connector's clock even between requests
            # (read through the bridge, so a clock set later still applies).
            wp.clock = self.now
        return wp

    def now(self) -> float:
        """The connector's clock, in seconds."""
        return self.clock()

    def _hook(self) -> RequestHook | None:
        policy = self.policy
        return None if policy is None else request_hook(policy)

    # -- keys ------------------------------------------------------------------------------------
    def chunk_keys(self, request: Any) -> list[Any]:
        """The request's offload keys (vLLM's, group ``group_idx``), one per full chunk."""
        step = self.hashes_per_chunk
        g = self.group_idx
        hashes = request.block_hashes
        return [make_offload_key(h, g) for h in hashes[step - 1 :: step]]

    def chain(self, request: Any) -> list[int]:
        """The request's chunk keys as kvtier's int keys, head first."""
        return [offload_key_id(k) for k in self.chunk_keys(request)]

    # -- the request's life ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        rid = request.request_id
        try:
            self._hints[rid] = hints_of(request)
        except BadRequestError as exc:
            self.refused += 1
            self._hints[rid] = None
            self._errors[rid] = exc
            logger.warning(
                "request %s: kvtier hints refused (%s), served without them: %s",
                rid, exc.param, exc,
            )  # fmt: skip

    @property
    def tracked(self) -> set[str]:
        """Requests the bridge holds state for (added and not finished)."""
        return set(self._hints) | set(self._errors) | self._announced

    def error_of(self, request_id: str) -> BadRequestError | None:
        """Why the request's hints were refused, or ``None``."""
        return self._errors.get(request_id)

    def on_lookup(self, request: Any, num_computed_tokens: int, num_hit_tokens: int | None) -> None:
        """vLLM looked the request's prefix up: announce it once, before its loads pin."""
        rid = request.request_id
        if num_hit_tokens is None or rid in self._announced:
            return
        self._announced.add(rid)
        if rid not in self._hints:
            self.on_new_request(request)  # a request vLLM added before the connector saw it
        keys = self.chain(request)
        if not keys:
            return
        num_hit = min(len(keys), (num_computed_tokens + num_hit_tokens) // self.tokens_per_chunk)
        hints = self._hints.get(rid)
        now = self.clock()
        self.requests += 1
        self.hinted += hints is not None
        as_dict = None if hints is None else hints.as_dict()
        predictor = self.predictor
        if predictor is not None and predictor is not self.policy:
            hook = request_hook(predictor)
            if hook is not None:
                hook(keys, num_hit, now, as_dict)
        hook = self._hook()
        if hook is not None:
            hook(keys, num_hit, now, as_dict)

    def on_finished(self, request: Any) -> dict[str, Any] | None:
        """The request's turn ended; returns what to add to its ``kv_transfer_params``."""
        rid = request.request_id
        hints = self._hints.pop(rid, None)
        self._announced.discard(rid)
        error = self._errors.pop(rid, None)
        if hints is not None:
            wp = self._workflow()
            if wp is not None:
                wp.on_finish(self.chain(request), self.clock(), hints)
        if error is None:
            return None
        return {ERROR_KEY: {"param": error.param, "message": str(error)}}

    def end_session(self, session_id: str) -> bool:
        """End a session out of band (as ``DELETE /v1/sessions/{id}``); False if unknown."""
        wp = self._workflow()
        return bool(wp is not None and wp.end_session(session_id))

    def stats(self) -> dict[str, Any]:
        """Counters: requests announced, hinted and refused; the workflow policy's sessions."""
        out: dict[str, Any] = {
            "requests": self.requests,
            "hinted_requests": self.hinted,
            "refused_hints": self.refused,
        }
        cp = self.cache_policy
        if cp is not None:
            cp.settle()
        wp = self._workflow()
        if wp is not None:
            out["sessions"] = wp.session_stats()
        return out


class KvTierConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's ``OffloadingConnector`` whose CPU tier runs a request-aware kvtier policy.

    See the module docs. Load it with ``"kv_connector": "KvTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm.connector"``.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        if extra is None:
            extra = transfer.kv_connector_extra_config = {}
        settings = _Settings(extra)
        settings.check()
        policies: list[KvTierCachePolicy] = []
        name = self._policy_class(settings, policies)
        extra["eviction_policy"] = name
        extra["cache_policy_module_path"] = MODULE_PATH
        super().__init__(vllm_config, role, kv_cache_config)
        self.kvtier: RequestBridge | None = None
        if role != KVConnectorRole.SCHEDULER:
            return
        group = self.scheduler.config.kv_group_configs[0]
        bridge = RequestBridge(
            settings, policies, group.group_idx, group.hashes_per_chunk, group.tokens_per_chunk
        )
        self.kvtier = bridge
        if settings.admission == "predicted":
            cp = bridge.cache_policy
            capacity = max(1, cp.cache_capacity if cp is not None else 1)
            predictor = bridge.policy
            if predictor is None or not callable(getattr(predictor, "reuse_probability", None)):
                # The tier's own policy does not predict reuse (the workflow policy
                # does not): a learned-reuse learner beside it sees the same requests.
                predictor = make_policy("learned-reuse")
                predictor.bind(capacity)
            bridge.predictor = predictor
            kwargs = {} if settings.threshold is None else {"threshold": float(settings.threshold)}
            admission = PredictedReuse(predictor, capacity, 1, **kwargs)  # type: ignore[arg-type]
            self.scheduler.manager = _AdmittingManager(self.scheduler.manager, bridge, admission)

    @staticmethod
    def _policy_class(settings: _Settings, policies: list[KvTierCachePolicy]) -> str:
        """A CachePolicy class of its own for this connector, registered for vLLM's factory.

        Its instances report to ``policies``, so the connector reaches the
        policy vLLM built without reading vLLM's private state.
        """

        class _ConnectorCachePolicy(KvTierCachePolicy):
            kvtier_policy = settings.policy
            kvtier_options = settings.options()
            chain_order_inserts = True

            def __init__(self, cache_capacity: int, **kwargs: Any) -> None:
                super().__init__(cache_capacity, **kwargs)
                policies.append(self)

        name = f"{NAME_PREFIX}connector-{next(_ids)}-{settings.policy}"
        _ConnectorCachePolicy.__name__ = _ConnectorCachePolicy.__qualname__ = name
        return register_policy_class(name, _ConnectorCachePolicy)

    # -- the scheduler side ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        if self.kvtier is not None:
            self.kvtier.on_new_request(request)
        super().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        out: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if self.kvtier is not None:
            self.kvtier.on_lookup(request, num_computed_tokens, out[0])
        return out

    def _finished(
        self, request: Any, out: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.kvtier is None:
            return out
        extra = self.kvtier.on_finished(request)
        if extra is None:
            return out
        return out[0], {**(out[1] or {}), **extra}

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, super().request_finished_all_groups(request, block_ids))


def connector_config(
    cpu_bytes: int, policy: str = "workflow", **extra: Any
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that turns the connector on (as a dict)."""
    return {
        "kv_connector": "KvTierConnector",
        "kv_connector_module_path": CONNECTOR_MODULE_PATH,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes,
            "kvtier_policy": policy,
            **extra,
        },
    }


__all__: Sequence[str] = (
    "CONNECTOR_MODULE_PATH",
    "ERROR_KEY",
    "EXTRA_CONFIG_KEYS",
    "HINTS_KEY",
    "KvTierConnector",
    "RequestBridge",
    "connector_config",
    "hints_of",
)
