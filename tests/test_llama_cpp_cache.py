"""kvtier tiers as llama-cpp-python's prompt cache, with the real SmolLM2 GGUF model.

Each test loads the model with llama-cpp-python (the release kvtier pins),
completes prompts greedily and checks what the cache did: a new process (a
new ``Llama`` on the same disk directory, or a subprocess) finds the state an
earlier one saved, loads it, and answers exactly as a model without a cache
does; a damaged or vanished state is a miss, never loaded; Redis shares
states between processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from needs import need_module, need_redis_server

need_module("llama_cpp.llama_cache", "run `make venv` (builds llama-cpp-python)")

import llama_cpp  # noqa: E402

from kvtier.engine.model import default_model_file  # noqa: E402
from kvtier.errors import CorruptBlockError  # noqa: E402
from kvtier.integrations.errors import UnsupportedReleaseError  # noqa: E402
from kvtier.integrations.llama_cpp import (  # noqa: E402
    KvTierLlamaCache,
    model_identity,
    pack_state,
    require_llama_cpp,
    unpack_state,
)

MODEL = str(default_model_file())
# A long shared system prompt (several 16-token blocks) and two questions.
SYSTEM = (
    "You are a careful assistant for a railway company. Answer in one short sentence. "
    "Timetables change on the first Monday of each month; fares are in euros; the "
    "network has four lines named after colours: red, blue, green and yellow. "
)

# Real servers in their own processes: run once, in the compiled pass (see the Makefile).
pytestmark = pytest.mark.process
FIRST = SYSTEM + "Question: which lines does the network have?\nAnswer: The"
SECOND = SYSTEM + "Question: when do timetables change?\nAnswer: They"


def make_llama(**kwargs: Any) -> Any:
    return llama_cpp.Llama(model_path=MODEL, n_ctx=512, n_threads=2, seed=0, verbose=False,
                           **kwargs)


def complete(llm: Any, prompt: str) -> str:
    out = llm.create_completion(prompt, max_tokens=8, temperature=0.0)
    return str(out["choices"][0]["text"])


@pytest.fixture(scope="module")
def plain() -> dict[str, str]:
    """What the model answers with no cache at all."""
    llm = make_llama()
    answers = {p: complete(llm, p) for p in (FIRST, SECOND)}
    assert all(a.strip() for a in answers.values()), answers  # something to compare
    return answers


def state_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvb") if "-states" in str(p))


def test_a_new_process_loads_the_state_an_earlier_one_saved(
    tmp_path: Path, plain: dict[str, str]
) -> None:
    url = f"disk:{tmp_path}?policy=lru"
    first = make_llama()
    cache = KvTierLlamaCache.for_model(first, url)
    first.set_cache(cache)
    assert complete(first, FIRST) == plain[FIRST]
    assert cache.misses == 1 and cache.saves == 1
    assert len(state_files(tmp_path)) == 1
    cache.close()

    # A fresh context on the same directory: the system prompt's blocks match.
    second = make_llama()
    again = KvTierLlamaCache.for_model(second, url)
    second.set_cache(again)
    assert again.cache_size == 0
    assert complete(second, SECOND) == plain[SECOND]
    assert again.hits == 1
    assert again.cache_size > 0
    again.close()


def test_the_state_is_loaded_into_the_context(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}"
    first = make_llama()
    first.set_cache(KvTierLlamaCache.for_model(first, url))
    complete(first, FIRST)
    second = make_llama()
    cache = KvTierLlamaCache.for_model(second, url)
    prompt = second.tokenize(SECOND.encode())
    state = cache[prompt]
    shared = 0
    for a, b in zip(state.input_ids.tolist(), prompt, strict=False):
        if a != b:
            break
        shared += 1
    assert shared >= 3 * 16  # the system prompt's full blocks at least
    second.load_state(state)
    assert second.n_tokens == state.n_tokens
    assert second.input_ids.tolist() == state.input_ids.tolist()


def test_logits_are_stored_only_when_the_model_keeps_them(tmp_path: Path) -> None:
    sizes = {}
    for logits_all in (False, True):
        llm = make_llama(logits_all=logits_all)
        cache = KvTierLlamaCache.for_model(llm, f"disk:{tmp_path / str(logits_all)}")
        assert cache.logits is logits_all
        llm.set_cache(cache)
        complete(llm, FIRST)
        sizes[logits_all] = state_files(tmp_path / str(logits_all))[0].stat().st_size
    # n_tokens x 49,152 float32 logits are most of a state.
    assert sizes[True] > 5 * sizes[False]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_state_is_a_miss_and_the_answer_is_unchanged(
    tmp_path: Path, plain: dict[str, str], damage: str
) -> None:
    url = f"disk:{tmp_path}"
    first = make_llama()
    first.set_cache(KvTierLlamaCache.for_model(first, url))
    complete(first, FIRST)
    (path,) = state_files(tmp_path)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
        path.write_bytes(bytes(blob))
    elif damage == "truncate":
        path.write_bytes(bytes(blob[: len(blob) // 3]))
    else:
        path.unlink()

    second = make_llama()
    cache = KvTierLlamaCache.for_model(second, url)
    second.set_cache(cache)
    assert complete(second, SECOND) == plain[SECOND]
    assert cache.hits == 0 and cache.misses == 1
    if damage == "delete":
        # The new process's scan of the directory never saw it.
        assert cache.states.counters.adopted == 0
    else:
        assert cache.states.counters.corrupt == 1
        assert not path.exists()  # a damaged state is purged


def test_another_model_or_context_never_shares_states(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}"
    first = make_llama()
    first.set_cache(KvTierLlamaCache.for_model(first, url))
    complete(first, FIRST)
    other = llama_cpp.Llama(model_path=MODEL, n_ctx=256, n_threads=2, seed=0, verbose=False)
    assert model_identity(other) != model_identity(first)
    cache = KvTierLlamaCache.for_model(other, url)
    with pytest.raises(KeyError):
        cache[other.tokenize(SECOND.encode())]


def test_a_prompt_shorter_than_a_block_is_neither_saved_nor_found(tmp_path: Path) -> None:
    llm = make_llama()
    cache = KvTierLlamaCache.for_model(llm, f"disk:{tmp_path}")
    llm.set_cache(cache)
    complete(llm, "Hi")  # prompt and answer under 16 tokens
    assert cache.saves == 0 and not state_files(tmp_path)
    assert [1, 2, 3] not in cache


def test_max_states_bounds_the_tier(tmp_path: Path) -> None:
    llm = make_llama()
    cache = KvTierLlamaCache.for_model(llm, f"disk:{tmp_path}", max_states=2)
    llm.set_cache(cache)
    for i in range(4):
        llm.reset()
        complete(llm, f"Story number {i}: " + SYSTEM)
    assert cache.saves == 4
    assert len(state_files(tmp_path)) == 2
    cache.states.offload_manager.check()


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=0, max_value=40), cols=st.integers(min_value=1, max_value=9),
       logits=st.booleans(), state=st.binary(max_size=300), seed=st.integers(0, 2**32))
def test_states_pack_and_unpack_exactly(
    n: int, cols: int, logits: bool, state: bytes, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    original = llama_cpp.llama.LlamaState(
        input_ids=rng.integers(0, 50_000, n).astype(np.intc),
        scores=rng.standard_normal((n, cols)).astype(np.single),
        n_tokens=n, llama_state=state, llama_state_size=len(state), seed=seed,
    )
    back = unpack_state(pack_state(original, logits=logits))
    assert back.input_ids.tolist() == original.input_ids.tolist()
    assert back.n_tokens == n and back.seed == seed and back.llama_state == state
    if logits:
        assert np.array_equal(back.scores, original.scores)
    else:
        assert back.scores.shape == (min(1, n), cols) and not back.scores.any()


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=200))
def test_malformed_states_raise_corrupt_block(data: bytes) -> None:
    try:
        unpack_state(data)
    except CorruptBlockError:
        return
    # Random bytes only parse when they happen to spell a whole, valid state.
    assert data[:4] == b"KVLS"


def test_untested_releases_are_refused_with_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert require_llama_cpp("0.3.99") == "0.3.99"
    with pytest.raises(UnsupportedReleaseError, match=r"llama-cpp-python\[server\]==0.3.36"):
        require_llama_cpp("0.2.90")
    with pytest.raises(UnsupportedReleaseError, match="KVTIER_LLAMA_CPP_ALLOW_UNTESTED"):
        require_llama_cpp("0.4.0")
    monkeypatch.setenv("KVTIER_LLAMA_CPP_ALLOW_UNTESTED", "1")
    assert require_llama_cpp("0.4.0") == "0.4.0"


# -- across processes --------------------------------------------------------------------------

_CHILD = """
import json, sys, llama_cpp
from kvtier.engine.model import default_model_file
from kvtier.integrations.llama_cpp import KvTierLlamaCache
llm = llama_cpp.Llama(model_path=str(default_model_file()), n_ctx=512, n_threads=2, seed=0,
                      verbose=False)
