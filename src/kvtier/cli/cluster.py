"""``kvtier cluster``: several ``kvtier serve`` behind a real router, started and stopped together.

A user running N instances needs something in front of them that sends each
request to the instance caching its prefix. This command starts N
``kvtier serve`` processes on one model, optionally sharing a Redis tier (one
given with ``--redis`` or a ``redis-server`` it starts itself), and a router
from PyPI in front of them: vLLM's ``vllm-router`` (the default) or SGLang's
``sglang-router``, both Rust load balancers with round-robin and cache-aware
(approximate prefix tree) routing. It prints the router's URL, relays every
child's output prefixed with its name, and on Ctrl-C (or SIGTERM) stops the
router, then the instances, then Redis. An instance that exits is started again
on its own port (``--on-instance-exit``; the router's health checks take it out
of rotation meanwhile and back once it answers), or left out while the others
go on serving; if the router or Redis dies, or no instance is left, the rest
are stopped and the command exits with status 1. With vllm-router's ``kv_aware``
policy each instance publishes its KV events on a free port (``--kv-events
tcp://HOST:0``; its banner says which) and the router subscribes to them
(``--kv-event-source``), so it routes on what each instance really holds.
With ``--pd`` the instances
split into prefill and decode roles (``kvtier serve --role``) behind
vllm-router's prefill/decode mode, handing each prompt's KV over through
the shared Redis (:mod:`kvtier.server.disagg`).

Children run in their own sessions so a terminal's Ctrl-C reaches this process
only, and the shutdown happens in order: the router first, so no request is
sent to an instance that is going away.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from kvtier.cli.args import arg, float_in, parse_memory_size, port, positive_int
from kvtier.errors import ConfigError

#: Seconds an instance may take from launch to its "serving" line (loading a model on CPU).
DEFAULT_STARTUP_TIMEOUT_S = 300.0
#: Seconds a child gets to exit after the stop signal before it is killed.
STOP_GRACE_S = 15.0
#: Lines of each child's output kept to explain its death.
TAIL_LINES = 40
#: What ``--on-instance-exit`` may say: start it again, serve on without it, stop all.
ON_INSTANCE_EXIT = ("restart", "continue", "stop")
#: An instance that exits this many times in a row before serving is left out: its start
#: keeps failing (a bad flag, a taken port, too little memory), so starting it again won't help.
MAX_FAILED_STARTS = 3
#: Seconds between the Rust routers' health checks of each instance (theirs is 60): a dead
#: instance leaves the rotation within about two of them.
HEALTH_CHECK_INTERVAL_S = 2

_SERVING = re.compile(r"^kvtier: serving (?P<name>.+) at (?P<url>\S+)/v1\b")
#: The banner lines of an instance that vllm-router's kv_aware policy needs: where its KV
#: events are published (the port it bound) and its block size.
_EVENTS_AT = re.compile(r"KV events \(vLLM's format\) published on (?P<endpoint>tcp://\S+)")
_BLOCKS = re.compile(r"KV cache: \d+ blocks of (?P<size>\d+) tokens")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Router lines relayed without --verbose: the routers log every start step at INFO
#: whatever their --log-level says.
_ROUTER_NEWS = re.compile(r"\b(WARN|WARNING|ERROR|CRITICAL|Traceback|panicked)\b")


@dataclass(frozen=True)
class RouterKind:
    """A router package: how to launch it and what it accepts."""

    command: str
    package: str
    module: str
    policies: tuple[str, ...]
    #: The router's name for the "warnings only" log level.
    quiet_level: str


ROUTERS: dict[str, RouterKind] = {
    "vllm": RouterKind(
        command="vllm-router",
        package="vllm-router==0.1.17",
        module="vllm_router.launch_router",
        policies=(
            "cache_aware",
            "round_robin",
            "random",
            "power_of_two",
            "consistent_hash",
            "sticky_least_loaded",
            "kv_aware",
        ),
        quiet_level="warning",
    ),
    "sglang": RouterKind(
        command="sglang-router",
        package="sglang-router==0.3.2",
        module="sglang_router.launch_router",
        policies=("cache_aware", "round_robin", "random", "power_of_two"),
        quiet_level="warn",
    ),
    # kvtier's own router (kvtier route): cache-aware on the KV events each instance
    # publishes, so it knows what each one holds instead of guessing from the text.
    "kvtier": RouterKind(
        command="kvtier route",
        package="kvtier",
        module="kvtier.routing.proxy",
        policies=("cache_aware",),
        quiet_level="warning",
    ),
}

_EPILOG = """\
what runs:
  N x kvtier serve --host HOST --port INSTANCE_PORT+i [--model PATH] [--tier REDIS]
                   [SERVE_ARGS after --]
  a router at http://HOST:PORT/v1 forwarding to them (OpenAI-compatible)
  redis-server on 127.0.0.1 with --start-redis (nothing kept on disk)

