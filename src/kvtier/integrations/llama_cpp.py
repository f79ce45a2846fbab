"""llama.cpp's prompt cache on kvtier's tiers: a ``BaseLlamaCache`` for llama-cpp-python.

``llama_cpp.Llama`` saves its whole state (KV cache, token ids, logits)
after each completion and, before the next, asks its cache for the state
whose tokens share the longest prefix with the new prompt, loading it when
that beats what it already holds. :class:`KvtierLlamaCache` keeps those
states in a kvtier tier, so a prompt is reused across processes, restarts
(a disk tier) and machines (Redis)::

    llm = llama_cpp.Llama(model_path="model.gguf", n_ctx=4096)
    llm.set_cache(KvtierLlamaCache.for_model(llm, "disk:/var/cache/kvtier?size=20GiB"))

Keys are kvtier's chained block keys (:class:`kvtier.keys.BlockHasher`,
``block_tokens`` tokens a block) of a state's tokens, in a namespace of the
model file, the context size and the llama-cpp-python release (a state only
loads into the context it came from). A state saved for tokens ``T`` is
stored once, under the key of ``T``'s last full block, and each of ``T``'s
full blocks gets a small index entry naming it. A prompt asks for the index
entries of its own block keys in one batched call: the leading run found is
the longest prefix a stored state shares, and its last entry names the
state. Every item carries kvtier's header and checksums; a damaged or
vanished state is a miss (and its entry is dropped).

The tier holds at most ``max_states`` states, chosen by the URL's ``policy``.

``python -m kvtier.integrations.llama_cpp --tier URL --model model.gguf ...``
runs llama-cpp-python's OpenAI-compatible server with this cache (the other
arguments are the server's own; it needs ``llama-cpp-python[server]``).

Importing this module needs the tested llama-cpp-python release (0.3).
"""

from __future__ import annotations

import os
import struct
import sys
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
        f"install it with `pip install llama-cpp-python=={TESTED_LLAMA_CPP}` (it compiles "
        "llama.cpp: several minutes) or `pip install 'kvtier[llama-cpp]'`"
    ),
    allow_env="KVTIER_LLAMA_CPP_ALLOW_UNTESTED",
)


def require_llama_cpp(version: str | None = None) -> str:
    """The installed llama-cpp-python version; :class:`UnsupportedReleaseError` unless tested."""
    return require_release(LLAMA_CPP, UnsupportedReleaseError, version=version)


LLAMA_CPP_VERSION = require_llama_cpp()

from llama_cpp.llama import LlamaState  # noqa: E402
from llama_cpp.llama_cache import BaseLlamaCache  # noqa: E402

_STATE = struct.Struct("<4sIqqqqqq")  # magic, version, n_tokens, seed, ids, rows, cols, state
_MAGIC = b"KVLS"
_POINTER = struct.Struct("<16sQ")  # the state's key, its stored length


def pack_state(state: Any) -> bytes:
    """A ``LlamaState`` as bytes: a header, the token ids, the logits, llama.cpp's state."""
    ids = np.ascontiguousarray(state.input_ids, dtype=np.intc)
    scores = np.ascontiguousarray(state.scores, dtype=np.single)
    rows, cols = scores.shape if scores.ndim == 2 else (0, 0)
    blob = bytes(state.llama_state)[: int(state.llama_state_size)]
    head = _STATE.pack(_MAGIC, 1, int(state.n_tokens), int(state.seed), ids.size, rows, cols,
                       len(blob))
    return head + ids.tobytes() + scores.tobytes() + blob


def unpack_state(data: bytes | memoryview) -> Any:
    """The ``LlamaState`` :func:`pack_state` wrote; :class:`CorruptBlockError` if malformed."""
    view = memoryview(data)
    if len(view) < _STATE.size:
        raise CorruptBlockError("a stored llama.cpp state is shorter than its header")
    magic, version, n_tokens, seed, n_ids, rows, cols, n_state = _STATE.unpack_from(view)
    want = _STATE.size + 4 * n_ids + 4 * rows * cols + n_state
    if magic != _MAGIC or version != 1 or len(view) != want:
        raise CorruptBlockError("a stored llama.cpp state has a bad header")
    at = _STATE.size
    ids = np.frombuffer(view[at : at + 4 * n_ids], dtype=np.intc).copy()
    at += 4 * n_ids
    scores = np.frombuffer(view[at : at + 4 * rows * cols], dtype=np.single).reshape(rows, cols)
    at += 4 * rows * cols
    return LlamaState(
        input_ids=ids, scores=scores.copy(), n_tokens=n_tokens,
        llama_state=bytes(view[at:]), llama_state_size=n_state, seed=seed,
    )


def model_identity(llama: Any) -> str:
    """What a saved state depends on: the model file, the context size, this release."""
    path = str(llama.model_path)
    try:
        size = os.path.getsize(path)
    except OSError:
        size = -1
    return (f"llama.cpp/{LLAMA_CPP_VERSION}/{os.path.basename(path)}/{size}"
            f"/n_ctx={llama.n_ctx()}")


