"""Mooncake Store as a shared offload medium.

:class:`MooncakeStore` implements :class:`~kvtier.offload.media.BlockStore`
on a Mooncake Store cluster (the ``mooncake-transfer-engine`` package): one
``mooncake_master`` keeps the object metadata, and every process that joins
contributes a *segment* of its host memory to one distributed pool. Any
engine using the same master reads the blocks any other one stored, over the
transfer engine (TCP here; RDMA where the hardware has it).

Each block is one Mooncake object, ``header + payload``
(:func:`~kvtier.offload.media.pack_blob`), named
``{key_prefix}:{namespace}:{key:032x}``, so that a damaged or truncated
object fails its checksum and is dropped like a miss. Mooncake owns the
space: the master evicts objects on its own when the pool passes its
high-water mark, and a block evicted there (or lost with the segment of a
process that left, or with a restarted master) reads back as a miss. A local
eviction leaves the shared copy in place unless ``delete_on_evict``.

A master that is down never hangs or crashes a request. Mooncake's client
spends seconds reconnecting to a dead master (and ``setup`` retries for more
than a minute), so the store connects lazily and, after any failure, first
checks with a plain TCP connect (``connect_timeout_s``) that the master
listens before it lets the client try again; for ``retry_interval_s`` after
a failure calls fail at once without touching the network. Every failure is
a :class:`~kvtier.TierUnavailableError`; the tier comes back by itself when
the master does (its contents are gone: a restarted master knows no objects).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.offload.codec import HEADER_SIZE
from kvtier.offload.media import MediumCaps, PutItem, Stored, pack_blob, split_blob
from kvtier.units import parse_memory_size

__all__ = [
    "INSTALL_HINT",
    "MooncakeStore",
    "check_mooncake",
    "make_mooncake_store",
    "parse_master",
    "probe_mooncake",
]

_T = TypeVar("_T")

#: What to install when ``mooncake.store`` cannot be imported.
INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (the CPU build; "
    "mooncake-transfer-engine on CUDA hosts), and its system library: "
    "apt-get install libibverbs1"
)

#: The P2P handshake: peers exchange segment descriptors directly, no metadata server.
P2P = "P2PHANDSHAKE"

# Mooncake's error codes (mooncake-store/include/types.h) that this module names.
_OBJECT_NOT_FOUND = -704
_NO_AVAILABLE_HANDLE = -200
_RPC_FAIL = -900
_CODES = {
    -1: "internal error",
    -10: "buffer overflow",
    _NO_AVAILABLE_HANDLE: "no space in the pool",
    -600: "invalid parameters",
    _OBJECT_NOT_FOUND: "object not found",
    -706: "object has a lease",
    -800: "transfer failed",
    _RPC_FAIL: "RPC to the master failed",
    -901: "RPC timed out",
}


def check_mooncake() -> Any:
    """The ``mooncake.store`` module, or :class:`ConfigError` saying what to install."""
    try:
        import mooncake.store  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            f"the Mooncake tier needs the mooncake package, which cannot be imported ({exc}): "
            + INSTALL_HINT
        ) from None
    return mooncake.store


def parse_master(location: str) -> tuple[str, int]:
    """``host:port`` of the master (``[v6]:port`` for IPv6), or :class:`ConfigError`."""
    where = location.strip().removeprefix("mooncake://").rstrip("/")
    host, sep, port = where.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"the Mooncake tier needs its master as host:port, e.g. mooncake://10.0.0.5:50051 "
            f"(mooncake_master's --rpc_port), got {location!r}"
        )
    return host, int(port)


def _http_host_port(url: str) -> tuple[str, int] | None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _tcp_reachable(host: str, port: int, timeout_s: float) -> OSError | None:
    """``None`` when something accepts TCP connections at ``host:port``, else the error."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc


def _route_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (the address peers reach us at)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _describe(code: int) -> str:
    return f"{code} ({_CODES.get(code, 'see mooncake-store/include/types.h')})"


