"""The reference engine on a tiny random Llama: generation, reuse, stops, scheduling, failures."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import tiny_engine  # noqa: E402

from kvtier import BadRequestError  # noqa: E402
from kvtier.engine import Engine, EngineWorker, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    outs = list(engine.generate(prompt, params))
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    text = "".join(o.text for o in outs)
    ids = [t for o in outs for t in o.token_ids]
    return text, ids, outs[-1]


def _hf_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = engine.model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine(block_size=4, num_blocks=128)


def test_greedy_output_matches_transformers_and_is_reused(engine: Engine) -> None:
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me about caches."}])
    text, ids, last = _run(
        engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    assert ids == _hf_greedy(engine, prompt, 10)
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert last.finish_reason == "length"
    m = last.metrics
    assert m.completion_tokens == 10 and m.prompt_tokens == len(prompt)
    assert m.cached_tokens == 0
    assert m.ttft is not None and m.ttft > 0 and m.decode_tokens_per_s is not None
    text2, ids2, last2 = _run(
        engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    assert (text2, ids2) == (text, ids)
    assert last2.metrics.cached_tokens == (len(prompt) - 1) // 4 * 4
    engine.manager.check()


def test_multi_turn_reuses_the_earlier_turn(engine: Engine) -> None:
    msgs = [{"role": "user", "content": "Hello there, how are you today?"}]
    first = engine.encode_chat(msgs)
    text, _, _ = _run(engine, first)
    second = engine.encode_chat(
        [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    )
    _, _, last = _run(engine, second)
    assert last.metrics.cached_tokens >= len(first) // 4 * 4


def test_stop_strings_cut_the_text_and_never_stream(engine: Engine) -> None:
    prompt = engine.encode_prompt("The stop test prompt: ")
    full, _, _ = _run(engine, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(full) >= 6
    stop = full[3:5]
    cut = full.index(stop)
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop])))
    streamed = "".join(o.text for o in outs)
    assert streamed == full[:cut]
    assert outs[-1].finish_reason == "stop"
    assert all(stop not in o.text for o in outs)


def test_eos_ends_generation(engine: Engine) -> None:
    prompt = engine.encode_prompt("eos test")
    _, ids, _ = _run(engine, prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({ids[2]})
    try:
        text, got, last = _run(engine, prompt, SamplingParams(max_tokens=5, temperature=0))
    finally:
        engine.eos_token_ids = saved
    assert got == ids[: ids.index(ids[2]) + 1]
    assert last.finish_reason == "stop"
    assert text == engine.tokenizer.decode(got[:-1], skip_special_tokens=True)


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = engine.encode_prompt("sample me")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    assert _run(engine, prompt, p)[1] == _run(engine, prompt, p)[1]
    others = {
        tuple(
            _run(
                engine,
                prompt,
                SamplingParams(max_tokens=16, temperature=1.5, seed=s, ignore_eos=True),
            )[1]
        )
        for s in range(4)
    }
    assert len(others) > 1
    tiny_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    assert (
        _run(engine, prompt, tiny_p)[1]
        == _run(engine, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[1]
    )


def test_context_limits() -> None:
    engine = tiny_engine(block_size=4, num_blocks=16, max_model_len=40)
    assert engine.max_model_len == 40
    with pytest.raises(BadRequestError, match="maximum context length is 40"):
        engine.add_request(list(range(5, 35)), SamplingParams(max_tokens=11))
    with pytest.raises(BadRequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(BadRequestError, match="outside"):
        engine.add_request([10**9], GREEDY)
    with pytest.raises(BadRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert engine.has_unfinished() is False


def test_round_robin_requests_do_not_interfere() -> None:
    engine = tiny_engine(block_size=4, num_blocks=256, max_num_seqs=3)
    prompts = [engine.encode_prompt(f"prompt number {i} " * (i + 1)) for i in range(5)]
    p = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    solo = [_run(engine, x, p)[1] for x in prompts]
    engine.manager.reset_prefix_cache()
    rids = [engine.add_request(x, p) for x in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    max_running = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
        max_running = max(max_running, engine.num_running)
    assert [got[r] for r in rids] == solo
    assert max_running == 3
    engine.manager.check()


def test_preempted_requests_resume_with_the_same_output() -> None:
    # 12 blocks of 4 tokens: three requests of ~20 tokens cannot all stay resident.
    engine = tiny_engine(block_size=4, num_blocks=12, max_num_seqs=3)
    prompts = [engine.encode_prompt(f"request {i}: ") for i in range(3)]
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    solo = [_run(engine, x, p)[1] for x in prompts]
    rids = [engine.add_request(x, p) for x in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert engine.counters.preemptions > 0
    assert [got[r] for r in rids] == solo
    assert set(reasons.values()) == {"length"}
    engine.manager.check()
    assert engine.manager.stats().used_blocks == 0


def test_cancel_aborts_a_running_request(engine: Engine) -> None:
    prompt = engine.encode_prompt("cancel me")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    first = engine.step()
    assert [o.request_id for o in first] == [rid]
    engine.cancel(rid)
    outs = engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.manager.stats().used_blocks == 0


def test_a_failed_forward_fails_one_request_and_serves_no_garbage() -> None:
    engine = tiny_engine(block_size=4, num_blocks=64)
    prompt = engine.encode_prompt("a prompt long enough to fill several blocks")
    want = _run(engine, prompt, GREEDY)[1]
    engine.manager.reset_prefix_cache()
    calls = {"n": 0}

    def flaky(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device error")

    layer = engine.model.model.layers[1].self_attn
    handle = layer.register_forward_pre_hook(flaky, with_kwargs=True)
    try:
        outs = list(engine.generate(prompt, GREEDY))
    finally:
        handle.remove()
    assert outs[-1].finish_reason == "error" and "injected device error" in (outs[-1].error or "")
    assert engine.counters.forward_errors == 1
    # The prompt's blocks were published before the failed pass: none may hit now.
    _, ids, last = _run(engine, prompt, GREEDY)
    assert last.metrics.cached_tokens == 0
    assert ids == want
    engine.manager.check()


def test_prefix_caching_off_keeps_nothing() -> None:
    engine = tiny_engine(block_size=4, num_blocks=64, prefix_caching=False)
    prompt = engine.encode_prompt("no caching for this prompt please")
    a = _run(engine, prompt)
    b = _run(engine, prompt)
    assert a[1] == b[1]
    assert b[2].metrics.cached_tokens == 0
    stats = engine.manager.stats()
    assert stats.cached_blocks == 0 and stats.used_blocks == 0 and stats.hit_tokens == 0


def test_worker_serves_concurrent_callers() -> None:
    engine = tiny_engine(block_size=4, num_blocks=256, max_num_seqs=2)
    prompts = [engine.encode_prompt(f"thread {i} says hello") for i in range(6)]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    solo = [_run(engine, x, p)[0] for x in prompts]
    results: dict[int, str] = {}
    with EngineWorker(engine) as worker:

        def client(i: int) -> None:
            text, last = worker.submit(prompts[i], p).result()
            assert last.finish_reason == "length"
            results[i] = text

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert worker.call(lambda e: e.manager.stats().num_requests) == 0
        with pytest.raises(BadRequestError):
            worker.submit([], p)
        handle = worker.submit(
            prompts[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        )
        outs = iter(handle)
        next(outs)
        handle.cancel()
        assert [o.finish_reason for o in outs][-1] == "abort"
    assert not worker.alive
    assert results == dict(enumerate(solo))


def test_generation_config_sampling_defaults() -> None:
    from transformers import GenerationConfig

    from kvtier.engine.model import generation_defaults

    engine = tiny_engine()
    assert generation_defaults(engine.model) == {}  # greedy by default: nothing to suggest
    engine.model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8)
    assert generation_defaults(engine.model) == {"temperature": 0.7, "top_p": 0.8}


def test_lazy_public_exports_do_not_import_torch_until_used() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvtier\n"
        "assert 'torch' not in sys.modules, 'import kvtier pulled torch'\n"
        "from kvtier import Engine, KvTierCache, KVBlockStorage, SamplingParams, create_app\n"
        "import kvtier.engine as e\n"
        "assert Engine is e.Engine and KvTierCache is e.KvTierCache\n"
        "assert 'torch' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
