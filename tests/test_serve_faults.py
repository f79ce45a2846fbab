"""Faults injected under a real ``kvtier serve``: damaged, deleted and full disks, a Redis killed
mid-load, clients leaving mid-stream.

Each case runs the server as a process on the tiny model (``model_dir``) with
a device pool small enough that finished prompts are evicted, damages the
tier under it from outside, and checks what a client and an operator see:
``/health`` stays 200, every greedy answer equals a reference server's (the
same model with no tier), the tier's counters in ``/v1/cache/stats`` and
``/metrics`` record the fault, and the server's log tells each episode once.
Prompts are token ids, so both servers compute exactly the same tokens.
"""

from __future__ import annotations

import random
import resource
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from needs import need_module, need_redis_server
from redis_servers import RedisServer, command
from serve_proc import ServeProcess, completion_body, sse_events, wait_for

need_module("uvicorn", "pip install 'kvtier[serve]'")

from kvtier.offload.codec import HEADER_SIZE  # noqa: E402

# Real servers in their own processes: run once, in the compiled pass (see the Makefile).
pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.process,
]

BLOCK = 16
#: A device pool of 24 blocks holds three prompts of PROMPT_LEN: a fourth evicts the oldest.
NUM_BLOCKS = 24
PROMPT_LEN = 120  # 7 full blocks, each stored on the tier when evicted
FULL_BLOCKS = PROMPT_LEN // BLOCK
MAX_TOKENS = 8
#: The tiny tokenizer's end-of-sequence tokens, kept from being chosen in the long streams.
NO_EOS = {"1": -100, "3": -100}


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 100) for _ in range(length)]


def base_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model_dir),
        "--served-model-name", "tiny",
        "--block-size", str(BLOCK),
        "--pressure", "off",
        "--log-level", "warning",
        *extra,
    ]  # fmt: skip


