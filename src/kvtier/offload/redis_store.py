"""A Redis (or Redis Cluster) keyspace as a shared offload medium.

:class:`RedisStore` implements :class:`~kvtier.offload.media.BlockStore` on
one Redis server or a Redis Cluster, so that many engines share the blocks
any of them computed. Each block is one Redis string, ``header + payload``
(:func:`~kvtier.offload.media.blob_view`), named
``{key_prefix}:{namespace}:{key:032x}``. Keys carry no hash tag, so a
cluster spreads blocks over all of its masters.

Redis owns the space: a local eviction leaves the shared copy in place
(unless ``delete_on_evict``), and the server's ``maxmemory`` policy (for
example ``allkeys-lru``) drops blocks on its own; a dropped block reads back
as a miss.

Redis being down never hangs or crashes a request: every connection,
timeout or cluster error becomes a :class:`~kvtier.TierUnavailableError`,
and for ``retry_interval_s`` after a failure calls fail at once without
touching the network (a circuit breaker). The first call after the interval
tries again, so the tier comes back by itself when Redis does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.offload.media import MediumCaps, PutItem, Stored, blob_view, split_blob

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

__all__ = ["RedisStore"]

_T = TypeVar("_T")
_SCHEMES = ("redis", "rediss", "unix")


def _redact(url: str) -> str:
    """``url`` without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def zero_copy_packer() -> Any:
    """redis-py's Python command packer, which sends large values without copying them.

    With hiredis installed redis-py otherwise packs every command with
    hiredis, copying each block value twice (into ``bytes``, then into the
    packed command); hiredis still parses the replies, which is where it is
    fast.
    """
    from redis._parsers import Encoder
    from redis.connection import PythonRespSerializer

    encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)  # type: ignore[no-untyped-call]
    # 6000 bytes: redis-py's own cutoff between joined and separately sent arguments.
    return PythonRespSerializer(6000, encoder.encode)


class RedisStore:
    """Encoded blocks as strings in a Redis keyspace, shared by every engine using it.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS); with
            ``cluster=True`` the URL of any node of the cluster.
        cluster: Talk to a Redis Cluster (``redis.cluster.RedisCluster``).
        client: A ready redis-py client to use instead of ``url``
            (``close()`` closes it).
        key_prefix: First part of every Redis key this store writes.
        ttl_s: Expiry of every block written, in seconds; ``None`` keeps
            blocks until Redis evicts them.
        socket_timeout_s: Connect and read timeout of each Redis call.
        delete_on_evict: Whether :meth:`delete` removes the shared copy.
        retry_interval_s: After a failure, how long calls fail at once
            before the next one tries Redis again.
    """

    name = "redis"
    caps = MediumCaps(background=True, shared=True, purge=True)

    def __init__(
        self,
        url: str | None = None,
        *,
        cluster: bool = False,
        client: object | None = None,
        key_prefix: str = "kvtier",
        ttl_s: int | None = None,
        socket_timeout_s: float = 2.0,
        delete_on_evict: bool = False,
        retry_interval_s: float = 1.0,
    ) -> None:
        try:
            import redis
            import redis.backoff
            import redis.cluster
            import redis.exceptions
            import redis.retry
        except ImportError:
            raise ConfigError(
                "the Redis tier needs the redis package: pip install 'kvtier[redis]'"
            ) from None
        if url is None and client is None:
            raise ConfigError("RedisStore needs url= (redis://host:port/db) or client=")
        if url is not None and urlsplit(url).scheme not in _SCHEMES:
            raise ConfigError(
                f"Redis URL {_redact(url)!r} must start with redis://, rediss:// or unix://"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"ttl_s must be a positive number of seconds or None, got {ttl_s}")
        if socket_timeout_s <= 0:
            raise ConfigError(f"socket_timeout_s must be positive, got {socket_timeout_s}")
        if retry_interval_s < 0:
            raise ConfigError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        if not key_prefix:
            raise ConfigError("key_prefix must not be empty")

        self.url = _redact(url) if url is not None else "the Redis client passed in"
        self.cluster = cluster
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.socket_timeout_s = socket_timeout_s
        self.delete_on_evict = delete_on_evict
        self.retry_interval_s = retry_interval_s
        #: Calls that failed talking to Redis.
        self.errors = 0
        #: Calls refused by the circuit breaker without a network attempt.
        self.rejected = 0
        self._namespace: str | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._failed = False
        self._closed = False

        # Errors that mean "Redis cannot serve now"; anything else from redis-py
        # (a server-side refusal such as OOM) is reported the same way, but
        # with its own wording.
        self._unreachable: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.ClusterError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self._redis_error: type[BaseException] = redis.exceptions.RedisError
        self._oom_error: type[BaseException] = redis.exceptions.OutOfMemoryError

        self._client = cast("Redis | RedisCluster | None", client)
        self._make_client: Callable[[], Redis | RedisCluster] | None = None
        if client is None and url is not None:
            # One immediate retry on a fresh connection covers a pooled socket
            # that died with a restarted server; backoff or more attempts would
            # only make a dead server slower to report.
            retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1)
            timeouts: dict[str, Any] = {
                "socket_timeout": socket_timeout_s,
                "socket_connect_timeout": socket_timeout_s,
                "retry": retry,
            }
            if cluster:
                # RedisCluster connects in its constructor; deferring that to the
                # first call lets the store be built while the cluster is down.
                def make() -> Redis | RedisCluster:
                    try:
                        return redis.cluster.RedisCluster.from_url(url, **timeouts)
                    except ValueError as exc:
                        raise ConfigError(f"bad Redis Cluster URL {self.url!r}: {exc}") from None

                self._make_client = make
            else:
                try:
                    self._client = redis.Redis.from_url(
                        url, command_packer=zero_copy_packer(), **timeouts
                    )
                except ValueError as exc:
                    raise ConfigError(f"bad Redis URL {self.url!r}: {exc}") from None

    # ------------------------------------------------------------------ state

    @property
    def available(self) -> bool:
        """False from a failed call until the next call that succeeds."""
        return not self._failed and not self._closed

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        # capacity is the tier's slot count; Redis manages its own space.
        self._namespace = namespace

    def _name(self, key: int) -> str:
        ns = self._namespace
        if ns is None:
            raise ConfigError("RedisStore.bind() must be called before the store is used")
        return f"{self.key_prefix}:{ns}:{key:032x}"

    def _call(self, what: str, fn: Callable[[Redis | RedisCluster], _T]) -> _T:
        """Run ``fn`` on the client, turning every Redis failure into TierUnavailableError."""
        if self._closed:
            raise TierUnavailableError(f"Redis tier at {self.url} is closed")
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self.rejected += 1
                raise TierUnavailableError(
                    f"Redis at {self.url} failed recently and is retried in "
                    f"{self._down_until - now:.1f}s (retry_interval_s={self.retry_interval_s:g}); "
                    "check that the server is up and reachable"
                )
        try:
            client = self._client
            if client is None:
                assert self._make_client is not None
                client = self._client = self._make_client()
            result = fn(client)
        except self._unreachable as exc:
            self._fail()
            hint = (
                "check that every master of the cluster is up and reachable from this host "
                "(CLUSTER INFO must say cluster_state:ok)"
                if self.cluster
                else "check that the server is up and reachable from this host"
            )
            raise TierUnavailableError(
                f"cannot reach Redis at {self.url} ({what}: {type(exc).__name__}: {exc}); {hint}"
            ) from exc
        except self._oom_error as exc:
            self._fail()
            raise TierUnavailableError(
                f"Redis at {self.url} refuses writes, its memory is full ({exc}); configure "
                "maxmemory-policy allkeys-lru (or volatile-lru with ttl_s) so it evicts blocks"
            ) from exc
        except self._redis_error as exc:
            self._fail()
            raise TierUnavailableError(
                f"Redis at {self.url} failed ({what}: {type(exc).__name__}: {exc}); "
                "check the server's log and configuration"
            ) from exc
        self._failed = False
        return result

    def _fail(self) -> None:
        with self._lock:
            self.errors += 1
            self._failed = True
            self._down_until = time.monotonic() + self.retry_interval_s

    def ping(self) -> None:
        """Ask Redis to answer now; raises :class:`TierUnavailableError` if it does not."""
        self._call("PING", lambda client: client.ping())

    # ------------------------------------------------------------ BlockStore

    def put(self, items: Sequence[PutItem]) -> None:
        if not items:
            return
        # Buffers, not bytes: redis-py's Python packer sends a memoryview as it is.
        values = [(self._name(key), blob_view(fmt, key, payload)) for key, _, payload, fmt in items]

        def run(client: Redis | RedisCluster) -> None:
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value, ex=self.ttl_s)
            pipe.execute()

        self._call("SET", run)

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        if not items:
            return []
        names = [self._name(key) for key, _ in items]

        def run(client: Redis | RedisCluster) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return list(pipe.execute())

        values = self._call("GET", run)
        return [None if value is None else split_blob(value) for value in values]

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        """Drop blocks the tier evicted; a no-op unless ``delete_on_evict``.

        Other engines may still want a block this one evicts, so by default
        the shared copy stays and Redis's maxmemory policy reclaims space.
        """
        if self.delete_on_evict:
            self.purge(items)

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        """Delete blocks from Redis whatever ``delete_on_evict`` says (corrupt blocks)."""
        if not items:
            return
        names = [self._name(key) for key, _ in items]

        def run(client: Redis | RedisCluster) -> None:
            pipe = client.pipeline(transaction=False)
            # One DEL per key: a multi-key DEL would cross cluster slots.
            for name in names:
                pipe.delete(name)
            pipe.execute()

        self._call("DEL", run)

    def contains(self, keys: Sequence[int]) -> list[bool]:
        if not keys:
            return []
        names = [self._name(key) for key in keys]

        def run(client: Redis | RedisCluster) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return list(pipe.execute())

        return [bool(n) for n in self._call("EXISTS", run)]

    def scan(self) -> list[int]:
        # Not persistent: a restarted process does not adopt what Redis holds;
        # contains() finds shared blocks on demand instead.
        return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is None:
            return
        # Closing only drops sockets; a dead server has nothing left to flush.
        with contextlib.suppress(*self._unreachable, self._redis_error):
            client.close()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisStore({kind} {self.url}, prefix={self.key_prefix!r})"