routing (--routing):
  cache_aware   the router keeps a prefix tree of the text it sent to each instance
                and sends a request to the instance with the longest match, unless the
                instances' loads differ too much (the router's balance thresholds)
  round_robin   instances in turn, whatever they cache
  kv_aware      (vllm-router) each instance publishes its KV events (vLLM's format) on a
                free port of its --host the router subscribes to; the router asks them for
                each request's tokens (/v1/chat/completions/render, /tokenize) and sends it
                to the instance holding the longest run of its leading blocks
  With --router kvtier (kvtier route), cache_aware reads the KV events each instance
  publishes, so it knows which blocks every instance holds (and evicted), and sends a
  request to the one holding the longest prefix of its tokens.
  A shared Redis tier makes any instance able to load a prefix another one computed,
  so round-robin then hits too (at the cost of moving the blocks over the network).

when an instance dies (--on-instance-exit):
  restart       (default) the cluster takes it out of the router at once, starts it again
                on the same port, and puts it back once it serves; the requests in flight
                on it fail, new ones go to the other instances meanwhile
  continue      it stays out; the cluster stops when no instance is left
  stop          the whole cluster stops, exit status 1
  The router or Redis dying stops the cluster in every case.

Each instance gets OMP_NUM_THREADS = CPU cores / N unless the variable is set,
so CPU instances do not fight over cores.

examples:
  kvtier cluster                                    # 2 instances, bundled model, vllm-router
  kvtier cluster --instances 4 --start-redis        # sharing a Redis tier started here
  kvtier cluster --redis redis://10.0.0.5:6379/0 --routing round_robin
  kvtier cluster --router sglang --model ./Qwen2.5-0.5B-Instruct -- --kv-cache-memory 1GiB
  kvtier cluster --router-arg=--cache-threshold=0.5  # any flag of the router itself
  kvtier cluster --pd --start-redis                 # 1 prefill + 1 decode instance, P/D router
  kvtier cluster --router kvtier                    # routing on the instances' KV events
  kvtier cluster --router vllm --policy kv_aware    # vllm-router on the instances' KV events
"""


# -- checks ---------------------------------------------------------------------------------


def check_router(kind: RouterKind, routing: str) -> None:
    """Raise ConfigError unless the router package is importable and takes ``routing``."""
    try:
        found = importlib.util.find_spec(kind.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"the router {kind.command} is not installed (module {kind.module} not found): "
            f"pip install {kind.package}, or pick the other one with --router"
        )
    if routing not in kind.policies:
        raise ConfigError(
            f"{kind.command} has no routing policy {routing!r}: use one of "
            f"{', '.join(kind.policies)}"
        )


def check_redis_server() -> str:
    """The path of ``redis-server``, or ConfigError saying how to get one."""
    path = shutil.which("redis-server")
    if path is None:
        raise ConfigError(
            "--start-redis needs redis-server on PATH: install it (apt-get install "
            "redis-server), or point --redis at a running server"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _client_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _ping_redis(port_: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port_), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _get_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


# -- children -------------------------------------------------------------------------------


@dataclass
class Child:
    """One process this command started, its output relayed line by line."""

    name: str
    proc: subprocess.Popen[str]
    echo: bool
    #: When set, only lines it matches are relayed (all are kept in ``tail``).
    only: re.Pattern[str] | None = None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    serving: re.Match[str] | None = None
    #: From the banner: the KV event endpoint bound and the block size (kvtier serve only).
    events_at: str | None = None
    block_size: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None

    def start_pump(self, out: IO[str]) -> None:
        self.pump = threading.Thread(target=self._relay, args=(out,), daemon=True)
        self.pump.start()

    def _relay(self, out: IO[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = _ANSI.sub("", line.rstrip("\n"))
            self.tail.append(line)
            if self.serving is None:
                match = _SERVING.match(line)
                if match is not None:
                    self.serving = match
                    self.ready.set()
                elif (found := _EVENTS_AT.search(line)) is not None:
                    self.events_at = found.group("endpoint")
                elif (size := _BLOCKS.search(line)) is not None:
                    self.block_size = int(size.group("size"))
            if self.echo and (self.only is None or self.only.search(line)):
                with contextlib.suppress(ValueError, OSError):
                    print(f"[{self.name}] {line}", file=out, flush=True)
        self.ready.set()  # exited: whoever waits must look at the process

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def why_dead(self) -> str:
        return f"{self.name} exited with status {self.proc.returncode}:\n" + "\n".join(
            f"  {line}" for line in self.tail
        )

    def send(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Signal the child, wait up to STOP_GRACE_S, then kill it."""
        self.send(sig)
        if self.alive:
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.pump is not None:
            self.pump.join(timeout=2)


def _spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    echo: bool = True,
    only: re.Pattern[str] | None = None,
) -> Child:
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise ConfigError(f"cannot start {name} ({argv[0]}): {exc}") from None
    child = Child(name, proc, echo, only)
    child.start_pump(sys.stdout)
    return child


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP: stop the cluster."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


