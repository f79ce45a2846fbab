"""kvtier's KV-event-aware router: its index, the event wire format, and real clusters.

The index (:mod:`kvtier.routing.index`) is checked against a model of what
each instance holds (a set of token prefixes) by a stateful property test,
and against a real :class:`~kvtier.KVCacheManager` whose events travel the
real publisher's wire format: for any prompt, the index's leading blocks
must be the device's cached prefix. Then real processes: ``kvtier cluster
--router kvtier`` with two ``kvtier serve`` on the tiny model (later turns
of a conversation go where its earlier turns are cached; answers, streamed
or not, equal a single server's greedy answer), and ``kvtier route`` in
front of two instances one of which is killed mid-run.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from needs import need_module

need_module("zmq")
need_module("msgspec")

from kvtier import KVCacheManager  # noqa: E402
from kvtier.cli import main  # noqa: E402
from kvtier.cli.route import parse_instance  # noqa: E402
from kvtier.errors import ConfigError, OutOfBlocksError  # noqa: E402
from kvtier.events import AllCleared, BlocksRemoved, BlocksStored  # noqa: E402
from kvtier.integrations.vllm.events import KvEventPublisher  # noqa: E402
from kvtier.routing.events import (  # noqa: E402
    EventFormatError,
    SequenceTracker,
    decode_batch,
    decode_message,
    subscriber_endpoint,
)
from kvtier.routing.index import PrefixIndex, block_hashes  # noqa: E402
from kvtier.routing.proxy import Instance, Router  # noqa: E402

BS = 4


# -- the index against a model -----------------------------------------------------------------


def test_block_hashes_chain_on_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial last block has no hash
    assert block_hashes([1, 2, 3, 4], 4) == a[:1]
    # The same block after another parent is another block.
    assert block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != a[1]
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def _key(prefix: tuple[int, ...]) -> int:
    """An instance's key for a block: any injective function of the whole prefix will do."""
    return hash(("key", prefix)) & ((1 << 120) - 1)


class IndexMachine(RuleBasedStateMachine):
    """A :class:`PrefixIndex` of two instances against the prefixes each one holds."""

    prefixes = Bundle("prefixes")

    @initialize()
    def start(self) -> None:
        self.index = PrefixIndex(["a", "b"])
        #: The model: per instance, key -> the token prefix (whole blocks) it names.
        self.held: dict[str, dict[int, tuple[int, ...]]] = {"a": {}, "b": {}}

    @rule(
        target=prefixes,
        name=st.sampled_from(["a", "b"]),
        base=st.one_of(st.none(), prefixes),
        blocks=st.lists(
            st.lists(st.integers(0, 3), min_size=BS, max_size=BS), min_size=1, max_size=3
        ),
    )
    def store(
        self,
        name: str,
        base: tuple[int, ...] | None,
        blocks: list[list[int]],
    ) -> tuple[int, ...]:
        held = self.held[name]
        start = base or ()
        if start and _key(start) not in held:
            # The instance cannot extend a chain it does not hold: a chain from the root.
            start = ()
        keys, prefix = [], start
        for block in blocks:
            prefix = prefix + tuple(block)
            keys.append(_key(prefix))
        tokens = [t for block in blocks for t in block]
        parent = _key(start) if start else None
        self.index.apply(name, [BlocksStored(tuple(keys), "device", parent, tuple(tokens), BS)])
        prefix = start
        for block in blocks:
            prefix = prefix + tuple(block)
            held[_key(prefix)] = prefix
        return prefix

    @rule(name=st.sampled_from(["a", "b"]), data=st.data())
    def remove(self, name: str, data: st.DataObject) -> None:
        held = self.held[name]
        if not held:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(held)), min_size=1, max_size=3))
        self.index.apply(name, [BlocksRemoved(tuple(keys), "device")])
        for key in keys:
            held.pop(key, None)

    @rule(name=st.sampled_from(["a", "b"]))
    def clear(self, name: str) -> None:
        self.index.apply(name, [AllCleared()])
        self.held[name].clear()

    @rule(name=st.sampled_from(["a", "b"]), prefix=prefixes)
    def tier_events_are_ignored(self, name: str, prefix: tuple[int, ...]) -> None:
        self.index.apply(name, [BlocksRemoved((_key(prefix),), "host")])
        self.index.apply(name, [BlocksStored((12345,), "redis")])

    @rule(prefix=prefixes, tail=st.lists(st.integers(0, 3), max_size=2 * BS))
    def match(self, prefix: tuple[int, ...], tail: list[int]) -> None:
        tokens = [*prefix, *tail]
        got = self.index.match(tokens)
        for name, held in self.held.items():
            prefixes = set(held.values())
            n = 0
            while (n + 1) * BS <= len(tokens) and tuple(tokens[: (n + 1) * BS]) in prefixes:
                n += 1
            assert got[name] == n, (name, tokens, got)

    @invariant()
    def sizes_agree(self) -> None:
        for name, held in self.held.items():
            assert len(self.index.instance(name)) == len(held)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None
)


