"""Swapping whole requests through the tier chain: a paused or moving request's blocks.

:func:`swap_out` stores a paused request's computed blocks on the first tier
(full blocks under their prefix keys, so other requests can hit them too; the
partial last block under a key private to the request) and frees them on the
device. :func:`store_request` does the same for a live request that keeps its
blocks (one moving to another engine that shares the tier). :func:`load_tail`
brings the private last block back. Only the chain's public methods are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvtier.errors import ConfigError, TierUnavailableError

if TYPE_CHECKING:
    from kvtier.offload.chain import TierChain


@dataclass(frozen=True, slots=True)
class SwappedRequest:
    """What :func:`swap_out` kept of a request, to resume it later (here or elsewhere)."""

    request_id: object
    token_ids: tuple[int, ...]
    extra_keys: tuple[object, ...]
    num_computed_tokens: int
    #: Key the partial last block was stored under (``None``: no partial block).
    tail_key: int | None
    #: The tier the tail went to (index into the chain's tiers).
    tail_tier: int = 0


def swap_out(
    chain: TierChain,
    request_id: object,
    token_ids: Sequence[int],
    num_computed_tokens: int,
    *,
    extra_keys: Sequence[object] = (),
) -> SwappedRequest:
    """Store a paused request's computed blocks on the first tier and free them."""
    swapped = store_request(
        chain, request_id, token_ids, num_computed_tokens, extra_keys=extra_keys
    )
    # Blocks nobody else holds leave the device now: that is the point of a swap.
    chain.device_manager.free_and_drop(request_id)
    return swapped


def store_request(
    chain: TierChain,
    request_id: object,
    token_ids: Sequence[int],
    num_computed_tokens: int,
    *,
    tier: int = 0,
    extra_keys: Sequence[object] = (),
) -> SwappedRequest:
    """Store a live request's computed blocks on tier ``tier``; it keeps its device blocks."""
    if not 0 <= tier < len(chain.tiers):
        raise ConfigError(f"tier {tier} is not one of this chain's {len(chain.tiers)} tiers")
    mgr = chain.device_manager
    blocks = mgr.block_table(request_id).blocks
    bs = mgr.block_size
    keys = mgr.block_keys(request_id)
    n_full = min(len(keys), num_computed_tokens // bs)
    rest = num_computed_tokens - n_full * bs
    held = blocks[: n_full + (1 if rest > 0 and n_full < len(blocks) else 0)]
    if not all(chain.storage.exportable(held)):
        raise TierUnavailableError(
            f"request {request_id!r} cannot be stored whole: some of its blocks' sliding-window "
            "K/V was reclaimed (it recomputes instead)"
        )
    chain.store_blocks(tier, keys[:n_full], blocks[:n_full])
    tail: int | None = None
    if rest > 0 and n_full < len(blocks):
        tail = tail_key(mgr.namespace_root, request_id, token_ids[:num_computed_tokens])
        chain.store_blocks(tier, [tail], [blocks[n_full]])
    return SwappedRequest(
        request_id, tuple(token_ids), tuple(extra_keys), num_computed_tokens, tail, tier
    )


def load_tail(chain: TierChain, swapped: SwappedRequest, block: int) -> bool:
    """Load a swapped request's partial last block into device ``block``; then drop it
    from the tier (it is the request's alone, on a shared medium too)."""
    if swapped.tail_key is None:
        return False
    return chain.load_block(swapped.tail_tier, swapped.tail_key, block, consume=True)


def tail_key(root: int, request_id: object, tokens: Sequence[int]) -> int:
    """The private key of a request's partial last block."""
    h = xxhash.xxh3_128()
    h.update(root.to_bytes(16, "little"))
    h.update(repr(request_id).encode())
    h.update(b"\x00swap-tail\x00")
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return int(h.intdigest())
