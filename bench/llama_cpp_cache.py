"""llama.cpp's prompt cache across a restart: kvtier's disk tier against llama-cpp-python's own.

What runs: llama-cpp-python (the pinned release) with the default SmolLM2-135M
GGUF model on the CPU. A long document (the start of docs/replay.md, about
``--doc-tokens`` tokens) is followed by a question. For each of
``--questions`` rounds, one ``Llama`` answers question A over the document
(its cache saves the state), then a *fresh* ``Llama`` with a fresh cache
object on the same directory (a restarted process: nothing in memory but the
model) answers question B over the same document; its time to first token
(a completion of one token) is what a restart costs. Configurations:

* no cache: the fresh model computes the whole prompt;
* ``LlamaDiskCache``: llama-cpp-python's own disk cache (diskcache, pickled
  states);
* kvtier disk: :class:`kvtier.integrations.llama_cpp.KvTierLlamaCache` on a
  ``disk:`` tier, as ``for_model`` makes it (the model keeps no per-token
  logits, so none are stored);
* kvtier disk, logits kept: the same, storing the logits as
  ``LlamaDiskCache`` does.

Reported: median and worst time to first token of the restarted model, its
answer compared with the no-cache answer, the bytes the directory holds per
state, and the time a save took. The files are read back from the OS page
cache (nothing drops it between rounds).

    python bench/llama_cpp_cache.py               # 3 rounds, about 900-token prompts
    python bench/llama_cpp_cache.py --questions 5 --doc-tokens 1500
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    disk_bytes,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    package_version,
    write_json,
)

DEFAULT_JSON = REPO / "bench" / "results" / "llama_cpp_cache.json"
QUESTIONS = [
    ("What is this document about? Answer:", "Which policies does it compare? Answer:"),
    ("Name one trace it uses. Answer:", "How is the hit ratio defined? Answer:"),
    ("Who would read this? Answer:", "What does MIN mean here? Answer:"),
    ("Summarise the first section. Answer:", "What command runs a replay? Answer:"),
    ("What is a block? Answer:", "What is a capacity? Answer:"),
]


class _TimedSaves:
    """Wraps a cache: times each save (what llama-cpp-python waits for after a completion)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.save_s: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __getitem__(self, key: Any) -> Any:
        return self.inner[key]

    def __contains__(self, key: Any) -> bool:
        return key in self.inner

    def __setitem__(self, key: Any, value: Any) -> None:
        start = time.perf_counter()
        self.inner[key] = value
        self.save_s.append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=3, help="rounds (at most 5)")
    ap.add_argument("--doc-tokens", type=int, default=900, help="about this many document tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="where the caches write")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    rounds = QUESTIONS[: max(1, min(args.questions, len(QUESTIONS)))]

    import llama_cpp
    from llama_cpp.llama_cache import LlamaDiskCache

    from kvtier.engine.model import default_model_file
    from kvtier.integrations.llama_cpp import KvTierLlamaCache

    model = str(default_model_file())
    n_ctx = 2048

    def fresh() -> Any:
        return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=args.threads, seed=0,
                               verbose=False)

    probe = fresh()
    text = (REPO / "docs" / "replay.md").read_text()
    words = text.split()
    doc = " ".join(words[: args.doc_tokens])
    while len(probe.tokenize(doc.encode())) > args.doc_tokens and " " in doc:
        doc = doc.rsplit(" ", 20)[0]
    doc_tokens = len(probe.tokenize(doc.encode()))
    del probe

    def complete(llm: Any, prompt: str) -> str:
        out = llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        return str(out["choices"][0]["text"])

    def caches(kind: str, root: Path, llm: Any) -> Any:
        if kind == "none":
            return None
        if kind == "llama-cpp-python LlamaDiskCache":
            return LlamaDiskCache(cache_dir=str(root))
        logits = kind.endswith("logits kept")
        return KvTierLlamaCache.for_model(llm, f"disk:{root}", logits=logits)

    kinds = ["none", "llama-cpp-python LlamaDiskCache", "kvtier disk",
             "kvtier disk, logits kept"]
    base = Path(tempfile.mkdtemp(prefix="kvtier-llama-bench-", dir=args.dir))
    log(f"document of {doc_tokens} tokens, {len(rounds)} rounds, model {Path(model).name}, "
        f"llama-cpp-python {package_version('llama-cpp-python')}")
    results: list[dict[str, Any]] = []
    reference: dict[str, str] = {}
    try:
        for kind in kinds:
            log(f"  {kind} ...")
            ttft: list[float] = []
            saves: list[float] = []
            per_state: list[int] = []
            same = 0
            for i, (qa, qb) in enumerate(rounds):
                root = base / f"{kinds.index(kind)}-{i}"
                first = fresh()
                cache = caches(kind, root, first)
                if cache is not None:
                    timed = _TimedSaves(cache)
                    first.set_cache(timed)
                complete(first, f"{doc}\n\n{qa}")
                if cache is not None:
                    saves.extend(timed.save_s)
                    per_state.append(disk_bytes(root)[0])
                    close = getattr(cache, "close", None)
                    if close is not None:
                        close()
                del first
                second = fresh()
                again = caches(kind, root, second)
                if again is not None:
                    second.set_cache(again)
                prompt = f"{doc}\n\n{qb}"
                start = time.perf_counter()
                answer = complete(second, prompt)
                ttft.append(time.perf_counter() - start)
                if kind == "none":
                    reference[prompt] = answer
                same += answer == reference[prompt]
                if hasattr(again, "hits"):
                    assert again.hits == 1, f"{kind}: the restarted model missed its state"
                shutil.rmtree(root, ignore_errors=True)
            row = {
                "config": kind,
                "ttft_median_s": statistics.median(ttft),
                "ttft_max_s": max(ttft),
                "same_answer": f"{same}/{len(rounds)}",
                "state_bytes": statistics.median(per_state) if per_state else 0,
                "save_median_s": statistics.median(saves) if saves else 0.0,
            }
            results.append(row)
            log(f"    TTFT {row['ttft_median_s']:.3f}s, state {row['state_bytes'] / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    none = results[0]["ttft_median_s"]
    headers = ["configuration", "TTFT after restart, median s", "max s", "vs no cache",
               "same answer", "MiB per state", "save s"]
    rows = [
        [r["config"], f"{r['ttft_median_s']:.3f}", f"{r['ttft_max_s']:.3f}",
         f"{r['ttft_median_s'] / none:.2f}x", r["same_answer"],
         f"{r['state_bytes'] / 2**20:.1f}", f"{r['save_median_s']:.3f}"]
        for r in results
    ]
    print(format_table(headers, rows))
    write_json(args.json, {
        "benchmark": "llama_cpp_cache",
        "doc_tokens": doc_tokens,
        "rounds": len(rounds),
        "threads": args.threads,
        "llama_cpp_python": package_version("llama-cpp-python"),
        "machine": machine_info(),
        "git": git_state(REPO),
        "results": results,
        "markdown": format_markdown_table(headers, rows),
    })
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
