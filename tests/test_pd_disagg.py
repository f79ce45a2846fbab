"""Prefill/decode disaggregation (``kvtier serve --role``) over a real Redis, real HTTP.

A prefill server computes a prompt and answers with ``kv_transfer_params``;
a decode server given them loads the prompt's blocks from the shared Redis
and generates. The tokens are a single ``both`` server's, the decode server
computes only the prompt's last partial block, and KV that went missing
(evicted from Redis, Redis down) is computed again and counted. The servers
run in this process (fast, many prompts) and as ``kvtier serve`` processes
behind vllm-router in its P/D mode (``--vllm-pd-disaggregation``), started
by ``kvtier cluster --pd``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from needs import need_module, need_redis_server

need_module("torch")
need_module("transformers")
need_module("fastapi")
need_redis_server()
redis = need_module("redis")
uvicorn = need_module("uvicorn")

from cli_launch import kvtier_cli  # noqa: E402
from redis_servers import RedisServer  # noqa: E402
from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_model_and_tokenizer  # noqa: E402

from kvtier.cli import main  # noqa: E402
from kvtier.engine import Engine  # noqa: E402
from kvtier.errors import BadRequestError, ConfigError  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.server.disagg import (  # noqa: E402
    ENGINE_ID_PREFIX,
    check_role,
    parse_transfer,
)

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BS = 4
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


# -- parsing and configuration ----------------------------------------------------------------


def test_plain_requests_carry_no_transfer() -> None:
    assert parse_transfer(None) is None
    assert parse_transfer({}) is None
    assert parse_transfer({"do_remote_decode": False, "do_remote_prefill": None}) is None
    prefill = parse_transfer(PREFILL)
    assert prefill is not None and prefill.remote_decode and not prefill.remote_prefill


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([], "JSON object"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "set one of them"),
        ({"do_remote_decode": "yes"}, "true or false"),
        ({"do_remote_prefill": True, "remote_block_ids": "ab"}, "must be a list"),
        ({"do_remote_prefill": True, "remote_block_ids": ["xyz"]}, "hex block keys"),
        ({"do_remote_prefill": True, "remote_num_tokens": -1}, "non-negative"),
        ({"do_remote_prefill": True, "remote_engine_id": 3}, "must be a string"),
    ],
)
def test_malformed_transfer_params_are_refused(raw: Any, says: str) -> None:
    with pytest.raises(BadRequestError, match=says) as info:
        parse_transfer(raw)
    assert info.value.param in ("kv_transfer_params",)


@given(
    keys=st.lists(st.integers(0, 2**128 - 1), max_size=40),
    tokens=st.integers(0, 10_000),
    engine=st.text("0123456789abcdef", min_size=1, max_size=32),
)
def test_a_prefill_answer_reads_back_as_sent(keys: list[int], tokens: int, engine: str) -> None:
    # What a prefill server answers (after a trip through JSON) is what the decode side reads.
    raw = json.loads(
        json.dumps(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": ENGINE_ID_PREFIX + engine,
                "remote_block_ids": [f"{k:x}" for k in keys],
                "remote_num_tokens": tokens,
                "remote_host": "127.0.0.1",
                "remote_port": 8000,
            }
        )
    )
    got = parse_transfer(raw)
    assert got is not None and got.remote_prefill and not got.remote_decode
    assert got.block_keys == tuple(keys)
    assert got.num_tokens == tokens and got.engine_id == ENGINE_ID_PREFIX + engine


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_split_role_needs_a_shared_tier_and_prefix_caching(role: str) -> None:
    ok = {"shared_tier": True, "writes_through": True, "prefix_caching": True}
    assert check_role(role, **ok) == role
    with pytest.raises(ConfigError, match="shares"):
        check_role(role, **{**ok, "shared_tier": False})
    with pytest.raises(ConfigError, match="--no-prefix-caching"):
        check_role(role, **{**ok, "prefix_caching": False})
    assert check_role("both", shared_tier=False, writes_through=False, prefix_caching=False)
    with pytest.raises(ConfigError, match="one of"):
        check_role("decoder", **ok)


def test_a_prefill_role_needs_write_through() -> None:
    with pytest.raises(ConfigError, match="write through"):
        check_role("prefill", shared_tier=True, writes_through=False, prefix_caching=True)
    assert check_role("decode", shared_tier=True, writes_through=False, prefix_caching=True)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--role", "decode"], "--role decode hands the prompt's KV over"),
        (["--role", "prefill", "--tier", "host:64MiB"], "--role prefill hands"),
        (["--role", "prefill", "--tier", "{redis}", "--write-mode", "write_back"], "write through"),
        (["--role", "prefill", "--tier", "{redis}?write=back"], "write through"),
        (["--role", "decode", "--tier", "{redis}", "--no-prefix-caching"], "--no-prefix-caching"),
    ],
)
def test_kvtier_serve_refuses_a_role_it_cannot_play(
    redis_server: RedisServer, flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [f.replace("{redis}", redis_server.url) for f in flags]
    assert main(["serve", "--port", "0", *args]) == 1
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--pd"], "--start-redis, or --redis URL"),
        (["--pd", "--start-redis", "--router", "sglang"], "drop --router sglang"),
        (["--pd", "--start-redis", "--prefill-instances", "2"], "leaves 0 to decode"),
    ],
)
def test_kvtier_cluster_refuses_a_pd_split_it_cannot_run(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    need_module("vllm_router", "pip install vllm-router==0.1.17")
    need_module("sglang_router", "pip install sglang-router==0.3.2")
    assert main(["cluster", "--port", "0", "--instance-port", "0", *flags]) == 1
    assert says in capsys.readouterr().err


# -- servers in this process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def tiny_engine(url: str | None = None, **kw: Any) -> Engine:
    model, tok = tiny_model_and_tokenizer()
    tiers = [TierSpec("redis", 32 * 2**20, location=url)] if url else []
    kw.setdefault("num_blocks", 128)
    return Engine(model, tok, model_id="tiny-chat", block_size=BS, tiers=tiers, **kw)


class Pair:
    """A prefill and a decode server sharing Redis, and a plain one as the reference."""

    def __init__(self, prefill: Server, decode: Server, solo: Server) -> None:
        self.prefill, self.decode, self.solo = prefill, decode, solo

    def prefill_then_decode(
        self, prompt: list[int], max_tokens: int, before_decode: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, pre = post(self.prefill, "/v1/completions", {**body, "kv_transfer_params": PREFILL})
        assert status == 200, pre
        assert pre["usage"]["completion_tokens"] == 1
        if before_decode is not None:
            before_decode(pre["kv_transfer_params"])
        status, dec = post(
            self.decode,
            "/v1/completions",
            {**body, "kv_transfer_params": pre["kv_transfer_params"]},
        )
        assert status == 200, dec
        return pre, dec

    def reference(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """A single ``both`` server's answer."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, ref = post(self.solo, "/v1/completions", body)
        assert status == 200, ref
        return dict(ref)


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        server.base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


