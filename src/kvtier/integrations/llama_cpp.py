"""llama.cpp's prompt cache on kvtier's tiers: a ``BaseLlamaCache`` for llama-cpp-python.

``llama_cpp.Llama`` saves its whole state (KV cache, token ids, logits)
after each completion and, before the next, asks its cache for a state whose
tokens share a prefix with the new prompt, loading it when that prefix is
longer than what the context already holds. :class:`KvTierLlamaCache` keeps
those states in a kvtier tier, so a prompt is reused across processes,
restarts (a disk tier) and machines (Redis)::

    llm = llama_cpp.Llama(model_path="model.gguf", n_ctx=4096)
    llm.set_cache(KvTierLlamaCache.for_model(llm, "disk:/var/cache/kvtier?size=20GiB"))

Keys are kvtier's chained block keys (:class:`kvtier.keys.BlockHasher`,
``block_tokens`` tokens a block) of a state's tokens, in a namespace of what
a state depends on (:func:`model_identity`: the model file, the context size,
the KV cache types, the llama-cpp-python release), since a state only loads
into a context like the one it came from. A state saved for tokens ``T`` is
stored once, under the key of ``T``'s last full block, and each of ``T``'s
full blocks gets a small index entry naming it. A prompt asks for the index
entries of its own block keys in one call: the leading run found is the
longest prefix a stored state shares, and its last entry names the state.
Every item carries kvtier's header and checksums; a damaged or vanished
state is a miss (and its entry is dropped), never loaded.

A state's logits are stored only when the model was created with
``logits_all=True``: otherwise llama-cpp-python never reads them (it
re-evaluates the prompt's last token before sampling, and logprobs need
``logits_all``), and they are most of a saved state (``n_tokens`` times
``n_vocab`` floats, 196 KB a token for a 49k vocabulary, against the KV
cache's tens of KB), so leaving them out shrinks what is written and read
about tenfold.

The tier holds at most ``max_states`` states (the URL's ``size`` is not a
bound: states differ in size); its URL's ``policy`` chooses which to keep.

``python -m kvtier.integrations.llama_cpp --tier URL --model model.gguf ...``
runs llama-cpp-python's OpenAI-compatible server with this cache (the other
arguments are the server's own; it needs ``llama-cpp-python[server]``).

Importing this module needs the tested llama-cpp-python release (0.3).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.integrations.errors import UnsupportedReleaseError
from kvtier.integrations.flat import FlatPages
from kvtier.integrations.release import Pin, require_release
from kvtier.integrations.sync_tier import SyncTier
from kvtier.keys import BlockHasher, Namespace
from kvtier.offload.config import TierSpec
from kvtier.offload.media import PutItem, Stored

#: The llama-cpp-python release the cache is tested against.
TESTED_LLAMA_CPP: Final = "0.3.36"
LLAMA_CPP: Final = Pin(
    distribution="llama-cpp-python",
    tested=TESTED_LLAMA_CPP,
    install=(
        f"install it with `pip install 'llama-cpp-python[server]=={TESTED_LLAMA_CPP}'` (it "
        "compiles llama.cpp: several minutes) or `pip install 'kvtier[llama-cpp]'`"
    ),
    allow_env="KVTIER_LLAMA_CPP_ALLOW_UNTESTED",
)


def require_llama_cpp(version: str | None = None) -> str:
    """The installed llama-cpp-python version; :class:`UnsupportedReleaseError` unless tested."""
    return require_release(LLAMA_CPP, UnsupportedReleaseError, version=version)


LLAMA_CPP_VERSION = require_llama_cpp()

from llama_cpp.llama import LlamaState  # noqa: E402
from llama_cpp.llama_cache import BaseLlamaCache  # noqa: E402

# magic, format version, n_tokens, seed, token ids, logit rows, logit columns, state bytes
_STATE = struct.Struct("<4sIqqqqqq")
_MAGIC = b"KVLS"
_POINTER = struct.Struct("<16sQ")  # the state's key, its stored length
_POINTER_PAGES = FlatPages.make(_POINTER.size)


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8).data)


def pack_state(state: Any, *, logits: bool = True) -> bytearray:
    """A ``LlamaState`` as bytes: a header, the token ids, the logits, llama.cpp's state.

    ``logits=False`` leaves the logits out (their column count is kept). Each
    part is copied once, straight into the result (a state can be hundreds of MB).
    """
    ids = np.ascontiguousarray(state.input_ids, dtype=np.intc)
    scores = np.ascontiguousarray(state.scores, dtype=np.single)
    rows, cols = scores.shape if scores.ndim == 2 else (0, 0)
    if not logits:
        rows, scores = 0, scores[:0]
    blob = memoryview(state.llama_state).cast("B")[: int(state.llama_state_size)]
    out = bytearray(_STATE.size + ids.nbytes + scores.nbytes + len(blob))
    _STATE.pack_into(out, 0, _MAGIC, 1, int(state.n_tokens), int(state.seed), ids.size, rows,
                     cols, len(blob))
    view = memoryview(out)
    at = _STATE.size
    for part in (_bytes_of(ids), _bytes_of(scores), blob):
        view[at : at + len(part)] = part
        at += len(part)
    return out


def unpack_state(data: bytes | bytearray | memoryview) -> Any:
    """The ``LlamaState`` :func:`pack_state` wrote; :class:`CorruptBlockError` if malformed.

    A state stored without its logits comes back with one row of zeros, which
    ``Llama.load_state`` spreads over the rows it never reads.
    """
    view = memoryview(data)
    if len(view) < _STATE.size:
        raise CorruptBlockError("a stored llama.cpp state is shorter than its header")
    magic, version, n_tokens, seed, n_ids, rows, cols, n_state = _STATE.unpack_from(view)
    if magic != _MAGIC or version != 1 or min(n_tokens, n_ids, rows, cols, n_state) < 0:
        raise CorruptBlockError("a stored llama.cpp state has a bad header")
    if len(view) != _STATE.size + 4 * n_ids + 4 * rows * cols + n_state:
        raise CorruptBlockError("a stored llama.cpp state has the wrong length")
    at = _STATE.size
    ids = np.frombuffer(view[at : at + 4 * n_ids], dtype=np.intc).copy()
    at += 4 * n_ids
    if rows:
        # A view of the buffer read (``Llama.load_state`` copies it).
        scores = np.frombuffer(view[at : at + 4 * rows * cols], dtype=np.single)
        scores = scores.reshape(rows, cols)
    else:
        scores = np.zeros((min(1, n_tokens), cols), dtype=np.single)
    at += 4 * rows * cols
    return LlamaState(
        input_ids=ids, scores=scores, n_tokens=n_tokens,
        llama_state=bytes(view[at:]), llama_state_size=n_state, seed=seed,
    )


def model_identity(llama: Any) -> str:
    """What a saved state depends on: the model file, the context, this release."""
    path = str(llama.model_path)
    try:
        size = os.path.getsize(path)
    except OSError:
        size = -1
    params = llama.context_params
    return (
        f"llama.cpp/{LLAMA_CPP_VERSION}/{os.path.basename(path)}/{size}/n_ctx={llama.n_ctx()}"
        f"/k={int(params.type_k)}/v={int(params.type_v)}"
        f"/fa={int(getattr(params, 'flash_attn_type', getattr(params, 'flash_attn', 0)))}"
    )


class KvTierLlamaCache(BaseLlamaCache):  # type: ignore[misc]
    """llama-cpp-python's prompt cache in a kvtier tier (see the module docstring)."""

    def __init__(
        self,
        tier: str,
        *,
        model: str,
        logits: bool = True,
        block_tokens: int = 16,
        max_states: int = 32,
        retry_interval_s: float = 1.0,
    ) -> None:
        spec = TierSpec.from_url(tier)
        if spec.write_mode is not None:
            raise ConfigError(f"tier {tier!r}: llama.cpp decides what to save; drop write=")
        if not isinstance(max_states, int) or isinstance(max_states, bool) or max_states < 1:
            raise ConfigError(f"max_states must be a positive integer, got {max_states!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        super().__init__(capacity_bytes=spec.size_bytes)
        self.spec = spec
        self.logits = logits
        self.hasher = BlockHasher(Namespace(model), block_tokens)
        root = f"llama-{self.hasher.root:032x}"
        self.states = SyncTier(spec, f"{root}-states", max_states,
                               retry_interval_s=retry_interval_s)
        # An entry per full block of each state: enough for states of 256 blocks.
        self.index = SyncTier(spec, f"{root}-index", max_states * 256,
                              _POINTER_PAGES.format.payload_size,
                              retry_interval_s=retry_interval_s)
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.saves = 0

    @classmethod
    def for_model(cls, llama: Any, tier: str, **kwargs: Any) -> KvTierLlamaCache:
        """A cache for ``llama``'s model and context (see :func:`model_identity`).

        Logits are stored only when ``llama`` was created with ``logits_all=True``.
        """
        kwargs.setdefault("logits", bool(getattr(llama, "_logits_all", True)))
        return cls(tier, model=model_identity(llama), **kwargs)

    @property
    def cache_size(self) -> int:
        """Bytes of the states this process stored or loaded that the tier still holds."""
        ready = set(self.states.offload_manager.ready_keys())
        with self._lock:
            return sum(n for k, n in self._sizes.items() if k in ready)

    # -- lookups ------------------------------------------------------------------------------
    # Reads check each item in place and copy nothing through torch: a torch kernel
    # would wake torch's worker threads, which then spin on the cores llama.cpp's own
    # threads are about to compute on (on two cores that doubled a restart's TTFT).
    def _pointer(self, key: int) -> tuple[int, int] | None:
        """The state an index entry names: (its key, its stored length)."""
        found: list[tuple[bytes, int]] = []

        def fill(_: int, stored: Stored) -> None:
            found.append(_POINTER.unpack(_POINTER_PAGES.verified_bytes(stored, key)))

        if not self.index.read([key], fill)[0]:
            return None
        raw, length = found[0]
        return int.from_bytes(raw, "little"), int(length)

    def _state(self, key: int, nbytes: int) -> Any | None:
        if not self.states.present([key]):  # (a shared medium is asked, and the key adopted)
            return None
        pages = FlatPages.make(nbytes)
        state: list[Any] = []

        def fill(_: int, stored: Stored) -> None:
            state.append(unpack_state(pages.verified_bytes(stored, key)))

        if not self.states.read([key], fill)[0]:
            return None
        return state[0]

    def _find(self, tokens: Sequence[int]) -> Any | None:
        keys = self.hasher.chain(list(tokens))
        n = self.index.present(keys) if keys else 0
        while n > 0:
            entry = self._pointer(keys[n - 1])
            if entry is not None:
                state = self._state(*entry)
                if state is not None:
                    with self._lock:
                        self._sizes[entry[0]] = entry[1]
                    return state
            # The state is gone (evicted, damaged): drop the entry, try a shorter prefix.
            self.index.forget([keys[n - 1]])
            n -= 1
        return None

    def __getitem__(self, key: Sequence[int]) -> Any:
        state = self._find(key)
        if state is None:
            self.misses += 1
            raise KeyError("no stored llama.cpp state shares a full block with these tokens")
        self.hits += 1
        return state

    def __contains__(self, key: Sequence[int]) -> bool:
        keys = self.hasher.chain(list(key))
        return bool(keys) and self.index.present(keys) > 0

    # -- saves --------------------------------------------------------------------------------
    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        keys = self.hasher.chain(list(key))
        if not keys:
            return  # shorter than a block: nothing to name it by
        data = pack_state(value, logits=self.logits)
        state_key = keys[-1]
        fmt = FlatPages.make(len(data)).format
        payload = torch.frombuffer(data, dtype=torch.uint8)

        def state_item(_: int) -> PutItem:
            return state_key, 0, payload, fmt

        if not self.states.write([state_key], state_item)[0]:
            return
        with self._lock:
            self._sizes[state_key] = len(data)
        self.saves += 1
        pointer = torch.frombuffer(
            bytearray(_POINTER.pack(state_key.to_bytes(16, "little"), len(data))),
            dtype=torch.uint8,
        )

        def pointer_item(i: int) -> PutItem:
            return keys[i], 0, pointer, _POINTER_PAGES.format

        self.index.write(keys, pointer_item)

    def close(self) -> None:
        self.states.close()
        self.index.close()


def main(argv: list[str] | None = None) -> None:
    """llama-cpp-python's server with a :class:`KvTierLlamaCache` on every model it loads."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--tier" not in args or args.index("--tier") + 1 >= len(args):
        raise SystemExit("usage: python -m kvtier.integrations.llama_cpp --tier URL "
                         "--model MODEL.gguf [llama_cpp.server arguments]")
    at = args.index("--tier")
    tier = args[at + 1]
    del args[at : at + 2]
    try:
        TierSpec.from_url(tier)  # a bad URL fails now, not at the first request
    except ConfigError as exc:
        raise SystemExit(f"--tier: {exc}") from None
    from llama_cpp.server import __main__ as server
    from llama_cpp.server.model import LlamaProxy

    load = LlamaProxy.load_llama_from_model_settings

    def load_with_cache(settings: Any) -> Any:
        model = load(settings)
        model.set_cache(KvTierLlamaCache.for_model(model, tier))
        return model

    LlamaProxy.load_llama_from_model_settings = staticmethod(load_with_cache)
    sys.argv = [sys.argv[0], *args]
    server.main()


if __name__ == "__main__":
    main()
