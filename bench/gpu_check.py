"""kvtier's CUDA paths on a real GPU, checked and measured in one short run.

Five parts, each recorded even when another one fails:

a. **tests**: the test files that hold CUDA tests (``tests/test_storage_device.py``,
   ``tests/test_pressure_monitors.py``, ``tests/test_placement.py``,
   ``tests/test_tier_checksum_flips.py``, ``tests/test_layer_loads.py``) run under
   pytest in a child process; passed / failed / skipped counts per file and
   every skip reason come from its JUnit XML.
b. **correctness**: a tiny random-weight Llama (built from a transformers
   ``LlamaConfig``, nothing downloaded) on the device, served by kvtier's
   :class:`~kvtier.engine.Engine` on the same device, gives the same greedy
   tokens as Hugging Face ``generate`` on that device: requests one at a
   time, all in one batch, preempted by a pool too small for all of them,
   through a host tier of pinned buffers (prefixes evicted from the pool and
   loaded back; again with the loads landing layer by layer, whose CUDA
   copies are counted by kind: one 2-D copy, or a staged one), swapped to
   that host tier on preemption, and (informative,
   lossy) through an int8 device tier. A float16 batch is reported too.
c. **throughput**: blocks of SmolLM2-135M's geometry (30 layers, 3 KV heads,
   head dim 64, 16 tokens per block) in float16 and float32, in a
   ``KVBlockStorage`` on the device, stored to a host tier and loaded back
   through a ``TierChain`` (store: copy out; load: check the headers, copy
   in; a host tier keeps no payload checksum, docs/tiers.md says why; every
   load checked bit-exact; the tier's free slots
   come back in reverse after each run, so the runs alternate between slots
   in order, where runs of blocks move with one copy, and slots in reverse,
   one copy per block). The ceiling moves the
   same bytes in the same run without kvtier: one ``copy_`` between the
   device tensor and a preallocated pinned host buffer, ``non_blocking``,
   then a synchronize. Per-block copies, per-block copies each followed by a
   synchronize, per-block copies with each block's xxh3 taken after its
   copy's event, and xxh3 alone over the host bytes (on one thread, and on
   kvtier's checksum pool) are reported beside it, to say where kvtier's
   time goes, and so is kvtier's own time per block (the same store and load
   of blocks of a kilobyte, where the copies cost next to nothing). Figures
   are medians over ``--repeat`` repeats after one warm-up; within a repeat
   the systems take turns, in an order rotated per repeat.
d. **pressure**: ``torch.cuda.mem_get_info`` and NVML (when ``pynvml``
   imports) monitors, each behind a :class:`~kvtier.pressure.PressureController`
   with the default ladder, are read while the script allocates device memory
   in ``--pressure-steps`` steps up to ``--pressure-fraction`` of the free
   memory and frees it again step by step; the modes each went through are
   recorded.
e. **ttft**: time to first token with a cached prefix of 2k, 8k and 32k
   tokens on random-weight models of Llama-3.1-8B's and Qwen3-30B-A3B's
   geometry in bfloat16, recomputed, found on the device, loaded from a host
   tier and from a disk tier, next to one pinned ``copy_`` of the prefix's KV
   bytes (:mod:`gpu_ttft`, whose options are ``--ttft-...`` here).

The device name, torch and transformers versions and every figure are
printed as tables and written to ``OUT/gpu_check.json`` (rewritten after each
part, so a run cut short keeps what it finished); pytest's output goes to
``OUT/pytest.log``. ``--device cpu`` runs the same code without a GPU (the
CUDA-only figures are then meaningless; it exists to debug the script).

    python bench/gpu_check.py --device cuda --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import gc
import random
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gpu_ttft
from _common import REPO, format_table, git_state, machine_info, median, package_version, write_json

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the tiny model's character tokenizer

import torch
import xxhash

from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.manager import KVCacheManager
from kvtier.offload.chain import TierChain
from kvtier.offload.codec import checksum_workers
from kvtier.offload.device_tier import DeviceStore
from kvtier.offload.host import HostStore
from kvtier.offload.tier import Tier
from kvtier.offload.transfer import checksums, chunks
from kvtier.storage import KVBlockStorage

TEST_FILES = (
    "tests/test_storage_device.py",
    "tests/test_pressure_monitors.py",
    "tests/test_placement.py",
    "tests/test_tier_checksum_flips.py",
    "tests/test_layer_loads.py",
)
#: SmolLM2-135M's KV geometry (the default model's).
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def say(text: str = "") -> None:
    print(text, flush=True)


def xxh3(row: torch.Tensor, seed: int) -> int:
    """The checksum kvtier's host tier takes of a block's bytes."""
    return xxhash.xxh3_64_intdigest(row.numpy().data, seed)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Report:
    """The results so far, written to ``OUT/gpu_check.json`` after every part."""

    def __init__(self, out: Path, payload: dict[str, Any]) -> None:
        self.path = out / "gpu_check.json"
        self.payload = payload
        self.save()

    def part(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        say(f"\n== {name} ==")
        started = time.perf_counter()
        try:
            result = fn()
        except BaseException as exc:  # a failed part is a result; the others still run
            if isinstance(exc, KeyboardInterrupt):
                raise
            text = traceback.format_exc()
            say(text)
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": text}
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.payload[name] = result
        say(f"-- {name}: {'ok' if result.get('ok') else 'NOT OK'} ({result['seconds']} s)")
        self.save()

    def save(self) -> None:
        write_json(self.path, self.payload)


# -- environment ---------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": package_version("transformers"),
        "tokenizers": package_version("tokenizers"),
        "huggingface_hub": package_version("huggingface_hub"),
        "xxhash": package_version("xxhash"),
        "checksum_workers": checksum_workers(),
        "nvidia_ml_py": package_version("nvidia-ml-py"),
        "machine": machine_info(),
        "git": git_state(REPO),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(
            device_name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            multiprocessors=props.multi_processor_count,
            memory_total=int(total),
            memory_free=int(free),
            allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    else:
        info["device_name"] = f"cpu ({info['machine']['cpu']})"
    rows = [(k, info[k]) for k in info if k not in ("machine", "git")]
    say(format_table(["what", "value"], rows))
    return info


# -- a. tests --------------------------------------------------------------------------------
def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    junit = out / "pytest-junit.xml"
    env = dict(__import__("os").environ)
    env["PYTHONPATH"] = ":".join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rA",
        f"--junitxml={junit}",
        *TEST_FILES,
    ]
    say(" ".join(cmd))
    started = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, log_text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = -1
        parts = [
            p.decode(errors="replace") if isinstance(p, bytes) else p or ""
            for p in (exc.stdout, exc.stderr)
        ]
        log_text = "".join(parts) + f"\n(timed out after {timeout} s)"
    (out / "pytest.log").write_text(log_text, encoding="utf-8")
    result: dict[str, Any] = {
        "command": " ".join(cmd[1:]),
        "returncode": rc,
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": log_text.strip().splitlines()[-1] if log_text.strip() else "",
    }
    per_file: dict[str, dict[str, int]] = {}
    skips: list[str] = []
    failures: list[str] = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            # "tests.test_x" or, for a test class, "tests.test_x.TestClass".
            parts = (case.get("classname") or "").split(".")
            file = next((p for p in parts if p.startswith("test_")), parts[-1])
            counts = per_file.setdefault(file, {"passed": 0, "failed": 0, "skipped": 0})
            if case.find("skipped") is not None:
                counts["skipped"] += 1
                skipped = case.find("skipped")
                assert skipped is not None
                skips.append(f"{name}: {skipped.get('message')}")
            elif case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
                failures.append(name)
            else:
                counts["passed"] += 1
        junit.unlink()
    result.update(per_file=per_file, skips=skips, failures=failures)
    total = {k: sum(c[k] for c in per_file.values()) for k in ("passed", "failed", "skipped")}
    result["total"] = total
    result["ok"] = rc == 0 and total["failed"] == 0 and total["passed"] > 0
    say(
        format_table(
            ["file", "passed", "failed", "skipped"],
            [(f, c["passed"], c["failed"], c["skipped"]) for f, c in per_file.items()],
        )
    )
    say(result["summary"])
    for line in skips + [f"FAILED {f}" for f in failures]:
        say(f"  {line}")
    return result


# -- b. correctness ------------------------------------------------------------------------------
def tiny_llama(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """A 3-layer random Llama (4 query heads, 2 KV heads) over a character tokenizer."""
    from tiny_model import tiny_tokenizer  # type: ignore[import-not-found]
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval(), tok


def make_prompts(n: int, seed: int, length: int, shared: int = 20) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids; the first ``shared`` are common to all."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(5, 90, (shared,), generator=g).tolist()
    return [
        common + torch.randint(5, 90, (length - shared,), generator=g).tolist() for _ in range(n)
    ]


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def engine_batch(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt added at once and stepped to the end: each one's tokens."""
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
        steps += 1
        if steps > 5000:
            raise RuntimeError("the engine made no progress in 5000 steps")
    return [got[r] for r in rids]


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    diverged = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            at = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
            diverged.append({"prompt": i, "first_diff": at, "got": g, "want": w})
    return {"prompts": len(want), "matching": len(want) - len(diverged), "diverged": diverged}