class MooncakeStore:
    """Encoded blocks as objects in a Mooncake Store pool, shared by every engine using it.

    Args:
        master: The master's RPC address, ``host:port`` (``mooncake_master --rpc_port``).
        metadata: Where transfer engines find each other: ``P2PHANDSHAKE``
            (no server) or the master's HTTP metadata server,
            ``http://host:port/metadata`` (``--enable_http_metadata_server``).
        local_hostname: The address other processes reach this one at; by
            default this host's address on the route to the master.
        segment_bytes: Host memory this process adds to the pool (0: it only
            reads and writes what other processes hold).
        buffer_bytes: This process's staging buffer for transfers; batches
            are split to fit in a quarter of it.
        protocol: ``tcp``, or ``rdma`` on hosts with RDMA devices (``rdma_devices``).
        key_prefix: First part of every object name this store writes.
        replicas: Copies of each block Mooncake keeps (on distinct segments).
        delete_on_evict: Whether :meth:`delete` removes the shared copy.
        retry_interval_s: After a failure, how long calls fail at once
            before the next one checks the master again.
        connect_timeout_s: The TCP check of the master before (re)connecting.
    """

    name = "mooncake"
    caps = MediumCaps(background=True, shared=True, purge=True)

    def __init__(
        self,
        master: str,
        *,
        metadata: str = P2P,
        local_hostname: str | None = None,
        segment_bytes: int = 1 << 30,
        buffer_bytes: int = 64 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        key_prefix: str = "kvtier",
        replicas: int = 1,
        delete_on_evict: bool = False,
        retry_interval_s: float = 1.0,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self._mc = check_mooncake()
        self.host, self.port = parse_master(master)
        self.master = f"{self.host}:{self.port}"
        if metadata != P2P and _http_host_port(metadata) is None:
            raise ConfigError(
                f"the Mooncake tier's metadata must be {P2P} or the master's HTTP metadata "
                f"server, http://HOST:PORT/metadata; got {metadata!r}"
            )
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"the Mooncake tier's protocol must be tcp or rdma, got {protocol!r}")
        if segment_bytes < 0:
            raise ConfigError(f"segment_bytes must be >= 0, got {segment_bytes}")
        if buffer_bytes < 1 << 20:
            raise ConfigError(f"buffer_bytes must be at least 1MiB, got {buffer_bytes}")
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        if retry_interval_s < 0:
            raise ConfigError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        if connect_timeout_s <= 0:
            raise ConfigError(f"connect_timeout_s must be positive, got {connect_timeout_s}")
        if not key_prefix or any(c.isspace() for c in key_prefix):
            raise ConfigError(f"key_prefix must be a non-empty word, got {key_prefix!r}")
        self.metadata = metadata
        self.local_hostname = local_hostname
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.protocol = protocol
        self.rdma_devices = rdma_devices
        self.key_prefix = key_prefix
        self.replicas = replicas
        self.delete_on_evict = delete_on_evict
        self.retry_interval_s = retry_interval_s
        self.connect_timeout_s = connect_timeout_s
        #: Calls that failed talking to Mooncake.
        self.errors = 0
        #: Calls refused by the circuit breaker without a network attempt.
        self.rejected = 0
        self._namespace: str | None = None
        self._blob_bytes: int | None = None
        self._client: Any = None
        self._config: Any = None
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._down_until = 0.0
        self._failed = False
        self._closed = False

    # ------------------------------------------------------------------ state

    @property
    def available(self) -> bool:
        """False from a failed call until the next call that succeeds."""
        return not self._failed and not self._closed

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        # capacity is the tier's slot count; the master manages the pool's space.
        self._namespace = namespace
        self._blob_bytes = None if item_bytes is None else HEADER_SIZE + item_bytes

    def object_name(self, key: int) -> str:
        """The Mooncake object that holds block ``key``."""
        ns = self._namespace
        if ns is None:
            raise ConfigError("MooncakeStore.bind() must be called before the store is used")
        return f"{self.key_prefix}:{ns}:{key:032x}"

    def reachable(self) -> OSError | None:
        """``None`` when the master (and an HTTP metadata server) accept TCP connections."""
        err = _tcp_reachable(self.host, self.port, self.connect_timeout_s)
        if err is None and self.metadata != P2P:
            http = _http_host_port(self.metadata)
            assert http is not None
            err = _tcp_reachable(*http, self.connect_timeout_s)
        return err

    def _connect(self) -> Any:
        """The set-up client; the first call (or the first after a failure) checks the master."""
        with self._setup_lock:
            if self._closed:
                raise TierUnavailableError(f"the Mooncake tier at {self.master} is closed")
            if self._client is not None and not self._failed:
                return self._client
            # Mooncake's own reconnect to a dead master blocks for seconds, and
            # setup() retries for over a minute: a TCP connect fails in one round trip.
            err = self.reachable()
            if err is not None:
                raise _Unreachable(f"nothing accepts connections there ({err})")
            if self._client is None:
                client = self._mc.MooncakeDistributedStore()
                hostname = self.local_hostname or _route_address(self.host, self.port)
                rc = client.setup(
                    hostname,
                    self.metadata,
                    self.segment_bytes,
                    self.buffer_bytes,
                    self.protocol,
                    self.rdma_devices,
                    self.master,
                )
                if rc != 0:
                    with contextlib.suppress(Exception):
                        client.close()
                    raise _Unreachable(f"setup failed with {rc}")
                config = self._mc.ReplicateConfig()
                config.replica_num = self.replicas
                self._client, self._config = client, config
            return self._client

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn`` on the client, turning every Mooncake failure into TierUnavailableError."""
        if self._closed:
            raise TierUnavailableError(f"the Mooncake tier at {self.master} is closed")
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self.rejected += 1
                raise TierUnavailableError(
                    f"the Mooncake master at {self.master} failed recently and is retried in "
                    f"{self._down_until - now:.1f}s (retry_interval_s={self.retry_interval_s:g}); "
                    "check that mooncake_master is up and reachable"
                )
        try:
            result = fn(self._connect())
        except _Unreachable as exc:
            self._fail()
            raise TierUnavailableError(
                f"cannot reach the Mooncake master at {self.master} ({what}: {exc}); start "
                f"mooncake_master --rpc_port={self.port} there, or fix the tier URL"
            ) from None
        except _Failed as exc:
            self._fail()
            raise TierUnavailableError(
                f"the Mooncake store at {self.master} failed ({what}: {exc}); check that "
                "mooncake_master is up and that the pool has segments with room"
            ) from None
        self._failed = False
        return result

    def _fail(self) -> None:
        with self._lock:
            self.errors += 1
            self._failed = True
            self._down_until = time.monotonic() + self.retry_interval_s

    def ping(self) -> None:
        """Connect now; raises :class:`TierUnavailableError` if the master does not answer."""

        def run(client: Any) -> None:
            rc = client.batch_is_exist([f"{self.key_prefix}:ping"])
            if rc and rc[0] < 0:
                raise _Failed(f"the master answered {_describe(rc[0])}")

        self._call("ping", run)

    def _chunks(self, names: list[str], sizes: list[int]) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of ``names`` whose bytes fit a quarter of the buffer."""
        budget = self.buffer_bytes // 4
        out: list[tuple[int, int]] = []
        start, used = 0, 0
        for i, size in enumerate(sizes):
            if size > budget:
                raise ConfigError(
                    f"a block of {size:,} bytes does not fit the Mooncake tier's staging buffer "
                    f"({self.buffer_bytes:,} bytes; a block may use a quarter): raise buffer="
                )
            if i > start and used + size > budget:
                out.append((start, i))
                start, used = i, 0
            used += size
        if start < len(names):
            out.append((start, len(names)))
        return out

    # ------------------------------------------------------------ BlockStore

    def put(self, items: Sequence[PutItem]) -> None:
        if not items:
            return
        # Mooncake's batch calls mix up repeated names in one batch: send each once.
        first: dict[int, PutItem] = {}
        for item in items:
            first.setdefault(item[0], item)
        names = [self.object_name(key) for key in first]
        values = [pack_blob(fmt, key, payload) for key, _, payload, fmt in first.values()]
        chunks = self._chunks(names, [len(v) for v in values])

        def run(client: Any) -> None:
            for start, end in chunks:
                # An object that exists already is left as it is (same key, same block).
                rc = client.put_batch(names[start:end], values[start:end], self._config)
                if rc != 0:
                    raise _Failed(f"put_batch returned {_describe(rc)}")

        self._call("put", run)

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        if not items:
            return []
        # Mooncake's batch calls mix up repeated names in one batch (a block
        # comes back under another's name): fetch each once, hand it to every asker.
        wanted = [self.object_name(key) for key, _ in items]
        names = list(dict.fromkeys(wanted))
        guess = self._blob_bytes or (1 << 20)
        chunks = self._chunks(names, [guess] * len(names))

        def run(client: Any) -> list[Stored | None]:
            out: list[Stored | None] = []
            for start, end in chunks:
                part = names[start:end]
                handles = client.batch_get_buffer(part)
                absent = [i for i, h in enumerate(handles) if h is None]
                if absent:
                    # None means a missing object or a master that did not
                    # answer (or a full staging buffer); ask which one it was.
                    codes = client.batch_is_exist([part[i] for i in absent])
                    bad = [c for c in codes if c < 0]
                    if bad:
                        raise _Failed(f"get found the master failing: {_describe(bad[0])}")
                # The handles point into the client's staging buffer: copy each
                # block out so the buffer is free again whatever the caller keeps.
                sizes = [0 if h is None else int(h.size()) for h in handles]
                owned = torch.empty(sum(sizes), dtype=torch.uint8)
                offset = 0
                for h, size in zip(handles, sizes, strict=True):
                    if h is None:
                        out.append(None)
                        continue
                    dst = owned[offset : offset + size]
                    dst.copy_(torch.frombuffer(memoryview(h), dtype=torch.uint8))
                    out.append(split_blob(dst.numpy().data))
                    offset += size
                del handles
            return out

        found = dict(zip(names, self._call("get", run), strict=True))
        return [found[name] for name in wanted]

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        """Drop blocks the tier evicted; a no-op unless ``delete_on_evict``.

        Other engines may still want a block this one evicts, so by default
        the shared copy stays and the master's eviction reclaims space.
        """
        if self.delete_on_evict:
            self.purge(items)

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        """Delete blocks from the pool whatever ``delete_on_evict`` says (corrupt blocks)."""
        if not items:
            return
        names = list(dict.fromkeys(self.object_name(key) for key, _ in items))

        def run(client: Any) -> None:
            # force: a fresh object carries a read lease for seconds, and a
            # damaged block must go now; a reader racing the removal reads
            # garbage that fails its checksum, a miss.
            codes = client.batch_remove(names, True)
            bad = [c for c in codes if c < 0 and c != _OBJECT_NOT_FOUND]
            if bad:
                raise _Failed(f"batch_remove returned {_describe(bad[0])}")

        self._call("remove", run)

    def contains(self, keys: Sequence[int]) -> list[bool]:
        if not keys:
            return []
        wanted = [self.object_name(key) for key in keys]
        names = list(dict.fromkeys(wanted))

        def run(client: Any) -> list[bool]:
            codes = client.batch_is_exist(names)
            bad = [c for c in codes if c < 0]
            if bad:
                raise _Failed(f"batch_is_exist returned {_describe(bad[0])}")
            return [c == 1 for c in codes]

        found = dict(zip(names, self._call("exist", run), strict=True))
        return [found[name] for name in wanted]

    def scan(self) -> list[int]:
        # Not persistent: the pool lives in the processes that joined it;
        # contains() finds shared blocks on demand instead.
        return []

    def close(self) -> None:
        """Leave the pool; the blocks held in this process's segment go with it."""
        with self._setup_lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def __repr__(self) -> str:
        return f"MooncakeStore(master {self.master}, prefix={self.key_prefix!r})"


