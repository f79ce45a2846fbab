"""Agent hints and workflows over HTTP: the official openai client against a real server."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import openai
import pytest
from serving import MODEL, serving
from tiny_model import tiny_engine

from kvtier.agents.policy import workflow_policy_of
from kvtier.agents.ranks import PINNED
from kvtier.errors import ConfigError


@pytest.fixture(scope="module")
def server() -> Any:
    eng = tiny_engine(block_size=4, num_blocks=128, policy="workflow")
    with serving(eng) as srv:
        yield srv


def chat(client: Any, text: str, kvtier: dict[str, Any] | None = None) -> Any:
    extra = {"kvtier": kvtier} if kvtier is not None else None
    return client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "agent prompt " * 4},
            {"role": "user", "content": text},
        ],
        max_tokens=3,
        temperature=0.0,
        extra_body=extra,
    )


def test_workflows_are_registered_and_advanced_by_hinted_requests(server: Any) -> None:
    base = server.base
    spec = {
        "workflow_id": "loop",
        "agents": [
            {"agent_id": "a", "after": ["c"], "entry": True,
             "prefix_messages": [{"role": "system", "content": "agent prompt " * 4}]},
            {"agent_id": "b", "after": ["a"], "prefix": "You are b."},
            {"agent_id": "c", "after": ["b"]},
        ],
    }  # fmt: skip
    r = httpx.post(f"{base}/v1/workflows", json=spec)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [a["steps_to_execution"] for a in body["agents"]] == [0, 1, 2]
    assert body["agents"][0]["prefix_blocks"] > 0
    client = server.client()
    plain = chat(client, "hello")
    hinted = chat(client, "hello", {"workflow_id": "loop", "agent_id": "a", "step": 0,
                                    "session_id": "s1", "cache_ttl_s": 60})  # fmt: skip
    # Hints change nothing in what is generated.
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    state = httpx.get(f"{base}/v1/workflows/loop").json()
    assert [a["steps_to_execution"] for a in state["agents"]] == [2, 0, 1]
    r = httpx.post(f"{base}/v1/workflows/loop/progress", json={"agent_id": "b"})
    assert [a["steps_to_execution"] for a in r.json()["agents"]] == [1, 2, 0]
    policy = workflow_policy_of(server.worker.engine.manager.pool.policy)
    assert policy is not None
    pinned = server.worker.call(
        lambda e: sum(policy.rank_of(k) == PINNED for k in e.manager.pool._cached)
    )
    assert pinned > 0, "the hinted request's blocks are pinned for its TTL"
    assert httpx.delete(f"{base}/v1/workflows/loop").status_code == 200
    assert httpx.get(f"{base}/v1/workflows/loop").status_code == 404


@pytest.mark.parametrize(
    ("kvtier", "param"),
    [
        ({"agentid": "x"}, "kvtier.agentid"),
        ({"step": "3", "workflow_id": "w", "agent_id": "a"}, "kvtier.step"),
        ({"reuse": "always"}, "kvtier.reuse"),
        ({"cache_ttl_s": True}, "kvtier.cache_ttl_s"),
        ({"session_id": 7}, "kvtier.session_id"),
        ("hints", "kvtier"),
    ],
)
def test_bad_hints_are_a_400_naming_the_field(server: Any, kvtier: Any, param: str) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "hi", kvtier)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]


def test_completions_take_hints_too(server: Any) -> None:
    r = httpx.post(
        f"{server.base}/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "kvtier": {"reuse": "never"}},
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server.base}/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "kvtier": {"bogus": 1}},
    )
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]


def test_bad_workflows_are_refused(server: Any) -> None:
    base = server.base
    for body, status, match in (
        ({"workflow_id": "w"}, 400, "agents"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "after": ["q"]}]}, 400, "'q'"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "prefix_messages": "x"}]}, 400,
         "prefix_messages"),
    ):  # fmt: skip
        r = httpx.post(f"{base}/v1/workflows", json=body)
        assert r.status_code == status and match in r.json()["error"]["message"], r.text
    r = httpx.post(f"{base}/v1/workflows/nope/progress", json={"agent_id": "a"})
    assert r.status_code == 404
    httpx.post(f"{base}/v1/workflows", json={"workflow_id": "w2", "agents": [{"agent_id": "a"}]})
    r = httpx.post(f"{base}/v1/workflows/w2/progress", json={"agent_id": "zz"})
    assert r.status_code == 400 and "not an agent" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/workflows/w2/progress", json={"agent_id": "a", "when": 1})
    assert r.status_code == 400


def test_serve_prefetch_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main
    from kvtier.cli.serve import add_parser, engine_config
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    # Without a tier the flag is refused before any model loads.
    assert main(["serve", "--prefetch-lookahead", "2", "--port", "0"]) == 1
    assert "add a tier" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefetch-lookahead", "2", "--prefetch-memory", "1MiB"])
    prefetch = engine_config(args).prefetch
    assert (prefetch.lookahead, prefetch.max_bytes) == (2, 2**20)
    eng = tiny_engine(
        block_size=4, num_blocks=32, policy="workflow", tiers=[Tier(HostStore(), 64)],
        prefetch=prefetch,
    )
    assert eng.agents.prefetcher is not None
    assert (eng.agents.prefetcher.lookahead, eng.agents.prefetcher.max_bytes) == (2, 2**20)
    eng.close()
    # The configuration itself refuses prefetch with no tier to bring blocks back from.
    with pytest.raises(ConfigError, match="add a tier"):
        tiny_engine(block_size=4, num_blocks=32, prefetch=prefetch)


def test_serve_session_prefetch_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main
    from kvtier.cli.serve import add_parser, engine_config
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    # Refused before any model loads: without a tier, without the workflow policy, and
    # with a lead that is no number of seconds.
    assert main(["serve", "--prefetch-session-lead", "1", "--port", "0"]) == 1
    assert "add a tier" in capsys.readouterr().err
    tier = ["--tier", "host:1MiB"]
    assert main(["serve", "--prefetch-session-lead", "1", *tier, "--port", "0"]) == 1
    assert "--policy workflow" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--prefetch-session-lead", "soon", "--policy", "workflow"])
    assert "--prefetch-session-lead" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefetch-session-lead", "1.5"])
    prefetch = engine_config(args).prefetch
    assert (prefetch.lookahead, prefetch.session_lead_s) == (0, 1.5)
    eng = tiny_engine(
        block_size=4, num_blocks=32, policy="workflow", tiers=[Tier(HostStore(), 64)],
        prefetch=prefetch,
    )
    assert eng.agents.prefetcher is not None and eng.agents.session_lead == 1.5
    eng.close()


def test_hints_on_completions_are_applied(server: Any) -> None:
    base = server.base
    client = server.client()
    before = httpx.get(f"{base}/v1/cache/stats").json()["sessions"]
    client.completions.create(
        model=MODEL,
        prompt="a completion in a tool session " * 3,
        max_tokens=3,
        temperature=0.0,
        extra_body={"kvtier": {"session_id": "completion-1", "cache_ttl_s": 60}},
    )
    after = httpx.get(f"{base}/v1/cache/stats").json()["sessions"]
    # The session hint reached the cache: a new live session pins its blocks.
    assert after["live"] == before["live"] + 1
    assert after["pinned_bytes"] > before["pinned_bytes"]
    assert httpx.delete(f"{base}/v1/sessions/completion-1").status_code == 200
    bad = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "kvtier": {"cache_ttl_s": -1}},
    )
    assert bad.status_code == 400


def test_sessions_end_by_hint_or_endpoint_and_show_in_the_stats(server: Any) -> None:
    base = server.base
    client = server.client()
    chat(client, "a tool call", {"session_id": "tool-1", "cache_ttl_s": 60})
    chat(client, "another", {"session_id": "tool-2", "cache_ttl_s": 60})
    sessions = httpx.get(f"{base}/v1/cache/stats").json()["sessions"]
    assert sessions["live"] >= 2 and sessions["pinned_bytes"] > 0
    assert sessions["ttls_followed"] is True  # no hinted pause has proved them wrong
    r = httpx.delete(f"{base}/v1/sessions/tool-1")
    assert r.status_code == 200 and r.json()["object"] == "session.ended"
    assert httpx.delete(f"{base}/v1/sessions/tool-1").status_code == 404
    chat(client, "done", {"session_id": "tool-2", "session_end": True})
    after = httpx.get(f"{base}/v1/cache/stats").json()["sessions"]
    # Each ended once: by DELETE, and by the request that said so (not again at its finish).
    assert after["ended"] == sessions["ended"] + 2 and after["live"] == sessions["live"] - 2
    bad = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
              "kvtier": {"session_end": True}},
    )  # fmt: skip
    assert bad.status_code == 400 and "session_id" in bad.text
