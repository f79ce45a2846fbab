"""Offload tiers on the real model's blocks: throughput against raw ceilings, and TTFT.

Part 1, throughput. The blocks are SmolLM2-135M's (30 layers, 3 KV heads,
head dim 64, 16 tokens per block, float32: 737,280 bytes a block). A CPU
``KVBlockStorage`` holds ``--blocks`` blocks of random values plus as many
empty ones. For each tier (host memory, disk, one Redis server) and codec
(raw, int8, fp8), a ``TierChain`` with that single tier stores the blocks
(``store_blocks`` then ``flush``: encode, checksum, write) and loads them
back into the empty blocks (``load``: read, verify the checksum, decode,
write into the device blocks). Next to each, in the same repeat and on the
same bytes, a raw ceiling moves the blocks' bytes without kvtier:

* host: one ``torch`` ``copy_`` per block into a preallocated host buffer
  and back;
* disk: one file per block of the same size (header + payload), written
  sequentially with ``open``/``write`` into a directory on the same file
  system, then read back with ``readinto`` straight into the destination
  blocks;
* Redis: redis-py pipelined SETs of values of the same size to the same
  server (the values built before the clock starts), then pipelined GETs,
  with the client configured as kvtier's (hiredis reply parsing where it is
  installed, values sent without a copy).

Throughput is block bytes (fp32, what the device gives and gets back) per
second, so a codec that stores fewer bytes can beat the ceiling on media
where bytes cost time. The disk runs see the page cache as it is: freshly
written files are read back from memory. A second disk row
(``load-cold``) reads after each file was fsynced and dropped from the page
cache (``posix_fadvise`` DONTNEED, per file: the machine's other files keep
theirs), for both kvtier and the ceiling; those runs come after all the
others, so their fsyncs do not slow the page-cache writes. Within a tier,
kvtier's codecs and the ceiling alternate, in an order rotated per repeat.
Every figure is the median over ``--repeat`` repeats (after one warm-up
repeat that is not counted); every load is checked (raw: bit-exact;
int8/fp8: small error) outside the timings.

Part 2, time to first token on the real model, the workload of
``bench/ttft.py``: a shared prefix of ``--prefix-tokens`` tokens, then a new
64-token question per sample, one generated token. The prefix sits:

* in the device pool (an engine without tiers; the baseline);
* on a tier (the compressed device tier with int8, host, disk, disk with the
  page cache dropped, Redis): an engine with only that tier,
  ``write_mode="write_through"``, computed the prefix once (so it was stored
  while computed), then its device cache was emptied
  (``reset_prefix_cache``); every sample loads the prefix from the tier and
  the device cache is emptied again after it;
* nowhere: the same engine with prefix caching off (recompute).

TTFT is ``RequestMetrics.ttft`` (request handed over to first token).
Systems alternate per question in an order rotated per question. Outside the
timings each system's first token is checked against a full forward pass
(counted, not required, for the int8 device tier, whose blocks come back
rounded), and the reused tokens against the prefix length (all of them
loaded from the tier for the tier systems, none for the device).

Run ``python bench/tiers.py --help``. Results go to ``bench/results/tiers.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    median,
    package_version,
    write_json,
)

from kvtier.engine.hf_cache import layout_for_model
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.manager import KVCacheManager
from kvtier.offload.chain import TierChain
from kvtier.offload.codec import HEADER_SIZE, make_codec
from kvtier.offload.device_tier import DeviceStore
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore
from kvtier.offload.tier import Tier
from kvtier.storage import KVBlockStorage

BLOCK_SIZE = 16
QUESTION_TOKENS = 64
CODECS = ("raw", "int8", "fp8")
TARGET_RATIO = 0.80
#: Disk tiers read with ``direct_reads`` (``--disk-direct-reads``).
DIRECT_READS = False


# -- redis-server ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port; yields its URL."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    port = _free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# -- part 1: throughput ---------------------------------------------------------------------


def drop_page_cache(paths: list[Path]) -> None:
    """Write ``paths`` to disk and drop their pages from the page cache (these files only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class Rig:
    """A device storage with ``n`` random source blocks and ``n`` destination blocks."""

    layout: KVLayout
    n: int
    storage: KVBlockStorage
    manager: KVCacheManager
    src: list[int]
    dst: list[int]
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @property
    def block_bytes(self) -> int:
        return self.storage.bytes_per_block

    def keys(self) -> list[int]:
        return [self.rng.getrandbits(128) for _ in range(self.n)]

    def clear_dst(self) -> None:
        self.storage.tensor[self.n :].zero_()

    def block_u8(self, b: int) -> torch.Tensor:
        return self.storage.tensor[b].view(-1).view(torch.uint8)

    def check(self, codec: str) -> float:
        """Max |loaded - stored| relative to the blocks' max |value|; raw must be exact."""
        a = self.storage.tensor[: self.n]
        b = self.storage.tensor[self.n :]
        if codec == "raw":
            if not torch.equal(a, b):
                raise SystemExit("check failed: raw blocks did not load back bit-exact")
            return 0.0
        err = float((a - b).abs().amax() / a.abs().amax())
        if not err < 0.1:
            raise SystemExit(f"check failed: {codec} blocks loaded back with relative error {err}")
        return err


def make_rig(layout: KVLayout, n: int, model_id: str) -> Rig:
    storage = KVBlockStorage(layout, 2 * n)
    manager = KVCacheManager(2 * n, layout.block_size, namespace=Namespace(model_id, layout))
    gen = torch.Generator().manual_seed(0)
    storage.tensor[:n].normal_(generator=gen)
    return Rig(layout, n, storage, manager, list(range(n)), list(range(n, 2 * n)))


class KvTierPath:
    """One tier (kind + codec) in a chain of its own, kept across repeats."""

    def __init__(self, rig: Rig, kind: str, codec: str, root: Path, redis_url: str | None) -> None:
        self.rig = rig
        self.kind = kind
        self.codec = codec
        if kind == "host":
            store: Any = HostStore()
        elif kind == "disk":
            self.dir = Path(tempfile.mkdtemp(prefix=f"kvtier-{codec}-", dir=root))
            store = DiskStore(self.dir, direct_reads=DIRECT_READS)
        else:
            from kvtier.offload.redis_store import RedisStore

            store = RedisStore(redis_url)
        self.store = store
        self.tier = Tier(store, rig.n, codec=codec)
        self.chain = TierChain(rig.storage, rig.manager, [self.tier], write_mode="write_through")

    def run(self, cold: bool) -> tuple[dict[str, float], float]:
        """Store then load the rig's blocks under fresh keys: timings and the load's error.

        Warm: store and load timed. Cold: the store is not timed; the files
        are fsynced and dropped from the page cache, then the load is timed.
        """
        rig, chain = self.rig, self.chain
        keys = rig.keys()
        rig.clear_dst()
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        chain.store_blocks(0, keys, rig.src)
        chain.flush()
        if not cold:
            out["store"] = time.perf_counter() - t0
        if self.tier.offload_manager.lookup(keys) != rig.n:
            stats = chain.stats()[self.tier.name]
            raise SystemExit(f"{self.kind}/{self.codec}: stored {stats}, not all {rig.n} blocks")
        if cold:
            drop_page_cache([self.store.path(k) for k in keys])
        t0 = time.perf_counter()
        got = chain.load(keys, rig.dst)
        out["load-cold" if cold else "load"] = time.perf_counter() - t0
        if got != rig.n:
            raise SystemExit(f"{self.kind}/{self.codec}: loaded {got} of {rig.n} blocks")
        err = rig.check(self.codec)
        # Outside the timings: forget this repeat's blocks so the next one starts empty.
        self.tier.offload_manager.remove(keys)
        items = [(k, -1) for k in keys]
        if self.kind == "disk":
            self.store.delete(items)
        elif self.kind == "redis":
            self.store.purge(items)
        chain.take_events()
        return out, err

    def close(self) -> None:
        self.chain.close()
        if self.kind == "disk":
            shutil.rmtree(self.dir, ignore_errors=True)


class Ceiling:
    """The same bytes moved without kvtier (see the module docstring)."""

    def __init__(self, rig: Rig, kind: str, root: Path, redis_url: str | None) -> None:
        self.rig = rig
        self.kind = kind
        self.blob = HEADER_SIZE + rig.block_bytes
        self.header = bytes(HEADER_SIZE)
        if kind == "host":
            self.rows = torch.empty((rig.n, rig.block_bytes), dtype=torch.uint8)
        elif kind == "disk":
            self.dir = Path(tempfile.mkdtemp(prefix="kvtier-ceiling-", dir=root))
            self.round = 0
        else:
            import redis

            assert redis_url is not None
            from kvtier.offload.redis_store import zero_copy_packer

            # Configured as kvtier's own client is (hiredis parses replies where it
            # is installed, values go out without a copy): the best redis-py does.
            self.client = redis.Redis.from_url(redis_url, command_packer=zero_copy_packer())
            self.round = 0

    def run(self, cold: bool) -> dict[str, float]:
        """Move the rig's blocks out and back; ``cold`` (disk): time only an uncached read."""
        rig = self.rig
        rig.clear_dst()
        src = [rig.block_u8(b) for b in rig.src]
        dst = [rig.block_u8(b) for b in rig.dst]
        out: dict[str, float] = {}
        if self.kind == "host":
            rows = self.rows
            t0 = time.perf_counter()
            for i, s in enumerate(src):
                rows[i].copy_(s)
            out["store"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i, d in enumerate(dst):
                d.copy_(rows[i])
            out["load"] = time.perf_counter() - t0
        elif self.kind == "disk":
            self.round += 1
            paths = [self.dir / f"{self.round}-{i:06d}.blk" for i in range(rig.n)]
            header = self.header
            t0 = time.perf_counter()
            for p, s in zip(paths, src, strict=True):
                with open(p, "wb") as f:
                    f.write(header)
                    f.write(s.numpy().data)
            if not cold:
                out["store"] = time.perf_counter() - t0
            else:
                drop_page_cache(paths)
            hbuf = bytearray(HEADER_SIZE)
            t0 = time.perf_counter()
            for p, d in zip(paths, dst, strict=True):
                with open(p, "rb", buffering=0) as f:
                    f.readinto(hbuf)
                    if f.readinto(d.numpy().data) != rig.block_bytes:
                        raise SystemExit(f"short read of {p}")
            out["load-cold" if cold else "load"] = time.perf_counter() - t0
            for p in paths:
                p.unlink()
        else:
            self.round += 1
            names = [f"ceiling:{self.round}:{i}" for i in range(rig.n)]
            values = [self.header + s.numpy().tobytes() for s in src]
            t0 = time.perf_counter()
            pipe = self.client.pipeline(transaction=False)
            for name, v in zip(names, values, strict=True):
                pipe.set(name, v)
            pipe.execute()
            out["store"] = time.perf_counter() - t0
            del values
            t0 = time.perf_counter()
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            got = pipe.execute()
            out["load"] = time.perf_counter() - t0
            if any(v is None or len(v) != self.blob for v in got):
                raise SystemExit("redis ceiling: a value did not come back whole")
            del got
            self.client.delete(*names)
        if self.kind != "redis" and not torch.equal(
            rig.storage.tensor[: rig.n], rig.storage.tensor[rig.n :]
        ):
            raise SystemExit(f"{self.kind} ceiling: blocks did not come back bit-exact")
        return out

    def close(self) -> None:
        if self.kind == "disk":
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.kind == "redis":
            self.client.close()


def throughput(
    layout: KVLayout,
    model_id: str,
    n: int,
    repeat: int,
    kinds: list[str],
    codecs: list[str],
    redis_url: str | None,
) -> dict[str, Any]:
    """Part 1: samples and medians per (tier, codec, direction)."""
    rig = make_rig(layout, n, model_id)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-"))
    samples: dict[str, list[float]] = {}
    errors: dict[str, float] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            samples.setdefault(key, []).append(value)

    paths: dict[tuple[str, str], KvTierPath] = {}
    ceilings: dict[str, Ceiling] = {}
    try:
        for kind in kinds:
            ceilings[kind] = Ceiling(rig, kind, root, redis_url)
            for codec in codecs:
                paths[(kind, codec)] = KvTierPath(rig, kind, codec, root, redis_url)
        # Warm runs first, then the disk's cold reads: their fsyncs and deletions
        # of synced files would otherwise slow the page-cache writes that follow.
        phases = [(kind, False) for kind in kinds]
        if "disk" in kinds:
            phases.append(("disk", True))
        for phase, (kind, cold) in enumerate(phases):
            for r in range(repeat + 1):
                counted = r > 0  # the first repeat warms buffers, files and connections up
                order = ["ceiling", *codecs]
                k = r % len(order)
                for what in order[k:] + order[:k]:
                    if what == "ceiling":
                        times = ceilings[kind].run(cold)
                    else:
                        times, err = paths[(kind, what)].run(cold)
                        errors[f"{kind}|{what}"] = max(errors.get(f"{kind}|{what}", 0.0), err)
                    if counted:
                        for direction, t in times.items():
                            add(f"{kind}|{what}|{direction}", t)
            log(
                f"  throughput: {kind}{' cold reads' if cold else ''} done "
                f"({phase + 1}/{len(phases)})"
            )
    finally:
        for p in paths.values():
            p.close()
        for c in ceilings.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)

    nbytes = n * rig.block_bytes
    med = {k: median(v) for k, v in samples.items()}
    rows = []
    for kind in kinds:
        for direction in ("store", "load", "load-cold"):
            ck = f"{kind}|ceiling|{direction}"
            if ck not in med:
                continue
            ceil_gbs = nbytes / med[ck] / 1e9
            for codec in codecs:
                key = f"{kind}|{codec}|{direction}"
                gbs = nbytes / med[key] / 1e9
                # Each repeat's ceiling time over kvtier's in the same repeat: on a machine
                # others share, a slow moment hits both sides of a pair alike.
                paired = median(
                    [c / t for c, t in zip(samples[ck], samples[key], strict=True)]
                )
                rows.append(
                    {
                        "tier": kind,
                        "codec": codec,
                        "direction": direction,
                        "kvtier_gb_s": gbs,
                        "ceiling_gb_s": ceil_gbs,
                        "ratio": gbs / ceil_gbs,
                        "paired_ratio": paired,
                    }
                )
    return {
        "blocks": n,
        "block_bytes": rig.block_bytes,
        "bytes_per_run": nbytes,
        "stored_bytes_per_block": {
            c: HEADER_SIZE + make_codec(c).payload_size(rig.storage.block_shape, rig.storage.dtype)
            for c in codecs
        },
        "repeat": repeat,
        "samples_s": samples,
        "median_s": med,
        "max_relative_error": errors,
        "rows": rows,
    }


# -- part 2: TTFT ---------------------------------------------------------------------------


def build_prompts(tokenizer: Any, prefix_tokens: int, n: int) -> tuple[list[int], list[list[int]]]:
    """bench/ttft.py's prefix (cut to ``prefix_tokens``) and ``n`` new 64-token questions."""
    from ttft import build_prompts as ttft_prompts

    return ttft_prompts(tokenizer, n, prefix_tokens)


def ttft(
    loaded: Any, prefix_tokens: int, questions_n: int, kinds: list[str], redis_url: str | None
) -> dict[str, Any]:
    """Part 2: TTFT samples per system, every first token checked."""
    from kvtier.engine import Engine, SamplingParams

    model, tok = loaded.model, loaded.tokenizer
    prefix, questions = build_prompts(tok, prefix_tokens, questions_n + 1)
    prefix_blocks = prefix_tokens // BLOCK_SIZE
    num_blocks = (prefix_tokens + QUESTION_TOKENS) // BLOCK_SIZE * 2
    one = SamplingParams(max_tokens=1, temperature=0)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-"))

    def engine(tiers: list[Tier] | None = None, prefix_caching: bool = True) -> Engine:
        return Engine(
            model,
            tok,
            model_id=loaded.model_id,
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            prefix_caching=prefix_caching,
            tiers=tiers or (),
            write_mode="write_through",
        )

    def tier(kind: str) -> Tier:
        cap = prefix_blocks * 2
        if kind == "device":
            return Tier(DeviceStore(), cap, codec="int8")
        if kind == "host":
            return Tier(HostStore(), cap)
        if kind in ("disk", "disk-cold"):
            return Tier(DiskStore(root / kind), cap)
        from kvtier.offload.redis_store import RedisStore

        return Tier(RedisStore(redis_url), cap)

    engines: dict[str, Engine] = {"device (prefix in the pool)": engine()}
    tier_engines: dict[str, Engine] = {}
    for kind in kinds:
        tier_engines[kind] = engine([tier(kind)])
        if kind == "disk":
            # A disk tier of its own: every system sees each question once.
            tier_engines["disk-cold"] = engine([tier("disk-cold")])
    recompute = engine(prefix_caching=False)

    def run(e: Engine, ids: list[int]) -> tuple[float, int, int, int]:
        before = e.counters.loaded_prompt_tokens
        outs = list(e.generate(ids, one))
        m = outs[-1].metrics
        assert m.ttft is not None
        loaded_tokens = e.counters.loaded_prompt_tokens - before
        return m.ttft, outs[-1].token_ids[0], m.cached_tokens, loaded_tokens

    def settle(e: Engine) -> None:
        """Outside the timings: finish background writes and empty the device cache."""
        if e.tier_chain is not None:
            e.tier_chain.flush()
        e.manager.reset_prefix_cache()

    def disk_files() -> list[Path]:
        return sorted((root / "disk-cold").rglob("*.kvb"))

    systems: dict[str, tuple[Engine, bool, bool]] = {}  # engine, from a tier, drop page cache
    systems["device (prefix in the pool)"] = (engines["device (prefix in the pool)"], False, False)
    for kind in kinds:
        systems[f"{kind} tier"] = (tier_engines[kind], True, False)
        if kind == "disk":
            systems["disk tier, page cache dropped"] = (tier_engines["disk-cold"], True, True)
    systems["recompute (prefix caching off)"] = (recompute, False, False)
    names = list(systems)
    samples: dict[str, list[float]] = {n: [] for n in names}
    checks: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            # Warm up every engine with a question of its own; this computes the
            # prefix once, and the tier engines store it (write-through).
            warm = questions.pop()
            for name in names:
                e, from_tier, _ = systems[name]
                run(e, prefix + warm)
                if from_tier:
                    settle(e)
            for e in tier_engines.values():
                stats = e.tier_chain.stats() if e.tier_chain is not None else {}
                for tier_name, st in stats.items():
                    if st["used_blocks"] < prefix_blocks:
                        raise SystemExit(f"the {tier_name} tier holds {st} after the warm-up")
            for i, q in enumerate(questions):
                logits = model(torch.tensor([prefix + q]), logits_to_keep=1).logits
                want = int(logits[0, -1].argmax())
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    e, from_tier, cold = systems[name]
                    if cold:
                        drop_page_cache(disk_files())
                    t, token, cached, loaded_tokens = run(e, prefix + q)
                    if from_tier:
                        settle(e)
                    samples[name].append(t)
                    log(f"    {name}: {t * 1e3:.1f} ms")
                    want_cached = 0 if e is recompute else prefix_tokens
                    want_loaded = prefix_tokens if from_tier else 0
                    checks.append(
                        {
                            "system": name,
                            "question": i,
                            "token": token,
                            "full_forward_token": want,
                            "cached_tokens": cached,
                            "loaded_tokens": loaded_tokens,
                        }
                    )
                    lossy = name == "device tier"
                    if (
                        (token != want and not lossy)
                        or cached != want_cached
                        or (loaded_tokens != want_loaded)
                    ):
                        raise SystemExit(
                            f"check failed for {name}: token {token} (full forward: {want}), "
                            f"{cached} cached tokens (expected {want_cached}), {loaded_tokens} "
                            f"loaded from a tier (expected {want_loaded})"
                        )
                log(f"  ttft: question {i + 1}/{len(questions)}")
    finally:
        tier_stats = {}
        for kind, e in tier_engines.items():
            if e.tier_chain is not None:
                tier_stats[kind] = e.tier_chain.stats()
                e.tier_chain.close()
        shutil.rmtree(root, ignore_errors=True)

    med = {n: median(v) for n, v in samples.items()}
    return {
        "prefix_tokens": prefix_tokens,
        "question_tokens": QUESTION_TOKENS,
        "questions": questions_n,
        "samples_s": samples,
        "median_s": med,
        "checks": checks,
        "tier_stats": tier_stats,
    }


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=256, help="blocks per throughput run (256)")
    ap.add_argument("--repeat", type=int, default=5, help="counted throughput repeats (5)")
    ap.add_argument(
        "--codecs", default=",".join(CODECS), help="codecs for the throughput part (all)"
    )
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="TTFT prefix length (2048)")
    ap.add_argument("--questions", type=int, default=6, help="TTFT samples per system (6)")
    ap.add_argument("--skip-throughput", action="store_true", help="only the TTFT part")
    ap.add_argument("--skip-ttft", action="store_true", help="only the throughput part")
    ap.add_argument("--skip-redis", action="store_true", help="leave the Redis tier out")
    ap.add_argument(
        "--tiers",
        default=None,
        help="comma-separated subset of host, disk, redis to run (all)",
    )
    ap.add_argument(
        "--disk-direct-reads",
        action="store_true",
        help="disk tier with direct_reads=true (files read straight into the device blocks "
        "on the loading thread) instead of the default background reads",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "tiers.json")
    args = ap.parse_args(argv)
    global DIRECT_READS
    DIRECT_READS = args.disk_direct_reads
    if args.blocks < 1 or args.repeat < 1 or args.questions < 1:
        ap.error("--blocks, --repeat and --questions must be positive")
    if args.prefix_tokens < BLOCK_SIZE or args.prefix_tokens % BLOCK_SIZE:
        ap.error(f"--prefix-tokens must be a positive multiple of {BLOCK_SIZE}")
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not codecs or any(c not in CODECS for c in codecs):
        ap.error(f"--codecs takes a comma-separated subset of {', '.join(CODECS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ["host", "disk"] if args.skip_redis else ["host", "disk", "redis"]
    if args.tiers is not None:
        chosen = [t.strip() for t in args.tiers.split(",") if t.strip()]
        if not chosen or any(t not in kinds for t in chosen):
            ap.error(f"--tiers takes a comma-separated subset of {', '.join(kinds)}")
        kinds = [t for t in kinds if t in chosen]

    from kvtier.engine.model import DEFAULT_MODEL_ID, default_model_file, load_model

    loaded = None
    if args.skip_ttft:
        from transformers import AutoConfig

        path = default_model_file()
        config = AutoConfig.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
        model_id = DEFAULT_MODEL_ID
    else:
        log("loading the model ...")
        loaded = load_model(None, dtype="float32")
        config, model_id = loaded.model.config, loaded.model_id
    layout = layout_for_model(config, BLOCK_SIZE, torch.float32)

    result: dict[str, Any] = {
        "benchmark": "tiers",
        "model": model_id,
        "layout": {
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": layout.dtype,
            "bytes_per_block": layout.bytes_per_block,
        },
        "torch_threads": torch.get_num_threads(),
    }
    with contextlib.ExitStack() as stack:
        redis_url = None if "redis" not in kinds else stack.enter_context(redis_server())
        if not args.skip_throughput:
            log(
                f"throughput: {args.blocks} blocks x {layout.bytes_per_block:,} bytes, "
                f"{args.repeat} repeats ..."
            )
            tp = throughput(layout, model_id, args.blocks, args.repeat, kinds, codecs, redis_url)
            result["throughput"] = tp
        if not args.skip_ttft:
            assert loaded is not None
            log(f"ttft: {args.prefix_tokens}-token prefix, {args.questions} questions ...")
            result["ttft"] = ttft(
                loaded, args.prefix_tokens, args.questions, ["device", *kinds], redis_url
            )

    if "throughput" in result:
        tp = result["throughput"]
        headers = [
            "tier", "codec", "direction", "kvtier GB/s", "ceiling GB/s", "kvtier/ceiling",
            "paired",
        ]  # fmt: skip
        rows = [
            [
                r["tier"],
                r["codec"],
                r["direction"],
                f"{r['kvtier_gb_s']:.2f}",
                f"{r['ceiling_gb_s']:.2f}",
                f"{r['ratio'] * 100:.0f}%",
                f"{r['paired_ratio'] * 100:.0f}%",
            ]
            for r in tp["rows"]
        ]
        print(
            f"\nTier throughput, {tp['blocks']} blocks of {tp['block_bytes']:,} bytes "
            f"({model_id} fp32, {BLOCK_SIZE}-token blocks), median of {tp['repeat']}; "
            "GB/s of fp32 block bytes; load-cold = page cache dropped per file first; "
            "paired = median over repeats of ceiling time / kvtier time in that repeat"
        )
        print(format_table(headers, rows))
        short = [
            f"{r['tier']}/{r['codec']}/{r['direction']}"
            for r in tp["rows"]
            if r["codec"] == "raw" and r["direction"] != "load-cold" and r["ratio"] < TARGET_RATIO
        ]
        print(
            f"raw rows below the {TARGET_RATIO:.0%} target: "
            + (", ".join(short) if short else "none")
        )
        if args.markdown:
            print()
            print(format_markdown_table(headers, rows))

    if "ttft" in result:
        tt = result["ttft"]
        med = tt["median_s"]
        base = med["device (prefix in the pool)"]
        rec = med["recompute (prefix caching off)"]
        headers = [
            "prefix sits in",
            "TTFT ms (median)",
            "min ms",
            "vs device",
            "speedup over recompute",
        ]
        rows = [
            [
                n,
                f"{med[n] * 1e3:.1f}",
                f"{min(tt['samples_s'][n]) * 1e3:.1f}",
                f"{med[n] / base:.2f}x",
                f"{rec / med[n]:.1f}x",
            ]
            for n in med
        ]
        print(
            f"\nTTFT, {tt['prefix_tokens']}-token cached prefix + {QUESTION_TOKENS}-token "
            f"question, {model_id} (float32), torch threads {torch.get_num_threads()}, "
            f"median of {tt['questions']}"
        )
        print(format_table(headers, rows))
        if "host tier" in med:
            print(f"host tier / device: {med['host tier'] / base:.2f}x (target <= 2x)")
        if args.markdown:
            print()
            print(format_markdown_table(headers, rows))

    result.update(
        {
            "machine": machine_info(),
            "disk_direct_reads": DIRECT_READS,
            "git": git_state(REPO),
            "versions": {
                p: package_version(p) for p in ("torch", "transformers", "redis", "kvtier")
            },
        }
    )
    write_json(args.json, result)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
