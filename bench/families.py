"""The conformance sweep: every decoder family of the installed transformers, exact or refused.

For each ``model_type`` with a causal-LM class, a tiny random-weight model
is built from its own config (generic small sizes, a sliding window that
binds where the config has one) and served through kvtier's engine in the
conformance cases (long prompts across windows and blocks, chunked batches
sharing a prefix, preemption, a host-tier round trip, a request moved
between engines), each token compared with transformers' own greedy
``generate``. Every family runs in a process of its own, two at a time.

    python bench/families.py                 # the table, and bench/results/families.json
    python bench/families.py --write         # also the record kvtier admits by, and docs/models.md
    python bench/families.py --types gemma2,gpt_oss --cases "long prompts"

``--write`` rewrites ``src/kvtier/layers/families.json`` (what
:func:`kvtier.layers.support.check_supported` admits by) and the generated
table in docs/models.md; run it after upgrading transformers.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from _common import REPO, format_markdown_table, log, machine_info, write_json

from kvtier.conformance.cases import CASES
from kvtier.conformance.sweep import (
    EXACT,
    REFUSED,
    UNBUILT,
    FamilyResult,
    as_json,
    causal_lm_types,
    markdown_table,
    sweep,
    write_record,
)

RECORD = REPO / "src" / "kvtier" / "layers" / "families.json"
DOC = REPO / "docs" / "models.md"
BEGIN, END = "<!-- families table: begin -->", "<!-- families table: end -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--types", help="comma-separated model_types (default: every causal-LM type)"
    )
    parser.add_argument(
        "--cases", help=f"comma-separated cases (default: all of {', '.join(CASES)})"
    )
    parser.add_argument("--workers", type=int, default=2, help="families run at once (default 2)")
    parser.add_argument(
        "--write", action="store_true", help="rewrite the record and docs/models.md"
    )
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "families.json")
    args = parser.parse_args(argv)
    known = causal_lm_types()
    types = known if not args.types else [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(types) - set(known))
    if unknown:
        parser.error(f"not causal-LM model_types of this transformers: {', '.join(unknown)}")
    cases = None if not args.cases else [c.strip() for c in args.cases.split(",")]
    if cases is not None and (bad := sorted(set(cases) - set(CASES))):
        parser.error(f"unknown cases {bad}; the cases are {list(CASES)}")
    if args.write and (args.types or args.cases):
        parser.error("--write records the whole sweep: leave out --types and --cases")
    start = time.perf_counter()
    results: list[FamilyResult] = []

    def progress(r: FamilyResult) -> None:
        results.append(r)
        log(
            f"[{len(results)}/{len(types)}] {r.model_type}: {r.outcome} ({r.seconds:.0f} s)"
            + (f" - {r.reason[:120]}" if r.reason else "")
        )

    for _ in sweep(types, cases, workers=args.workers, progress=progress):
        pass
    counts = {o: sum(r.outcome == o for r in results) for o in (EXACT, REFUSED, UNBUILT)}
    print(markdown_table(results))
    print(format_markdown_table(["outcome", "families"], [[o, n] for o, n in counts.items()]))
    print(f"\n{len(results)} families in {time.perf_counter() - start:.0f} s")
    write_json(
        args.json,
        {
            "machine": machine_info(),
            "cases": cases or list(CASES),
            "counts": counts,
            "families": as_json(sorted(results, key=lambda r: r.model_type)),
        },
    )
    if args.write:
        write_record(results, RECORD)
        text = DOC.read_text()
        table = markdown_table(results)
        summary = ", ".join(f"{n} {o}" for o, n in counts.items())
        block = f"{BEGIN}\n{summary}.\n\n{table}{END}"
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        if not pattern.search(text):
            sys.exit(f"{DOC} has no {BEGIN} ... {END} block to rewrite")
        DOC.write_text(pattern.sub(lambda _: block, text))
        log(f"wrote {RECORD.relative_to(REPO)} and the table in {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
