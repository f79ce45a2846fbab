"""Loading request traces for replay: Mooncake JSONL and token-level JSONL.

Two line-oriented formats are understood; the first non-blank line decides
which one a file holds, and every later line must match it:

* **Mooncake** (``kvcache-ai/Mooncake`` traces): ``{"timestamp": ms,
  "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
  ``hash_ids`` names the prompt's blocks (512 tokens by default), prefix-
  chained: two requests that share their first k ids share their first k
  blocks of tokens. The last id may cover a partial block, so a prompt of
  ``input_length`` tokens has ``ceil(input_length / block_size)`` ids. The
  ids are used directly as block keys.
* **token-level**: ``{"tokens": [ids...]}`` with optional ``"timestamp"``
  and ``"output_tokens"``. Block keys are computed with kvtier's own
  :class:`~kvtier.keys.BlockHasher` (the manager's default namespace), so a
  replay keys blocks exactly as live serving does. Only full blocks get keys.

Either format may carry the agent hints of :mod:`kvtier.hints` as
optional fields of a line (``session_id``, ``workflow_id``, ``agent_id``,
``step``, ``cache_ttl_s``, ``reuse``, ...): the replay passes them to the
policy as serving would. A line ``{"workflow": {...}}`` registers an agent
step graph (:func:`kvtier.agents.parse_workflow`) before the replay starts.

Files ending in ``.gz`` are decompressed on the fly. Every problem is a
:class:`~kvtier.errors.KvTierError` naming the file and line.
"""

from __future__ import annotations

import gzip
import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from kvtier.agents.graph import WorkflowSpec, parse_workflow
from kvtier.errors import BadRequestError, ConfigError
from kvtier.hints import HINT_NAMES, parse_hints
from kvtier.keys import BlockHasher, Namespace

TraceFormat = Literal["mooncake", "tokens"]

#: Block size the Mooncake traces' ``hash_ids`` were made with.
MOONCAKE_BLOCK_SIZE = 512
#: Default block size for token-level traces (a common engine block size).
TOKENS_BLOCK_SIZE = 16
#: The sample bundled in ``kvtier/data`` and replayed when no trace is named.
SAMPLE_TRACE = "mooncake_conversation_sample.jsonl"

_MAX_TOKEN_ID = 2**32


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, reduced to what the replay needs."""

    #: Prompt length in tokens.
    input_length: int
    #: Keys of the prompt's blocks, in order (Mooncake: every id, the last one
    #: possibly a partial block; token-level: full blocks only).
    keys: list[int]
    timestamp: float | None = None
    output_length: int = 0
    #: The prompt's token ids (token-level traces only).
    tokens: array[int] | None = None
    #: Generated token ids (token-level traces only, when the trace has them).
    output_tokens: array[int] | None = None
    #: Keys of the blocks the output completes, chained after the prompt's.
    output_keys: list[int] = field(default_factory=list)
    #: The request's agent hints (validated), or ``None``.
    hints: dict[str, object] | None = None

    def full_keys(self, block_size: int) -> list[int]:
        """Keys of the prompt's full blocks: what the manager caches and looks up."""
        n_full = self.input_length // block_size
        return self.keys if len(self.keys) == n_full else self.keys[:n_full]


