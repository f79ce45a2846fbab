"""Moving requests between engines through a shared Redis tier (real redis-server processes).

The source stores the request's computed blocks on Redis and hands over its
state as JSON; the destination loads the blocks back and continues. Checked
in one process (a single server and a Redis Cluster), and between two
OpenAI servers over real HTTP: a client streaming from the first keeps
streaming while the request runs on the second, and the text is the text
of a run that never moved. A move to a server that cannot take it leaves
the request running where it was.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from cli_launch import kvtier_cli  # noqa: E402
from redis_servers import RedisClusterServers, RedisServer, redis_server_available  # noqa: E402
from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_model_and_tokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.migrate import attach_state, detach, release  # noqa: E402
from kvtier.errors import MigrationError  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.server.auth import ServerAuth  # noqa: E402

if not redis_server_available():
    pytest.skip("redis-server / redis-cli are not installed", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


#: The admin key the servers of these tests share.
ADMIN_KEY = "admin-key-shared-by-the-servers"
#: A loopback port nothing listens on: a peer that is down.
DOWN = "http://127.0.0.1:9"


def admin(*peers: str) -> ServerAuth:
    """Admin endpoints on, moves allowed to ``peers``."""
    return ServerAuth(admin_key=ADMIN_KEY, migrate_peers=peers)


PROMPT = [7, 21, 33, 40, 8, 9, 60, 61, 62, 5, 17, 29, 31, 44, 50, 52, 70, 71, 72, 3 + 10]
TEXT = "Once upon a time, in a land far away"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def engine(url: str, *, cluster: bool = False, **kw: Any) -> Engine:
    model, tok = tiny_model_and_tokenizer()
    tier = TierSpec("redis+cluster" if cluster else "redis", 32 * 2**20, location=url)
    kw.setdefault("num_blocks", 128)
    return Engine(model, tok, model_id="tiny-chat", block_size=4, tiers=[tier], **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(e: Engine, got: list[int], steps: int | None = None) -> None:
    done = 0
    while e.has_unfinished() and (steps is None or done < steps):
        for out in e.step():
            got.extend(out.token_ids)
        done += 1


def _move_through_redis(url: str, *, cluster: bool = False) -> None:
    want: list[int] = []
    ref = engine(url, cluster=cluster)
    ref.add_request(PROMPT, greedy(24), "r")
    run(ref, want)
    ref.close()
    a, b = engine(url, cluster=cluster), engine(url, cluster=cluster)
    try:
        got: list[int] = []
        a.add_request(PROMPT[::-1], greedy(24), "r")  # another prefix than the reference's
        run(a, got, steps=9)
        dep = detach(a, "r", via="tier")
        state = json.loads(json.dumps(dep.state()))
        assert attach_state(b, state, "moved") == "moved"
        release(a, dep)
        run(b, got)
        again: list[int] = []
        solo = engine(url, cluster=cluster)
        solo.add_request(PROMPT[::-1], greedy(24), "r")
        run(solo, again)
        solo.close()
        assert got == again
        # The destination loaded every computed token from Redis, the tail block
        # included, and computed none of them again: it resumed from the one token
        # that had no KV yet (counted as prompt, as for any resumed request).
        assert b.counters.loaded_prompt_tokens == dep.computed
        assert b.counters.computed_prompt_tokens == 1
        assert len(a.manager) == 0 and len(b.manager) == 0
    finally:
        a.close()
        b.close()


def test_a_request_moves_through_redis(redis_server: RedisServer) -> None:
    _move_through_redis(redis_server.url)


def test_a_request_moves_through_a_redis_cluster() -> None:
    with RedisClusterServers() as cluster:
        _move_through_redis(cluster.url, cluster=True)


def test_moving_through_a_tier_needs_a_shared_one() -> None:
    model, tok = tiny_model_and_tokenizer()
    a = Engine(model, tok, model_id="tiny-chat", block_size=4, num_blocks=64)
    a.add_request(PROMPT, greedy(8), "r")
    a.step()
    with pytest.raises(MigrationError, match="no shared tier"):
        detach(a, "r", via="tier")
    assert a.num_running == 1


# -- two servers --------------------------------------------------------------------------


def _get(url: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def stream_and_move(src: Server, target: str, max_tokens: int) -> tuple[str, Any, int]:
    """Stream a completion from ``src``; after a few chunks, ask to move it to ``target``."""
    client = src.client()
    parts: list[str] = []
    moved: tuple[int, Any] | None = None
    usage = None
    stream = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
        if moved is None and len(parts) == 5:
            running = _get(f"{src.base}/admin/requests")["requests"]
            assert [r["state"] for r in running] == ["running"], running
            moved = _post(
                f"{src.base}/admin/migrate",
                {"request_id": running[0]["request_id"], "target": target},
            )
    assert moved is not None
    return "".join(parts), usage, moved


def test_a_streaming_client_keeps_streaming_while_its_request_moves(
    redis_server: RedisServer,
) -> None:
    with (
        serving(engine(redis_server.url), auth=admin()) as b,
        serving(engine(redis_server.url), auth=admin(b.base)) as a,
    ):
        ref = a.client().completions.create(
            model=MODEL, prompt=TEXT, max_tokens=300, temperature=0
        )
        text, usage, (status, body) = stream_and_move(a, b.base, 300)
        assert status == 200 and body["moved"] is True, body
        assert text == ref.choices[0].text
        assert usage.completion_tokens == 300
        assert _get(f"{a.base}/admin/requests")["migrated_out"] == 1
        after = _get(f"{b.base}/admin/requests")
        assert after["migrated_in"] == 1 and after["requests"] == []
        stats = _get(f"{b.v1}/cache/stats")
        assert stats["engine"]["loaded_prompt_tokens"] > 0
        assert stats["engine"]["computed_prompt_tokens"] == 1


def test_a_client_leaving_after_a_move_cancels_the_request_where_it_runs(
    redis_server: RedisServer,
) -> None:
    with (
        serving(engine(redis_server.url), auth=admin()) as b,
        serving(engine(redis_server.url), auth=admin(b.base)) as a,
    ):
        stream = a.client().completions.create(
            model=MODEL, prompt=TEXT, max_tokens=400, temperature=0, stream=True
        )
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        rid = _get(f"{a.base}/admin/requests")["requests"][0]["request_id"]
        status, body = _post(f"{a.base}/admin/migrate", {"request_id": rid, "target": b.base})
        assert status == 200, body
        next(chunks)
        stream.close()  # the client goes away
        deadline = time.monotonic() + 30
        while _get(f"{b.base}/admin/requests")["requests"]:
            assert time.monotonic() < deadline, "the moved request was never cancelled"
            time.sleep(0.05)
        finished = _get(f"{b.v1}/cache/stats")["engine"]["finished"]
        assert finished == {"abort": 1}
        assert _get(f"{a.base}/admin/requests")["requests"] == []


@pytest.mark.parametrize("target", ["down", "other-model"])
def test_a_refused_move_leaves_the_request_streaming_from_its_server(
    redis_server: RedisServer, target: str
) -> None:
    model, tok = tiny_model_and_tokenizer()
    other = Engine(model, tok, model_id="another", block_size=4, num_blocks=64,
                   tiers=[TierSpec("redis", 2**22, location=redis_server.url)])  # fmt: skip
    with (
        serving(other, auth=admin()) as b,
        serving(engine(redis_server.url), auth=admin(DOWN, b.base)) as a,
    ):
        ref = a.client().completions.create(
            model=MODEL, prompt=TEXT, max_tokens=200, temperature=0
        )
        url = DOWN if target == "down" else b.base
        text, usage, (status, body) = stream_and_move(a, url, 200)
        assert status == (502 if target == "down" else 409), body
        assert body["error"]["type"] == "migration_error"
        assert text == ref.choices[0].text and usage.completion_tokens == 200
        assert _get(f"{a.base}/admin/requests")["migrated_out"] == 0
        assert _get(f"{b.base}/admin/requests")["migrated_in"] == 0


def test_admin_requests_bad_input(redis_server: RedisServer) -> None:
    with serving(engine(redis_server.url), auth=admin(DOWN)) as a:
        status, body = _post(f"{a.base}/admin/migrate", {"request_id": 3})
        assert status == 400
        status, body = _post(f"{a.base}/admin/migrate", {"request_id": "x", "target": DOWN})
        assert status == 409 and "not on this engine" in body["error"]["message"]
        status, body = _post(f"{a.base}/admin/migrate/accept", {"version": 99})
        assert status == 409 and "version" in body["error"]["message"]


# -- two `kvtier serve` processes ---------------------------------------------------------


@pytest.mark.slow
def test_two_kvtier_serve_processes_move_a_request_through_redis(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tier = f"{redis_server.url}?size=32MiB"
    ports = _free_ports(2)
    args = ["serve", "--model", str(tmp_path), "--served-model-name", MODEL,
            "--num-blocks", "160", "--block-size", "4", "--tier", tier, "--log-level", "warning",
            "--admin-key", ADMIN_KEY]
    procs = [
        subprocess.Popen(
            kvtier_cli(*args, "--port", str(port),
                       "--migrate-peer", f"http://127.0.0.1:{ports[1 - i]}"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for i, port in enumerate(ports)
    ]  # fmt: skip
    try:
        urls = [_serving_url(p) for p in procs]
        a, b = (Server(url.removesuffix("/v1"), None) for url in urls)  # type: ignore[arg-type]
        ref = b.client().completions.create(
            model=MODEL, prompt=TEXT, max_tokens=300, temperature=0
        )
        text, usage, (status, body) = stream_and_move(a, b.base, 300)
        assert status == 200 and body["moved"] is True, body
        assert text == ref.choices[0].text and usage.completion_tokens == 300
        assert _get(f"{a.base}/admin/requests")["migrated_out"] == 1
        assert _get(f"{b.base}/admin/requests")["migrated_in"] == 1
        # The destination computed the reference's prompt and, for the moved
        # request, only the one token that had no KV yet: everything else came
        # from its prefix cache or from Redis (a partial tail block is loaded
        # from Redis only when the move happens mid-block, so that count varies).
        engine_stats = _get(f"{b.v1}/cache/stats")["engine"]
        assert ref.usage is not None
        assert engine_stats["computed_prompt_tokens"] == ref.usage.prompt_tokens + 1
        assert engine_stats["last_request"]["cached_tokens"] > 0
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert "Traceback" not in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _serving_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"kvtier serve exited early: {''.join(seen)}"
        seen.append(line)
        if line.startswith("kvtier: serving"):
            return line.split(" at ", 1)[1].split(" ", 1)[0]
    raise AssertionError("kvtier serve did not start in time")
