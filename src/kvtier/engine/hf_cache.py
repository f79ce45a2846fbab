"""A Hugging Face transformers ``Cache`` whose keys and values live in kvtier blocks.

:class:`KvTierCache` is one request's view of the block pool. Built from a
prompt, it asks the :class:`~kvtier.KVCacheManager` for the longest cached
prefix and reports that many tokens as already in the cache, so
``model(...)`` and ``generate(...)`` compute only the rest of the prompt,
at the right positions, with the causal mask covering the cached prefix.
Every forward pass writes the new tokens' K/V into the request's slots of a
:class:`~kvtier.storage.KVBlockStorage` and attention reads the request's
whole K/V back through its block table, so what the next request reuses is
exactly what this one computed.

Publishing a full block needs its token ids, which a ``Cache`` never sees;
:func:`attach` installs a forward pre-hook that hands the model's
``input_ids`` to the cache (``generate`` needs it; the reference engine
calls :meth:`KvTierCache.feed` itself). One cache holds one sequence
(batch size 1). Use it as a context manager, or call :meth:`release` (done)
or :meth:`abort` (a forward pass failed), so no block published for tokens
that were never computed can be hit later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.block_table import BlockTable
from kvtier.errors import BadRequestError, ConfigError, KvTierError
from kvtier.keys import ExtraKey
from kvtier.layers import install_kinds
from kvtier.layers.base import BlockCache
from kvtier.layers.geometry import geometry
from kvtier.layers.state_spec import slot_width, state_spec
from kvtier.layers.support import check_supported, check_wrapper
from kvtier.layout import DTYPE_BYTES, KVLayout, cdiv
from kvtier.manager import KVCacheManager, RequestId
from kvtier.offload.chain import TierChain
from kvtier.offload.swap import SwappedRequest
from kvtier.storage import KVBlockStorage

_HOOK_ATTR = "_kvtier_cache_hook"


def layout_for_model(config: Any, block_size: int, dtype: torch.dtype) -> KVLayout:
    """The KV block layout of a transformers decoder config.

    Raises :class:`ConfigError` for a model kvtier cannot serve exactly
    (:func:`kvtier.layers.support.check_supported`). Sliding-window layers
    (:mod:`kvtier.layers.attention_spec`) keep the same per-block geometry as
    full ones: every block holds every layer's K/V.
    """
    text = getattr(config, "text_config", None) or config  # vision-language: the decoder's

    def get(name: str) -> object:
        # Whether the decoder serves images decides how some families attend (Gemma 3).
        source = config if name == "vision_config" else text
        return getattr(source, name, None)

    if text is not config:
        check_wrapper(getattr(config, "model_type", None))
    check_supported(get)
    layers, _, kv_heads, head_dim = geometry(lambda name: getattr(text, name, None))
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"model dtype {dtype} cannot be stored in KV blocks")
    state = state_spec(lambda name: getattr(text, name, None))
    if state is not None:
        # A state layer's part of a block holds the layer's recurrent state.
        head_dim = slot_width(state, head_dim, kv_heads, block_size, DTYPE_BYTES[name])
    return KVLayout(layers, kv_heads, head_dim, block_size, name)


class _KvTierLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's view of a :class:`KvTierCache`."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, owner: KvTierCache, index: int, length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self._index = index
        #: Tokens of this layer whose K/V are in the blocks.
        self.length = length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        width = self._owner.storage.layout.head_dim
        k_dim, v_dim = key_states.shape[-1], value_states.shape[-1]
        if k_dim != v_dim and max(k_dim, v_dim) == width:
            # MLA (DeepSeek V3) caches its latent and rotary key, of two widths: the
            # narrower one is zero-padded to the block's width and cut back on the way out.
            key_states = F.pad(key_states, (0, width - k_dim))
            value_states = F.pad(value_states, (0, width - v_dim))
        k, v = self._owner._update(self, key_states, value_states)
        if k_dim != v_dim:
            k, v = k[..., :k_dim], v[..., :v_dim]
        self.keys, self.values = k, v
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise BadRequestError("a KvTierCache cannot be reset: release it and build a new one")

    def crop(self, tokens_to_remove: int) -> None:
        raise BadRequestError(
            "a KvTierCache cannot be cropped (its full blocks may be shared): "
            "disable assisted/speculative decoding with it"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise BadRequestError("a KvTierCache holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise BadRequestError(
            "a KvTierCache holds one sequence: use fork() for more than one continuation"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise BadRequestError("a KvTierCache holds one sequence")


class _Pass:
    """Index tensors of the forward pass in progress, shared by every layer."""

    __slots__ = ("block_ids", "end", "slots", "start")

    def __init__(self, table: BlockTable, start: int, end: int, device: torch.device) -> None:
        self.start = start
        self.end = end
        self.slots = torch.tensor(table.slot_mapping(start, end), dtype=torch.int64, device=device)
        bs = table.block_size
        self.block_ids = torch.tensor(
            table.blocks[: cdiv(end, bs)], dtype=torch.int64, device=device
        )


class KvTierCache(Cache, BlockCache):
    """One request's KV cache, stored in kvtier blocks (see the module docstring).

    ``prompt_ids`` are the request's tokens so far; their longest cached
    prefix is reused (:attr:`num_cached_tokens`) and blocks are allocated for
    the rest. ``extra_keys`` (a LoRA id, a tenant salt) are mixed into every
    block key, so only requests with the same extra keys share blocks.
    """

    def __init__(
        self,
        storage: KVBlockStorage,
        manager: KVCacheManager,
        request_id: RequestId,
        prompt_ids: Sequence[int],
        *,
        extra_keys: Sequence[ExtraKey] = (),
        tiers: TierChain | None = None,
    ) -> None:
        if storage.layout.block_size != manager.block_size:
            raise ConfigError(
                f"storage block size {storage.layout.block_size} differs from the "
                f"manager's {manager.block_size}: build both from one KVLayout"
            )
        if storage.num_blocks < manager.num_blocks:
            raise ConfigError(
                f"storage holds {storage.num_blocks} blocks but the manager hands out "
                f"{manager.num_blocks}: size them alike"
            )
        if storage.layout_kind == "split":
            raise ConfigError(
                "a KvTierCache needs storage that keeps every layer in every block "
                "(make_storage); windowed storage is the batched engine's"
            )
        ids = _as_ids(prompt_ids, "prompt_ids")
        if tiers is not None and (
            tiers.storage is not storage or tiers.device_manager is not manager
        ):
            raise ConfigError("the tier chain was built for another storage or manager")
        match = manager.match(ids, extra_keys=extra_keys)
        alloc = manager.allocate(request_id, ids, match=match)
        cached = alloc.num_cached_tokens
        loaded = 0
        if tiers is not None:
            try:
                loaded = self._promote(tiers, manager, request_id, alloc.block_table, cached, ids)
            except BaseException:
                manager.abort(request_id, cached)
                raise
        self._init(storage, manager, request_id, ids, alloc.block_table, cached + loaded)
        self._tiers: TierChain | None = tiers
        #: Prompt tokens whose K/V came from the cache (not computed here).
        self.num_cached_tokens = cached + loaded
        #: Of those, tokens loaded from a tier below the device.
        self.num_loaded_tokens = loaded

    @staticmethod
    def _promote(
        tiers: TierChain,
        manager: KVCacheManager,
        request_id: RequestId,
        table: BlockTable,
        cached: int,
        ids: list[int],
    ) -> int:
        """Load prompt blocks past the device hit from the tiers; returns the tokens loaded."""
        bs = manager.block_size
        start = cached // bs
        # The last prompt token is always computed (its logits are needed).
        limit = (len(ids) - 1) // bs
        if limit <= start:
            return 0
        keys = manager.block_keys(request_id)[start:limit]
        return tiers.load(keys, table.blocks[start : start + len(keys)]) * bs

    def _init(
        self,
        storage: KVBlockStorage,
        manager: KVCacheManager,
        request_id: RequestId,
        tokens: list[int],
        table: BlockTable,
        computed: int,
    ) -> None:
        self.storage = storage
        self.manager = manager
        self.request_id = request_id
        self._tokens = tokens
        self._table = table
        self._computed = computed
        self._pass: _Pass | None = None
        self._open = True
        self._tiers = None
        self.num_loaded_tokens = 0
        super().__init__(
            layers=[_KvTierLayer(self, i, computed) for i in range(storage.layout.num_layers)]
        )

    # -- state ------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """Every token given to the cache so far (a copy)."""
        return list(self._tokens)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the blocks (cached prefix included)."""
        return self._computed

    @property
    def block_table(self) -> BlockTable:
        return self._table.copy()

    @property
    def is_open(self) -> bool:
        return self._open

    def _check_open(self) -> None:
        if not self._open:
            raise BadRequestError(
                f"the KvTierCache of request {self.request_id!r} was released; build a new one"
            )

    # -- feeding tokens -------------------------------------------------------------
    def feed(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Declare the input ids of the next forward pass.

        Ids at positions the cache already knows (the rest of the prompt)
        must match them; ids past them are appended to the request, and full
        blocks they complete are published for reuse.
        """
        self._check_open()
        ids = _as_ids(token_ids, "input_ids")
        start = self._computed
        known = len(self._tokens)
        overlap = max(min(known - start, len(ids)), 0)
        if ids[:overlap] != self._tokens[start : start + overlap]:
            raise BadRequestError(
                f"input_ids do not continue this cache's sequence at position {start}: "
                "pass the same prompt the cache was built with"
            )
        new = ids[overlap:]
        if new:
            ext = self.manager.extend(self.request_id, new)
            if ext.copies:
                self.storage.copy_blocks(ext.copies)
            self._table = ext.block_table
            self._tokens.extend(new)

    def _begin(self, num_new: int) -> _Pass:
        start = self._computed
        end = start + num_new
        if end > len(self._tokens):
            raise BadRequestError(
                f"the forward pass brings {num_new} tokens at position {start}, but the cache "
                f"knows token ids only up to {len(self._tokens)}: call kvtier.engine.attach(model) "
                "once, or cache.feed(input_ids) before model(...)"
            )
        p = _Pass(self._table, start, end, self.storage.device)
        self._pass = p
        return p

    def _update(
        self, layer: _KvTierLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_open()
        if key_states.dim() != 4 or key_states.shape[0] != 1:
            raise BadRequestError(
                f"a KvTierCache holds one sequence, got key states shaped {list(key_states.shape)}"
                " (batch must be 1): build one cache per request"
            )
        q = key_states.shape[2]
        p = self._pass
        if p is None or layer.length != p.start or p.end - p.start != q:
            if layer.length != self._computed:
                raise BadRequestError(
                    f"layer {layer._index} is at token {layer.length} while the cache is at "
                    f"{self._computed}: a forward pass was interrupted; abort() this cache"
                )
            p = self._begin(q)
        storage = self.storage
        idx = layer._index
        storage.write(idx, p.slots, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        k, v = storage.read(idx, p.block_ids, p.end)
        layer.length = p.end
        if idx == len(self.layers) - 1:
            self._computed = p.end
            self._pass = None
            tiers = self._tiers
            if tiers is not None and tiers.writes_through:
                self._write_through(tiers, p.start, p.end)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def _write_through(self, tiers: TierChain, start: int, end: int) -> None:
        bs = self.manager.block_size
        first, last = start // bs, end // bs
        if last > first:
            keys = self.manager.block_keys(self.request_id)[first:last]
            tiers.store_computed(keys, self._table.blocks[first : first + len(keys)])

    # -- lifecycle ------------------------------------------------------------------
    def fork(self, request_id: RequestId) -> KvTierCache:
        """A new request continuing from this one, sharing its blocks (copy-on-write)."""
        self._check_open()
        if self._pass is not None:
            raise BadRequestError("cannot fork a KvTierCache in the middle of a forward pass")
        table = self.manager.fork(self.request_id, request_id)
        other = KvTierCache.__new__(KvTierCache)
        other._init(
            self.storage, self.manager, request_id, list(self._tokens), table, self._computed
        )
        other.num_cached_tokens = self._computed
        other._tiers = self._tiers
        return other

    def swap_out(self) -> SwappedRequest:
        """Move this request's computed blocks to the first tier and free them here.

        The cache is closed afterwards; :meth:`swap_in` builds its successor.
        """
        self._check_open()
        if self._tiers is None:
            raise ConfigError("swap_out needs a KvTierCache built with tiers=TierChain(...)")
        if self._pass is not None:
            raise BadRequestError("cannot swap out a KvTierCache in the middle of a forward pass")
        if self._computed < len(self._tokens):
            # Tokens fed but not computed have no K/V to keep: forget them first.
            self.manager.abort(self.request_id, self._computed)
            tokens = self._tokens[: self._computed]
            self._open = False
            return SwappedRequest(self.request_id, tuple(tokens), (), 0, None)
        swapped = self._tiers.swap_out(self.request_id, self._tokens, self._computed)
        self._open = False
        return swapped

    @classmethod
    def swap_in(
        cls,
        swapped: SwappedRequest,
        storage: KVBlockStorage,
        manager: KVCacheManager,
        tiers: TierChain,
        *,
        token_ids: Sequence[int] | None = None,
        extra_keys: Sequence[ExtraKey] = (),
    ) -> KvTierCache:
        """Rebuild a swapped-out request: its blocks come back from the device or the tiers.

        ``token_ids`` may extend the swapped tokens (a token sampled but not
        yet run through the model).
        """
        ids = list(swapped.token_ids) if token_ids is None else _as_ids(token_ids, "token_ids")
        if tuple(ids[: len(swapped.token_ids)]) != swapped.token_ids:
            raise BadRequestError("token_ids must start with the swapped request's tokens")
        cache = cls(
            storage,
            manager,
            swapped.request_id,
            ids,
            extra_keys=extra_keys,
            tiers=tiers,
        )
        bs = manager.block_size
        n = swapped.num_computed_tokens
        full = n // bs
        if (
            n % bs
            and cache._computed == full * bs
            and swapped.tail_key is not None
            and tiers.load_tail(swapped, cache._table.blocks[full])
        ):
            cache._computed = n
            for layer in cache.layers:
                assert isinstance(layer, _KvTierLayer)
                layer.length = n
            cache.num_cached_tokens = n
            cache.num_loaded_tokens += n - full * bs
        return cache

    def release(self) -> None:
        """End the request; its full computed blocks stay cached for reuse.

        Tokens fed but never computed (a pass that did not run) are withdrawn.
        """
        if not self._open:
            return
        self._open = False
        if self._computed < len(self._tokens):
            self.manager.abort(self.request_id, self._computed)
        else:
            self.manager.free(self.request_id)

    def abort(self) -> None:
        """End the request after a failed forward pass: blocks past the last
        complete pass are withdrawn from the cache, never served."""
        if not self._open:
            return
        self._open = False
        self._pass = None
        self.manager.abort(self.request_id, self._computed)

    def discard(self) -> None:
        """End the request keeping nothing: every block it published is withdrawn.

        Blocks it reused from the cache (its cached prefix, or the blocks it
        shares with the request it was forked from) stay cached.
        """
        if not self._open:
            return
        self._open = False
        self._pass = None
        self.manager.abort(self.request_id, self.num_cached_tokens)

    def __enter__(self) -> KvTierCache:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.release()
        else:
            self.abort()

    def __repr__(self) -> str:
        return (
            f"KvTierCache(request_id={self.request_id!r}, tokens={len(self._tokens)}, "
            f"computed={self._computed}, cached_prefix={self.num_cached_tokens})"
        )


def _as_ids(token_ids: object, what: str) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2:
            if token_ids.shape[0] != 1:
                raise BadRequestError(
                    f"{what} has batch size {token_ids.shape[0]}; a KvTierCache holds one sequence"
                )
            token_ids = token_ids[0]
        if token_ids.dim() != 1 or token_ids.is_floating_point():
            raise BadRequestError(f"{what} must be a 1-D integer tensor or a list of ints")
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise BadRequestError(
            f"{what} must be a sequence of token ids, got {type(token_ids).__name__}"
        )
    out = list(token_ids)
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadRequestError(f"{what} must hold ints, got {type(t).__name__}")
    return out


#: The keyword a forward pass gets its cache under: ``cache`` from transformers
#: 5.24 on (what ``generate`` passes), ``past_key_values`` before (deprecated since).
_CACHE_KWARGS = ("cache", "past_key_values")


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = next(
        (c for c in (kwargs.get(k) for k in _CACHE_KWARGS) if isinstance(c, KvTierCache)), None
    )
    if cache is None:
        return
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if ids is None:
        raise KvTierError(
            "a KvTierCache needs the input_ids of every forward pass (inputs_embeds alone "
            "cannot be keyed): pass input_ids"
        )
    cache.feed(ids)


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Let ``model`` feed its input ids to a :class:`KvTierCache` (idempotent).

    Needed for ``model.generate(..., cache=cache)`` (``past_key_values=cache``
    before transformers 5.24): the cache must know each generated token's id
    to publish the blocks it fills.
    """
    # Some layer kinds (LFM2's convolutions) keep their memory in the cache's blocks too.
    install_kinds(model, for_cache=True)
    if not getattr(model, _HOOK_ATTR, False):
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        setattr(model, _HOOK_ATTR, True)
    return model