def correctness(device: torch.device, new_tokens: int) -> dict[str, Any]:
    from kvtier.costs import CostModel
    from kvtier.engine import Engine, SamplingParams

    pin = device.type == "cuda"
    model, tok = tiny_llama(device, torch.float32)
    cases: dict[str, dict[str, Any]] = {}
    required: list[str] = []

    def engine(**kw: Any) -> Any:
        kw.setdefault("block_size", 4)
        return Engine(model, tok, model_id="tiny-gpu-check", **kw)

    def record(
        name: str,
        got: list[list[int]],
        want: list[list[int]],
        eng: Any,
        must_match: bool = True,
        **extra: Any,
    ) -> None:
        c = compare(got, want)
        c.update(extra)
        c["engine_device"] = str(eng.device)
        c["storage_device"] = str(eng.storage.device)
        c["preemptions"] = int(eng.counters.preemptions)
        c["loaded_prompt_tokens"] = int(eng.counters.loaded_prompt_tokens)
        if eng.tier_chain is not None:
            eng.tier_chain.flush()
            c["tiers"] = {
                name: {k: st[k] for k in ("stored_blocks", "loaded_blocks", "corrupt_blocks")}
                for name, st in eng.tier_chain.stats().items()
            }
            eng.tier_chain.check()
        eng.manager.check()
        c["must_match"] = must_match
        cases[name] = c
        if must_match:
            required.append(name)

    # Requests one at a time, then all in one batch (shared prefix, mixed lengths).
    prompts = make_prompts(4, seed=1, length=29)
    prompts += [p[: 20 + 3 * i] for i, p in enumerate(make_prompts(2, seed=2, length=37))]
    want = [hf_greedy(model, p, new_tokens) for p in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    eng = engine(num_blocks=256)
    solo = [[t for o in eng.generate(p, params) for t in o.token_ids] for p in prompts]
    record("one at a time", solo, want, eng)
    eng = engine(num_blocks=256)
    record("one batch", engine_batch(eng, prompts, new_tokens), want, eng)

    # Preemption: 12 blocks of 4 tokens cannot hold three requests of 23 + 10 tokens.
    small = make_prompts(3, seed=13, length=23)
    want_small = [hf_greedy(model, p, 10) for p in small]
    eng = engine(num_blocks=12, max_num_seqs=3)
    got = engine_batch(eng, small, 10)
    record("preempted (12-block pool)", got, want_small, eng)
    if cases["preempted (12-block pool)"]["preemptions"] == 0:
        cases["preempted (12-block pool)"]["diverged"].append("no preemption happened")

    # Host tier of pinned buffers: a 20-block pool evicts prefixes, the second round loads them.
    host = HostStore(pin_memory=pin)
    eng = engine(num_blocks=20, tiers=[Tier(host, 32)])
    rounds = [engine_batch(eng, [p], new_tokens)[0] for _ in range(2) for p in prompts]
    pinned = bool(host.row(0).is_pinned())
    record("host tier (pinned) round trip", rounds, want + want, eng, host_rows_pinned=pinned)
    c = cases["host tier (pinned) round trip"]
    if pin and not pinned:
        c["diverged"].append("host tier rows are not pinned")
    if c["tiers"]["host"]["loaded_blocks"] == 0:
        c["diverged"].append("nothing was loaded back from the host tier")

    # The same, each load landing layer by layer while the forward pass starts.
    eng = engine(num_blocks=20, tiers=[Tier(HostStore(pin_memory=pin), 32)], tier_layer_loads=True)
    slow = CostModel(decay=1.0)  # computing looks slow: every prefix the tier holds loads
    for n in (16, 64, 256):
        slow.observe_pass([(0, n)], 1.0 * n)
    eng.connector.costs = slow
    rounds = [engine_batch(eng, [p], new_tokens)[0] for _ in range(2) for p in prompts]
    record(
        "host tier, loads by layer",
        rounds,
        want + want,
        eng,
        layer_fills=eng.storage.fills,
        fill_copies=dict(getattr(eng.storage, "fill_copies", {})),
    )
    c = cases["host tier, loads by layer"]
    if eng.storage.fills == 0:
        c["diverged"].append("no load landed layer by layer")

    # Preemption swapping requests out to the host tier and back.
    eng = engine(num_blocks=12, max_num_seqs=3, tiers=[Tier(HostStore(pin_memory=pin), 32)])
    record("preempted, swapped to host tier", engine_batch(eng, small, 10), want_small, eng)
    c = cases["preempted, swapped to host tier"]
    if c["preemptions"] == 0 or c["loaded_prompt_tokens"] == 0:
        c["diverged"].append("no preemption, or nothing came back from the host tier")

    # Informative: the int8 device tier above the host tier (lossy, so tokens may differ).
    eng = engine(
        num_blocks=20,
        tiers=[Tier(DeviceStore(device), 16, codec="int8"), Tier(HostStore(pin_memory=pin), 32)],
    )
    rounds = [engine_batch(eng, [p], new_tokens)[0] for _ in range(2) for p in prompts]
    record("int8 device tier + host (lossy)", rounds, want + want, eng, must_match=False)

    # Informative: float16 model and cache, one batch.
    model16, _ = tiny_llama(device, torch.float16)
    want16 = [hf_greedy(model16, p, new_tokens) for p in prompts]
    eng = Engine(model16, tok, model_id="tiny-gpu-check-fp16", block_size=4, num_blocks=256)
    record(
        "float16 one batch", engine_batch(eng, prompts, new_tokens), want16, eng, must_match=False
    )

    rows = []
    for name, c in cases.items():
        tiers = c.get("tiers", {})
        loaded = sum(t["loaded_blocks"] for t in tiers.values())
        corrupt = sum(t["corrupt_blocks"] for t in tiers.values())
        rows.append(
            (
                name,
                f"{c['matching']}/{c['prompts']}",
                c["preemptions"],
                c["loaded_prompt_tokens"],
                loaded,
                corrupt,
                "required" if c["must_match"] else "info",
            )
        )
    say(
        format_table(
            [
                "case",
                "tokens match HF",
                "preemptions",
                "loaded prompt tokens",
                "tier blocks loaded",
                "corrupt",
                "kind",
            ],
            rows,
        )
    )
    for name, c in cases.items():
        for d in c["diverged"]:
            say(f"  {name}: {d}")
    ok = all(not cases[n]["diverged"] for n in required)
    return {"ok": ok, "new_tokens": new_tokens, "cases": cases}


# -- c. throughput ---------------------------------------------------------------------------------
class Rig:
    """``n`` random source blocks and ``n`` empty ones in a device storage, a host tier chain,
    and a pinned host buffer of the same bytes for the ceilings."""

    def __init__(self, layout: KVLayout, n: int, device: torch.device) -> None:
        self.layout = layout
        self.n = n
        self.device = device
        self.storage = KVBlockStorage(layout, 2 * n, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        self.storage.tensor[:n].normal_(generator=gen)
        self.manager = KVCacheManager(
            2 * n, layout.block_size, namespace=Namespace("gpu-check", layout)
        )
        self.host = HostStore(pin_memory=device.type == "cuda")
        self.tier = Tier(self.host, n, codec="raw")
        self.chain = TierChain(self.storage, self.manager, [self.tier], write_mode="write_through")
        self.bpb = self.storage.bytes_per_block
        pin = device.type == "cuda"
        self.buf = torch.empty((n, self.bpb), dtype=torch.uint8, pin_memory=pin)
        self.src_u8 = self.storage.tensor[:n].reshape(n, -1).view(torch.uint8)
        self.dst_u8 = self.storage.tensor[n:].reshape(n, -1).view(torch.uint8)
        self.rng = random.Random(0)
        self.async_copy = pin

    @property
    def nbytes(self) -> int:
        return self.n * self.bpb

    def clear(self) -> None:
        self.dst_u8.zero_()
        sync(self.device)

    def check(self, what: str) -> None:
        sync(self.device)
        if not torch.equal(self.src_u8, self.dst_u8):
            raise RuntimeError(f"{what}: loaded blocks differ from the stored ones")

    def kvtier(self) -> dict[str, float]:
        keys = [self.rng.getrandbits(128) for _ in range(self.n)]
        src, dst = list(range(self.n)), list(range(self.n, 2 * self.n))
        self.clear()
        t0 = time.perf_counter()
        self.chain.store_blocks(0, keys, src)
        self.chain.flush()
        sync(self.device)
        t1 = time.perf_counter()
        held = self.tier.offload_manager.lookup(keys)
        if held != self.n:
            raise RuntimeError(f"the host tier holds {held} of {self.n} stored blocks")
        t2 = time.perf_counter()
        got = self.chain.load(keys, dst)
        sync(self.device)
        t3 = time.perf_counter()
        if got != self.n:
            raise RuntimeError(f"loaded {got} of {self.n} blocks: {self.chain.stats()}")
        self.check("kvtier")
        self.tier.offload_manager.remove(keys)
        self.chain.take_events()
        return {"store": t1 - t0, "load": t3 - t2}

    def ceiling(self) -> dict[str, float]:
        nb = self.async_copy
        self.clear()
        t0 = time.perf_counter()
        self.buf.copy_(self.src_u8, non_blocking=nb)
        sync(self.device)
        t1 = time.perf_counter()
        self.dst_u8.copy_(self.buf, non_blocking=nb)
        sync(self.device)
        t2 = time.perf_counter()
        self.check("ceiling")
        return {"store": t1 - t0, "load": t2 - t1}

    def per_block(self, each_sync: bool) -> dict[str, float]:
        nb = self.async_copy
        self.clear()
        t0 = time.perf_counter()
        for i in range(self.n):
            self.buf[i].copy_(self.src_u8[i], non_blocking=nb)
            if each_sync:
                sync(self.device)
        sync(self.device)
        t1 = time.perf_counter()
        for i in range(self.n):
            self.dst_u8[i].copy_(self.buf[i], non_blocking=nb)
            if each_sync:
                sync(self.device)
        sync(self.device)
        t2 = time.perf_counter()
        self.check("per-block copies")
        return {"store": t1 - t0, "load": t2 - t1}

    def overlapped(self) -> dict[str, float]:
        """Per-block copies with each block's xxh3 overlapping the copies after it.

        What a host tier that checksums every block could reach on one thread.
        """
        nb = self.async_copy
        cuda = self.device.type == "cuda"
        self.clear()
        events: list[Any] = []
        t0 = time.perf_counter()
        for i in range(self.n):
            self.buf[i].copy_(self.src_u8[i], non_blocking=nb)
            if cuda:
                events.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
                events[-1].record()
        for i in range(self.n):
            if cuda:
                events[i].synchronize()
            xxh3(self.buf[i], i)
        t1 = time.perf_counter()
        for i in range(self.n):
            xxh3(self.buf[i], i)
            self.dst_u8[i].copy_(self.buf[i], non_blocking=nb)
        sync(self.device)
        t2 = time.perf_counter()
        self.check("overlapped copies")
        return {"store": t1 - t0, "load": t2 - t1}

    def per_block_async(self) -> dict[str, float]:
        return self.per_block(each_sync=False)

    def per_block_synced(self) -> dict[str, float]:
        return self.per_block(each_sync=True)

    def checksum(self) -> dict[str, float]:
        t0 = time.perf_counter()
        for i in range(self.n):
            xxh3(self.buf[i], i)
        t = time.perf_counter() - t0
        return {"store": t, "load": t}

    def checksum_pool(self) -> dict[str, float]:
        """xxh3 of the host bytes in kvtier's chunks, on its checksum pool."""
        width = self.bpb
        parts = [(self.buf[i], [i], [width]) for i in range(self.n)]
        t0 = time.perf_counter()
        pending = [checksums(parts[s : s + c], parallel=True) for s, c in chunks([width] * self.n)]
        for p in pending:
            p.result()
        t = time.perf_counter() - t0
        return {"store": t, "load": t}

    def close(self) -> None:
        self.chain.close()


SYSTEMS = (
    "kvtier",
    "ceiling",
    "per-block copies",
    "per-block copies + sync",
    "per-block copies overlapped with xxh3",
    "xxh3 of host bytes",
    "xxh3 of host bytes, checksum pool",
)


def throughput(device: torch.device, mib: int, repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    rows = []
    ratios: list[float] = []
    for dtype in ("float16", "float32"):
        layout = replace(SMOLLM2, dtype=dtype)
        n = max(1, (mib << 20) // layout.bytes_per_block)
        rig = Rig(layout, n, device)
        runs: dict[str, Callable[[], dict[str, float]]] = {
            "kvtier": rig.kvtier,
            "ceiling": rig.ceiling,
            "per-block copies": rig.per_block_async,
            "per-block copies + sync": rig.per_block_synced,
            "per-block copies overlapped with xxh3": rig.overlapped,
            "xxh3 of host bytes": rig.checksum,
            "xxh3 of host bytes, checksum pool": rig.checksum_pool,
        }
        times: dict[str, dict[str, list[float]]] = {s: {"store": [], "load": []} for s in runs}
        order = list(runs)
        for r in range(repeat + 1):
            for s in order[r % len(order) :] + order[: r % len(order)]:
                t = runs[s]()
                if r:  # the first repeat warms up
                    for d in ("store", "load"):
                        times[s][d].append(t[d])
        gbps = {
            s: {d: rig.nbytes / median(times[s][d]) / 1e9 for d in ("store", "load")} for s in runs
        }
        entry: dict[str, Any] = {
            "blocks": n,
            "bytes_per_block": rig.bpb,
            "bytes": rig.nbytes,
            "gb_per_s": gbps,
            "seconds": {s: {d: times[s][d] for d in times[s]} for s in times},
        }
        for d in ("store", "load"):
            ratio = gbps["kvtier"][d] / gbps["ceiling"][d]
            entry[f"kvtier_over_ceiling_{d}"] = ratio
            ratios.append(ratio)
            for s in SYSTEMS:
                rows.append(
                    (dtype, d, s, f"{gbps[s][d]:.2f}", f"{gbps[s][d] / gbps['ceiling'][d]:.0%}")
                )
        results[dtype] = entry
        rig.close()
        del rig
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    say(f"{mib} MiB of blocks per run, median of {repeat} repeats after one warm-up")
    say(format_table(["dtype", "direction", "system", "GB/s", "of ceiling"], rows))
    goal = 0.8
    met = all(r >= goal for r in ratios)
    say(f"kvtier/ceiling goal {goal:.0%}: {'met' if met else 'NOT met'} (lowest {min(ratios):.0%})")
    per_block = bookkeeping(device, repeat)
    say(
        f"kvtier's own time per block (blocks of {per_block['bytes_per_block']} bytes, "
        f"next to nothing to copy): store {per_block['store_us']:.2f} us, "
        f"load {per_block['load_us']:.2f} us"
    )
    return {
        "ok": True,
        "mib": mib,
        "repeat": repeat,
        "goal": goal,
        "goal_met": met,
        "results": results,
        "bookkeeping": per_block,
    }


def bookkeeping(device: torch.device, repeat: int, n: int = 1456) -> dict[str, Any]:
    """kvtier's time per block when the copies cost next to nothing: ``n`` blocks of one
    layer, one head of 8 (a kilobyte in float32) stored and loaded like the runs above. A
    block's copy at the ceiling's bandwidth next to this says what share of the ceiling
    kvtier can reach, and how much of the gap is bookkeeping rather than copying."""
    rig = Rig(replace(SMOLLM2, num_layers=1, num_kv_heads=1, head_dim=8), n, device)
    try:
        rig.kvtier()  # warm-up
        runs = [rig.kvtier() for _ in range(max(3, repeat))]
    finally:
        rig.close()
    return {
        "blocks": n,
        "bytes_per_block": rig.bpb,
        "store_us": median([r["store"] for r in runs]) / n * 1e6,
        "load_us": median([r["load"] for r in runs]) / n * 1e6,
    }


# -- d. pressure ----------------------------------------------------------------------------------
def pressure(device: torch.device, steps: int, fraction: float, cpu_mib: int) -> dict[str, Any]:
    from kvtier.errors import MonitorUnavailableError
    from kvtier.pressure import (
        HostMemoryMonitor,
        Mode,
        NvmlMonitor,
        PressureController,
        TorchCudaMonitor,
    )

    gc.collect()
    controllers: dict[str, PressureController] = {}
    unavailable: dict[str, str] = {}
    factories: list[tuple[str, Callable[[], Any]]]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.empty_cache()
        factories = [
            ("torch.cuda", lambda: TorchCudaMonitor(index)),
            ("nvml", lambda: NvmlMonitor(index)),
        ]
        free, total = torch.cuda.mem_get_info(device)
        target = int(free * fraction)
    else:
        factories = [("host", HostMemoryMonitor)]
        free, total = 0, 0
        target = cpu_mib << 20  # a dry run: a little host memory, not 90% of a shared machine
    for name, make in factories:
        try:
            controllers[name] = PressureController(make())
        except MonitorUnavailableError as exc:
            unavailable[name] = str(exc)
    chunk = max(1, target // steps)
    held: list[torch.Tensor] = []
    trace: list[dict[str, Any]] = []

    def read(phase: str) -> None:
        sync(device)
        row: dict[str, Any] = {"phase": phase, "held_bytes": sum(t.numel() for t in held)}
        for name, c in controllers.items():
            mode = c.sample()
            row[name] = {"fraction": round(c.fraction, 4), "mode": mode.name}
        trace.append(row)

    try:
        read("start")
        for _ in range(steps):
            held.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            if device.type == "cpu":
                held[-1].fill_(1)  # host pages count once touched
            read("allocate")
        while held:
            held.pop()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            read("free")
    finally:
        held.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows = []
    for row in trace:
        cells: list[object] = [row["phase"], f"{row['held_bytes'] / 2**30:.2f}"]
        for name in controllers:
            cells += [f"{row[name]['fraction']:.1%}", row[name]["mode"]]
        rows.append(cells)
    headers = ["phase", "held GiB"]
    for name in controllers:
        headers += [f"{name} used", f"{name} mode"]
    say(
        f"free at start {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB; "
        f"{steps} steps of {chunk / 2**30:.2f} GiB"
    )
    say(format_table(headers, rows))
    modes: dict[str, list[str]] = {}
    for name, c in controllers.items():
        walk = [Mode.RELAXED.name] + [ch.new.name for ch in c.timeline]
        modes[name] = walk
        say(f"{name}: {' -> '.join(walk)}")
        c.close()
    for name, why in unavailable.items():
        say(f"{name}: unavailable ({why})")
    ok = bool(controllers) and all(
        len(w) > 1 and w[-1] in (Mode.RELAXED.name, w[0]) for w in modes.values()
    )
    if device.type == "cpu":
        ok = bool(controllers)  # a few MiB of a shared host move no mode
    return {
        "ok": ok,
        "free_at_start": int(free),
        "total": int(total),
        "steps": steps,
        "chunk_bytes": int(chunk),
        "target_fraction_of_free": fraction,
        "modes": modes,
        "unavailable": unavailable,
        "trace": trace,
        "ladder_thresholds": {"NORMAL": 0.5, "PRESSURE": 0.8, "CRITICAL": 0.9, "EMERGENCY": 0.97},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device to check (default: cuda)")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "results" / "gpu_check",
        help="directory for gpu_check.json and pytest.log",
    )
    p.add_argument(
        "--parts",
        default="tests,correctness,throughput,pressure,ttft",
        help="comma-separated parts to run (default: all five)",
    )
    p.add_argument("--test-timeout", type=float, default=240.0, help="seconds for pytest")
    p.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per request")
    p.add_argument(
        "--mib", type=int, default=512, help="MiB of blocks per throughput run (default 512)"
    )
    p.add_argument("--repeat", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--pressure-steps", type=int, default=10)
    p.add_argument(
        "--pressure-fraction",
        type=float,
        default=0.9,
        help="share of the free device memory to allocate (default 0.9)",
    )
    p.add_argument(
        "--cpu-pressure-mib",
        type=int,
        default=64,
        help="host MiB the pressure part allocates with --device cpu",
    )
    gpu_ttft.add_arguments(p, prefix="ttft-")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if not 0 < args.pressure_fraction < 1:
        raise SystemExit("--pressure-fraction must be within (0, 1)")
    if args.ttft_prefixes is not None and any(n < 1 for n in args.ttft_prefixes):
        raise SystemExit("--ttft-prefixes must be positive token counts")
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    say("== environment ==")
    report = Report(
        args.out,
        {"environment": environment(device), "args": {k: str(v) for k, v in vars(args).items()}},
    )
    if "tests" in parts:
        report.part("tests", lambda: run_tests(args.out, args.test_timeout))
    if "correctness" in parts:
        report.part("correctness", lambda: correctness(device, args.new_tokens))
    if "throughput" in parts:
        report.part("throughput", lambda: throughput(device, args.mib, args.repeat))
    if "pressure" in parts:
        report.part(
            "pressure",
            lambda: pressure(
                device, args.pressure_steps, args.pressure_fraction, args.cpu_pressure_mib
            ),
        )
    if "ttft" in parts:
        report.part("ttft", lambda: gpu_ttft.ttft_from_args(device, args, prefix="ttft-"))
    say("\n== summary ==")
    say(
        f"device: {report.payload['environment']['device_name']}, torch {torch.__version__}, "
        f"transformers {report.payload['environment']['transformers']}"
    )
    ok = {name: bool(report.payload.get(name, {}).get("ok")) for name in parts}
    for name in parts:
        say(f"{name}: {'ok' if ok[name] else 'NOT OK'}")
    say(f"results: {report.path}")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
