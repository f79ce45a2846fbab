"""Per-tenant limits of ``kvtier serve``: requests in flight and a share of the KV cache.

A real uvicorn server runs the tiny random model on loopback, with API keys
of three tenants and one key without a tenant. Checked: a tenant at its
request limit gets 429 with ``Retry-After`` and OpenAI's error body while
another tenant is served; its count comes back when its requests finish,
fail after admission, are cancelled, or their client disconnects mid-stream;
a tenant holding its share of the KV blocks is refused; the anonymous tenant
is one tenant; the counts show in ``/v1/cache/stats`` (the caller's own) and
``/admin/tenants`` (names, never keys), refusals in ``/metrics``; bad flag
values are ConfigErrors that name the flag. The bookkeeping is checked by a
hypothesis state machine, and the worker's ``on_leave`` by a real worker.

The engine is held still where a test needs requests to stay in flight: a
``worker.call`` that blocks keeps the engine thread between two steps, so
requests are admitted and queued but none advances.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)
from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.cli import build_parser, main  # noqa: E402
from kvtier.cli.serve_config import server_limits  # noqa: E402
from kvtier.engine import EngineWorker  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server import create_app  # noqa: E402
from kvtier.server.auth import ApiKey, ServerAuth  # noqa: E402
from kvtier.server.limits import ServerLimits  # noqa: E402
from kvtier.server.tenant_limits import (  # noqa: E402
    TenantCounter,
    TenantLimit,
    TenantLimits,
    Ticket,
    build_tenant_limits,
    parse_tenant_limit,
)

ALPHA = "sk-alpha-0123456789"
BETA = "sk-beta-0123456789"
GAMMA = "sk-gamma-0123456789"
ANON = "sk-anon-0123456789"
ADMIN = "admin-0123456789"
KEYS = (ALPHA, BETA, GAMMA, ANON, ADMIN)

AUTH = ServerAuth(
    (ApiKey(ALPHA, "alpha"), ApiKey(BETA, "beta"), ApiKey(GAMMA, "gamma"), ApiKey(ANON)),
    admin_key=ADMIN,
)
NUM_BLOCKS = 64
#: gamma may hold a tenth of the blocks (6.4 of 64); every tenant may have one request in
#: flight but beta (three) and gamma (four).
LIMITS = ServerLimits(
    tenants=build_tenant_limits(
        1, None, ["beta:max_requests=3", "gamma:max_requests=4,max_kv_fraction=0.1"]
    )
)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = tiny_engine(num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=4)
    with serving(engine, auth=AUTH, limits=LIMITS) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


def post(server: Server, key: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    return httpx.post(f"{server.base}{path}", json=body, headers=bearer(key), timeout=90)


def in_flight(server: Server) -> dict[str, Any]:
    """``/admin/tenants``: answered without the engine thread, so it works while it is held."""
    r = httpx.get(f"{server.base}/admin/tenants", headers=bearer(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def count(server: Server, tenant: str | None) -> int:
    data = in_flight(server)
    if tenant is None:
        return int(data["anonymous"]["in_flight"])
    return int(data["tenants"][tenant]["in_flight"])


def wait_for(what: Callable[[], bool], why: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not what():
        assert time.monotonic() < deadline, f"gave up waiting: {why}"
        time.sleep(0.02)


@contextmanager
def engine_held(server: Server) -> Iterator[None]:
    """Keep the engine thread between two steps for the ``with`` body."""
    entered, release = threading.Event(), threading.Event()

    def hold(engine: Any) -> None:
        entered.set()
        release.wait(DEADLINE_S)

    t = threading.Thread(target=server.worker.call, args=(hold, DEADLINE_S * 2), daemon=True)
    t.start()
    assert entered.wait(DEADLINE_S)
    try:
        yield
    finally:
        release.set()
        t.join(DEADLINE_S)


@contextmanager
def no_eos(server: Server) -> Iterator[None]:
    """The random model cannot end a request early: it runs to its ``max_tokens``."""
    engine = server.worker.engine
    eos = engine.eos_token_ids
    engine.eos_token_ids = frozenset()
    try:
        yield
    finally:
        engine.eos_token_ids = eos


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    return t, box


def assert_rate_limited(r: Any, needle: str) -> dict[str, Any]:
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert needle in err["message"]
    return err


def rejected(server: Server, reason: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(f'kvtier_rejected_requests_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no kvtier_rejected_requests_total for {reason} in /metrics")


# -- the request limit ----------------------------------------------------------------------


def test_a_tenant_at_its_limit_gets_429_while_another_is_served(server: Server) -> None:
    before = rejected(server, "tenant_max_requests")
    with engine_held(server):
        first, first_box = in_background(lambda: post(server, ALPHA, chat_body("first")))
        wait_for(lambda: count(server, "alpha") == 1, "alpha's first request admitted")
        assert_rate_limited(post(server, ALPHA, chat_body("second")), "tenant 'alpha'")
        # beta has a limit of its own, and alpha's full count is nothing to it.
        other, other_box = in_background(lambda: post(server, BETA, chat_body("beta's")))
        wait_for(lambda: count(server, "beta") == 1, "beta's request admitted")
        assert count(server, "alpha") == 1
    first.join(DEADLINE_S)
    other.join(DEADLINE_S)
    assert first_box[0].status_code == 200 and other_box[0].status_code == 200
    wait_for(lambda: count(server, "alpha") == 0, "alpha's count released")
    assert count(server, "beta") == 0
    assert post(server, ALPHA, chat_body("again")).status_code == 200
    assert rejected(server, "tenant_max_requests") == before + 1


def test_the_anonymous_tenant_is_one_tenant(server: Server) -> None:
    with engine_held(server):
        first, box = in_background(
            lambda: post(
                server, ANON, {"model": MODEL, "prompt": "a", "max_tokens": 2}, "/v1/completions"
            )
        )
        wait_for(lambda: count(server, None) == 1, "the anonymous request admitted")
        r = post(server, ANON, {"model": MODEL, "prompt": "b", "max_tokens": 2}, "/v1/completions")
        assert_rate_limited(r, "the anonymous tenant")
    first.join(DEADLINE_S)
    assert box[0].status_code == 200
    wait_for(lambda: count(server, None) == 0, "the anonymous count released")


def test_a_request_refused_after_admission_is_released(server: Server) -> None:
    # Token ids are admitted first and refused by the engine's checks: past the context.
    body = {"model": MODEL, "prompt": [40] * 600, "max_tokens": 1}
    for _ in range(3):  # a leak would refuse the second with 429
        r = post(server, ALPHA, body, "/v1/completions")
        assert r.status_code == 400, r.text
    assert count(server, "alpha") == 0
    assert post(server, ALPHA, chat_body("after the failures")).status_code == 200


def _stream(server: Server, key: str, content: str, max_tokens: int) -> Any:
    client = httpx.Client(timeout=90)
    request = client.build_request(
        "POST",
        f"{server.base}/v1/chat/completions",
        json=chat_body(content, max_tokens=max_tokens, stream=True),
        headers=bearer(key),
    )
    return client, client.send(request, stream=True)


def _finished(server: Server) -> dict[str, int]:
    r = httpx.get(f"{server.base}/v1/cache/stats", headers=bearer(BETA), timeout=30)
    finished: dict[str, int] = r.json()["engine"]["finished"]
    return finished


def test_a_client_that_disconnects_mid_stream_releases_its_count(server: Server) -> None:
    aborted = _finished(server).get("abort", 0)
    with no_eos(server):
        client, response = _stream(server, ALPHA, "disconnect me", 400)
        try:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert count(server, "alpha") == 1
            assert_rate_limited(post(server, ALPHA, chat_body("while streaming")), "'alpha'")
        finally:
            response.close()
            client.close()
        wait_for(lambda: count(server, "alpha") == 0, "the count released after the disconnect")
    assert _finished(server).get("abort", 0) == aborted + 1
    assert post(server, ALPHA, chat_body("after the disconnect")).status_code == 200


def test_a_cancelled_request_releases_its_count(server: Server) -> None:
    with no_eos(server):
        client, response = _stream(server, ALPHA, "cancel me", 400)
        try:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            rows = httpx.get(
                f"{server.base}/admin/requests", headers=bearer(ADMIN), timeout=30
            ).json()["requests"]
            (rid,) = {row["request_id"] for row in rows}
            with engine_held(server):  # the request cannot finish on its own meanwhile
                r = httpx.post(
                    f"{server.base}/admin/requests/{rid}/cancel", headers=bearer(ADMIN), timeout=30
                )
                assert r.status_code == 200
                assert count(server, "alpha") == 1
            events = [line for line in lines if line.startswith("data: ")]
        finally:
            response.close()
            client.close()
    assert any("cancelled" in e for e in events), events[-3:]
    wait_for(lambda: count(server, "alpha") == 0, "the count released after the cancel")
    assert post(server, ALPHA, chat_body("after the cancel")).status_code == 200


# -- the KV share ---------------------------------------------------------------------------


def test_a_tenant_holding_its_kv_share_gets_429(server: Server) -> None:
    before = rejected(server, "tenant_kv_share")
    long = "a long prompt that fills several blocks " * 5  # about 13 of the 64 blocks
    with no_eos(server):
        client, response = _stream(server, GAMMA, long, 250)
        try:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            r = post(server, GAMMA, chat_body("one more"))
            err = assert_rate_limited(r, "--tenant-max-kv-fraction")
            assert "of the 64 KV cache blocks" in err["message"]
            # Only gamma's share is full: beta is served.
            assert post(server, BETA, chat_body("beta meanwhile")).status_code == 200
        finally:
            response.close()
            client.close()
    wait_for(lambda: count(server, "gamma") == 0, "gamma's count released")
    assert post(server, GAMMA, chat_body("gamma again")).status_code == 200
    assert rejected(server, "tenant_kv_share") == before + 1


# -- what the server shows ------------------------------------------------------------------


def test_stats_show_the_callers_own_tenant_and_admin_shows_names_only(server: Server) -> None:
    r = httpx.get(f"{server.base}/v1/cache/stats", headers=bearer(BETA), timeout=30)
    tenant = r.json()["tenant"]
    assert tenant == {"name": "beta", "in_flight": 0, "max_requests": 3, "max_kv_fraction": None}
    assert "alpha" not in r.text and "gamma" not in r.text
    anon = httpx.get(f"{server.base}/v1/cache/stats", headers=bearer(ANON), timeout=30)
    assert anon.json()["tenant"]["name"] is None
    data = in_flight(server)
    assert sorted(data["tenants"]) == ["alpha", "beta", "gamma"]
    assert data["tenants"]["gamma"]["max_kv_fraction"] == 0.1
    assert data["anonymous"]["max_requests"] == 1
    text = json.dumps(data)
    assert not any(key in text for key in KEYS)
    # The admin view needs the admin key, as every /admin endpoint does.
    assert httpx.get(f"{server.base}/admin/tenants", headers=bearer(ALPHA)).status_code == 403


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--tenant-max-requests", "0"], "--tenant-max-requests"),
        (["--tenant-max-requests", "-3"], "positive number of requests"),
        (["--tenant-max-kv-fraction", "0"], "--tenant-max-kv-fraction"),
        (["--tenant-max-kv-fraction", "1.5"], "in (0, 1]"),
        (["--tenant-max-kv-fraction", "nan"], "in (0, 1]"),
        (["--tenant-limit", "alpha"], "TENANT:max_requests=N,max_kv_fraction=F"),
        (["--tenant-limit", "alpha:"], "TENANT:max_requests=N,max_kv_fraction=F"),
        (["--tenant-limit", "al pha:max_requests=2"], "must be 1 to 64 letters"),
        (["--tenant-limit", "alpha:max_reqs=2"], "unknown setting 'max_reqs'"),
        (["--tenant-limit", "alpha:max_requests=two"], "not a number"),
        (["--tenant-limit", "alpha:max_requests=0"], "tenant 'alpha'"),
        (["--tenant-limit", "alpha:max_kv_fraction=2"], "in (0, 1]"),
        (["--tenant-limit", "alpha:max_requests=1,max_requests=2"], "given twice"),
        (
            ["--tenant-limit", "alpha:max_requests=1", "--tenant-limit", "alpha:max_requests=2"],
            "given twice",
        ),
    ],
)
def test_bad_flag_values_are_config_errors_naming_the_flag(flags: list[str], needle: str) -> None:
    parser, _ = build_parser()
    args = parser.parse_args(["serve", *flags])
    with pytest.raises(ConfigError) as info:
        server_limits(args)
    assert needle in str(info.value)


def test_a_bad_flag_stops_kvtier_serve_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--tenant-max-kv-fraction", "1.5"]) == 1
    err = capsys.readouterr().err
    assert "--tenant-max-kv-fraction" in err and "Traceback" not in err


def test_flags_become_limits_and_an_override_keeps_the_other_default() -> None:
    parser, _ = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--tenant-max-requests", "4",
            "--tenant-max-kv-fraction", "0.5",
            "--tenant-limit", "alpha:max_requests=16",
        ]
    )  # fmt: skip
    tenants = server_limits(args).tenants
    assert tenants.for_tenant(None) == TenantLimit(4, 0.5)
    assert tenants.for_tenant("beta") == TenantLimit(4, 0.5)
    assert tenants.for_tenant("alpha") == TenantLimit(16, 0.5)
    assert not server_limits(parser.parse_args(["serve"])).tenants.enabled
    assert hash(server_limits(args)) == hash(server_limits(args))  # still a hashable value
    assert tenants.describe() == (
        "per-tenant limits: 4 requests, 0.5 of the KV cache per tenant; 1 tenant override(s)"
    )


def test_a_config_file_sets_the_limits(tmp_path: Path) -> None:
    from kvtier.cli.config_file import apply_config_file

    path = tmp_path / "serve.toml"
    path.write_text(
        "tenant_max_requests = 2\n"
        'tenant_limit = ["alpha:max_kv_fraction=0.75", "beta:max_requests=5"]\n'
    )
    parser, serve = build_parser()
    argv = ["serve", "--config", str(path), "--tenant-max-kv-fraction", "0.5"]
    args = apply_config_file(parser, serve, argv, parser.parse_args(argv))
    tenants = server_limits(args).tenants
    assert tenants.for_tenant(None) == TenantLimit(2, 0.5)
    assert tenants.for_tenant("alpha") == TenantLimit(2, 0.75)
    assert tenants.for_tenant("beta") == TenantLimit(5, 0.5)


def test_an_override_for_a_tenant_no_key_has_is_refused() -> None:
    limits = ServerLimits(tenants=TenantLimits(overrides={"alhpa": TenantLimit(2)}))
    worker = EngineWorker(tiny_engine(num_blocks=16, block_size=16))
    with pytest.raises(ConfigError, match="no API key belongs to"):
        create_app(worker, served_model_name=MODEL, limits=limits, auth=AUTH)
    with pytest.raises(ConfigError, match="tenants of the keys: none"):
        create_app(worker, served_model_name=MODEL, limits=limits)


def test_parse_tenant_limit_reads_both_settings() -> None:
    assert parse_tenant_limit(" team-a.1:max_kv_fraction=0.25 , max_requests=3 ") == (
        "team-a.1",
        TenantLimit(3, 0.25),
    )


# -- the worker tells when a request leaves -------------------------------------------------


def test_on_leave_fires_once_when_a_request_moves_away_or_is_closed() -> None:
    worker = EngineWorker(tiny_engine(num_blocks=16, block_size=16)).start()
    try:
        calls: list[str] = []
        moved = worker.open_handle()
        worker.on_leave(moved.request_id, lambda: calls.append("moved"))
        worker.forward(moved.request_id, lambda: None)
        assert calls == ["moved"]
        worker.on_leave(moved.request_id, lambda: calls.append("late"))  # gone: at once
        assert calls == ["moved", "late"]
        closed = worker.open_handle()
        worker.on_leave(closed.request_id, lambda: calls.append("closed"))
        worker.close_handle(closed)
        worker.close_handle(closed)
        assert calls == ["moved", "late", "closed"]
        worker.on_leave("req-unknown", lambda: calls.append("unknown"))
        assert calls[-1] == "unknown"
    finally:
        worker.stop()


def test_on_leave_fires_when_a_submitted_request_finishes() -> None:
    from kvtier.engine import SamplingParams

    worker = EngineWorker(tiny_engine(num_blocks=16, block_size=16)).start()
    try:
        left = threading.Event()
        handle = worker.submit([40, 41, 42], SamplingParams(max_tokens=2, temperature=0))
        worker.on_leave(handle.request_id, left.set)
        handle.result()
        assert left.wait(DEADLINE_S)
        assert worker.blocks_held([handle.request_id]) == (0, 16)
    finally:
        worker.stop()


# -- the bookkeeping, as a state machine ----------------------------------------------------

TENANTS = st.sampled_from([None, "a", "b"])
LIMIT = {None: 2, "a": 1, "b": None}


class CounterMachine(RuleBasedStateMachine):
    """Any sequence of admissions, releases (of held, released and foreign tickets) and
    bindings keeps every count equal to the tickets held: never negative, never past the
    tenant's limit."""

    held = Bundle("held")
    released = Bundle("released")

    def __init__(self) -> None:
        super().__init__()
        self.counter = TenantCounter()
        self.model: dict[int, Ticket] = {}
        self.bound: dict[int, str] = {}

    @rule(target=held, tenant=TENANTS)
    def acquire(self, tenant: str | None) -> Any:
        n = sum(1 for t in self.model.values() if t.tenant == tenant)
        limit = LIMIT[tenant]
        ticket = self.counter.acquire(tenant, limit)
        if limit is not None and n >= limit:
            assert ticket is None
            return multiple()
        assert ticket is not None and ticket.id not in self.model
        self.model[ticket.id] = ticket
        return ticket

    @rule(target=released, ticket=consumes(held))
    def release(self, ticket: Ticket) -> Ticket:
        assert self.counter.release(ticket) is True
        del self.model[ticket.id]
        self.bound.pop(ticket.id, None)
        return ticket

    @rule(ticket=released)
    def release_again_is_a_no_op(self, ticket: Ticket) -> None:
        assert self.counter.release(ticket) is False
        assert self.counter.bind(ticket, "req-late") is False

    @rule(tenant=TENANTS, ident=st.integers(min_value=10**6, max_value=2 * 10**6))
    def release_a_foreign_ticket_is_a_no_op(self, tenant: str | None, ident: int) -> None:
        assert self.counter.release(Ticket(ident, tenant)) is False

    @rule(ticket=held, n=st.integers(min_value=1, max_value=99))
    def bind(self, ticket: Ticket, n: int) -> None:
        assert ticket.id in self.model
        assert self.counter.bind(ticket, f"req-{n}")
        self.bound[ticket.id] = f"req-{n}"

    @invariant()
    def counts_match_the_tickets_held(self) -> None:
        counts = self.counter.counts()
        for tenant in (None, "a", "b"):
            n = sum(1 for t in self.model.values() if t.tenant == tenant)
            assert self.counter.count(tenant) == n >= 0
            assert counts.get(tenant, 0) == n
            limit = LIMIT[tenant]
            assert limit is None or n <= limit
            want = sorted(r for i, r in self.bound.items() if self.model[i].tenant == tenant)
            assert sorted(self.counter.request_ids(tenant)) == want
        assert all(n > 0 for n in counts.values())


TestCounterMachine = CounterMachine.TestCase
TestCounterMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_concurrent_admissions_never_pass_the_limit() -> None:
    counter = TenantCounter()
    got: list[Ticket | None] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def admit() -> None:
        start.wait()
        for _ in range(200):
            t = counter.acquire("a", 3)
            with lock:
                got.append(t)
            if t is not None:
                assert counter.count("a") <= 3
                counter.release(t)

    threads = [threading.Thread(target=admit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.counts() == {}
    assert any(t is not None for t in got)