cache = KvTierLlamaCache.for_model(llm, sys.argv[1])
llm.set_cache(cache)
out = llm.create_completion(sys.argv[2], max_tokens=8, temperature=0.0)
print(json.dumps({"text": out["choices"][0]["text"], "hits": cache.hits,
                  "saves": cache.saves}))
"""


def run_child(url: str, prompt: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _CHILD, url, prompt], capture_output=True,
                          text=True, timeout=300, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture
def redis_url() -> Iterator[str]:
    need_redis_server()
    from redis_servers import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def test_processes_share_states_through_redis(redis_url: str, plain: dict[str, str]) -> None:
    first = run_child(redis_url, FIRST)
    assert first == {"text": plain[FIRST], "hits": 0, "saves": 1}
    second = run_child(redis_url, SECOND)
    assert second == {"text": plain[SECOND], "hits": 1, "saves": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_server_reuses_prompts_across_restarts(tmp_path: Path, plain: dict[str, str]) -> None:
    need_module("sse_starlette", "run `make venv` (installs llama-cpp-python[server])")
    url = f"disk:{tmp_path / 'tier'}"

    def serve_once(prompt: str) -> tuple[str, str]:
        port = _free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log_path = tmp_path / f"server-{port}.log"
        log_file = log_path.open("w")  # not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.integrations.llama_cpp", "--tier", url,
             "--model", MODEL, "--n_ctx", "512", "--n_threads", "2", "--seed", "0",
             "--host", "127.0.0.1", "--port", str(port), "--verbose", "True"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )
        try:
            deadline = time.monotonic() + 120
            body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
            while True:
                try:
                    req = urllib.request.Request(
                        f"http://127.0.0.1:{port}/v1/completions", data=body,
                        headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        text = json.loads(resp.read())["choices"][0]["text"]
                    break
                except OSError:
                    assert proc.poll() is None, log_path.read_text()
                    assert time.monotonic() < deadline, "the server never answered"
                    time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log_file.close()
        return str(text), log_path.read_text()

    text, log = serve_once(FIRST)
    assert text == plain[FIRST] and "cache miss" in log
    text, log = serve_once(SECOND)  # a new server process on the same directory
    assert text == plain[SECOND] and "cache hit" in log


def test_the_server_entry_point_checks_its_tier_first() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.integrations.llama_cpp", "--tier", "nowhere:/x",
         "--model", MODEL],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and "--tier" in done.stderr and "no registered medium" in (
        done.stderr)
    done = subprocess.run([sys.executable, "-m", "kvtier.integrations.llama_cpp"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "usage:" in done.stderr
