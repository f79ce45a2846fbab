"""``kvtier cluster``: two real ``kvtier serve`` behind a real router, on loopback.

The command is run as a process, as a user runs it: it starts the instances
on the tiny model, a redis-server they share, and vllm-router in front.
Requests go through the router with the official ``openai`` client; where
they landed is read from each instance's ``/v1/cache/stats``. With
cache-aware routing a repeated long prompt goes back to the instance that
computed it and hits its device cache; with round-robin (sglang-router, no
shared tier) the second copy goes to the other instance and hits nothing.
Ctrl-C stops the router, the instances and Redis.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_launch import kvtier_cli
from needs import need_module, need_redis_server

need_module("torch")
need_module("transformers")
need_module("fastapi")
openai = need_module("openai")
need_module("vllm_router", "pip install vllm-router==0.1.17")

from kvtier.cli import main  # noqa: E402
from kvtier.cli.cluster import ROUTERS, RouterKind, check_router  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402

#: Long enough to span many 4-token blocks; the router's prefix tree matches text.
LONG_PROMPT = "The archive holds every letter the lighthouse keeper wrote. " * 6
_INSTANCE = re.compile(r"^kvtier:   instance \d+: (?P<url>\S+)/v1 \(pid (?P<pid>\d+)\)")
_SERVING = re.compile(
    r"^kvtier: cluster serving (?P<name>.+) at (?P<url>\S+)/v1 \(router pid (?P<pid>\d+)"
)

# Real servers in their own processes: run once, in the compiled pass (see the Makefile).
pytestmark = pytest.mark.process


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    model: str
    instances: list[str]
    pids: list[int]

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for url in self.instances:
            with urllib.request.urlopen(f"{url}/v1/cache/stats", timeout=10) as r:
                out.append(json.loads(r.read())["engine"])
        return out


def _start(tmp: Path, *flags: str, timeout: float = 120) -> Cluster:
    log = tmp / "cluster.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            kvtier_cli("cluster", "--port", "0", "--instance-port", "0", *flags),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        lines = text.splitlines()
        serving = [m for m in map(_SERVING.match, lines) if m]
        if serving:
            found = [m for m in map(_INSTANCE.match, lines) if m]
            return Cluster(
                proc,
                log,
                serving[0]["url"],
                serving[0]["name"],
                [m["url"] for m in found],
                [int(m["pid"]) for m in found] + [int(serving[0]["pid"])],
            )
        if proc.poll() is not None:
            raise AssertionError(f"kvtier cluster exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"kvtier cluster did not start in {timeout:g}s:\n{log.read_text()}")


def _stop(cluster: Cluster) -> int:
    if cluster.proc.poll() is None:
        cluster.proc.send_signal(signal.SIGINT)
    try:
        return cluster.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        cluster.proc.kill()
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited but was not reaped yet is a zombie: gone for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _chat(client: Any, model: str, text: str) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
    )


@pytest.fixture(scope="module")
def cache_aware(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    need_redis_server()
    cluster = _start(
        tmp_path_factory.mktemp("cluster-cache-aware"),
        "--model", str(model_dir),
        "--routing", "cache_aware",
        "--start-redis",
        "--", "--block-size", "4", "--pressure", "off", "--max-num-seqs", "2",
    )  # fmt: skip
    try:
        yield cluster
    finally:
        _stop(cluster)


def test_a_chat_completion_goes_through_the_router(cache_aware: Cluster) -> None:
    assert len(cache_aware.instances) == 2
    reply = _chat(cache_aware.client(), cache_aware.model, "Hello there")
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens > 0
    models = cache_aware.client().models.list()
    assert [m.id for m in models.data] == [cache_aware.model]
    log = cache_aware.log.read_text()
    assert "shared tier: redis://127.0.0.1:" in log
    assert "redis tier:" in log  # each instance reported the tier in its banner


def test_cache_aware_routing_sends_a_repeated_prompt_to_the_same_instance(
    cache_aware: Cluster,
) -> None:
    client = cache_aware.client()
    before = cache_aware.stats()
    first = _chat(client, cache_aware.model, LONG_PROMPT)
    repeats = [_chat(client, cache_aware.model, LONG_PROMPT) for _ in range(3)]
    after = cache_aware.stats()
    added = [a["requests_added"] - b["requests_added"] for a, b in zip(after, before, strict=True)]
    assert sorted(added) == [0, 4], added  # all four on one instance
    home = added.index(4)
    prompt = first.usage.prompt_tokens
    for reply in repeats:
        assert reply.usage.prompt_tokens == prompt
        # All but the last partial block (and the token computed again) is a hit ...
        assert reply.usage.prompt_tokens_details.cached_tokens >= prompt - 8
    # ... in the device cache of the instance that computed it, not loaded from Redis.
    cached = after[home]["cached_prompt_tokens"] - before[home]["cached_prompt_tokens"]
    loaded = after[home]["loaded_prompt_tokens"] - before[home]["loaded_prompt_tokens"]
    assert cached >= 3 * (prompt - 8)
    assert loaded == 0


def test_a_killed_instance_is_restarted_and_no_request_fails(cache_aware: Cluster) -> None:
    client = cache_aware.client()
    os.kill(cache_aware.pids[1], signal.SIGKILL)
    # Sent at once, before the router's health checks could notice: the cluster takes
    # the instance out of the router itself, and every request is served by the other.
    replies = [_chat(client, cache_aware.model, f"Question {i}: {LONG_PROMPT}") for i in range(6)]
    assert all(r.usage.completion_tokens > 0 for r in replies)
    back = re.compile(r"^kvtier: serve 2 serving again \(pid (\d+)\)", re.M)
    deadline = time.monotonic() + 120
    while (found := back.search(cache_aware.log.read_text(errors="replace"))) is None:
        assert cache_aware.proc.poll() is None, cache_aware.log.read_text()
        assert time.monotonic() < deadline, "the killed instance was not started again"
        time.sleep(0.2)
    cache_aware.pids[1] = int(found[1])
    assert "serve 2 exited with status -9" in cache_aware.log.read_text()
    # Back on its own URL, and in the router's rotation again, healthy.
    with urllib.request.urlopen(f"{cache_aware.url}/workers", timeout=10) as r:
        workers = {w["url"]: w["is_healthy"] for w in json.loads(r.read())["workers"]}
    assert workers == {u.rstrip("/"): True for u in cache_aware.instances}
    direct = openai.OpenAI(base_url=f"{cache_aware.instances[1]}/v1", api_key="u", max_retries=0)
    assert _chat(direct, cache_aware.model, "Are you back?").usage.completion_tokens > 0


def test_ctrl_c_stops_the_router_the_instances_and_redis(cache_aware: Cluster) -> None:
    assert all(_alive(pid) for pid in cache_aware.pids)
    assert _stop(cache_aware) == 0
    assert not any(_alive(pid) for pid in cache_aware.pids)
    log = cache_aware.log.read_text()
    assert log.count("Application shutdown complete") == 2  # uvicorn shut each down gracefully
    assert "kvtier: cluster stopped" in log
    redis_port = int(re.search(r"shared tier: redis://127\.0\.0\.1:(\d+)/0", log)[1])  # type: ignore[index]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()


def test_round_robin_behind_sglang_router_alternates_instances(
    model_dir: Path, tmp_path: Path
) -> None:
    need_module("sglang_router", "pip install sglang-router==0.3.2")
    cluster = _start(
        tmp_path,
        "--model", str(model_dir),
        "--router", "sglang",
        "--routing", "round_robin",
        "--", "--block-size", "4", "--pressure", "off",
    )  # fmt: skip
    try:
        client = cluster.client()
        replies = [_chat(client, cluster.model, LONG_PROMPT) for _ in range(2)]
        stats = cluster.stats()
        assert [s["requests_added"] for s in stats] == [1, 1]
        # No shared tier: the instance that did not compute the prompt has nothing of it.
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0]
        assert "no shared tier" in cluster.log.read_text()
    finally:
        assert _stop(cluster) == 0


# -- vllm-router's kv_aware on the instances' KV events ----------------------------------------

#: Two conversations, each seeded on its own instance before the router sees a turn of it.
CONVERSATIONS = (
    "Tell me about the lighthouse keeper's letters and the ships they name. " * 3,
    "Describe the glassblower's workshop, its furnace and every tool on the wall. " * 3,
)


def _turn(history: list[dict[str, str]], reply: Any, text: str) -> list[dict[str, str]]:
    said = reply.choices[0].message.content or ""
    return [*history, {"role": "assistant", "content": said}, {"role": "user", "content": text}]


def _wait_for_events(cluster: Cluster, instance: str, timeout: float = 60) -> None:
    """Wait until the router's log shows a batch of ``instance``'s KV events applied."""
    seen = f"kv_index live sequence advanced source={instance} "
    deadline = time.monotonic() + timeout
    while seen not in cluster.log.read_text(errors="replace"):
        assert cluster.proc.poll() is None, cluster.log.read_text()
        assert time.monotonic() < deadline, f"no KV events of {instance} reached the router"
        time.sleep(0.1)


def test_kv_aware_sends_a_conversations_later_turns_where_its_kv_is(
    model_dir: Path, tmp_path: Path
) -> None:
    cluster = _start(
        tmp_path,
        "--model", str(model_dir),
        "--router", "vllm",
        "--policy", "kv_aware",
        # The router's debug log says when an instance's events reached its index.
        "--verbose", "--router-arg=--log-level=debug",
        "--", "--block-size", "4", "--pressure", "off",
    )  # fmt: skip
    try:
        assert len(cluster.instances) == 2
        histories: list[list[dict[str, str]]] = []
        replies = []
        # Each conversation's first turn goes straight to its own instance, not through
        # the router: only the KV events can tell the router where it is.
        for url, text in zip(cluster.instances, CONVERSATIONS, strict=True):
            direct = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            history = [{"role": "user", "content": text}]
            replies.append(_chat_messages(direct, cluster.model, history))
            histories.append(history)
        for url in cluster.instances:
            _wait_for_events(cluster, url)
        client = cluster.client()
        for round_ in range(2):
            for home, (history, reply) in enumerate(zip(histories, replies, strict=True)):
                history = _turn(history, reply, f"And then, part {round_ + 2}?")
                before = cluster.stats()
                reply = _chat_messages(client, cluster.model, history)
                after = cluster.stats()
                added = [
                    a["requests_added"] - b["requests_added"]
                    for a, b in zip(after, before, strict=True)
                ]
                assert added[home] == 1 and sum(added) == 1, (home, round_, added)
                # The conversation so far was cached there: all but the last partial block.
                previous = replies[home].usage.prompt_tokens
                assert reply.usage.prompt_tokens_details.cached_tokens >= previous - 4
                histories[home], replies[home] = history, reply
        # The router said so itself: its last decision credited a cached prefix.
        last = cluster.log.read_text().split("KV prefix decision")[-1]
        assert "credited_prefix_tokens=0 " not in last.splitlines()[0]
    finally:
        assert _stop(cluster) == 0


def _chat_messages(client: Any, model: str, messages: list[dict[str, str]]) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0
    )


# -- errors, without starting anything ------------------------------------------------------


def test_a_missing_router_package_says_what_to_install() -> None:
    missing = RouterKind(
        command="no-such-router",
        package="no-such-router==1.0",
        module="kvtier_no_such_router_module",
        policies=("round_robin",),
        quiet_level="warn",
    )
    with pytest.raises(ConfigError, match=r"pip install no-such-router==1\.0"):
        check_router(missing, "round_robin")


def test_a_policy_the_router_lacks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"no routing policy 'kv_aware'.*cache_aware"):
        check_router(ROUTERS["sglang"], "kv_aware")


def test_kv_aware_refuses_what_it_cannot_wire(capsys: pytest.CaptureFixture[str]) -> None:
    # The cluster gives each instance its own event endpoint ...
    assert main(["cluster", "--policy", "kv_aware", "--", "--kv-events", "tcp://*:1"]) == 1
    assert "drop --kv-events" in capsys.readouterr().err
    # ... and vllm-router's P/D mode would need the prefill instances' events wired too.
    assert main(["cluster", "--policy", "kv_aware", "--pd", "--start-redis"]) == 1
    assert "--pd with kv_aware" in capsys.readouterr().err


def test_start_redis_without_redis_server_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no redis-server on it
    assert main(["cluster", "--start-redis", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "redis-server" in err and "apt-get install redis-server" in err


def test_serve_flags_that_the_cluster_sets_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--", "--port", "9000"]) == 1
    assert "--instance-port" in capsys.readouterr().err
