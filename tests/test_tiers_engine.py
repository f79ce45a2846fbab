"""The engine over a tier chain: same outputs as without tiers, Redis faults, sharing, cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from needs import need_redis_server
from redis_servers import RedisClusterServers, RedisServer
from tiny_model import tiny_model_and_tokenizer

from kvtier.engine import Engine, SamplingParams
from kvtier.offload.chain import Tier
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

needs_redis = pytest.mark.usefixtures("_redis_installed")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def prompts(n: int, seed: int = 0, length: int = 37) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 60, (20,), generator=g).tolist()
    return [shared + torch.randint(3, 60, (length - 20,), generator=g).tolist() for _ in range(n)]


def run(engine: Engine, prompt: list[int]) -> tuple[Any, list[int]]:
    """The final output of a greedy run and every token it generated."""
    outs = list(engine.generate(prompt, GREEDY))
    assert outs and outs[-1].finished
    return outs[-1], [t for out in outs for t in out.token_ids]


@pytest.fixture(scope="module")
def reference(model_tok: tuple[Any, Any]) -> Engine:
    model, tok = model_tok
    return Engine(model, tok, model_id="tiny", block_size=4, num_blocks=256)


def test_engine_with_host_and_disk_tiers_matches_reference(
    model_tok: tuple[Any, Any], reference: Engine, tmp_path: Path
) -> None:
    model, tok = model_tok
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=24,
        tiers=[Tier(HostStore(), 12), Tier(DiskStore(tmp_path), 200, codec="raw")],
    )
    ps = prompts(6)
    for _round in range(2):
        for p in ps:
            got, got_tokens = run(eng, p)
            ref, ref_tokens = run(reference, p)
            assert got_tokens == ref_tokens
            assert got.finish_reason == ref.finish_reason
            assert got.metrics.completion_tokens == ref.metrics.completion_tokens == len(ref_tokens)
    # The second round found prefixes the small device pool had evicted.
    assert eng.counters.loaded_prompt_tokens > 0
    st = eng.tier_chain.stats() if eng.tier_chain else {}
    assert st["host"]["loaded_blocks"] + st["disk"]["loaded_blocks"] > 0
    assert eng.tier_chain is not None
    eng.tier_chain.flush()
    eng.tier_chain.check()
    eng.manager.check()
    eng.tier_chain.close()


def collect_text(engine: Engine, prompt: list[int]) -> list[int]:
    toks: list[int] = []
    for out in engine.generate(prompt, GREEDY):
        toks.extend(out.token_ids)
    return toks


def test_outputs_identical_with_tiers(
    model_tok: tuple[Any, Any], reference: Engine, tmp_path: Path
) -> None:
    model, tok = model_tok
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=20,
        tiers=[Tier(HostStore(), 8), Tier(DiskStore(tmp_path), 200)],
    )
    ps = prompts(5, seed=3)
    expected = [collect_text(reference, p) for p in ps]
    for _round in range(3):
        assert [collect_text(eng, p) for p in ps] == expected
    assert eng.counters.loaded_prompt_tokens > 0
    assert eng.tier_chain is not None
    eng.tier_chain.close()


@pytest.fixture()
def _redis_installed() -> None:
    need_redis_server()


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    need_redis_server()
    with RedisServer() as srv:
        yield srv


def redis_tier(url: str, **kw: Any) -> Tier:
    from kvtier.offload.redis_store import RedisStore

    return Tier(RedisStore(url, retry_interval_s=0.2, **kw), 500)


@needs_redis
def test_redis_killed_mid_run_requests_still_served_and_service_resumes(
    model_tok: tuple[Any, Any], reference: Engine, redis_server: RedisServer
) -> None:
    model, tok = model_tok
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=20,
        tiers=[Tier(HostStore(), 6), redis_tier(redis_server.url)],
        write_mode="write_through",
    )
    assert eng.tier_chain is not None
    ps = prompts(6, seed=5)
    expected = [collect_text(reference, p) for p in ps]
    assert [collect_text(eng, p) for p in ps[:3]] == expected[:3]
    eng.tier_chain.flush()
    stored_before = eng.tier_chain.stats()["redis"]["stored_blocks"]
    assert stored_before > 0
    redis_server.stop(kill=True)
    # Redis is gone: every request still completes, from host or recomputed.
    for _round in range(2):
        assert [collect_text(eng, p) for p in ps] == expected
    eng.tier_chain.flush()
    st = eng.tier_chain.stats()["redis"]
    assert st["unavailable_errors"] + st["store_failures"] > 0
    redis_server.start()
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert [collect_text(eng, p) for p in ps] == expected
        eng.tier_chain.flush()
        if eng.tier_chain.stats()["redis"]["stored_blocks"] > stored_before:
            break
        time.sleep(0.3)
    assert eng.tier_chain.stats()["redis"]["stored_blocks"] > stored_before, "Redis never came back"
    eng.tier_chain.check()
    eng.tier_chain.close()


@needs_redis
def test_two_engines_share_blocks_through_redis(
    model_tok: tuple[Any, Any], reference: Engine, redis_server: RedisServer
) -> None:
    model, tok = model_tok
    kw: dict[str, Any] = {"model_id": "tiny", "block_size": 4, "num_blocks": 64}
    a = Engine(model, tok, tiers=[redis_tier(redis_server.url)], write_mode="write_through", **kw)
    b = Engine(model, tok, tiers=[redis_tier(redis_server.url)], **kw)
    p = prompts(1, seed=9, length=41)[0]
    expected = collect_text(reference, p)
    assert collect_text(a, p) == expected
    assert a.tier_chain is not None and b.tier_chain is not None
    a.tier_chain.flush()
    # b never saw this prompt: its prefix comes from what a stored in Redis.
    assert collect_text(b, p) == expected
    assert b.counters.loaded_prompt_tokens == (len(p) - 1) // 4 * 4
    assert b.tier_chain.stats()["redis"]["adopted_blocks"] > 0
    a.tier_chain.close()
    b.tier_chain.close()


@needs_redis
def test_redis_cluster_tier(model_tok: tuple[Any, Any], reference: Engine) -> None:
    model, tok = model_tok
    with RedisClusterServers() as cluster:
        eng = Engine(
            model,
            tok,
            model_id="tiny",
            block_size=4,
            num_blocks=16,
            tiers=[redis_tier(cluster.url, cluster=True)],
        )
        ps = prompts(5, seed=11)
        expected = [collect_text(reference, p) for p in ps]
        for _round in range(2):
            assert [collect_text(eng, p) for p in ps] == expected
        assert eng.tier_chain is not None
        eng.tier_chain.flush()
        st = eng.tier_chain.stats()["redis"]
        assert st["stored_blocks"] > 0 and st["loaded_blocks"] > 0
        assert st["corrupt_blocks"] == 0 and st["unavailable_errors"] == 0
        eng.tier_chain.close()


def test_preemption_swaps_out_and_resumes_with_the_same_output(
    model_tok: tuple[Any, Any], reference: Engine
) -> None:
    model, tok = model_tok
    eng = Engine(
        model, tok, model_id="tiny", block_size=4, num_blocks=12, max_num_seqs=3,
        tiers=[Tier(HostStore(), 32)],
    )
    ps = prompts(3, seed=13, length=23)
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    solo = [[t for o in reference.generate(x, p) for t in o.token_ids] for x in ps]
    rids = [eng.add_request(x, p) for x in ps]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
    assert eng.counters.preemptions > 0
    assert [got[r] for r in rids] == solo
    # Resumed requests found their swapped blocks (the partial ones too) on the host tier.
    assert eng.counters.loaded_prompt_tokens > 0
    eng.manager.check()
    assert eng.tier_chain is not None
    eng.tier_chain.check()
    eng.close()
