"""``max_num_seqs`` left unset is sized from the KV cache; an explicit value always wins.

The engine divides the KV pool into sequences of 512 tokens (or of the
context length, if shorter), keeps at least 4 and at most 32 on a CPU (256
elsewhere), and never more than an explicit ``max_num_batched_tokens``. The
startup banner (``Engine.describe()``, printed by ``kvtier serve``) says what
it came to and why; ``/v1/cache/stats`` reports the value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cli_launch import kvtier_cli, read_banner
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import tiny_engine

from kvtier.engine.config import (
    AUTO_MAX_SEQS,
    AUTO_MAX_SEQS_CPU,
    AUTO_MIN_SEQS,
    AUTO_SEQ_TOKENS,
    SchedulerConfig,
    plan_cache,
)
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout


def _scheduler_line(engine: Any) -> str:
    return next(line for line in engine.describe() if line.startswith("scheduler:"))


def test_a_small_kv_cache_gives_a_small_max_num_seqs() -> None:
    # 32 blocks of 16 = 512 tokens: one sequence of 512 fits, so the floor of 4 applies.
    small = tiny_engine(num_blocks=32, block_size=16)
    assert small.max_num_seqs == AUTO_MIN_SEQS
    # 320 blocks of 16 = 5120 tokens, context 512: ten sequences of 512.
    medium = tiny_engine(num_blocks=320, block_size=16)
    assert medium.max_num_seqs == 10
    assert medium.scheduler.limits.max_num_seqs == 10
    assert medium.processor.limits.max_num_seqs == 10
    assert medium.config.scheduler.max_num_seqs == 10
    # The default 512 MiB holds far more than the CPU cap of the tiny model's sequences.
    roomy = tiny_engine()
    assert roomy.max_num_seqs == AUTO_MAX_SEQS_CPU
    assert small.max_num_seqs < medium.max_num_seqs < roomy.max_num_seqs


def test_the_banner_says_how_max_num_seqs_was_sized() -> None:
    line = _scheduler_line(tiny_engine(num_blocks=320, block_size=16))
    assert "up to 10 requests at once" in line
    assert "auto" in line and "10 sequences of 512 tokens" in line and "--max-num-seqs" in line
    explicit = _scheduler_line(tiny_engine(num_blocks=320, block_size=16, max_num_seqs=3))
    assert "up to 3 requests at once (--max-num-seqs)" in explicit and "auto" not in explicit


def test_an_explicit_max_num_seqs_wins() -> None:
    for n in (1, 2, 50):
        engine = tiny_engine(num_blocks=320, block_size=16, max_num_seqs=n)
        assert engine.max_num_seqs == n == engine.scheduler.limits.max_num_seqs
    # Above the automatic cap too: the flag is the operator's call.
    assert tiny_engine(max_num_seqs=AUTO_MAX_SEQS_CPU + 8).max_num_seqs == AUTO_MAX_SEQS_CPU + 8


def test_the_automatic_value_respects_an_explicit_token_budget() -> None:
    engine = tiny_engine(max_num_batched_tokens=6)
    assert engine.max_num_seqs == 6 and engine.max_num_batched_tokens == 6
    # An explicit pair that cannot work is still refused.
    with pytest.raises(ConfigError, match="at least max_num_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_the_automatic_engine_runs_more_requests_at_once() -> None:
    from kvtier.engine import SamplingParams

    engine = tiny_engine(num_blocks=320, block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(12):
        engine.add_request(engine.encode_prompt(f"prompt {i}"), params)
    engine.step()
    # Ten run together (the automatic limit); the other two wait.
    assert engine.num_running == 10 and engine.num_waiting == 2
    finished = 0
    while engine.has_unfinished():
        finished += sum(o.finished for o in engine.step())
    assert finished == 12


_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 100_000),
    positions=st.integers(1, 1 << 20),
    budget=st.none() | st.integers(1, 4096),
    device=st.sampled_from(["cpu", "cuda", "cuda:1", "mps"]),
)
def test_the_automatic_value_is_the_sequences_the_cache_holds_within_bounds(
    num_blocks: int, positions: int, budget: int | None, device: str
) -> None:
    plan = plan_cache(
        _LAYOUT, positions, num_blocks=num_blocks, kv_cache_bytes=1, max_model_len=None
    )
    resolved = SchedulerConfig(max_num_batched_tokens=budget).resolve(plan, device)
    seqs = resolved.max_num_seqs
    assert seqs is not None and resolved.max_num_batched_tokens is not None
    cap = AUTO_MAX_SEQS_CPU if device == "cpu" else AUTO_MAX_SEQS
    per_seq = min(AUTO_SEQ_TOKENS, plan.max_model_len)
    holds = plan.pool_tokens // per_seq
    expected = min(max(holds, AUTO_MIN_SEQS), cap)
    if budget is not None:
        expected = min(expected, budget)
    assert seqs == expected
    assert 1 <= seqs <= cap
    # The resolved configuration is consistent: every running request can decode each step.
    assert resolved.max_num_batched_tokens >= seqs
    assert resolved.max_model_len == plan.max_model_len
    # A bigger cache never gives fewer sequences.
    bigger = plan_cache(
        _LAYOUT, positions, num_blocks=num_blocks * 2, kv_cache_bytes=1, max_model_len=None
    )
    again = SchedulerConfig(max_num_batched_tokens=budget).resolve(bigger, device).max_num_seqs
    assert again is not None and again >= seqs
    # An explicit value is kept as it is.
    assert SchedulerConfig(max_num_seqs=3).resolve(plan, device).max_num_seqs == 3


def test_serve_sizes_max_num_seqs_and_says_so(model_dir: Path) -> None:
    proc = subprocess.Popen(
        kvtier_cli(
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--port",
            "0",
            "--num-blocks",
            "320",
            "--pressure",
            "off",
            "--log-level",
            "warning",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = read_banner(proc)
        scheduler = next(ln for ln in lines if "scheduler:" in ln)
        assert "up to 10 requests at once (auto:" in scheduler
        url = lines[-1].split(" at ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(f"{url}/cache/stats", timeout=30) as resp:
            stats = json.loads(resp.read())
        assert stats["engine"]["max_num_seqs"] == 10
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
