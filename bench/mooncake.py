"""The Mooncake Store tier's throughput against Mooncake's own put/get of the same bytes.

The blocks are SmolLM2-135M's (30 layers, 3 KV heads, head dim 64, 16
tokens per block, float32: 737,280 bytes a block). A CPU ``KVBlockStorage``
holds ``--blocks`` blocks of random values plus as many empty ones. The run
starts a ``mooncake_master`` and one storage node (``mooncake_client`` with
a segment big enough for every block) on loopback, TCP transport, P2P
handshake. Then, per repeat, on fresh keys:

* kvtier: a ``TierChain`` whose single tier is the ``mooncake`` medium (raw
  codec; the process adds no segment, so every byte goes to the storage node
  like a remote pool) stores the blocks (``store_blocks`` then ``flush``:
  encode, checksum, ``put_batch``) and loads them back into the empty blocks
  (``load``: ``batch_get_buffer``, copy out, verify, write into the blocks);
* ceiling, the same number of objects of the same size (header + payload)
  through Mooncake's Python API in a client with the same staging buffer,
  batched the same way (a quarter of the buffer per call): ``put_batch`` of
  prebuilt ``bytes``; ``get_batch`` (Mooncake copies each object into a new
  ``bytes``) and ``batch_get_into`` (straight into a preregistered host
  buffer, no copy in Python: the fastest read the API offers);
* Redis, when ``redis-server`` is on PATH (``--skip-redis`` leaves it out):
  the ``redis`` medium in the same kind of chain, on a throwaway server.

Throughput is block bytes (fp32) per second. Systems alternate in an order
rotated per repeat; every figure is the median over ``--repeat`` repeats
after one warm-up repeat; every kvtier load is checked bit-exact outside the
timings. Everything is loopback on one machine: the numbers are the cost of
the software path (copies, checksums, RPCs), not of a network.

Run ``python bench/mooncake.py --help``. Results go to ``bench/results/mooncake.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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

# This script's name is the Mooncake package's: with its directory first on
# sys.path, ``import mooncake`` would import the script again.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE]
sys.modules.pop("mooncake", None)

from kvtier.engine.hf_cache import layout_for_model  # noqa: E402
from kvtier.keys import Namespace  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.manager import KVCacheManager  # noqa: E402
from kvtier.offload.chain import TierChain  # noqa: E402
from kvtier.offload.codec import HEADER_SIZE  # noqa: E402
from kvtier.offload.tier import Tier  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

BLOCK_SIZE = 16


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not listen on port {port} in 20s")
        time.sleep(0.05)


def _binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: pip install mooncake-transfer-engine-non-cuda")
    return found


@contextlib.contextmanager
def mooncake_pool(segment_bytes: int) -> Iterator[str]:
    """A master and a storage node of ``segment_bytes`` on loopback; yields the master address."""
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-mooncake-"))
    rpc, metrics, node = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(workdir / "master.log", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        _binary("mooncake_master"),
                        f"--rpc_port={rpc}",
                        "--rpc_address=127.0.0.1",
                        f"--metrics_port={metrics}",
                        "--metrics_host=127.0.0.1",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        _wait_listening(rpc, procs[0], "mooncake_master")
        with open(workdir / "storage.log", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        _binary("mooncake_client"),
                        "--host=127.0.0.1",
                        f"--port={node}",
                        f"--global_segment_size={segment_bytes}",
                        "--local_buffer_size=16MB",
                        f"--master_server_address=127.0.0.1:{rpc}",
                        "--metadata_server=P2PHANDSHAKE",
                        "--protocol=tcp",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        _wait_listening(node, procs[1], "mooncake_client")
        yield f"127.0.0.1:{rpc}"
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway ``redis-server`` on loopback, or ``None`` when there is none."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_listening(port, proc, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


class Rig:
    """A device storage with ``n`` random source blocks and ``n`` destination blocks."""

    def __init__(self, layout: KVLayout, n: int) -> None:
        self.n = n
        self.storage = KVBlockStorage(layout, 2 * n)
        self.manager = KVCacheManager(
            2 * n, layout.block_size, namespace=Namespace("bench-mooncake", layout)
        )
        self.storage.tensor[:n].normal_(generator=torch.Generator().manual_seed(0))
        self.src, self.dst = list(range(n)), list(range(n, 2 * n))
        self.rng = random.Random(0)

    @property
    def block_bytes(self) -> int:
        return self.storage.bytes_per_block

    def keys(self) -> list[int]:
        return [self.rng.getrandbits(128) for _ in range(self.n)]


class KvTierPath:
    """The rig's blocks through a chain whose only tier is ``store``."""

    def __init__(self, rig: Rig, store: Any) -> None:
        self.rig, self.store = rig, store
        self.tier = Tier(store, rig.n, codec="raw")
        self.chain = TierChain(rig.storage, rig.manager, [self.tier], write_mode="write_through")

    def run(self) -> dict[str, float]:
        rig, chain = self.rig, self.chain
        keys = rig.keys()
        rig.storage.tensor[rig.n :].zero_()
        t0 = time.perf_counter()
        chain.store_blocks(0, keys, rig.src)
        chain.flush()
        store_s = time.perf_counter() - t0
        if self.tier.offload_manager.lookup(keys) != rig.n:
            raise SystemExit(f"{self.store.name}: stored {chain.stats()[self.tier.name]}")
        t0 = time.perf_counter()
        got = chain.load(keys, rig.dst)
        load_s = time.perf_counter() - t0
        if got != rig.n or not torch.equal(
            rig.storage.tensor[: rig.n], rig.storage.tensor[rig.n :]
        ):
            raise SystemExit(f"{self.store.name}: loaded {got} of {rig.n}, or not bit-exact")
        # Outside the timings: forget this repeat's blocks so the next starts empty.
        self.tier.offload_manager.remove(keys)
        self.store.purge([(k, -1) for k in keys])
        chain.take_events()
        return {"store": store_s, "load": load_s}

    def close(self) -> None:
        self.chain.close()