class KvtierLlamaCache(BaseLlamaCache):  # type: ignore[misc]
    """llama-cpp-python's prompt cache in a kvtier tier (see the module docstring)."""

    def __init__(
        self,
        tier: str,
        *,
        model: str,
        block_tokens: int = 16,
        max_states: int = 32,
        retry_interval_s: float = 1.0,
    ) -> None:
        spec = TierSpec.from_url(tier)
        if spec.write_mode is not None:
            raise ConfigError(f"tier {tier!r}: llama.cpp decides what to save; drop write=")
        if not isinstance(max_states, int) or max_states < 1:
            raise ConfigError(f"max_states must be a positive integer, got {max_states!r}")
        super().__init__(capacity_bytes=spec.size_bytes)
        self.spec = spec
        self.hasher = BlockHasher(Namespace(model), block_tokens)
        root = f"llama-{self.hasher.root:032x}"
        self.states = SyncTier(spec, f"{root}-states", max_states,
                               retry_interval_s=retry_interval_s)
        self.index = SyncTier(spec, f"{root}-index", max_states * 256,
                              retry_interval_s=retry_interval_s)
        self._sizes: dict[int, int] = {}
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_model(cls, llama: Any, tier: str, **kwargs: Any) -> KvtierLlamaCache:
        """A cache for ``llama``'s model and context size (see :func:`model_identity`)."""
        return cls(tier, model=model_identity(llama), **kwargs)

    @property
    def cache_size(self) -> int:
        with self.states._lock:
            held = [k for k in self._sizes if self.states.manager.is_ready(k)]
        return sum(self._sizes[k] for k in held)

    # -- lookups ------------------------------------------------------------------------------
    def _longest(self, keys: list[int]) -> int:
        return self.index.present(keys) if keys else 0

    def _pointer(self, key: int) -> tuple[int, int] | None:
        """The state an index entry names: (its key, its stored length)."""
        pages = FlatPages.make(_POINTER.size)
        out = torch.empty(_POINTER.size, dtype=torch.uint8)

        def fill(_: int, stored: Stored) -> None:
            pages.decode_into(stored, key, out)

        if not self.index.read([key], fill)[0]:
            return None
        raw, length = _POINTER.unpack(out.numpy().tobytes())
        return int.from_bytes(raw, "little"), int(length)

    def _state(self, key: int, nbytes: int) -> Any | None:
        pages = FlatPages.make(nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8)
        state: list[Any] = []

        def fill(_: int, stored: Stored) -> None:
            pages.decode_into(stored, key, out)
            state.append(unpack_state(out.numpy().data))

        if not self.states.read([key], fill)[0]:
            return None
        return state[0]

    def _find(self, tokens: Sequence[int]) -> Any | None:
        keys = self.hasher.chain(list(tokens))
        n = self._longest(keys)
        while n > 0:
            entry = self._pointer(keys[n - 1])
            if entry is not None:
                state = self._state(*entry)
                if state is not None:
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
        return self._longest(self.hasher.chain(list(key))) > 0

    # -- saves --------------------------------------------------------------------------------
    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        keys = self.hasher.chain(list(key))
        if not keys:
            return  # shorter than a block: nothing to name it by
        data = pack_state(value)
        state_key = keys[-1]
        pages = FlatPages.make(len(data))
        fmt = pages.format
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        def state_item(_: int) -> PutItem:
            return state_key, 0, payload, fmt

        if not self.states.write([state_key], state_item)[0]:
            return
        self._sizes[state_key] = len(data)
        pointer = torch.frombuffer(
            bytearray(_POINTER.pack(state_key.to_bytes(16, "little"), len(data))),
            dtype=torch.uint8,
        )
        pfmt = FlatPages.make(_POINTER.size).format

        def pointer_item(i: int) -> PutItem:
            return keys[i], 0, pointer, pfmt

        self.index.write(keys, pointer_item)

    def close(self) -> None:
        self.states.close()
        self.index.close()


def main(argv: list[str] | None = None) -> None:
    """llama-cpp-python's server with a :class:`KvtierLlamaCache` on every model it loads."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--tier" not in args:
        raise SystemExit("usage: python -m kvtier.integrations.llama_cpp --tier URL "
                         "--model MODEL.gguf [llama_cpp.server arguments]")
    at = args.index("--tier")
    tier = args[at + 1]
    del args[at : at + 2]
    TierSpec.from_url(tier)  # a bad URL fails now, not at the first request
    from llama_cpp.server import __main__ as server
    from llama_cpp.server.model import LlamaProxy

    load = LlamaProxy.load_llama_from_model_settings

    def load_with_cache(settings: Any) -> Any:
        model = load(settings)
        model.set_cache(KvtierLlamaCache.for_model(model, tier))
        return model

    LlamaProxy.load_llama_from_model_settings = staticmethod(load_with_cache)
    sys.argv = [sys.argv[0], *args]
    server.main()


if __name__ == "__main__":
    main()
