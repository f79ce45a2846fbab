"""Run the conformance cases over transformers' decoder families and record the outcome.

:func:`run_family` decides one family: ``exact`` (every case gave
transformers' own greedy tokens; the config features the tiny model had are
recorded, and only configs within them are admitted), ``refused`` (kvtier's
support check names an attention feature it does not implement, or a case
gave other tokens or failed: the reason says which, or, for a family whose
own attention code kvtier's never replaces (:data:`OWN_ATTENTION`), why) or
``unbuilt`` (no tiny model could be made from the family's config with
generic sizes, e.g. an encoder-decoder's or an image-text wrapper's).
:func:`sweep` runs many, each in a process of its own (a family that
crashes or hangs costs only itself), and :func:`write_record` /
:func:`markdown_table` turn the results into the record
:mod:`kvtier.layers.support` reads and the table in docs/models.md.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXACT = "exact"
REFUSED = "refused"
UNBUILT = "unbuilt"

#: More parameters than this means the family's config ignored the small sizes.
MAX_PARAMETERS = 5_000_000

#: The block size of the tiny engines: small, so short prompts cross many blocks.
BLOCK_SIZE = 4


@dataclass(frozen=True)
class FamilyResult:
    """What the sweep found for one ``model_type``."""

    model_type: str
    outcome: str
    #: Why it is refused or could not be built ("" when exact).
    reason: str = ""
    #: The config features the exact run exercised
    #: (:func:`kvtier.layers.support.config_features`).
    features: tuple[str, ...] = field(default_factory=tuple)
    seconds: float = 0.0


#: Families whose attention is code of their own, which kvtier's paged attention (an
#: implementation of transformers' attention interface) never replaces, and what that code
#: adds: when one fails a case, this is the reason recorded rather than the symptom.
OWN_ATTENTION = {
    "bloom": "ALiBi position biases built from a per-sequence attention mask",
    "mpt": "ALiBi position biases sliced by the cache's length",
}


def _refusal(model_type: str, symptom: str) -> str:
    """The reason a family that failed a case is refused: its known cause, else the symptom."""
    added = OWN_ATTENTION.get(model_type)
    if added is None:
        return symptom[:400]
    return (
        f"attends in code of its own ({added}), not through transformers' attention "
        "interface, which kvtier's paged attention implements"
    )


def causal_lm_types() -> list[str]:
    """Every ``model_type`` with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(exc: BaseException, limit: int = 240) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_family(model_type: str, cases: Iterable[str] | None = None) -> FamilyResult:
    """Build ``model_type`` tiny and run the conformance ``cases`` (all by default)."""
    import time

    import torch

    from kvtier.conformance.cases import CASES, Mismatch
    from kvtier.conformance.tiny import TinyFamily, causal_lm_class, char_tokenizer, tiny_config
    from kvtier.errors import ConfigError
    from kvtier.layers import support

    start = time.perf_counter()

    def done(outcome: str, reason: str = "", features: tuple[str, ...] = ()) -> FamilyResult:
        return FamilyResult(
            model_type, outcome, reason, features, round(time.perf_counter() - start, 2)
        )

    tok = char_tokenizer()
    try:
        config = tiny_config(model_type, len(tok))
        with torch.device("meta"):
            size = sum(p.numel() for p in causal_lm_class(model_type)(config).parameters())
        if size > MAX_PARAMETERS:
            return done(UNBUILT, f"generic small sizes still give {size:,} parameters")
        family = TinyFamily(
            causal_lm_class(model_type), config, tok, f"tiny-{model_type}", BLOCK_SIZE
        )
    except Exception as exc:  # any failure of a family's own code means "not buildable"
        return done(UNBUILT, _first_line(exc))

    def get(name: str) -> object:
        return getattr(config, name, None)  # by transformers' names, aliases included

    reason = support.unsupported_reason(get)
    if reason is not None:
        return done(REFUSED, reason)
    names = list(CASES) if cases is None else list(cases)
    with support.on_trial(model_type):
        for name in names:
            try:
                CASES[name](family)
            except Mismatch as exc:
                symptom = f"gives other tokens than transformers ({name}: {exc})"
                return done(REFUSED, _refusal(model_type, symptom))
            except ConfigError as exc:
                return done(REFUSED, f"refused while serving ({name}): {exc}"[:400])
            except Exception as exc:
                last = traceback.extract_tb(exc.__traceback__)[-1]
                where = f"{Path(last.filename).name}:{last.lineno}"
                symptom = f"fails ({name}): {_first_line(exc)} at {where}"
                return done(REFUSED, _refusal(model_type, symptom))
    return done(EXACT, features=tuple(sorted(support.config_features(get))))