# -- the index against a real device, through the real wire format ---------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "alloc", "free", "reset"]),
        st.integers(0, 5),  # which conversation
        st.integers(1, 5 * BS),  # how many tokens it grows by
    ),
    min_size=1,
    max_size=25,
)


_ADDRESSES = itertools.count()


@settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(ops=_ops)
def test_the_index_agrees_with_a_real_device_cache(ops: list[tuple[str, int, int]]) -> None:
    m = KVCacheManager(24, BS)  # small: allocations evict
    m.record_events()
    # A fresh address per example: an id() can come back while the last example's
    # socket is still bound.
    publisher = KvEventPublisher(f"inproc://kv-router-{next(_ADDRESSES)}", structs="local")
    index = PrefixIndex(["one"])
    convs: dict[int, list[int]] = {}
    live: set[str] = set()
    n = 0
    try:
        for op, conv, grow in ops:
            rid = f"r{n}"
            n += 1
            if op == "alloc":
                tokens = convs.setdefault(conv, [])
                tokens.extend((conv * 7 + len(tokens) + i) % 11 for i in range(grow))
                if len(tokens) > 20 * BS:
                    continue
                try:
                    m.allocate(rid, list(tokens))
                except OutOfBlocksError:  # the cache is full of live requests
                    continue
                live.add(rid)
            elif op == "free" and live:
                oldest = min(live)
                m.free(oldest)
                live.discard(oldest)
            elif op == "reset" and not live:
                m.reset_prefix_cache()
            publisher.drain_device(m)
            # The exact bytes a subscriber receives.
            payload = publisher.encode(_take(publisher), ts=0.0)
            index.apply("one", decode_batch(payload))
            for tokens in convs.values():
                if tokens:
                    # One token more: match() never counts a prompt's last full block.
                    device = m.match([*tokens, 0]).device_blocks
                    assert index.match(tokens)["one"] == device, (tokens, ops)
    finally:
        publisher.close()


def _take(publisher: KvEventPublisher) -> list[Any]:
    with publisher._lock:
        events, publisher._pending = publisher._pending, []
    return events


# -- the routing decision ------------------------------------------------------------------


def _router(threshold: int = 4) -> Router:
    return Router(
        [Instance(n, f"http://{n}:1", "tcp://*:1") for n in "abc"], balance_threshold=threshold
    )


def _hold(router: Router, name: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    keys = tuple(_key(tuple(tokens[: (i + 1) * BS])) for i in range(n))
    router.index.apply(name, [BlocksStored(keys, "device", None, tuple(tokens[: n * BS]), BS)])


@settings(max_examples=200, deadline=None, database=None)
@given(
    loads=st.lists(st.integers(0, 8), min_size=3, max_size=3),
    held=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    threshold=st.integers(0, 5),
    down=st.sets(st.sampled_from("abc"), max_size=2),
)
def test_the_choice_is_the_longest_prefix_within_the_load_guard(
    loads: list[int], held: list[int], threshold: int, down: set[str]
) -> None:
    router = _router(threshold)
    prompt = list(range(100, 100 + 5 * BS))
    for inst, load, n in zip(router.instances, loads, held, strict=True):
        inst.in_flight = load
        inst.up = inst.name not in down
        if n:
            _hold(router, inst.name, prompt[: n * BS])
    ranked = router.ranked(prompt)
    up = [i for i in router.instances if i.up]
    assert [c.instance.name for c in ranked][:1] and {c.instance.name for c in ranked} == {
        i.name for i in up
    }
    first = ranked[0]
    least = min(i.in_flight for i in up)
    eligible = [i for i in up if i.in_flight - least <= threshold]
    assert first.instance in eligible
    hits = {i.name: h for i, h in zip(router.instances, held, strict=True)}
    best = max(hits[i.name] for i in eligible)
    assert first.hit_blocks == hits[first.instance.name] == best
    # Among the equally good, the least loaded.
    assert first.instance.in_flight == min(i.in_flight for i in eligible if hits[i.name] == best)
    up_hits = [hits[i.name] for i in up]
    if max(up_hits) > best:
        assert first.reason == "balanced_away"
    elif best > min(up_hits):
        assert first.reason == "hit"
    else:
        assert first.reason == "least_loaded"


def test_no_instance_up_means_no_choice() -> None:
    router = _router()
    for inst in router.instances:
        router.mark_down(inst)
    assert router.ranked([1, 2, 3, 4]) == []


def test_marking_an_instance_down_forgets_what_it_held() -> None:
    router = _router()
    _hold(router, "a", list(range(8)))
    assert router.index.match(list(range(8)))["a"] == 2
    router.mark_down(router.instances[0])
    assert router.index.match(list(range(8)))["a"] == 0


# -- the wire format and its edges ---------------------------------------------------------


def test_messages_travel_a_real_socket_and_decode() -> None:
    zmq = need_module("zmq")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    # The router's rule: an instance given a plain address connects, the router binds.
    endpoint = f"tcp://127.0.0.1:{port}"
    assert subscriber_endpoint(endpoint, "http://127.0.0.1:1") == (endpoint, True)
    publisher = KvEventPublisher(endpoint, structs="local")
    try:
        got: list[tuple[int, Any]] = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:  # a subscriber joins asynchronously
            publisher.stored([7, 8], parent=None, token_ids=list(range(8)), block_size=4)
            publisher.removed([7])
            publisher.flush()
            if sub.poll(100):
                got.append(decode_message(sub.recv_multipart()))
        assert got, "nothing reached the subscriber"
        _, events = got[0]
        assert events == [
            BlocksStored((7, 8), "device", None, tuple(range(8)), 4),
            BlocksRemoved((7,), "device"),
        ]
    finally:
        publisher.close()
        sub.close(linger=0)


def test_bad_payloads_are_refused_with_a_typed_error() -> None:
    for payload in (b"\xc1", b"\x90", b"\x92\x01\x02"):
        with pytest.raises(EventFormatError):
            decode_batch(payload)
    with pytest.raises(EventFormatError):
        decode_message([b"topic", b"\x00", b""])


def test_sequence_numbers_tell_restarts_and_losses() -> None:
    t = SequenceTracker()
    assert [t.see(s) for s in (5, 6, 9, 0, 1)] == ["ok", "ok", "gap", "restart", "ok"]
    assert (t.lost, t.restarts, t.batches) == (2, 1, 5)


def test_endpoints_and_bad_instance_flags() -> None:
    assert subscriber_endpoint("tcp://*:5557", "http://10.0.0.5:8001") == (
        "tcp://10.0.0.5:5557",
        False,
    )
    assert subscriber_endpoint("ipc:///tmp/kv", "http://h:1") == ("ipc:///tmp/kv", False)
    with pytest.raises(ConfigError, match="fixed port"):
        subscriber_endpoint("tcp://*:0", "http://h:1")
    with pytest.raises(ConfigError, match="--kv-events"):
        subscriber_endpoint("udp://h:1", "http://h:1")
    assert parse_instance("http://h:8001/v1=tcp://*:5557", 1) == (
        "instance-1",
        "http://h:8001",
        "tcp://*:5557",
    )
    with pytest.raises(ConfigError, match="URL=EVENTS"):
        parse_instance("http://h:8001", 1)


def test_route_without_instances_says_what_to_add(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--port", "0"]) == 1
    assert "--instance URL=EVENTS" in capsys.readouterr().err


def test_cluster_refuses_kv_events_after_the_separator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["cluster", "--router", "kvtier", "--", "--kv-events", "tcp://*:1"]) == 1
    assert "drop --kv-events" in capsys.readouterr().err


def test_the_router_loads_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys; import kvtier.routing.proxy, kvtier.cli.route; "
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('kvtier.engine')]; "
        "print(heavy)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- real processes ------------------------------------------------------------------------

_INSTANCE = re.compile(r"^kvtier:   instance \d+: (?P<url>\S+)/v1 \(pid (?P<pid>\d+)\)")
_SERVING = re.compile(r"^kvtier: cluster serving (?P<name>.+) at (?P<url>\S+)/v1 ")
_ROUTING = re.compile(r"^kvtier: routing \d+ instances by their KV events at (?P<url>\S+)/v1 ")
_SERVE_FLAGS = ("--block-size", "4", "--pressure", "off", "--max-num-seqs", "2")


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    instances: list[str]
    pids: list[int]
    #: The name the instances serve the model under.
    model: str = ""

    def post(self, path: str, body: dict[str, Any], base: str | None = None) -> Any:
        req = urllib.request.Request(
            (base or self.url) + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with _open(req) as resp:
            return json.loads(resp.read())

    def stats(self) -> Any:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _launch(log: Path, *args: str, ready: re.Pattern[str], timeout: float = 180) -> Running:
    from cli_launch import kvtier_cli

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            kvtier_cli(*args), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text(errors="replace").splitlines()
        found = [m for m in map(ready.match, lines) if m]
        if found:
            inst = [m for m in map(_INSTANCE.match, lines) if m]
            return Running(
                proc,
                log,
                found[0]["url"],
                [m["url"] for m in inst],
                [int(m["pid"]) for m in inst],
                found[0].groupdict().get("name") or "",
            )
        if proc.poll() is not None:
            raise AssertionError(f"{args[0]} exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{args[0]} did not start in {timeout:g}s:\n{log.read_text()}")


def _open(req: urllib.request.Request) -> Any:
    """``urlopen``, with the answer's body in the error when it is not 2xx."""
    try:
        return urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{req.full_url}: {exc.code} {exc.read()!r}") from None


def _chat(model: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def _cached(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _stream_text(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """The streamed answer's text and the chunks it came in."""
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, chunks = "", 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
                text += piece
                chunks += 1
    return text, chunks


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    need_module("torch")
    need_module("transformers")
    need_module("fastapi")
    log = tmp_path_factory.mktemp("kv-router-cluster") / "cluster.log"
    running = _launch(
        log,
        "cluster", "--router", "kvtier", "--model", str(model_dir),
        "--port", "0", "--instance-port", "0", "--", *_SERVE_FLAGS,
        ready=_SERVING,
    )  # fmt: skip
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.process
def test_later_turns_go_where_the_conversation_is_cached(cluster: Running) -> None:
    conversations = {
        c: [{"role": "user", "content": f"Conversation {c}: the lighthouse keeper. " * 3}]
        for c in range(3)
    }
    served: dict[int, list[str]] = {c: [] for c in conversations}
    cached: dict[int, list[int]] = {c: [] for c in conversations}
    for turn in range(3):
        for c, messages in conversations.items():
            req = urllib.request.Request(
                f"{cluster.url}/v1/chat/completions",
                data=json.dumps(_chat(cluster.model, messages)).encode(),
                headers={"Content-Type": "application/json"},
            )
            with _open(req) as resp:
                served[c].append(resp.headers["x-kvtier-instance"])
                answer = json.loads(resp.read())
            cached[c].append(_cached(answer))
            text = answer["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"More on turn {turn}."},
            ]
    for c in conversations:
        assert len(set(served[c])) == 1, (c, served[c])
        # Each later turn finds the whole earlier conversation cached there.
        assert cached[c][0] < cached[c][1] < cached[c][2], (c, cached[c])
    stats = cluster.stats()
    assert stats["prefix_hits"] >= 6 and stats["hit_blocks"] > 0
    assert all(i["lost_batches"] == 0 and i["orphan_blocks"] == 0 for i in stats["instances"])


@pytest.mark.process
def test_answers_streamed_or_not_equal_a_single_servers(cluster: Running) -> None:
    messages = [{"role": "user", "content": "Which words did the keeper write? " * 4}]
    through = cluster.post("/v1/chat/completions", _chat(cluster.model, messages))
    text = through["choices"][0]["message"]["content"]
    # Each instance is a single server: ask both, straight, for the same greedy answer.
    for base in cluster.instances:
        direct = cluster.post("/v1/chat/completions", _chat(cluster.model, messages), base=base)
        assert direct["choices"][0]["message"]["content"] == text
    streamed, chunks = _stream_text(
        f"{cluster.url}/v1/chat/completions", _chat(cluster.model, messages)
    )
    assert streamed == text and chunks >= 2
    prompt = list(range(5, 40))
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    completion = cluster.post("/v1/completions", body)["choices"][0]["text"]
    direct = cluster.post("/v1/completions", body, base=cluster.instances[0])
    assert direct["choices"][0]["text"] == completion
    assert _stream_text(f"{cluster.url}/v1/completions", body)[0] == completion
    with urllib.request.urlopen(f"{cluster.url}/v1/models", timeout=30) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == cluster.model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.process
def test_a_killed_instance_is_routed_around(model_dir: Path, tmp_path: Path) -> None:
    need_module("torch")
    need_module("transformers")
    need_module("fastapi")
    from serve_proc import ServeProcess

    ports = [_free_port(), _free_port()]
    # Instances that bind their event port, as in a deployment: the router connects.
    servers = [
        ServeProcess(["--model", str(model_dir), "--kv-events", f"tcp://*:{p}", *_SERVE_FLAGS])
        for p in ports
    ]
    starters = [threading.Thread(target=s.start) for s in servers]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    router: Running | None = None
    try:
        assert all(s.base for s in servers), [s.output() for s in servers]
        flags = [f"--instance={s.base}=tcp://*:{p}" for s, p in zip(servers, ports, strict=True)]
        router = _launch(
            tmp_path / "route.log",
            "route", "--model", str(model_dir), "--port", "0", "--health-interval", "0.5", *flags,
            ready=_ROUTING,
        )  # fmt: skip
        router.model = model_dir.name
        messages = [{"role": "user", "content": "A conversation that must survive. " * 4}]
        first = router.post("/v1/chat/completions", _chat(router.model, messages))
        answer = first["choices"][0]["message"]["content"]
        stats = router.stats()
        home = next(i for i in stats["instances"] if i["routed"])
        victim = next(s for s in servers if s.base == home["url"])
        assert victim.proc is not None
        victim.proc.kill()  # mid-run, no goodbye
        victim.proc.wait()
        for _ in range(3):
            again = router.post("/v1/chat/completions", _chat(router.model, messages))
            assert again["choices"][0]["message"]["content"] == answer
        stats = router.stats()
        gone = next(i for i in stats["instances"] if i["url"] == home["url"])
        assert not gone["up"] and gone["failures"] >= 1 and gone["indexed_blocks"] == 0
        assert stats["retries"] >= 1 and stats["unavailable"] == 0
        with urllib.request.urlopen(f"{router.url}/health", timeout=30) as resp:
            assert json.loads(resp.read())["instances_up"] == 1
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
    assert os.path.exists(tmp_path / "route.log")