def pd_stats(server: Server | str) -> dict[str, Any]:
    base = server if isinstance(server, str) else server.base
    stats: dict[str, Any] = get(base, "/v1/cache/stats")
    return {**stats["disaggregation"], **{f"engine_{k}": v for k, v in stats["engine"].items()}}


@pytest.fixture(scope="module")
def pair(redis_server: RedisServer) -> Iterator[Pair]:
    url = redis_server.url
    with ExitStack() as stack:
        p = stack.enter_context(serving(tiny_engine(url), role="prefill"))
        d = stack.enter_context(serving(tiny_engine(url), role="decode"))
        solo = stack.enter_context(serving(tiny_engine()))
        yield Pair(p, d, solo)


def drop_from_redis(port: int, keys_hex: list[str]) -> int:
    """Delete the blocks with these keys from Redis, as its eviction would; how many went."""
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        names = [n for k in keys_hex for n in client.scan_iter(match=f"*:{int(k, 16):032x}")]
        return int(client.delete(*names)) if names else 0
    finally:
        client.close()


def deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


PROMPTS = st.lists(st.integers(4, 100), min_size=1, max_size=33)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(prompt=PROMPTS, max_tokens=st.integers(1, 6), dropped=st.lists(st.booleans(), max_size=9))
def test_decoding_a_prefilled_prompt_gives_a_single_servers_tokens(
    pair: Pair, redis_server: RedisServer, prompt: list[int], max_tokens: int, dropped: list[bool]
) -> None:
    before = pd_stats(pair.decode)

    def evict(params: dict[str, Any]) -> None:
        # Redis loses some of the handed-over blocks (its own eviction) before the decode.
        keys = params["remote_block_ids"]
        drop_from_redis(redis_server.port, [k for k, d in zip(keys, dropped, strict=False) if d])

    pre, dec = pair.prefill_then_decode(prompt, max_tokens, evict)
    ref = pair.reference(prompt, max_tokens)
    assert dec["choices"][0]["text"] == ref["choices"][0]["text"]
    assert dec["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(prompt) // BS * BS
    assert len(params["remote_block_ids"]) == len(prompt) // BS
    d = deltas(before, pd_stats(pair.decode))
    assert d["decode_requests"] == 1 and d["decode_mismatched"] == 0
    usable = (len(prompt) - 1) // BS * BS
    assert d["decode_expected_tokens"] == usable
    # Every handed-over token was either found here or computed again, and counted.
    assert d["decode_found_tokens"] + d["decode_recomputed_tokens"] == usable
    assert d["decode_kv_missing"] == (1 if d["decode_recomputed_tokens"] else 0)
    assert d["engine_computed_prompt_tokens"] == len(prompt) - d["decode_found_tokens"]
    if not any(dropped[: len(prompt) // BS]):
        # Nothing lost: the decode side computed only the prompt's last partial block.
        assert d["decode_recomputed_tokens"] == 0
        assert d["engine_computed_prompt_tokens"] == len(prompt) - usable <= BS


class HandOffs(RuleBasedStateMachine):
    """Hand-overs interleaved with Redis losing blocks: tokens right, counters add up."""

    def __init__(self, pair: Pair, redis_port: int) -> None:
        super().__init__()
        self.pair, self.redis_port = pair, redis_port
        self.start = pd_stats(pair.decode)
        self.handed: list[str] = []
        self.requests = 0

    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 4))
    def hand_over(self, prompt: list[int], max_tokens: int) -> None:
        pre, dec = self.pair.prefill_then_decode(prompt, max_tokens)
        ref = self.pair.reference(prompt, max_tokens)
        assert dec["choices"][0]["text"] == ref["choices"][0]["text"]
        self.handed += pre["kv_transfer_params"]["remote_block_ids"]
        self.requests += 1

    @precondition(lambda self: bool(self.handed))
    @rule(data=st.data())
    def redis_evicts(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.handed))
        drop_from_redis(self.redis_port, [key])

    @invariant()
    def every_handed_token_is_found_or_recomputed(self) -> None:
        d = deltas(self.start, pd_stats(self.pair.decode))
        assert d["decode_requests"] == self.requests and d["decode_mismatched"] == 0
        assert (
            d["decode_found_tokens"] + d["decode_recomputed_tokens"] == d["decode_expected_tokens"]
        )
        assert d["decode_kv_missing"] <= self.requests