class _Unreachable(Exception):
    """The master cannot be connected to (internal)."""


class _Failed(Exception):
    """A Mooncake call returned an error code (internal)."""


# -- the ``mooncake://`` tier URL -------------------------------------------------------------

#: The options a ``mooncake://HOST:PORT?...`` tier URL takes, and their defaults.
URL_OPTIONS: dict[str, str] = {
    "metadata": P2P,
    "local_hostname": "",
    "segment": "1GiB",
    "buffer": "64MiB",
    "protocol": "tcp",
    "rdma_devices": "",
    "prefix": "kvtier",
    "replicas": "1",
    "delete_on_evict": "false",
}


def make_mooncake_store(location: str, options: Mapping[str, str]) -> MooncakeStore:
    """The store a tier URL names: ``location`` is ``HOST:PORT``, ``options`` its settings."""
    unknown = sorted(set(options) - set(URL_OPTIONS))
    if unknown:
        raise ConfigError(
            f"the mooncake medium has no option {', '.join(unknown)}; "
            f"it takes {', '.join(URL_OPTIONS)}"
        )
    opts = {**URL_OPTIONS, **options}
    if not opts["replicas"].isdigit():
        raise ConfigError(
            f"the mooncake medium's replicas must be a whole number, got {opts['replicas']!r}"
        )
    flag = opts["delete_on_evict"].lower()
    if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ConfigError(
            f"the mooncake medium's delete_on_evict must be true or false, got {flag!r}"
        )
    return MooncakeStore(
        location,
        metadata=opts["metadata"],
        local_hostname=opts["local_hostname"] or None,
        # 0: this process adds no memory and uses what other members of the pool hold.
        segment_bytes=0 if opts["segment"].strip() == "0" else parse_memory_size(opts["segment"]),
        buffer_bytes=parse_memory_size(opts["buffer"]),
        protocol=opts["protocol"],
        rdma_devices=opts["rdma_devices"],
        key_prefix=opts["prefix"],
        replicas=int(opts["replicas"]),
        delete_on_evict=flag in ("1", "true", "yes", "on"),
    )


def probe_mooncake(location: str, options: Mapping[str, str], timeout_s: float) -> str | None:
    """Before serving: :class:`ConfigError` when the package or the URL is wrong, a warning
    when the master does not accept connections (the tier comes back when it does)."""
    store = make_mooncake_store(location, options)
    store.connect_timeout_s = timeout_s
    try:
        err = store.reachable()
    finally:
        store.close()
    if err is None:
        return None
    return (
        f"the Mooncake master at {store.master} (metadata {store.metadata}) does not accept "
        f"connections ({err}). Serving without the Mooncake tier until it answers (it is "
        f"retried every second); start mooncake_master --rpc_port={store.port} there "
        "(with --enable_http_metadata_server for an http:// metadata) or fix the tier URL"
    )