class MooncakeCeiling:
    """The same number and size of objects through Mooncake's own Python API."""

    def __init__(self, rig: Rig, master: str, buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

        self.rig = rig
        self.client = MooncakeDistributedStore()
        rc = self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise SystemExit(f"ceiling client setup failed with {rc}")
        self.blob = HEADER_SIZE + rig.block_bytes
        flat = rig.storage.tensor[: rig.n].reshape(rig.n, -1).view(torch.uint8)
        self.values = [bytes(HEADER_SIZE) + flat[i].numpy().tobytes() for i in range(rig.n)]
        per_call = max(1, (buffer_bytes // 4) // self.blob)
        self.batches = [(i, min(i + per_call, rig.n)) for i in range(0, rig.n, per_call)]
        self.into = torch.empty(rig.n * self.blob, dtype=torch.uint8)
        if self.client.register_buffer(self.into.data_ptr(), self.into.numel()) != 0:
            raise SystemExit("ceiling: register_buffer failed")
        self.round = 0

    def run(self) -> dict[str, float]:
        self.round += 1
        names = [f"ceiling:{self.round}:{i}" for i in range(self.rig.n)]
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        for a, b in self.batches:
            if self.client.put_batch(names[a:b], self.values[a:b]) != 0:
                raise SystemExit("ceiling: put_batch failed")
        out["store"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got: list[bytes] = []
        for a, b in self.batches:
            got.extend(self.client.get_batch(names[a:b]))
        out["load"] = time.perf_counter() - t0
        if any(len(v) != self.blob for v in got):
            raise SystemExit("ceiling: get_batch did not return every object whole")
        del got
        base = self.into.data_ptr()
        t0 = time.perf_counter()
        for a, b in self.batches:
            ptrs = [base + i * self.blob for i in range(a, b)]
            codes = self.client.batch_get_into(names[a:b], ptrs, [self.blob] * (b - a))
            if any(c != self.blob for c in codes):
                raise SystemExit(f"ceiling: batch_get_into returned {codes[:4]}")
        out["load-into"] = time.perf_counter() - t0
        self.client.batch_remove(names, True)
        return out

    def close(self) -> None:
        self.client.unregister_buffer(self.into.data_ptr())
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, default=128, help="blocks per run (128)")
    ap.add_argument("--repeat", type=int, default=5, help="counted repeats (5)")
    ap.add_argument(
        "--buffer", default="64MiB", help="staging buffer of both Mooncake clients (64MiB)"
    )
    ap.add_argument("--skip-redis", action="store_true", help="leave the Redis medium out")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "mooncake.json")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.repeat < 1:
        ap.error("--blocks and --repeat must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvtier.units import parse_memory_size

    buffer_bytes = parse_memory_size(args.buffer)

    from transformers import AutoConfig

    from kvtier.engine.model import DEFAULT_MODEL_ID, default_model_file
    from kvtier.offload.mooncake_store import MooncakeStore

    path = default_model_file()
    config = AutoConfig.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    layout = layout_for_model(config, BLOCK_SIZE, torch.float32)
    rig = Rig(layout, args.blocks)
    blob = HEADER_SIZE + rig.block_bytes
    # Room for a repeat's kvtier blocks and the ceiling's, with slack for Mooncake's watermark.
    segment = max(256 << 20, 4 * args.blocks * blob)

    samples: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(mooncake_pool(segment))
        redis_url = None if args.skip_redis else stack.enter_context(redis_server())
        systems: dict[str, Any] = {
            "kvtier mooncake": KvTierPath(
                rig, MooncakeStore(master, segment_bytes=0, buffer_bytes=buffer_bytes)
            ),
            "mooncake API": MooncakeCeiling(rig, master, buffer_bytes),
        }
        if redis_url is not None:
            from kvtier.offload.redis_store import RedisStore

            systems["kvtier redis"] = KvTierPath(rig, RedisStore(redis_url))
        for system in systems.values():
            stack.callback(system.close)
        names = list(systems)
        log(
            f"{args.blocks} blocks x {rig.block_bytes:,} bytes, {args.repeat} repeats "
            f"(+1 warm-up): {', '.join(names)}"
        )
        for rep in range(args.repeat + 1):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                timings = systems[name].run()
                if rep == 0:
                    continue
                for direction, seconds in timings.items():
                    samples.setdefault(f"{name}|{direction}", []).append(seconds)

    total = args.blocks * rig.block_bytes
    gbs = {k: total / median(v) / 1e9 for k, v in samples.items()}
    ceiling = {"store": gbs["mooncake API|store"], "load": gbs["mooncake API|load-into"]}
    rows: list[dict[str, Any]] = []
    for key, value in gbs.items():
        name, direction = key.split("|")
        base = ceiling["store" if direction == "store" else "load"]
        rows.append(
            {
                "system": name,
                "direction": direction,
                "gb_s": value,
                "median_s": median(samples[key]),
                "of_ceiling": value / base,
            }
        )
    rows.sort(key=lambda r: (r["direction"] != "store", r["system"]))

    headers = ["system", "direction", "GB/s", "median ms", "of Mooncake's best"]
    table = [
        [
            r["system"],
            r["direction"],
            f"{r['gb_s']:.2f}",
            f"{r['median_s'] * 1e3:.1f}",
            f"{r['of_ceiling'] * 100:.0f}%",
        ]
        for r in rows
    ]
    print(
        f"\nMooncake tier throughput, {args.blocks} blocks of {rig.block_bytes:,} bytes "
        f"({DEFAULT_MODEL_ID} fp32, {BLOCK_SIZE}-token blocks), median of {args.repeat}; "
        f"GB/s of fp32 block bytes; staging buffer {args.buffer}; loopback TCP"
    )
    print(format_table(headers, table))
    print("Mooncake's best: put_batch for stores, batch_get_into a registered buffer for loads")
    if args.markdown:
        print()
        print(format_markdown_table(headers, table))

    result: dict[str, Any] = {
        "benchmark": "mooncake",
        "model": DEFAULT_MODEL_ID,
        "blocks": args.blocks,
        "block_bytes": rig.block_bytes,
        "blob_bytes": blob,
        "repeat": args.repeat,
        "buffer_bytes": buffer_bytes,
        "rows": rows,
        "samples_s": samples,
        "torch_threads": torch.get_num_threads(),
        "machine": machine_info(),
        "git": git_state(REPO),
        "versions": {
            p: package_version(p)
            for p in ("torch", "redis", "kvtier", "mooncake-transfer-engine-non-cuda")
        },
    }
    write_json(args.json, result)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