# -- the command ----------------------------------------------------------------------------


def _roles(args: argparse.Namespace) -> list[str | None]:
    """Each instance's ``--role``: with ``--pd``, the first ``--prefill-instances`` prefill."""
    if not args.pd:
        return [None] * args.instances
    return ["prefill" if i < args.prefill_instances else "decode" for i in range(args.instances)]


def _serve_argv(
    args: argparse.Namespace,
    instance_port: int,
    tier: str | None,
    role: str | None = None,
    events: str | None = None,
) -> list[str]:
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--host", args.host]
    argv += ["--port", str(instance_port)]
    if args.model:
        argv += ["--model", os.path.expanduser(args.model)]
    if tier:
        argv += ["--tier", tier]
    if role:
        argv += ["--role", role]
    if events:
        argv += ["--kv-events", events]
    return argv + list(args.serve_args)


def _instance_env(n: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _start_redis(args: argparse.Namespace, workdir: str) -> tuple[Child, str]:
    server = check_redis_server()
    port_ = args.redis_port or free_port()
    argv = [
        server,
        "--save", "",
        "--appendonly", "no",
        "--port", str(port_),
        "--bind", "127.0.0.1",
        "--dir", workdir,
        "--maxmemory", str(args.redis_memory),
        "--maxmemory-policy", "allkeys-lru",
    ]  # fmt: skip
    child = _spawn("redis", argv, echo=args.verbose)
    deadline = time.monotonic() + 15
    while not _ping_redis(port_):
        if not child.alive:
            raise ConfigError(f"redis-server did not start: {child.why_dead()}")
        if time.monotonic() > deadline:
            raise ConfigError(f"redis-server on port {port_} did not answer PING in 15s")
        time.sleep(0.05)
    return child, f"redis://127.0.0.1:{port_}/0"


def _wait_serving(children: Sequence[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for child in children:
        if not child.ready.wait(max(0.0, deadline - time.monotonic())):
            raise ConfigError(
                f"{child.name} printed no 'kvtier: serving' line in {timeout_s:g}s "
                "(raise --startup-timeout for a large model on CPU)"
            )
        if child.serving is None:
            raise ConfigError(f"{child.name} did not start: {child.why_dead()}")


def _kv_aware(args: argparse.Namespace, kind: RouterKind) -> bool:
    """Whether vllm-router routes on the instances' KV events (its ``kv_aware`` policy)."""
    return kind is ROUTERS["vllm"] and args.routing == "kv_aware"


def _publish_at(host: str) -> str:
    """Where an instance binds its KV event publisher: a free port on its own address.

    vllm-router's subscribers connect, so the instance must bind; port 0 lets it pick a
    port no other process holds, and its banner says which (:func:`_event_sources`).
    """
    if host in ("0.0.0.0", "", "::"):
        return "tcp://*:0"
    return f"tcp://{_client_host(host)}:0"


@dataclass(frozen=True)
class EventSources:
    """What vllm-router's ``kv_aware`` policy is told about the instances' KV events."""

    #: ``(instance URL, ZeroMQ endpoint to connect to)`` per instance.
    sources: list[tuple[str, str]]
    block_size: int
    model: str


def _event_sources(instances: Sequence[Child], urls: Sequence[str]) -> EventSources:
    """Each instance's bound KV event endpoint and the block size, read from its banner."""
    sources: list[tuple[str, str]] = []
    sizes: set[int] = set()
    for child, url in zip(instances, urls, strict=True):
        if child.events_at is None or child.block_size is None:
            raise ConfigError(
                f"{child.name} did not say where it publishes its KV events (its banner has "
                "no 'KV events ... published on' or 'KV cache: ... blocks of' line): "
                "kv_aware routing needs both"
            )
        endpoint = child.events_at
        bound_host, _, port_text = endpoint[len("tcp://") :].rpartition(":")
        if bound_host in ("0.0.0.0", "*", "[::]", "::"):
            # Bound on every address: the router reaches it where the instance serves HTTP.
            where = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
            endpoint = f"tcp://{_client_host(where)}:{port_text}"
        sources.append((url, endpoint))
        sizes.add(child.block_size)
    if len(sizes) != 1:
        raise ConfigError(
            f"the instances use different block sizes ({sorted(sizes)}); kv_aware routing "
            "hashes a request's blocks with one size: give every instance the same --block-size"
        )
    first = instances[0].serving
    return EventSources(sources, sizes.pop(), first.group("name") if first else "unknown")


def _router_argv(
    args: argparse.Namespace,
    kind: RouterKind,
    router_port: int,
    urls: Sequence[str],
    roles: Sequence[str | None] = (),
    events: EventSources | None = None,
) -> list[str]:
    metrics_port = args.router_metrics_port or free_port()
    if kind is ROUTERS["kvtier"]:
        argv = [sys.executable, "-m", "kvtier.cli", "route", "--host", args.host]
        argv += ["--port", str(router_port)]
        if args.model:
            argv += ["--model", os.path.expanduser(args.model)]
        for url, events in zip(urls, args.kv_events, strict=True):
            argv += ["--instance", f"{url}={events}"]
        argv += ["--log-level", "info" if args.verbose else kind.quiet_level]
        return argv + list(args.router_arg or ())
    argv = [sys.executable, "-m", kind.module, "--host", args.host, "--port", str(router_port)]
    if args.pd:
        # vLLM's P/D mode: prefill first (max_tokens 1), then decode with the
        # kv_transfer_params the prefill instance answered.
        argv += ["--vllm-pd-disaggregation", "--worker-startup-check-interval", "1"]
        for url, role in zip(urls, roles, strict=True):
            argv += ["--prefill" if role == "prefill" else "--decode", url]
        argv += ["--policy", args.routing]
    else:
        argv += ["--worker-urls", *urls, "--policy", args.routing]
    if events is not None:
        # kv_aware: the router subscribes to each instance's events (vLLM's format) and
        # asks the instances to render each request's tokens (/v1/chat/completions/render,
        # /tokenize), so it names blocks by the tokens the engines compute.
        for url, endpoint in events.sources:
            argv += ["--kv-event-source", f"{url}={endpoint}"]
        argv += ["--kv-event-block-size", str(events.block_size)]
        argv += ["--kv-event-model", events.model]
    argv += ["--prometheus-port", str(metrics_port), "--prometheus-host", args.host]
    given = {a.split("=", 1)[0] for a in args.router_arg or ()}
    if "--health-check-interval-secs" not in given:
        # So a dead instance leaves the rotation in seconds, not the routers' minute.
        argv += ["--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S)]
    argv += ["--log-level", "info" if args.verbose else kind.quiet_level]
    return argv + list(args.router_arg or ())


def _wait_router(child: Child, url: str, timeout_s: float) -> None:
    """Wait until a request through the router reaches an instance (``GET /v1/models``)."""
    deadline = time.monotonic() + timeout_s
    while not _get_ok(f"{url}/v1/models"):
        if not child.alive:
            raise ConfigError(f"the router did not start: {child.why_dead()}")
        if time.monotonic() > deadline:
            raise ConfigError(f"the router at {url} did not answer /v1/models in {timeout_s:g}s")
        time.sleep(0.1)


@dataclass
class Instance:
    """One ``kvtier serve`` of the cluster: how to start it again on the same address."""

    name: str
    argv: list[str]
    env: dict[str, str]
    child: Child
    #: Where it serves (the router's name for it), once it has.
    url: str = ""
    #: Exits in a row before its serving line, for MAX_FAILED_STARTS.
    failed_starts: int = 0
    #: Started again and not yet serving.
    restarting: bool = False
    #: Left out: ``--on-instance-exit continue``, or it kept failing.
    down: bool = False

    def pin_addresses(self) -> None:
        """Rewrite port 0 in its argv to the ports it bound, so a restart keeps its URL.

        The router knows an instance by its URL (and, with kv_aware, by the KV event
        endpoint it subscribed to): a restarted instance must come back on both.
        """
        if self.child.serving is not None:
            self.url = self.child.serving.group("url")
            bound = urllib.parse.urlsplit(self.url).port
            at = self.argv.index("--port") + 1 if "--port" in self.argv else 0
            if bound and at and self.argv[at] == "0":
                self.argv[at] = str(bound)
        if "--kv-events" in self.argv and self.child.events_at is not None:
            at = self.argv.index("--kv-events") + 1
            if self.argv[at].endswith(":0"):
                port_text = self.child.events_at.rpartition(":")[2]
                self.argv[at] = self.argv[at][: -len("0")] + port_text

    def may_restart(self) -> bool:
        """Record an exit; False once MAX_FAILED_STARTS starts in a row ended before serving.

        An instance that served and then died (killed, out of memory) is always started
        again; only one that cannot get as far as serving is given up on.
        """
        self.failed_starts = self.failed_starts + 1 if self.restarting else 0
        return self.failed_starts < MAX_FAILED_STARTS


def _post_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        req = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tell_router(admin: str | None, action: str, inst: Instance) -> None:
    """Add or remove an instance at the router at once, not at its next health check.

    Between an instance's death and the router's health checks noticing it, the router
    would still pick it, and its retries go to the same instance: those requests fail.
    """
    if admin is None or not inst.url:
        return
    query = urllib.parse.urlencode({"url": inst.url})
    if not _post_ok(f"{admin}/{action}_worker?{query}"):
        _say(f"warning: the router did not take {action}_worker for {inst.url}", err=True)


def _say(text: str, err: bool = False) -> None:
    print(f"kvtier: {text}", file=sys.stderr if err else sys.stdout, flush=True)


def _supervise(
    router: Child,
    instances: Sequence[Instance],
    others: Sequence[Child],
    on_exit: str,
    admin: str | None = None,
) -> Child | None:
    """Serve until Ctrl-C / SIGTERM (None) or a death the cluster cannot go on after.

    An instance that exits is restarted on its own address, left out, or ends it all,
    as ``on_exit`` says; the router, Redis, or the last instance ending ends it all.
    ``admin`` is the router's URL when it takes ``/add_worker`` and ``/remove_worker``.
    """
    try:
        while True:
            for child in (router, *others):
                if not child.alive:
                    return child
            for inst in instances:
                if inst.down:
                    continue
                if inst.child.alive:
                    if inst.restarting and inst.child.serving is not None:
                        inst.restarting = False
                        _tell_router(admin, "add", inst)
                        _say(f"{inst.name} serving again (pid {inst.child.proc.pid})")
                    continue
                if not inst.restarting:
                    _tell_router(admin, "remove", inst)
                _say(inst.child.why_dead(), err=True)
                if on_exit == "stop":
                    return inst.child
                if on_exit == "restart" and inst.may_restart():
                    _say(f"starting {inst.name} again at {inst.url}")
                    inst.restarting = True
                    inst.child = _spawn(inst.name, inst.argv, env=inst.env, echo=True)
                    continue
                inst.down = True
                left = sum(not i.down for i in instances)
                why = (
                    f"it exited {MAX_FAILED_STARTS} times in a row before serving"
                    if on_exit == "restart"
                    else "--on-instance-exit continue"
                )
                _say(f"{inst.name} left out ({why}); {left} instance(s) serving", err=True)
                if left == 0:
                    return inst.child
            time.sleep(0.2)
    except (KeyboardInterrupt, _Stop):
        return None


def run(args: argparse.Namespace) -> int:
    kind = ROUTERS[args.router]
    check_router(kind, args.routing)
    check_pd(args)
    if args.start_redis:
        check_redis_server()
    if args.instance_port and args.instance_port + args.instances - 1 > 65535:
        raise ConfigError(
            f"--instance-port {args.instance_port} leaves no room for {args.instances} "
            "instances below port 65535: pick a lower one, or 0 for free ports"
        )
    router_port = args.port or free_port(args.host)
    host = _client_host(args.host)
    # SIGINT too: a shell starting this in the background leaves SIGINT ignored, and
    # Python then installs no KeyboardInterrupt for it.
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _raise_stop) for s in stops}
    redis: Child | None = None
    slots: list[Instance] = []
    router: Child | None = None
    workdir = tempfile.mkdtemp(prefix="kvtier-cluster-")
    try:
        tier = args.redis
        if args.start_redis:
            redis, tier = _start_redis(args, workdir)
        env = _instance_env(args.instances)
        roles = _roles(args)
        if kind is ROUTERS["kvtier"]:
            # kvtier's router listens on these; each instance connects and publishes there.
            args.kv_events = [f"tcp://127.0.0.1:{free_port()}" for _ in roles]
        elif _kv_aware(args, kind):
            args.kv_events = [_publish_at(args.host) for _ in roles]
        else:
            args.kv_events = [None] * len(roles)
        for i, role in enumerate(roles):
            instance_port = args.instance_port + i if args.instance_port else 0
            argv = _serve_argv(args, instance_port, tier, role, args.kv_events[i])
            name = f"{role} {i + 1}" if role else f"serve {i + 1}"
            slots.append(Instance(name, argv, env, _spawn(name, argv, env=env, echo=True)))
        instances = [slot.child for slot in slots]
        _wait_serving(instances, args.startup_timeout)
        for slot in slots:
            slot.pin_addresses()
        urls = [child.serving.group("url") for child in instances if child.serving]
        events = _event_sources(instances, urls) if _kv_aware(args, kind) else None
        router_argv = _router_argv(args, kind, router_port, urls, roles, events)
        router = _spawn("router", router_argv, only=None if args.verbose else _ROUTER_NEWS)
        url = f"http://{host}:{router_port}"
        _wait_router(router, url, args.startup_timeout)
        name = instances[0].serving.group("name") if instances[0].serving else "?"
        mode = ", prefill/decode disaggregated" if args.pd else ""
        print(
            f"kvtier: cluster of {len(instances)} kvtier serve behind {kind.command} "
            f"({args.routing} routing{mode})",
            flush=True,
        )
        for i, (child, instance_url, role) in enumerate(zip(instances, urls, roles, strict=True)):
            print(
                f"kvtier:   instance {i + 1}: {instance_url}/v1 (pid {child.proc.pid})"
                + (f" --role {role}" if role else ""),
                flush=True,
            )
        if tier:
            where = "redis-server started here" if redis else "given"
            print(f"kvtier:   shared tier: {tier} ({where})", flush=True)
        else:
            print(
                "kvtier:   no shared tier: each instance caches only what it computes",
                flush=True,
            )
        print(
            f"kvtier: cluster serving {name} at {url}/v1 (router pid {router.proc.pid}; "
            f"try: curl {url}/v1/models); Ctrl-C stops everything",
            flush=True,
        )
        # vllm-router and sglang-router take workers in and out over HTTP; kvtier route
        # moves a request on to the next instance when one refuses the connection.
        admin = url if kind is not ROUTERS["kvtier"] else None
        died = _supervise(router, slots, [redis] if redis else [], args.on_instance_exit, admin)
        if died is not None:
            if died in (router, redis):
                _say(f"error: {died.why_dead()}", err=True)
            elif args.on_instance_exit == "stop":
                _say("error: an instance exited (--on-instance-exit stop); stopping", err=True)
            else:
                _say("error: no instance left serving; stopping the cluster", err=True)
            return 1
        print("kvtier: stopping the cluster", flush=True)
        return 0
    except (KeyboardInterrupt, _Stop):
        print("kvtier: interrupted while starting; stopping", file=sys.stderr, flush=True)
        return 130
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave children behind:
        # each child gets STOP_GRACE_S and is then killed anyway.
        for s in stops:
            signal.signal(s, signal.SIG_IGN)
        # The router first, so it sends nothing to an instance being stopped.
        if router is not None:
            router.stop(signal.SIGTERM)
        # SIGTERM, not SIGINT: a child inherits an ignored SIGINT from a background shell.
        for slot in slots:  # all at once: they shut down in parallel
            slot.child.send(signal.SIGTERM)
        for slot in slots:
            slot.child.stop(signal.SIGTERM)
        if redis is not None:
            redis.stop(signal.SIGTERM)
        shutil.rmtree(workdir, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if router is not None:
            print("kvtier: cluster stopped", flush=True)


# -- flags ----------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    cluster = sub.add_parser(
        "cluster",
        help="run several kvtier serve behind a cache-aware router (vllm-router, sglang-router)",
        description="Start N kvtier serve instances on one model, optionally sharing a Redis "
        "tier, and a router in front of them that sends each request to the instance caching "
        "its prefix (cache_aware) or to each in turn (round_robin). Ctrl-C stops everything. "
        "Flags after -- go to every kvtier serve.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cluster.add_argument(
        "--instances",
        type=arg(positive_int, "instance count"),
        default=2,
        metavar="N",
        help="kvtier serve processes to start (default 2)",
    )
    cluster.add_argument(
        "--model",
        metavar="PATH",
        help="a local Hugging Face model directory or .gguf file for every instance "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    cluster.add_argument(
        "--router",
        choices=tuple(ROUTERS),
        default="vllm",
        help="vllm: vllm-router (pip install vllm-router); sglang: sglang-router "
        "(pip install sglang-router); kvtier: kvtier route, routing on the KV events each "
        "instance publishes (--kv-events). Default vllm",
    )
    cluster.add_argument(
        "--routing",
        "--policy",
        dest="routing",
        default="cache_aware",
        metavar="POLICY",
        help="the router's policy: cache_aware, round_robin, random, power_of_two, and the "
        "router's own others; with vllm-router, kv_aware routes on the KV events each "
        "instance publishes (default cache_aware)",
    )
    cluster.add_argument(
        "--host", default="127.0.0.1", help="address the router and instances listen on"
    )
    cluster.add_argument(
        "--port",
        type=arg(port, "port"),
        default=8000,
        help="the router's port, the one clients use; 0 picks a free one (default 8000)",
    )
    cluster.add_argument(
        "--instance-port",
        type=arg(port, "port"),
        default=8001,
        metavar="PORT",
        help="the first instance's port; the others follow (default 8001: 8001, 8002, ...; "
        "0: free ports)",
    )
    shared = cluster.add_mutually_exclusive_group()
    shared.add_argument(
        "--redis",
        metavar="URL",
        help="a running Redis every instance shares as a tier, e.g. redis://10.0.0.5:6379/0 "
        "(any kvtier redis:// or redis+cluster:// tier URL)",
    )
    shared.add_argument(
        "--start-redis",
        action="store_true",
        help="start a redis-server on 127.0.0.1 (nothing on disk, LRU at --redis-memory) "
        "and share it as every instance's tier",
    )
    cluster.add_argument(
        "--redis-port",
        type=arg(port, "port"),
        default=0,
        metavar="PORT",
        help="port of the redis-server --start-redis starts (default: a free one)",
    )
    cluster.add_argument(
        "--redis-memory",
        type=arg(parse_memory_size, "memory size"),
        default=2 * 2**30,
        metavar="SIZE",
        help="maxmemory of the redis-server --start-redis starts (default 2GiB)",
    )
    cluster.add_argument(
        "--router-arg",
        action="append",
        metavar="ARG",
        help="an extra flag for the router, e.g. --router-arg=--cache-threshold=0.5 "
        "(repeatable; see vllm-router --help)",
    )
    cluster.add_argument(
        "--router-metrics-port",
        type=arg(port, "port"),
        default=0,
        metavar="PORT",
        help="the router's Prometheus port (default: a free one)",
    )
    cluster.add_argument(
        "--startup-timeout",
        type=arg(float_in("number of seconds", 0.0, 86400.0, open_low=True), "seconds"),
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help=f"longest wait for an instance or the router to start "
        f"(default {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )
    cluster.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: the first --prefill-instances instances run "
        "--role prefill, the others --role decode, behind vllm-router's P/D mode; needs "
        "--start-redis or --redis (the KV goes from prefill to decode through it)",
    )
    cluster.add_argument(
        "--prefill-instances",
        type=arg(positive_int, "instance count"),
        default=1,
        metavar="N",
        help="with --pd, how many instances prefill (default 1; the rest decode)",
    )
    cluster.add_argument(
        "--on-instance-exit",
        choices=ON_INSTANCE_EXIT,
        default="restart",
        help="when an instance exits while the cluster serves: restart it on the same "
        f"address (given up after {MAX_FAILED_STARTS} exits in a row before serving), "
        "continue without it, or stop the whole cluster (default restart). The router is "
        "told at once (vllm-router, sglang-router: /remove_worker, then /add_worker when it "
        "serves again), so no new request goes to it meanwhile",
    )
    cluster.add_argument(
        "--verbose", action="store_true", help="relay the router's and Redis's info logs too"
    )
    cluster.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        metavar="-- SERVE_ARGS",
        help="flags for every kvtier serve, e.g. -- --block-size 32 --max-num-seqs 8",
    )
    cluster.set_defaults(func=_run_checked)
    return cluster


def check_pd(args: argparse.Namespace) -> None:
    """ConfigError unless ``--pd`` has what it needs: vllm-router, a shared tier, both roles."""
    if not args.pd:
        return
    if args.routing == "kv_aware":
        raise ConfigError(
            "--pd with kv_aware routing is not wired: the prefill instances' KV events "
            "would have to reach the router's P/D mode (--pd-kv-events); use --routing "
            "cache_aware or round_robin with --pd"
        )
    if args.router != "vllm":
        raise ConfigError(
            "--pd runs vllm-router in its P/D mode (--vllm-pd-disaggregation); sglang-router's "
            "P/D mode speaks SGLang's bootstrap protocol, not vLLM's kv_transfer_params: "
            "drop --router sglang"
        )
    if not (args.redis or args.start_redis):
        raise ConfigError(
            "--pd hands each prompt's KV from the prefill to the decode instances through a "
            "shared Redis tier: add --start-redis, or --redis URL"
        )
    if not 1 <= args.prefill_instances < args.instances:
        raise ConfigError(
            f"--pd needs at least one prefill and one decode instance: --prefill-instances "
            f"{args.prefill_instances} of --instances {args.instances} leaves "
            f"{args.instances - args.prefill_instances} to decode"
        )


def _run_checked(args: argparse.Namespace) -> int:
    extra = list(args.serve_args or ())
    if extra and extra[0] == "--":
        extra = extra[1:]
    routes_on_events = args.router == "kvtier" or (
        args.router == "vllm" and args.routing == "kv_aware"
    )
    if routes_on_events and any(a.split("=", 1)[0] == "--kv-events" for a in extra):
        raise ConfigError(
            f"--router {args.router} --routing {args.routing} gives every instance its own "
            "--kv-events endpoint: drop --kv-events after --"
        )
    for flag in ("--host", "--port", "--model"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise ConfigError(
                f"{flag} after -- would override the cluster's own: use kvtier cluster's "
                f"{'--instance-port' if flag == '--port' else flag}"
            )
    args.serve_args = extra
    return run(args)
