"""Real Mooncake Store processes for tests: a ``mooncake_master`` and a storage node.

The master listens on 127.0.0.1 at free ports (its RPC port, its metrics
port and, when asked, its HTTP metadata server). A Mooncake pool holds data
in the memory its clients contribute, so :class:`MooncakePool` also starts a
``mooncake_client`` process with a segment: a storage node, as a deployment
would run beside its engines. Clients in the tests can then add no memory of
their own and still find their blocks after they close. Everything these
helpers start is stopped, and every directory removed, even when a start
fails halfway.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

START_TIMEOUT_S = 20.0


def mooncake_binary(name: str) -> str | None:
    """A binary the Mooncake wheel installs (``mooncake_master``, ``mooncake_client``)."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which(name)


def mooncake_import_error() -> str | None:
    """Why ``mooncake.store`` cannot be imported, or ``None`` when it can."""
    try:
        import mooncake.store  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


class _Process:
    """One child process logging to a file; :meth:`stop` and :meth:`start` keep its ports."""

    label = "process"

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / f"{self.label}.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def args(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self.ready():
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.label} exited with {self.proc.returncode}:\n" + self.log_tail()
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.label} was not ready in {START_TIMEOUT_S:g}s:\n" + self.log_tail()
                    )
                time.sleep(0.05)
        except BaseException:
            self.stop(kill=True)
            raise

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, *, kill: bool = False) -> None:
        """Stop the process; ``kill=True`` sends SIGKILL, as a crash would."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class MooncakeMaster(_Process):
    """``mooncake_master`` on 127.0.0.1; ``http_metadata`` also serves transfer-engine metadata."""

    label = "master"

    def __init__(self, workdir: Path, *, http_metadata: bool = False) -> None:
        super().__init__(workdir)
        self.binary = mooncake_binary("mooncake_master") or "mooncake_master"
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port() if http_metadata else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        """The metadata setting clients use: the HTTP server, or ``P2PHANDSHAKE``."""
        if self.http_port is None:
            return "P2PHANDSHAKE"
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def args(self) -> list[str]:
        args = [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            "--rpc_thread_num=2",
            # A client that died is dropped (with its segment) after this many seconds.
            "--client_ttl=3",
        ]
        if self.http_port is not None:
            args += [
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]
        return args

    def ready(self) -> bool:
        ports = [self.rpc_port] + ([self.http_port] if self.http_port is not None else [])
        return all(listening(p) for p in ports)


class StorageNode(_Process):
    """``mooncake_client``: a process that only adds ``segment`` of memory to the pool."""

    label = "storage"

    def __init__(self, workdir: Path, master: MooncakeMaster, segment: str = "256MB") -> None:
        super().__init__(workdir)
        self.binary = mooncake_binary("mooncake_client") or "mooncake_client"
        self.master = master
        self.segment = segment
        self.port = free_port()

    def args(self) -> list[str]:
        return [
            self.binary,
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--global_segment_size={self.segment}",
            "--local_buffer_size=16MB",
            f"--master_server_address={self.master.address}",
            f"--metadata_server={self.master.metadata}",
            "--protocol=tcp",
        ]

    def ready(self) -> bool:
        return listening(self.port)


class MooncakePool:
    """A master and one storage node on 127.0.0.1, with their logs in one directory."""

    def __init__(self, *, http_metadata: bool = False, segment: str = "256MB") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
        self.master = MooncakeMaster(self.dir, http_metadata=http_metadata)
        self.storage = StorageNode(self.dir, self.master, segment)

    @property
    def address(self) -> str:
        return self.master.address

    @property
    def metadata(self) -> str:
        return self.master.metadata

    @property
    def url(self) -> str:
        """The kvtier tier URL for this pool (clients add no memory of their own)."""
        url = f"mooncake://{self.address}?segment=0"
        if self.master.http_port is not None:
            url += f"&metadata={self.metadata}"
        return url

    def start(self) -> MooncakePool:
        try:
            self.master.start()
            self.storage.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> None:
        self.storage.stop(kill=True)
        self.master.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> MooncakePool:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


__all__ = [
    "MooncakeMaster",
    "MooncakePool",
    "StorageNode",
    "free_port",
    "listening",
    "mooncake_binary",
    "mooncake_import_error",
]