#: A family's process may use this much memory (a tiny model needs far less; a config
#: class that ignores the small sizes would otherwise build a full-size model).
MEMORY_LIMIT = 4 << 30


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_family_in_process(
    model_type: str, cases: Iterable[str] | None = None, timeout: float = 600.0
) -> FamilyResult:
    """:func:`run_family` in a fresh Python process, so a crash, a hang (past ``timeout``
    seconds) or a full-size model costs only this family."""
    import subprocess
    import sys

    names = None if cases is None else list(cases)
    code = (
        "import json, sys, dataclasses, torch\n"
        "torch.set_num_threads(1)\n"
        "from kvtier.conformance.sweep import run_family\n"
        "r = run_family(sys.argv[1], json.loads(sys.argv[2]))\n"
        "print('\\n' + json.dumps(dataclasses.asdict(r)))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, model_type, json.dumps(names)],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired:
        return FamilyResult(model_type, UNBUILT, f"did not finish within {timeout:.0f} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        data = json.loads(lines[-1])
        data["features"] = tuple(data["features"])
        return FamilyResult(**data)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if "MemoryError" in tail or proc.returncode in (-9, 137):
        tail = f"needs more than {MEMORY_LIMIT >> 30} GiB built with small sizes ({tail})"
    return FamilyResult(model_type, UNBUILT, f"its process failed: {tail}"[:300])


def sweep(
    model_types: Iterable[str],
    cases: Iterable[str] | None = None,
    *,
    workers: int = 2,
    progress: Callable[[FamilyResult], None] | None = None,
) -> Iterator[FamilyResult]:
    """:func:`run_family_in_process` for each type, ``workers`` at a time.

    Results come in completion order; ``progress`` is called with each.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    names = None if cases is None else list(cases)
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run_family_in_process, t, names) for t in model_types]
        for future in as_completed(futures):
            result = future.result()
            if progress is not None:
                progress(result)
            yield result


def record(results: Iterable[FamilyResult]) -> dict[str, Any]:
    """The record :mod:`kvtier.layers.support` admits by, as a JSON-ready dict."""
    import transformers

    families = {}
    for r in sorted(results, key=lambda r: r.model_type):
        entry: dict[str, Any] = {"outcome": r.outcome}
        if r.outcome == EXACT:
            entry["features"] = list(r.features)
        else:
            entry["reason"] = r.reason
        families[r.model_type] = entry
    return {
        "transformers": transformers.__version__,
        "command": "python bench/families.py --write",
        "families": families,
    }


def write_record(results: Iterable[FamilyResult], path: Path) -> None:
    path.write_text(json.dumps(record(results), indent=1, sort_keys=True) + "\n")


def markdown_table(results: Iterable[FamilyResult]) -> str:
    """One row per family: its outcome and, for a refusal, the reason."""
    rows = ["| model_type | outcome | features exercised / reason |", "|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.outcome != EXACT, r.outcome, r.model_type)):
        detail = ", ".join(r.features) or "full attention" if r.outcome == EXACT else r.reason
        detail = detail.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{r.model_type}` | {r.outcome} | {detail} |")
    return "\n".join(rows) + "\n"


def as_json(results: Iterable[FamilyResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
