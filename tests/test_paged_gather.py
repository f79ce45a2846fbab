"""The paged attention's gather and batched attention equal plain attention per sequence.

For random batches (block sizes, grouped-query head counts, scattered block
tables, contexts and new-token counts, pure decode steps and mixes with
prefill chunks, full, sliding-window and chunked-local layers, float32 and
bfloat16) one call of :func:`~kvtier.engine.paged.paged_attention` must give,
for every sequence, what dense SDPA gives over that sequence's own keys and
values alone, built here from the tensors written (not read back through the
gather under test). The per-pass views of :class:`~kvtier.engine.paged.BatchMeta`
must name the right blocks and keep the same mask, and the additive form of
the mask shared by all layers must give results bit for bit the same as the
boolean mask it replaces.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier.engine.paged import paged_attention  # noqa: E402
from kvtier.layers.batch import BatchMeta, SeqSlice  # noqa: E402
from kvtier.layout import KVLayout, cdiv  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

F = torch.nn.functional
DIM = 16
LAYERS = 2


class _Layer(torch.nn.Module):
    def __init__(self, index: int, chunk: int | None = None) -> None:
        super().__init__()
        self.layer_idx = index
        if chunk is not None:
            self._kvtier_chunk = chunk


@st.composite
def passes(draw: Any) -> dict[str, Any]:
    """One batched pass: geometry, sequences ``(start, num_new)``, layer kind, dtype."""
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    decode = draw(st.booleans())
    count = draw(st.integers(1, 6))
    seqs = []
    for _ in range(count):
        start = draw(st.integers(0, 40))
        n = 1 if decode else draw(st.integers(1, 9))
        seqs.append((start, n))
    kind = draw(st.sampled_from(["full", "window", "chunk"]))
    return {
        "block_size": draw(st.sampled_from([1, 2, 4, 16])),
        "kv_heads": kv_heads,
        "heads": kv_heads * group,
        "seqs": seqs,
        "window": draw(st.integers(1, 24)) if kind == "window" else None,
        "chunk": draw(st.integers(1, 24)) if kind == "chunk" else None,
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None,
    chunk: int | None,
) -> torch.Tensor:
    """Plain SDPA of one sequence: ``q`` ``[heads, n, dim]`` over its own ``[kv_heads, L, dim]``."""
    n, length = q.shape[1], k.shape[1]
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(length)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if chunk is not None:
        mask &= kpos >= qpos // chunk * chunk
    out = F.scaled_dot_product_attention(
        q[None].float(),
        k[None].float(),
        v[None].float(),
        attn_mask=mask,
        scale=DIM**-0.5,
        enable_gqa=True,
    )
    return out[0]


def _run(p: dict[str, Any]) -> None:
    bs, kv_heads, heads, dtype = p["block_size"], p["kv_heads"], p["heads"], p["dtype"]
    g = torch.Generator().manual_seed(p["seed"])
    needed = sum(cdiv(s + n, bs) for s, n in p["seqs"])
    storage = KVBlockStorage(
        KVLayout(LAYERS, kv_heads, DIM, bs, "bfloat16" if dtype is torch.bfloat16 else "float32"),
        needed + 3,
        dtype=dtype,
    )
    # Scattered, shuffled blocks; stale data in every slot that no sequence owns yet.
    storage.tensor.copy_(torch.randn(storage.tensor.shape, generator=g) * 100)
    free = torch.randperm(needed + 3, generator=g).tolist()
    slices, past = [], []
    for start, n in p["seqs"]:
        blocks = [free.pop() for _ in range(cdiv(start + n, bs))]
        slots = [blocks[i // bs] * bs + i % bs for i in range(start + n)]
        k = torch.randn(LAYERS, start, kv_heads, DIM, generator=g).to(dtype)
        v = torch.randn(LAYERS, start, kv_heads, DIM, generator=g).to(dtype)
        if start:
            rows = storage.slot_rows(torch.tensor(slots[:start]))
            for layer in range(LAYERS):
                storage.write_rows(layer, rows, k[layer], v[layer])
        slices.append(SeqSlice(start, n, slots))
        past.append((k, v))
    total = sum(n for _, n in p["seqs"])
    meta = BatchMeta(storage, slices)
    assert meta.decode_only == all(n == 1 for _, n in p["seqs"])
    for layer in range(LAYERS):
        q = torch.randn(1, heads, total, DIM, generator=g).to(dtype)
        k_new = torch.randn(1, kv_heads, total, DIM, generator=g).to(dtype)
        v_new = torch.randn(1, kv_heads, total, DIM, generator=g).to(dtype)
        out, _ = paged_attention(
            _Layer(layer, p["chunk"]),
            q,
            k_new,
            v_new,
            None,
            scaling=DIM**-0.5,
            sliding_window=p["window"],
            kvtier_batch=meta,
        )
        assert out.shape == (1, total, heads, DIM)
        assert out.dtype == dtype
        t = 0
        for (start, n), (k, v) in zip(p["seqs"], past, strict=True):
            keys = torch.cat([k[layer], k_new[0, :, t : t + n].transpose(0, 1)]).transpose(0, 1)
            values = torch.cat([v[layer], v_new[0, :, t : t + n].transpose(0, 1)]).transpose(0, 1)
            want = _dense(q[0, :, t : t + n], keys, values, start, p["window"], p["chunk"])
            got = out[0, t : t + n].transpose(0, 1).float()
            tol = 2e-2 if dtype is torch.bfloat16 else 1e-5
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            t += n


@given(passes())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_paged_attention_equals_dense_attention_per_sequence(p: dict[str, Any]) -> None:
    _run(p)


@given(passes())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_views_name_each_sequences_blocks_and_the_bias_is_the_mask(p: dict[str, Any]) -> None:
    bs = p["block_size"]
    needed = sum(cdiv(s + n, bs) for s, n in p["seqs"])
    storage = KVBlockStorage(KVLayout(1, 1, DIM, bs, "float32"), needed + 3, dtype=torch.float32)
    g = torch.Generator().manual_seed(p["seed"])
    free = torch.randperm(needed + 3, generator=g).tolist()
    slices, tables = [], []
    for start, n in p["seqs"]:
        blocks = [free.pop() for _ in range(cdiv(start + n, bs))]
        tables.append(blocks)
        slices.append(SeqSlice(start, n, [blocks[i // bs] * bs + i % bs for i in range(start + n)]))
    meta = BatchMeta(storage, slices)
    view = meta.full
    # The block-id view: each sequence's own blocks in order, padded with its first one.
    ids = view.blocks.view(meta.B, meta.NB).tolist()
    for row, blocks in zip(ids, tables, strict=True):
        assert row[: len(blocks)] == blocks
        assert set(row[len(blocks) :]) <= {blocks[0]}
    assert torch.equal(meta.kv_blocks, view.blocks)
    # The rows gathered are those blocks' slots, through the storage's row view.
    slots = (view.blocks[:, None] * bs + torch.arange(bs)).flatten()
    assert torch.equal(view.rows, storage.slot_rows(slots))
    # Sliding and chunked views reuse one object per pass, whichever layer asks first.
    if p["window"] is not None:
        assert meta.window_view(p["window"]) is meta.window_view(p["window"])
        view = meta.window_view(p["window"])
    if p["chunk"] is not None:
        assert meta.chunked_view(p["chunk"]) is meta.chunked_view(p["chunk"])
        view = meta.chunked_view(p["chunk"])
    # No query row is all masked (SDPA would give NaN), and the additive mask is the mask.
    assert bool(view.mask.any(dim=-1).all())
    for dtype in (torch.float32, torch.bfloat16):
        bias = view.bias(dtype)
        assert bias.dtype == dtype and bias.shape == view.mask.shape
        assert torch.equal(bias == 0, view.mask)
        assert bool(torch.isneginf(bias[~view.mask]).all())
        assert view.bias(dtype) is bias  # built once, shared by the pass's layers
        q = torch.randn(meta.B, 2, meta.Q, DIM, generator=g).to(dtype)
        kv = torch.randn(meta.B, 2, view.mask.shape[-1], DIM, generator=g).to(dtype)
        with_bool = F.scaled_dot_product_attention(q, kv, kv, attn_mask=view.mask)
        with_bias = F.scaled_dot_product_attention(q, kv, kv, attn_mask=bias)
        assert torch.equal(with_bool, with_bias)


def test_a_decode_step_of_mixed_lengths_with_grouped_query_heads() -> None:
    """A decode step over lengths on both sides of block boundaries, 4 query heads per K/V head."""
    _run(
        {
            "block_size": 4,
            "kv_heads": 2,
            "heads": 8,
            "seqs": [(0, 1), (3, 1), (4, 1), (17, 1), (31, 1)],
            "window": None,
            "chunk": None,
            "dtype": torch.float32,
            "seed": 7,
        }
    )