def test_hand_overs_and_evictions_keep_the_books(pair: Pair, redis_server: RedisServer) -> None:
    class Bound(HandOffs):
        def __init__(self) -> None:
            super().__init__(pair, redis_server.port)

    run_state_machine_as_test(
        Bound,
        settings=settings(
            max_examples=4,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_blocks_redis_lost_are_computed_again_from_where_the_prefix_breaks(
    pair: Pair, redis_server: RedisServer
) -> None:
    prompt = [90, 91, 92, 93, *range(20, 46)]  # 30 tokens: 7 full blocks handed over
    before = pd_stats(pair.decode)

    def evict(params: dict[str, Any]) -> None:
        assert drop_from_redis(redis_server.port, params["remote_block_ids"][1:2]) == 1

    _, dec = pair.prefill_then_decode(prompt, 6, evict)
    assert dec["choices"][0]["text"] == pair.reference(prompt, 6)["choices"][0]["text"]
    d = deltas(before, pd_stats(pair.decode))
    # The first block loads; the prefix breaks at the second, so the rest is computed.
    assert d["decode_found_tokens"] == BS
    assert d["decode_recomputed_tokens"] == 28 - BS and d["decode_kv_missing"] == 1
    assert d["engine_computed_prompt_tokens"] == len(prompt) - BS


def test_a_chat_request_splits_the_same_way(pair: Pair) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the lighthouse keeper's letters"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    before = pd_stats(pair.decode)
    status, pre = post(
        pair.prefill, "/v1/chat/completions", {**body, "kv_transfer_params": PREFILL}
    )
    assert status == 200, pre
    transfer = pre["kv_transfer_params"]
    status, dec = post(
        pair.decode, "/v1/chat/completions", {**body, "kv_transfer_params": transfer}
    )
    assert status == 200, dec
    status, ref = post(pair.solo, "/v1/chat/completions", body)
    assert dec["choices"][0]["message"] == ref["choices"][0]["message"]
    n = ref["usage"]["prompt_tokens"]
    d = deltas(before, pd_stats(pair.decode))
    assert d["engine_computed_prompt_tokens"] == n - (n - 1) // BS * BS
    assert d["decode_recomputed_tokens"] == 0


def test_the_counters_are_prometheus_metrics(pair: Pair) -> None:
    pair.prefill_then_decode([11, 12, 13, 14, 15, 16, 17], 2)
    for server, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        stats = pd_stats(server)
        for name in ("prefill_requests", "decode_requests", "decode_recomputed_tokens"):
            assert f'kvtier_pd_{name}_total{{role="{role}"}} {float(stats[name])}' in text


def test_a_decode_server_recomputes_when_redis_is_down(tmp_path: Path) -> None:
    prompt = list(range(10, 40))
    with RedisServer() as srv, ExitStack() as stack:
        p = stack.enter_context(serving(tiny_engine(srv.url), role="prefill"))
        d = stack.enter_context(serving(tiny_engine(srv.url), role="decode"))
        solo = stack.enter_context(serving(tiny_engine()))
        pair = Pair(p, d, solo)
        _, dec = pair.prefill_then_decode(prompt, 8, lambda params: srv.stop(kill=True))
        assert dec["choices"][0]["text"] == pair.reference(prompt, 8)["choices"][0]["text"]
        stats = pd_stats(d)
        assert stats["decode_kv_missing"] == 1
        assert stats["decode_recomputed_tokens"] == stats["decode_expected_tokens"] == 28
        assert stats["engine_computed_prompt_tokens"] == len(prompt)
        # And a prefill server whose Redis is down hands nothing over: its answer says so.
        body = {"model": MODEL, "prompt": prompt[::-1], "max_tokens": 3}
        status, again = post(p, "/v1/completions", {**body, "kv_transfer_params": PREFILL})
        assert status == 200, again
        assert again["kv_transfer_params"]["remote_num_tokens"] == 0
        assert pd_stats(p)["prefill_unhanded_blocks"] == len(prompt) // BS


@pytest.mark.parametrize(
    ("server", "body", "param", "says"),
    [
        ("decode", {"kv_transfer_params": PREFILL}, "kv_transfer_params", "--role decode"),
        ("prefill", {"kv_transfer_params": {"do_remote_prefill": True}}, None, "--role prefill"),
        ("prefill", {"kv_transfer_params": PREFILL, "stream": True}, "stream", "stream false"),
        ("solo", {"kv_transfer_params": PREFILL}, "kv_transfer_params", "no shared tier"),
        ("prefill", {"kv_transfer_params": "yes"}, "kv_transfer_params", "dictionary"),
    ],
)
def test_p_d_requests_a_server_cannot_serve_are_refused(
    pair: Pair, server: str, body: dict[str, Any], param: str | None, says: str
) -> None:
    target = {"prefill": pair.prefill, "decode": pair.decode, "solo": pair.solo}[server]
    full = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **body}
    status, err = post(target, "/v1/completions", full)
    assert status == 400, err
    assert says in err["error"]["message"]
    assert err["error"]["param"] == (param or "kv_transfer_params")


def test_plain_requests_are_served_by_either_role(pair: Pair) -> None:
    prompt = [9, 8, 7, 6, 5, 4, 30, 31, 32]
    want = pair.reference(prompt, 5)["choices"][0]["text"]
    for server in (pair.prefill, pair.decode):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        status, got = post(server, "/v1/completions", body)
        assert status == 200 and got["choices"][0]["text"] == want
        assert "kv_transfer_params" not in got


def test_a_decode_server_of_another_model_recomputes_and_says_so(
    redis_server: RedisServer, pair: Pair
) -> None:
    prompt = list(range(50, 70))
    with serving(tiny_engine(redis_server.url, kv_cache_dtype="int8"), role="decode") as other:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        status, pre = post(pair.prefill, "/v1/completions", {**body, "kv_transfer_params": PREFILL})
        assert status == 200, pre
        status, dec = post(
            other, "/v1/completions", {**body, **{"kv_transfer_params": pre["kv_transfer_params"]}}
        )
        assert status == 200, dec
        stats = pd_stats(other)
        assert stats["decode_mismatched"] == 1
        assert stats["engine_computed_prompt_tokens"] == len(prompt)


# -- kvtier serve processes behind vllm-router --------------------------------------------------

_INSTANCE = re.compile(r"^kvtier:   instance \d+: (?P<url>\S+)/v1 \(pid \d+\) --role (?P<role>\w+)")
_SERVING = re.compile(r"^kvtier: cluster serving .+ at (?P<url>\S+)/v1 ")


@pytest.mark.slow
def test_kvtier_cluster_pd_serves_through_vllm_router(tmp_path: Path) -> None:
    """``kvtier cluster --pd``: redis-server, a prefill and a decode ``kvtier serve`` process,
    vllm-router --vllm-pd-disaggregation in front; clients see one server's tokens."""
    need_module("vllm_router", "pip install vllm-router==0.1.17")
    openai = need_module("openai")
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    log_path = tmp_path / "cluster.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            kvtier_cli("cluster", "--pd", "--start-redis", "--routing", "round_robin",
                       "--port", "0", "--instance-port", "0", "--model", str(tmp_path),
                       "--", "--served-model-name", MODEL, "--block-size", str(BS),
                       "--num-blocks", "160", "--log-level", "warning"),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (up := [m for m in map(_SERVING.match, lines(log_path)) if m]):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        roles = {m["role"]: m["url"] for m in map(_INSTANCE.match, lines(log_path)) if m}
        assert set(roles) == {"prefill", "decode"}
        url = up[0]["url"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        computed = 0
        with serving(tiny_engine(), role="both") as solo:
            ref = solo.client()
            for text in ("The archive holds every letter the keeper wrote. " * 3, "Once upon"):
                got = client.completions.create(
                    model=MODEL, prompt=text, max_tokens=24, temperature=0
                )
                want = ref.completions.create(
                    model=MODEL, prompt=text, max_tokens=24, temperature=0
                )
                assert got.choices[0].text == want.choices[0].text
                stream = client.completions.create(
                    model=MODEL, prompt=text, max_tokens=24, temperature=0, stream=True
                )
                streamed = "".join(c.choices[0].text for c in stream if c.choices)
                assert streamed == want.choices[0].text
                # Each time the decode instance computed only the prompt's last partial
                # block (from Redis the first time, from its device cache the second).
                n = want.usage.prompt_tokens
                computed += 2 * (n - (n - 1) // BS * BS)
            chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}
            got_chat = client.chat.completions.create(model=MODEL, temperature=0, **chat)
            want_chat = ref.chat.completions.create(model=MODEL, temperature=0, **chat)
            assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
            n = want_chat.usage.prompt_tokens
            computed += n - (n - 1) // BS * BS
        decode = pd_stats(roles["decode"])
        assert decode["decode_requests"] == 5 and decode["decode_recomputed_tokens"] == 0
        assert decode["engine_computed_prompt_tokens"] == computed
        assert pd_stats(roles["prefill"])["prefill_requests"] == 5
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=60) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "Traceback" not in log_path.read_text()


def lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []
