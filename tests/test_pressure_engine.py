"""The engine under memory pressure: rejection, delay, demotion to tiers, metrics, the CLI spec."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tiny_model import tiny_model_and_tokenizer

from kvtier import ConfigError, Ladder, Mode, ModeActions, PressureController, ScriptedMonitor
from kvtier.engine import Engine, SamplingParams
from kvtier.offload.chain import Tier
from kvtier.offload.host import HostStore
from kvtier.pressure import DEFAULT_ACTIONS, PressureSpec
from kvtier.server.metrics import metric_families, render, snapshot_engine

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def prompt(seed: int, n: int = 33) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (n,), generator=g).tolist()


def finish(engine: Engine, rid: str, limit: int = 200) -> Any:
    for _ in range(limit):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish")


def scripted(
    emergency: str = "reject", max_wait: float = 30.0
) -> tuple[PressureController, ScriptedMonitor]:
    actions = {**DEFAULT_ACTIONS, Mode.EMERGENCY: ModeActions(admission=emergency)}  # type: ignore[arg-type]
    mon = ScriptedMonitor(0.0)
    ladder = Ladder.from_fractions((0.5, 0.8, 0.9, 0.97), 0.05, actions)
    return PressureController(mon, ladder, interval=0.01, max_wait=max_wait), mon


def small_engine(model_tok: tuple[Any, Any], ctrl: PressureController) -> Engine:
    model, tok = model_tok
    return Engine(model, tok, model_id="tiny", block_size=4, num_blocks=64, pressure=ctrl)


def test_emergency_rejects_new_requests_and_recovers(model_tok: tuple[Any, Any]) -> None:
    ctrl, mon = scripted("reject")
    eng = small_engine(model_tok, ctrl)
    try:
        mon.set(0.99)
        ctrl.sample()
        rid = eng.add_request(prompt(1), GREEDY)
        out = finish(eng, rid)
        assert out.finish_reason == "rejected" and "EMERGENCY" in (out.error or "")
        assert eng.counters.rejected == 1 and eng.manager.pool.num_used == 0
        mon.set(0.2)
        ctrl.sample()
        out = finish(eng, eng.add_request(prompt(1), GREEDY))
        assert out.finish_reason == "length"
        assert (out.metrics.prompt_tokens, out.metrics.completion_tokens) == (33, 5)
        assert eng.counters.rejected == 1
    finally:
        eng.close()
    assert not ctrl._thread  # close() stopped sampling


def test_delay_holds_a_request_until_the_mode_drops(model_tok: tuple[Any, Any]) -> None:
    ctrl, mon = scripted("delay", max_wait=30.0)
    eng = small_engine(model_tok, ctrl)
    try:
        mon.set(0.99)
        ctrl.sample()  # the background sampler reads the same monitor; this one is certain
        assert ctrl.mode is Mode.EMERGENCY
        rid = eng.add_request(prompt(2), GREEDY)
        for _ in range(5):
            assert not [o for o in eng.step() if o.finished]
        assert eng.num_waiting == 1 and eng.num_running == 0
        mon.set(0.1)
        ctrl.sample()  # the mode drops; the held request goes ahead
        out = finish(eng, rid)
        assert out.finish_reason == "length" and eng.counters.rejected == 0
    finally:
        eng.close()


@pytest.mark.parametrize("max_wait", [0.0, 0.1])
def test_delay_gives_up_after_max_wait(model_tok: tuple[Any, Any], max_wait: float) -> None:
    ctrl, mon = scripted("delay", max_wait=max_wait)
    eng = small_engine(model_tok, ctrl)
    try:
        mon.set(0.99)
        ctrl.sample()
        rid = eng.add_request(prompt(3), GREEDY)
        first = [o for o in eng.step() if o.finished]
        if max_wait == 0.0:
            # Nothing to wait for: refused on its first step.
            assert [o.finish_reason for o in first] == ["rejected"]
            out = first[0]
        else:
            # Held back (not refused at once), then given up on while the mode still delays.
            assert not first and eng.num_waiting == 1
            out = finish(eng, rid, limit=10_000)
        assert out.finish_reason == "rejected" and "delays" in (out.error or "")
        assert ctrl.mode is Mode.EMERGENCY and eng.counters.rejected == 1
    finally:
        eng.close()


def test_critical_demotes_target_evictions_to_the_host_tier(model_tok: tuple[Any, Any]) -> None:
    """The blocks CRITICAL evicts to its free target go to the host tier and come back."""
    model, tok = model_tok
    reference = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=256)
    ctrl, mon = scripted()
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=40,
        tiers=[Tier(HostStore(), 64)],
        pressure=ctrl,
    )
    try:
        pool = eng.manager.pool
        prompts: list[list[int]] = []
        while pool.num_empty >= 4:  # finished prompts fill the pool with cached blocks
            prompts.append(prompt(10 + len(prompts)))
            finish(eng, eng.add_request(prompts[-1], GREEDY))
        assert len(prompts) <= 6
        assert eng.tier_chain is not None
        stored_before = eng.tier_chain.stats()["host"]["stored_blocks"]
        mon.set(0.92)
        ctrl.sample()  # CRITICAL: keep 10% (4 blocks) empty, offloading first
        out = finish(eng, eng.add_request(prompt(99), GREEDY))
        assert pool.num_empty >= 4
        s = eng.manager.stats()
        assert s.pressure_evictions > 0
        stored = eng.tier_chain.stats()["host"]["stored_blocks"]
        assert stored - stored_before >= s.pressure_evictions
        # The first prompt lost device blocks to the target; its prefix loads from host
        # memory and the output is the reference's, token for token.
        loaded_before = eng.counters.loaded_prompt_tokens
        again = finish(eng, eng.add_request(prompts[0], GREEDY))
        assert eng.counters.loaded_prompt_tokens > loaded_before
        assert again.metrics.completion_tokens == 5
        ref = finish(reference, reference.add_request(prompts[0], GREEDY))
        assert _tokens(eng, prompts[0]) == _tokens(reference, prompts[0])
        assert out.finish_reason == ref.finish_reason == "length"
    finally:
        eng.close()


def _tokens(engine: Engine, p: list[int]) -> list[int]:
    return [t for o in engine.generate(p, GREEDY) for t in o.token_ids]


def test_pressure_metrics_and_stats(model_tok: tuple[Any, Any]) -> None:
    ctrl, mon = scripted()
    eng = small_engine(model_tok, ctrl)
    try:
        mon.set(0.85)
        ctrl.sample()
        snap = snapshot_engine(eng)
        assert snap.pressure is not None and snap.pressure.mode is Mode.PRESSURE
        text = render(metric_families(snap))
        assert 'kvtier_pressure_mode{mode="PRESSURE"} 1' in text
        assert 'kvtier_pressure_mode{mode="RELAXED"} 0' in text
        assert "kvtier_pressure_level 2" in text
        ratio = re.search(r'kvtier_memory_usage_ratio\{source="scripted"\} (\S+)\n', text)
        assert ratio and float(ratio.group(1)) == pytest.approx(0.85)
        assert "kvtier_pressure_mode_changes_total 1" in text  # straight up from RELAXED
        assert 'kvtier_requests_finished_total{reason="rejected"} 0' in text
    finally:
        eng.close()


def test_engine_with_the_pool_monitor_spec(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=32,
        max_num_seqs=4,
        pressure=PressureSpec(monitor="pool", interval=0.005),
    )
    try:
        assert eng.pressure is not None and eng.pressure.monitor.name == "pool"
        assert eng.pressure.max_wait == 30.0
        rids = [eng.add_request(prompt(40 + i, 20), GREEDY) for i in range(4)]
        while eng.has_unfinished():
            eng.step()
        assert eng.counters.finished.get("length") == len(rids)
        eng.pressure.sample()
        assert eng.pressure.mode is Mode.RELAXED  # nothing held once everything finished
    finally:
        eng.close()


def test_bad_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown memory monitor"):
        PressureSpec(monitor="gpu")
    with pytest.raises(ConfigError, match="rise from NORMAL"):
        PressureSpec(thresholds=(0.9, 0.8, 0.95, 0.99))
    with pytest.raises(ConfigError, match="max_wait"):
        PressureSpec(max_wait=-1)