@dataclass(slots=True)
class Trace:
    """A loaded trace: its requests and how to interpret them."""

    name: str
    format: TraceFormat
    block_size: int
    requests: list[TraceRequest]
    _unique: int = field(default=-1, repr=False)
    #: Agent step graphs the trace registers (``{"workflow": ...}`` lines).
    workflows: list[WorkflowSpec] = field(default_factory=list)

    @property
    def unique_blocks(self) -> int:
        """Distinct block keys in the trace (prompt and output): the base of ``5%`` capacities."""
        if self._unique < 0:
            seen: set[int] = set()
            for req in self.requests:
                seen.update(req.keys)
                seen.update(req.output_keys)
            self._unique = len(seen)
        return self._unique

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def _open_lines(path: Path) -> Iterator[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            yield from fh
    else:
        with path.open("r", encoding="utf-8") as fh:
            yield from fh


def _int_field(obj: dict[str, Any], name: str, where: str, *, minimum: int) -> int | None:
    if name not in obj:
        return None
    value = obj[name]
    # bool is an int subclass; a JSON true is not a length.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequestError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _timestamp(obj: dict[str, Any], where: str) -> float | None:
    ts = obj.get("timestamp")
    if ts is None:
        return None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise BadRequestError(f"{where}: 'timestamp' must be a number, got {ts!r}")
    return float(ts)


def _token_ids(value: Any, name: str, where: str, allow_empty: bool) -> array[int]:
    if not isinstance(value, list):
        raise BadRequestError(f"{where}: {name!r} must be a list of token ids")
    if not value and not allow_empty:
        raise BadRequestError(f"{where}: {name!r} is empty; a request needs at least one token")
    try:
        return array("I", value)
    except (OverflowError, TypeError):
        raise BadRequestError(
            f"{where}: {name!r} must hold integer token ids in [0, 2**32)"
        ) from None


def _hints(obj: dict[str, Any], where: str) -> dict[str, object] | None:
    """The line's hint fields, validated (``None`` without any)."""
    if not any(name in obj for name in HINT_NAMES):
        return None
    try:
        hints = parse_hints({k: obj[k] for k in HINT_NAMES if k in obj}, where="")
    except BadRequestError as exc:
        raise BadRequestError(f"{where}: {exc}") from None
    return None if hints is None else hints.as_dict()


def _mooncake_request(obj: dict[str, Any], where: str, block_size: int) -> TraceRequest:
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise BadRequestError(f"{where}: Mooncake line needs a 'hash_ids' list")
    for k in ids:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise BadRequestError(f"{where}: 'hash_ids' must hold non-negative integers, got {k!r}")
    if not ids:
        raise BadRequestError(f"{where}: 'hash_ids' is empty; a request needs at least one block")
    n = _int_field(obj, "input_length", where, minimum=1)
    if n is None:
        # Without a length, assume every id is a full block.
        n = len(ids) * block_size
    if math.ceil(n / block_size) != len(ids):
        raise BadRequestError(
            f"{where}: input_length {n} needs {math.ceil(n / block_size)} blocks of "
            f"{block_size} tokens but 'hash_ids' has {len(ids)}; is --block-size right?"
        )
    out = _int_field(obj, "output_length", where, minimum=0) or 0
    return TraceRequest(n, ids, _timestamp(obj, where), out, hints=_hints(obj, where))


def _token_request(obj: dict[str, Any], where: str, hasher: BlockHasher) -> TraceRequest:
    if "tokens" not in obj:
        raise BadRequestError(f"{where}: token-level line needs a 'tokens' list")
    tokens = _token_ids(obj["tokens"], "tokens", where, allow_empty=False)
    n = len(tokens)
    n_full = n // hasher.block_size
    out_raw = obj.get("output_tokens")
    hints = _hints(obj, where)
    if out_raw is None:
        return TraceRequest(n, hasher.chain(tokens), _timestamp(obj, where), 0, tokens, hints=hints)
    output = _token_ids(out_raw, "output_tokens", where, allow_empty=True)
    # One chain over prompt and output: the prompt's keys are its prefix, and
    # the rest are the keys the manager publishes when it extends the request.
    keys = hasher.chain(tokens + output)
    return TraceRequest(
        n, keys[:n_full], _timestamp(obj, where), len(output), tokens, output, keys[n_full:], hints
    )


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRequestError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(obj, dict):
        raise BadRequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _detect(obj: dict[str, Any], where: str) -> TraceFormat:
    if "hash_ids" in obj:
        return "mooncake"
    if "tokens" in obj:
        return "tokens"
    raise BadRequestError(
        f"{where}: unknown trace format: expected a Mooncake object with 'hash_ids' or a "
        f"token-level object with 'tokens'; got keys {sorted(obj)}"
    )


def load_trace(
    path: str | Path,
    *,
    block_size: int | None = None,
    limit: int | None = None,
    name: str | None = None,
) -> Trace:
    """Read a trace file; ``block_size`` defaults per format (512 Mooncake, 16 tokens)."""
    p = Path(path)
    if block_size is not None and (
        not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0
    ):
        raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
    if limit is not None and limit <= 0:
        raise ConfigError(f"--limit must be a positive number of requests, got {limit}")
    if not p.exists():
        raise ConfigError(f"trace file not found: {p}")
    if p.is_dir():
        raise ConfigError(f"trace path is a directory, not a file: {p}")
    fmt: TraceFormat | None = None
    bs = 0
    hasher: BlockHasher | None = None
    requests: list[TraceRequest] = []
    workflows: list[WorkflowSpec] = []
    try:
        for lineno, line in enumerate(_open_lines(p), 1):
            if not line.strip():
                continue
            where = f"{p.name}:{lineno}"
            if fmt is None and not line.lstrip().startswith("{"):
                raise BadRequestError(
                    f"{where}: not a JSONL trace (lines must be JSON objects); CSV traces "
                    "such as Azure's carry only lengths, no block ids, and cannot be replayed"
                )
            obj = _parse_line(line, where)
            if "workflow" in obj and "hash_ids" not in obj and "tokens" not in obj:
                try:
                    workflows.append(parse_workflow(obj["workflow"]))
                except BadRequestError as exc:
                    raise BadRequestError(f"{where}: {exc}") from None
                continue
            if fmt is None:
                fmt = _detect(obj, where)
                if fmt == "mooncake":
                    bs = block_size or MOONCAKE_BLOCK_SIZE
                else:
                    bs = block_size or TOKENS_BLOCK_SIZE
                    hasher = BlockHasher(Namespace("default"), bs)
            if fmt == "mooncake":
                requests.append(_mooncake_request(obj, where, bs))
            else:
                assert hasher is not None
                requests.append(_token_request(obj, where, hasher))
            if limit is not None and len(requests) >= limit:
                break
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"{p.name}: not a UTF-8 text file ({exc.reason})") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"cannot read trace {p}: {exc}") from None
    if fmt is None or not requests:
        raise ConfigError(f"trace {p} holds no requests")
    return Trace(name or p.name, fmt, bs, requests, workflows=workflows)


def load_sample_trace(*, block_size: int | None = None, limit: int | None = None) -> Trace:
    """The small Mooncake sample shipped with kvtier (see ``kvtier/data/README.md``)."""
    ref = resources.files("kvtier").joinpath("data", SAMPLE_TRACE)
    with resources.as_file(ref) as path:
        return load_trace(path, block_size=block_size, limit=limit, name=SAMPLE_TRACE)
