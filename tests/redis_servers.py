"""Real ``redis-server`` processes for tests: one server, or a three-master cluster.

The servers listen on 127.0.0.1 at free ports, keep nothing on disk
(``--save "" --appendonly no``) and live in their own temporary directory.
They talk to the tests over RESP directly, so these helpers need no client
library. Everything they start is stopped, and every directory removed,
even when a start fails halfway.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

START_TIMEOUT_S = 15.0


def redis_server_available() -> bool:
    """Whether ``redis-server`` and ``redis-cli`` are on PATH."""
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(port: int, *args: str, timeout_s: float = 2.0) -> bytes:
    """Send one command to the server on ``port``; its simple or bulk string reply.

    Raises OSError when nothing answers and RuntimeError on an error reply.
    """
    request = f"*{len(args)}\r\n".encode()
    for arg in args:
        data = arg.encode()
        request += b"$%d\r\n%s\r\n" % (len(data), data)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(request)
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis on port {port} closed the connection")
            buf += chunk
        line, rest = buf.split(b"\r\n", 1)
        kind, body = line[:1], line[1:]
        if kind == b"-":
            raise RuntimeError(f"redis on port {port}: {body.decode()}")
        if kind in (b"+", b":"):
            return body
        if kind != b"$":
            raise RuntimeError(f"redis on port {port}: unexpected reply {line!r}")
        size = int(body)
        if size < 0:
            return b""
        while len(rest) < size + 2:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis on port {port} closed the connection")
            rest += chunk
        return rest[:size]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 <= 65535 and _port_is_free(port + 10000):
            return port
    raise RuntimeError("found no free port pair for a Redis Cluster node")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; :meth:`stop` and :meth:`start` keep its port.

    ``extra_args`` are appended to the command line, for example
    ``("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")``.
    """

    def __init__(self, extra_args: Sequence[str] = (), *, port: int | None = None) -> None:
        self.extra_args = tuple(extra_args)
        self.port = port if port is not None else free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvtier-redis-{self.port}-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.running:
            return self
        args = [
            "redis-server",
            "--save", "",
            "--appendonly", "no",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop(kill=True)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError, RuntimeError):
                if command(self.port, "PING", timeout_s=0.5) == b"PONG":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING in "
                    f"{START_TIMEOUT_S:g}s:\n" + self.log_tail()
                )
            time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server; ``kill=True`` sends SIGKILL, as a crash would."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def cleanup(self) -> None:
        """Stop the server and remove its directory."""
        self.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class RedisClusterServers:
    """A Redis Cluster of three masters and no replicas on 127.0.0.1."""

    def __init__(self, masters: int = 3, extra_args: Sequence[str] = ()) -> None:
        self.masters = masters
        self.extra_args = tuple(extra_args)
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL; a cluster client discovers the others from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServers:
        try:
            for _ in range(self.masters):
                node = RedisServer(
                    port=free_cluster_port(),
                    extra_args=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "2000",
                        *self.extra_args,
                    ),
                )  # fmt: skip
                self.nodes.append(node)
                node.start()
            create = subprocess.run(
                [
                    "redis-cli", "--cluster", "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    "--cluster-replicas", "0", "--cluster-yes",
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=60,
                check=False,
            )  # fmt: skip
            if create.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed ({create.returncode}):\n"
                    + create.stdout.decode(errors="replace")
                    + create.stderr.decode(errors="replace")
                )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self) -> None:
        """Wait until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(self.ports)
        while pending:
            for port in sorted(pending):
                with contextlib.suppress(OSError, RuntimeError):
                    info = command(port, "CLUSTER", "INFO", timeout_s=0.5)
                    if b"cluster_state:ok" in info:
                        pending.discard(port)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Redis Cluster nodes {sorted(pending)} did not reach cluster_state:ok "
                    f"in {START_TIMEOUT_S:g}s"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill every node and remove their directories."""
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            node.cleanup()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = [
    "RedisClusterServers",
    "RedisServer",
    "command",
    "free_cluster_port",
    "free_port",
    "redis_server_available",
]
