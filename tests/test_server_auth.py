"""API keys, tenants, the admin key and TLS, over real HTTP on loopback.

A real uvicorn server runs the tiny random model. Checked: requests without
a key or with a wrong one are refused with OpenAI's 401 body, ``/health``
stays open, the admin endpoints are off unless an admin key is set and then
need it, a move to a server outside the allow-list is refused without any
connection, tenants (and cache salts) never hit each other's cached
prefixes, on the device or through a host tier, workflows are scoped by
tenant, and the server speaks https with a certificate made here.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server.auth import ApiKey, ServerAuth, build_auth, parse_api_key  # noqa: E402
from kvtier.server.tenants import effective_salt  # noqa: E402

ALPHA = "sk-alpha-0123456789"
BETA = "sk-beta-0123456789"
SHARED = "sk-shared-0123456789"
ADMIN = "admin-0123456789"

AUTH = ServerAuth(
    (ApiKey(ALPHA, "alpha"), ApiKey(BETA, "beta"), ApiKey(SHARED)),
    admin_key=ADMIN,
    migrate_peers=("http://127.0.0.1:1",),
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving(tiny_engine(num_blocks=256, block_size=16), auth=AUTH) as s:
        yield s


@pytest.fixture(scope="module")
def open_server() -> Iterator[Server]:
    with serving(tiny_engine(num_blocks=64, block_size=16)) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


def long_prompt() -> str:
    """A prompt no earlier request shares, several blocks long."""
    return f"{uuid.uuid4().hex} " + "the same long question about caches " * 8


def cached(server: Server, key: str, content: str, salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    r = server.client(key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
        temperature=0,
        extra_body=extra,
    )
    assert r.usage.prompt_tokens > 32
    return int(r.usage.prompt_tokens_details.cached_tokens)


# -- API keys ------------------------------------------------------------------------------


def _is_401(r: Any) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key" and error["param"] is None


def test_no_key_is_401_with_openais_error_body(server: Server) -> None:
    r = httpx.post(f"{server.v1}/chat/completions", json=chat_body("hi"), timeout=30)
    _is_401(r)
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    _is_401(httpx.get(f"{server.v1}/models", timeout=30))
    _is_401(httpx.get(f"{server.v1}/cache/stats", timeout=30))
    _is_401(httpx.get(f"{server.base}/v1/nowhere", timeout=30))  # no route is revealed
    _is_401(httpx.get(f"{server.v1}/models", headers={"Authorization": ALPHA}, timeout=30))


def test_a_wrong_key_is_401_and_never_echoed(server: Server) -> None:
    for key in ("sk-wrong-key", ALPHA + "x", ALPHA[:-1], ADMIN):
        r = httpx.post(
            f"{server.v1}/chat/completions", json=chat_body("hi"), headers=bearer(key), timeout=30
        )
        _is_401(r)
        assert key not in r.text
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong-key").models.list()


def test_the_right_key_is_served(server: Server) -> None:
    for key in (ALPHA, BETA, SHARED):
        r = server.client(key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
        assert r.choices[0].finish_reason in ("stop", "length")
    r = httpx.get(f"{server.v1}/models", headers={"authorization": f"bearer {BETA}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_health_and_metrics_stay_open(server: Server) -> None:
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.base}/metrics", timeout=30).status_code == 200


def test_metrics_can_require_a_key() -> None:
    auth = ServerAuth((ApiKey(ALPHA),), metrics_require_key=True)
    with serving(tiny_engine(num_blocks=32, block_size=16), auth=auth) as s:
        _is_401(httpx.get(f"{s.base}/metrics", timeout=30))
        assert httpx.get(f"{s.base}/metrics", headers=bearer(ALPHA), timeout=30).status_code == 200
        assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200


def test_without_keys_the_server_is_open(open_server: Server) -> None:
    r = httpx.post(f"{open_server.v1}/chat/completions", json=chat_body("hi"), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{open_server.v1}/chat/completions",
        json=chat_body("hi"),
        headers=bearer("anything"),
        timeout=60,
    )
    assert r.status_code == 200, r.text


# -- admin ---------------------------------------------------------------------------------


def test_admin_endpoints_are_off_without_an_admin_key(open_server: Server) -> None:
    for method, path in (
        ("GET", "/admin/requests"),
        ("POST", "/admin/migrate"),
        ("POST", "/admin/migrate/accept"),
        ("POST", "/admin/requests/req-1/cancel"),
    ):
        r = httpx.request(method, f"{open_server.base}{path}", json={}, timeout=30)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["message"].startswith("Invalid URL")


def test_admin_endpoints_need_the_admin_key(server: Server) -> None:
    url = f"{server.base}/admin/requests"
    _is_401(httpx.get(url, timeout=30))
    _is_401(httpx.get(url, headers=bearer("sk-wrong-key"), timeout=30))
    r = httpx.get(url, headers=bearer(ALPHA), timeout=30)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.get(url, headers=bearer(ADMIN), timeout=30)
    assert r.status_code == 200 and r.json()["requests"] == []
    # The accepting side of a move needs it too.
    accept = f"{server.base}/admin/migrate/accept"
    _is_401(httpx.post(accept, json={"version": 1}, timeout=30))
    assert httpx.post(accept, json={}, headers=bearer(BETA), timeout=30).status_code == 403
    r = httpx.post(accept, json={"version": 99}, headers=bearer(ADMIN), timeout=30)
    assert r.status_code == 409 and "version" in r.json()["error"]["message"]


def test_a_move_outside_the_allow_list_is_403_and_connects_nowhere(server: Server) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.5)
        target = f"http://127.0.0.1:{listener.getsockname()[1]}"
        for t in (target, target + "/", "http://127.0.0.1:1.evil.example", "file:///etc/passwd"):
            r = httpx.post(
                f"{server.base}/admin/migrate",
                json={"request_id": "req-1", "target": t},
                headers=bearer(ADMIN),
                timeout=30,
            )
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["code"] == "migration_peer_not_allowed" and error["param"] == "target"
            assert "http://127.0.0.1:1" in error["message"]  # the allowed peers are named
        with pytest.raises(TimeoutError):
            listener.accept()
    # An allowed peer gets as far as the request itself (not on this engine: 409).
    r = httpx.post(
        f"{server.base}/admin/migrate",
        json={"request_id": "req-none", "target": "HTTP://127.0.0.1:1/"},
        headers=bearer(ADMIN),
        timeout=30,
    )
    assert r.status_code == 409, r.text


# -- tenants and cache salts ----------------------------------------------------------------


def test_tenants_never_hit_each_others_cached_prefixes(server: Server) -> None:
    content = long_prompt()
    assert cached(server, ALPHA, content) == 0
    assert cached(server, ALPHA, content) > 0  # the same tenant keeps its hits
    assert cached(server, BETA, content) == 0
    assert cached(server, SHARED, content) == 0  # a key without a tenant: no tenant's cache
    assert cached(server, BETA, content) > 0


def test_cache_salts_under_one_key_never_share(server: Server) -> None:
    content = long_prompt()
    assert cached(server, SHARED, content, salt="one") == 0
    assert cached(server, SHARED, content, salt="one") > 0
    assert cached(server, SHARED, content, salt="two") == 0
    assert cached(server, SHARED, content) == 0
    # A tenant's salt is scoped by its tenant too.
    assert cached(server, ALPHA, content, salt="one") == 0
    assert cached(server, ALPHA, content, salt="one") > 0


def test_completions_take_a_cache_salt(server: Server) -> None:
    prompt = long_prompt()

    def complete(salt: str) -> int:
        r = server.client(SHARED).completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        return int(r.usage.prompt_tokens_details.cached_tokens)

    assert complete("a") == 0
    assert complete("a") > 0
    assert complete("b") == 0


@pytest.mark.parametrize("salt", ["", 42, None, ["x"], "a\x1fb", "tab\there", "x" * 257])
def test_a_bad_cache_salt_is_400_naming_it(server: Server, salt: Any) -> None:
    body = chat_body("hello", cache_salt=salt)
    if salt is None:
        body["cache_salt"] = None  # null: no salt, accepted
    for path, b in (
        ("chat/completions", body),
        ("completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1, "cache_salt": salt}),
    ):
        r = httpx.post(f"{server.v1}/{path}", json=b, headers=bearer(ALPHA), timeout=60)
        if salt is None:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


def test_effective_salts_never_collide() -> None:
    salts = [
        effective_salt(None, None),
        effective_salt(None, "s"),
        effective_salt("a", None),
        effective_salt("a", "s"),
        effective_salt("b", "s"),
        effective_salt("a", "x" * 256),
        effective_salt("a", "x" * 255 + "y"),
    ]
    assert len(set(salts)) == len(salts)
    assert all(s is None or len(s) <= 256 for s in salts)


def test_tenants_stay_apart_through_a_host_tier() -> None:
    from kvtier.offload.config import TierSpec

    engine = tiny_engine(num_blocks=24, block_size=4, tiers=[TierSpec("host", 8 * 2**20)])
    auth = ServerAuth((ApiKey(ALPHA, "alpha"), ApiKey(BETA, "beta")))
    prompt = [(7 * i) % 50 + 3 for i in range(40)]

    def complete(s: Server, key: str, ids: list[int]) -> Any:
        r = s.client(key).completions.create(model=MODEL, prompt=ids, max_tokens=1)
        return r.usage.prompt_tokens_details.cached_tokens

    with serving(engine, auth=auth) as s:
        assert complete(s, ALPHA, prompt) == 0
        for j in range(4):  # evict the prompt's blocks from the device, into the host tier
            complete(s, ALPHA, [(11 * i + j) % 50 + 3 for i in range(40)])
        stats = httpx.get(f"{s.v1}/cache/stats", headers=bearer(ALPHA), timeout=30).json()
        assert stats["engine"]["loaded_prompt_tokens"] == 0
        assert complete(s, BETA, prompt) == 0
        assert complete(s, ALPHA, prompt) > 0
        stats = httpx.get(f"{s.v1}/cache/stats", headers=bearer(ALPHA), timeout=30).json()
        assert stats["engine"]["loaded_prompt_tokens"] > 0  # alpha's hit came from the tier


def test_tenants_never_share_cached_image_encodings() -> None:
    from tiny_vlm import png_bytes, tiny_llava

    from kvtier.engine import Engine
    from kvtier.mm.images import image_data_url

    model, tok = tiny_llava()
    engine = Engine(model, tok, model_id=MODEL, num_blocks=256, block_size=4)
    auth = ServerAuth((ApiKey(ALPHA, "alpha"), ApiKey(BETA, "beta"), ApiKey(SHARED)))
    image = {"type": "image_url", "image_url": {"url": image_data_url(png_bytes(1), "image/png")}}

    def ask(s: Server, key: str, text: str, salt: str | None = None) -> dict[str, int]:
        s.client(key).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": text}]}],
            max_tokens=1,
            extra_body=None if salt is None else {"cache_salt": salt},
        )
        stats = httpx.get(f"{s.v1}/cache/stats", headers=bearer(key), timeout=30).json()
        return {k: stats["encoder_cache"][k] for k in ("hits", "misses")}

    with serving(engine, MODEL, auth=auth) as s:
        assert ask(s, ALPHA, "one") == {"hits": 0, "misses": 1}
        assert ask(s, ALPHA, "two") == {"hits": 1, "misses": 1}  # the tenant's own entry
        assert ask(s, BETA, "one") == {"hits": 1, "misses": 2}  # not alpha's
        assert ask(s, SHARED, "one") == {"hits": 1, "misses": 3}
        assert ask(s, SHARED, "two") == {"hits": 2, "misses": 3}
        assert ask(s, SHARED, "one", salt="s") == {"hits": 2, "misses": 4}


# -- workflows -----------------------------------------------------------------------------


def test_workflows_are_scoped_by_tenant(server: Server) -> None:
    spec = {"workflow_id": "wf", "agents": [{"agent_id": "a", "entry": True, "prefix": "x " * 40}]}
    url = f"{server.v1}/workflows"
    r = httpx.post(url, json=spec, headers=bearer(ALPHA), timeout=30)
    assert r.status_code == 200 and r.json()["workflow_id"] == "wf", r.text
    assert httpx.get(f"{url}/wf", headers=bearer(ALPHA), timeout=30).status_code == 200
    for key in (BETA, SHARED):
        assert httpx.get(f"{url}/wf", headers=bearer(key), timeout=30).status_code == 404
        r = httpx.post(
            f"{url}/wf/progress", json={"agent_id": "a"}, headers=bearer(key), timeout=30
        )
        assert r.status_code == 404
        assert httpx.delete(f"{url}/wf", headers=bearer(key), timeout=30).status_code == 404
    # Beta's own "wf" is another workflow.
    other = {"workflow_id": "wf", "agents": [{"agent_id": "b", "entry": True}]}
    assert httpx.post(url, json=other, headers=bearer(BETA), timeout=30).status_code == 200
    got = httpx.get(f"{url}/wf", headers=bearer(ALPHA), timeout=30).json()
    assert [a["agent_id"] for a in got["agents"]] == ["a"] and got["workflow_id"] == "wf"
    # A tenant's hinted request reports to its own workflow only.
    r = server.client(ALPHA).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "step"}],
        max_tokens=1,
        extra_body={"kvtier": {"workflow_id": "wf", "agent_id": "a", "step": 1}},
    )
    assert r.choices
    # An id reaching into a tenant's namespace is refused.
    bad = {"workflow_id": "alpha\x1fwf", "agents": [{"agent_id": "a", "entry": True}]}
    r = httpx.post(url, json=bad, headers=bearer(SHARED), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "workflow_id"
    assert httpx.delete(f"{url}/wf", headers=bearer(ALPHA), timeout=30).status_code == 200
    assert httpx.get(f"{url}/wf", headers=bearer(BETA), timeout=30).status_code == 200


def test_a_tenants_workflow_prefix_is_keyed_like_its_requests(server: Server) -> None:
    prefix = "You are a careful planner. " * 6
    spec = {"workflow_id": "keys", "agents": [{"agent_id": "p", "entry": True, "prefix": prefix}]}
    r = httpx.post(f"{server.v1}/workflows", json=spec, headers=bearer(BETA), timeout=30)
    assert r.status_code == 200, r.text
    server.client(BETA).completions.create(model=MODEL, prompt=prefix, max_tokens=1)

    def held(engine: Any) -> bool:
        state = engine.agents.tracker.get("beta\x1fkeys")
        keys = state.spec.agents[0].prefix_keys
        assert keys
        return all(engine.manager.pool.cached_block(k) is not None for k in keys)

    assert server.worker.call(held)


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_serves_https_with_a_self_signed_certificate(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    auth = ServerAuth((ApiKey(ALPHA),))
    with serving(tiny_engine(num_blocks=32, block_size=16), auth=auth, tls=tls) as s:
        assert s.base.startswith("https://")
        verify = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=verify, timeout=60) as http:
            assert http.get(f"{s.base}/health").status_code == 200
            r = http.post(
                f"{s.v1}/chat/completions", json=chat_body("hello"), headers=bearer(ALPHA)
            )
            assert r.status_code == 200, r.text
            _is_401(http.get(f"{s.v1}/models"))
            client = s.client(ALPHA, http_client=http)
            assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
            httpx.get(f"{s.base}/health", timeout=10)


# -- configuration ---------------------------------------------------------------------------


def test_key_syntax_files_and_environment(tmp_path: Path) -> None:
    assert parse_api_key("k1") == ApiKey("k1")
    assert parse_api_key("k1:team-a") == ApiKey("k1", "team-a")
    path = tmp_path / "keys"
    path.write_text("# keys\nk2 team-b\n\nk3\n")
    path.chmod(0o600)
    auth, warnings = build_auth(
        ["k1:team-a"], [str(path)], env={"KVTIER_API_KEY": "k4:team-c"}, admin_key="secret-qq"
    )
    assert warnings == []
    assert [(k.key, k.tenant) for k in auth.api_keys] == [
        ("k1", "team-a"), ("k2", "team-b"), ("k3", None), ("k4", "team-c"),
    ]  # fmt: skip
    assert auth.identify("k3") == ApiKey("k3") and auth.identify("k5") is None
    assert auth.is_admin("secret-qq") and not auth.is_admin("k1")
    banner = "\n".join(auth.describe())
    assert "API keys: 4 configured; tenants: team-a, team-b, team-c" in banner
    assert not any(k in banner for k in ("k1", "k2", "k3", "k4", "secret-qq"))
    assert "k1" not in repr(auth) and "secret-qq" not in repr(auth)
    path.chmod(0o644)
    _, warnings = build_auth([], [str(path)], env={})
    assert any("chmod 600" in w for w in warnings)
    opened, _ = build_auth([], [], env={})
    assert opened.open and "open to anyone" in opened.describe()[0]
    assert "off" in opened.describe()[2]


@pytest.mark.parametrize(
    ("keys", "kwargs", "needle"),
    [
        (["k1", "k1:t"], {}, "given twice"),
        (["k1:bad tenant!"], {}, "tenant"),
        (["has space"], {}, "printable ASCII"),
        ([":t"], {}, "must not be empty"),
        (["k1"], {"admin_key": "k1"}, "admin key must differ"),
        ([], {"metrics_require_key": True}, "--metrics-require-key needs"),
        (["k1"], {"migrate_peers": ["ftp://x"]}, "http(s)://host:port"),
    ],
)
def test_bad_key_settings_are_refused(keys: list[str], kwargs: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")) as info:
        build_auth(keys, [], env={}, **kwargs)
    assert "k1" not in str(info.value) and "has space" not in str(info.value)


# -- kvtier serve ----------------------------------------------------------------------------


def test_serve_help_explains_the_access_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--api-key", "--api-key-file", "--admin-key", "--migrate-peer",
                 "--metrics-require-key", "--ssl-certfile", "--ssl-keyfile", "KVTIER_API_KEY",
                 "KEY:TENANT", "cache_salt"):  # fmt: skip
        assert flag in out, flag


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ssl-keyfile", "/nonexistent.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "/nonexistent.pem"], "cannot load the TLS certificate"),
        (["--api-key", "k:bad tenant"], "tenant"),
        (["--api-key-file", "/nonexistent-keys"], "cannot read the API key file"),
        (["--metrics-require-key"], "--metrics-require-key needs"),
    ],
)
def test_bad_access_flags_fail_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    from kvtier.cli import main

    assert main(["serve", "--port", "0", "--pressure", "off", *args]) == 1
    _, err = capsys.readouterr()
    assert needle in err and "loading" not in err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_kvtier_serve_with_keys_and_tls(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    import os
    import signal

    from cli_launch import kvtier_cli, read_banner
    from tiny_model import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{BETA} beta\n")
    keys.chmod(0o600)
    cert, key = certificate
    proc = subprocess.Popen(
        kvtier_cli("serve", "--model", str(tmp_path), "--served-model-name", MODEL,
                   "--port", "0", "--num-blocks", "64", "--pressure", "off",
                   "--log-level", "warning", "--api-key", f"{ALPHA}:alpha",
                   "--api-key-file", str(keys), "--admin-key", ADMIN,
                   "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVTIER_API_KEY": SHARED},
    )  # fmt: skip
    try:
        lines = read_banner(proc)
        banner = "".join(lines)
        assert "API keys: 3 configured; tenants: alpha, beta" in banner
        assert "admin endpoints (/admin/...): on" in banner and "TLS: on" in banner
        assert not any(k in banner for k in (ALPHA, BETA, SHARED, ADMIN))
        url = lines[-1].split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("https://127.0.0.1:")
        verify = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=verify, timeout=60) as http:
            _is_401(http.get(f"{url}/models"))
            for k in (ALPHA, BETA, SHARED):
                assert http.get(f"{url}/models", headers=bearer(k)).status_code == 200
            base = url.removesuffix("/v1")
            assert http.get(f"{base}/admin/requests", headers=bearer(ADMIN)).status_code == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert not any(k in out + err for k in (ALPHA, BETA, SHARED, ADMIN))