class Reference:
    """Greedy answers of a server on the same model without any tier, memoised."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self._memo: dict[tuple[Any, ...], str] = {}

    def __call__(self, ids: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> str:
        key = (tuple(ids), max_tokens, repr(sorted(extra.items())))
        if key not in self._memo:
            self._memo[key] = str(self.server.complete(ids, max_tokens, **extra)["text"])
        return self._memo[key]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Iterator[Reference]:
    with ServeProcess(base_args(model_dir, "--num-blocks", "256")) as server:
        yield Reference(server)


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb")) if root.exists() else []


def wait_stable_files(root: Path, at_least: int, timeout_s: float = 60.0) -> list[Path]:
    """The block files under ``root`` once there are ``at_least`` and no more arrive."""
    seen: list[int] = []

    def settled() -> bool:
        seen.append(len(block_files(root)))
        return seen[-1] >= at_least and seen[-3:] == [seen[-1]] * 3

    wait_for(f"{at_least} block files under {root}", settled, timeout_s, interval_s=0.2)
    return block_files(root)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample; 0 when it is absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def healthy_throughout(server: ServeProcess) -> None:
    """``/health`` answered 200 now and every time it was asked in the background."""
    assert server.health() == 200
    wait_for("a /health check in the background", lambda: server.health_checks > 0)
    assert server.unhealthy == [], server.unhealthy


def evict(server: ServeProcess, reference: Reference, seeds: range) -> None:
    """Send prompts that push earlier ones out of the device pool (down to its tiers)."""
    for seed in seeds:
        ids = prompt(seed)
        assert server.text(ids, MAX_TOKENS) == reference(ids)


# -- a. damaged block files ---------------------------------------------------------------


def test_flipped_bytes_on_disk_are_caught_counted_and_recomputed(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    args = base_args(model_dir, "--num-blocks", str(NUM_BLOCKS), "--tier", f"disk:{root}?size=8MiB")
    with ServeProcess(args) as server:
        p1 = prompt(1)
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        evict(server, reference, range(100, 104))
        files = wait_stable_files(root, FULL_BLOCKS)
        for path in files:  # one payload byte in every block file
            with open(path, "r+b") as f:
                f.seek(HEADER_SIZE + 37)
                byte = f.read(1)
                f.seek(HEADER_SIZE + 37)
                f.write(bytes([byte[0] ^ 0xFF]))
        before = server.tier("disk")
        assert before["corrupt_blocks"] == 0 and before["loaded_blocks"] == 0
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        after = server.tier("disk")
        assert after["corrupt_blocks"] >= 1
        assert after["loaded_blocks"] == 0, "a damaged block must never reach the device"
        assert (
            metric(server.metrics(), "kvtier_tier_errors_total", tier="disk", kind="corrupt") >= 1
        )
        # Asked again, the prompt is answered the same (now from the device cache).
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        healthy_throughout(server)
        corrupt = server.lines(r"disk tier: .*dropped and is recomputed")
        assert len(corrupt) == 1, server.output()
    assert "Traceback" not in server.output()


# -- b. Redis killed while a prefix loads ---------------------------------------------------


def redis_keys(redis: RedisServer) -> int:
    return int(command(redis.port, "DBSIZE"))


@pytest.fixture()
def redis() -> Iterator[RedisServer]:
    need_redis_server()
    with RedisServer() as server:
        yield server


def test_redis_killed_during_a_prefix_load_then_restarted(
    model_dir: Path, reference: Reference, redis: RedisServer
) -> None:
    args = base_args(model_dir, "--num-blocks", str(NUM_BLOCKS), "--tier", redis.url)
    with ServeProcess(args) as server:
        p1 = prompt(2)
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        wait_for("the prompt's blocks in Redis", lambda: redis_keys(redis) >= FULL_BLOCKS)
        evict(server, reference, range(200, 204))
        # p1's prefix is only on Redis now: ask for it and kill Redis as the load starts.
        answer: list[tuple[int, Any]] = []
        asking = threading.Thread(
            target=lambda: answer.append(
                server.request("POST", "/v1/completions", completion_body(p1, MAX_TOKENS))
            )
        )
        # Redis holds every command back (ours answers first), so the load's read is still
        # waiting on it when it dies.
        command(redis.port, "CLIENT", "PAUSE", "10000", "ALL")
        asking.start()
        time.sleep(0.5)
        redis.stop(kill=True)
        asking.join(120)
        assert answer, "the request did not come back"
        status, body = answer[0]
        assert status == 200, body
        assert body["choices"][0]["text"] == reference(p1)
        cut = server.tier("redis")
        assert cut["loaded_blocks"] == 0 and cut["unavailable_errors"] >= 1, cut
        # While Redis is down every request is still answered, recomputed.
        for seed in (210, 211):
            ids = prompt(seed)
            assert server.text(ids, MAX_TOKENS) == reference(ids)
        down = server.tier("redis")
        assert down["unavailable_errors"] + down["store_failures"] > 0
        assert server.health() == 200
        redis.start()  # the same port, empty: it keeps nothing on disk
        seeds = iter(range(300, 400))

        def back() -> bool:
            ids = prompt(next(seeds))
            assert server.text(ids, MAX_TOKENS) == reference(ids)
            return bool(server.lines(r"the redis tier answers again"))

        wait_for("the redis tier to answer again", back, timeout_s=60, interval_s=0.2)
        # Hits come back: a new prompt stored through, evicted from the device, loaded.
        q = prompt(500)
        keys = redis_keys(redis)
        assert server.text(q, MAX_TOKENS) == reference(q)
        wait_for("q's blocks in Redis", lambda: redis_keys(redis) >= keys + FULL_BLOCKS)
        evict(server, reference, range(501, 505))
        loaded = server.tier("redis")["loaded_blocks"]
        assert server.text(q, MAX_TOKENS) == reference(q)
        up = server.tier("redis")
        assert up["loaded_blocks"] >= loaded + FULL_BLOCKS
        # What the restart lost left the bookkeeping once Redis answered again.
        assert up["reconciled_blocks"] > 0
        assert up["corrupt_blocks"] == 0
        text = server.metrics()
        assert metric(text, "kvtier_tier_errors_total", tier="redis", kind="unavailable") > 0
        healthy_throughout(server)
        assert len(server.lines(r"the redis tier cannot be reached")) == 1, server.output()
        assert len(server.lines(r"the redis tier answers again")) == 1, server.output()
    assert "Traceback" not in server.output()


# -- c. the disk tier's directory deleted -----------------------------------------------------


def test_a_deleted_disk_directory_is_served_around_and_made_again(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    args = base_args(model_dir, "--num-blocks", str(NUM_BLOCKS), "--tier", f"disk:{root}?size=8MiB")
    with ServeProcess(args) as server:
        p1 = prompt(3)
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        evict(server, reference, range(600, 604))
        wait_stable_files(root, FULL_BLOCKS)
        shutil.rmtree(root)
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        gone = server.tier("disk")
        assert gone["vanished_blocks"] >= 1 and gone["loaded_blocks"] == 0
        assert (
            metric(server.metrics(), "kvtier_tier_errors_total", tier="disk", kind="vanished") >= 1
        )
        # Demotions go on: the directory is made again and holds new blocks.
        evict(server, reference, range(700, 705))
        wait_stable_files(root, FULL_BLOCKS)
        loaded = server.tier("disk")["loaded_blocks"]
        g = prompt(700)  # the oldest of them: evicted, on disk only
        assert server.text(g, MAX_TOKENS) == reference(g)
        back = server.tier("disk")
        assert back["loaded_blocks"] >= loaded + FULL_BLOCKS, back
        assert back["store_failures"] == 0, "writes must go on once the directory is gone"
        healthy_throughout(server)
        lost = server.lines(r"disk tier directory .* disappeared; creating it again")
        assert len(lost) == 1, server.output()
    assert "Traceback" not in server.output()


# -- d. a disk that takes no more bytes ---------------------------------------------------------

#: Smaller than one block file (8 KiB of payload): every write of one fails with EFBIG.
FILE_SIZE_LIMIT = 2048


def _limit_file_size() -> None:
    # In the child between fork and exec: a full disk as seen by one process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def test_a_full_disk_fails_stores_logs_once_and_answers_stay_right(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    args = base_args(model_dir, "--num-blocks", str(NUM_BLOCKS), "--tier", f"disk:{root}?size=8MiB")
    with ServeProcess(args, preexec_fn=_limit_file_size) as server:
        p1 = prompt(4)
        assert server.text(p1, MAX_TOKENS) == reference(p1)
        evict(server, reference, range(800, 805))
        assert server.text(p1, MAX_TOKENS) == reference(p1)  # recomputed: nothing stored
        seeds = iter(range(805, 900))

        def counted() -> bool:
            # Stores finish in the background; the next request collects their failures.
            if server.tier("disk")["store_failures"] >= FULL_BLOCKS:
                return True
            ids = prompt(next(seeds))
            assert server.text(ids, MAX_TOKENS) == reference(ids)
            return False

        wait_for("failed stores to be counted", counted, interval_s=0.2)
        # The last request's own stores may still be failing: the idle server finishes them.
        wait_for("failed stores to free the tier", lambda: server.tier("disk")["used_blocks"] == 0)
        disk = server.tier("disk")
        assert disk["stored_blocks"] == 0 and disk["used_blocks"] == 0
        assert block_files(root) == [], "no partial block file may stay behind"
        text = server.metrics()
        assert metric(text, "kvtier_tier_errors_total", tier="disk", kind="store_failed") > 0
        healthy_throughout(server)
        episode = server.lines(
            r"the disk tier (cannot be reached|failed|is full)|storing on the disk tier fails"
        )
        assert len(episode) == 1, server.output()
        # A full disk is said to be full (EFBIG, what RLIMIT_FSIZE gives), not unreachable.
        assert "the disk tier is full" in episode[0] and "File too large" in episode[0], episode
    assert "Traceback" not in server.output()


# -- e. clients leaving mid-stream --------------------------------------------------------------

ADMIN_KEY = "admin-" + "k" * 24


def test_clients_closing_streams_leave_nothing_running(
    model_dir: Path, reference: Reference
) -> None:
    args = base_args(
        model_dir, "--num-blocks", "256", "--max-num-seqs", "8", "--admin-key", ADMIN_KEY
    )
    long = 160
    with ServeProcess(args) as server:
        ids = [prompt(900 + i, 40) for i in range(6)]
        streams = [server.open_stream(p, long, logit_bias=NO_EOS) for p in ids]
        texts: list[list[str]] = [[] for _ in ids]
        for i, (_conn, resp) in enumerate(streams):  # every stream is under way
            events = sse_events(resp)
            for _ in range(2):
                texts[i].append(next(events)["choices"][0]["text"])
        closed = [0, 2, 4]
        for i in closed:
            conn, _resp = streams[i]
            conn.close()

        def finish(i: int) -> None:
            _conn, resp = streams[i]
            for event in sse_events(resp):
                texts[i].extend(c["text"] for c in event["choices"])
            streams[i][0].close()

        readers = [threading.Thread(target=finish, args=(i,)) for i in (1, 3, 5)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(120)
        for i in (1, 3, 5):
            assert "".join(texts[i]) == reference(ids[i], long, logit_bias=NO_EOS)

        def idle() -> bool:
            engine = server.stats()["engine"]
            return bool(engine["running"] == 0 and engine["waiting"] == 0)

        wait_for("the engine to run nothing", idle, timeout_s=60)
        engine = server.stats()["engine"]
        assert engine["finished"].get("abort", 0) == len(closed), engine["finished"]
        assert engine["generation_tokens"] < len(ids) * long
        status, body = server.request("GET", "/admin/requests", key=ADMIN_KEY)
        assert status == 200 and body["requests"] == [], body
        assert metric(server.metrics(), "kvtier_requests_running") == 0
        later = prompt(950, 40)
        assert server.text(later, MAX_TOKENS) == reference(later)
        healthy_throughout(server)
    assert "Traceback" not in server.output()
