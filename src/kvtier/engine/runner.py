"""The model runner: one forward pass over a scheduled batch, and the tokens it samples.

:class:`ModelRunner` is the engine's only caller of the model. It takes the
scheduler's batch as data (each sequence and how many new tokens it
computes), fetches the image features the batch needs, builds the attention
metadata over the KV blocks (:mod:`kvtier.engine.paged`), runs the pass and
samples the next token of every sequence whose tokens are all in. It never
touches the queues: what it returns (:class:`RunnerOutput`) says what
happened, and the engine acts on it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch

from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import TokenLogprob
from kvtier.errors import KvTierError
from kvtier.layers.batch import BatchMeta, SeqSlice
from kvtier.storage import KVBlockStorage

if TYPE_CHECKING:
    from kvtier.mm.vlm import ImageTextModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token a sequence sampled in a pass."""

    seq: Seq
    token: int
    logprob: TokenLogprob | None
    #: Its logits row, for the choices forked from it (they sample the same position).
    logits: torch.Tensor


@dataclass(slots=True)
class RunnerOutput:
    """What one pass produced."""

    #: Sequences whose tokens were all computed and sampled, in batch order.
    sampled: list[SampledToken] = field(default_factory=list)
    #: Sequences the pass computed tokens for (and how many), in batch order.
    computed: list[tuple[Seq, int]] = field(default_factory=list)
    #: Sequences that must end with an error: ``(sequence, message)``.
    failed: list[tuple[Seq, str]] = field(default_factory=list)
    #: Whether the forward pass itself ran (False: it raised, or nothing was left to run).
    ran: bool = False
    #: Why the pass raised (every sequence of the batch is then in ``failed``).
    pass_error: str | None = None


class TableSlots(SequenceABC[int]):
    """The slots of a sequence's first ``length`` positions, computed from its blocks on access.

    The attention metadata reads the new tokens' slots and one slot per
    block; listing every slot of the context each step would cost Python
    work proportional to the context length.
    """

    __slots__ = ("_blocks", "_bs", "_length")

    def __init__(self, blocks: list[int], block_size: int, length: int) -> None:
        self._blocks = blocks
        self._bs = block_size
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        bs, blocks = self._bs, self._blocks
        if isinstance(index, slice):
            return [blocks[p // bs] * bs + p % bs for p in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"slot {index} is past this sequence's {self._length} positions")
        return blocks[index // bs] * bs + index % bs


class ModelRunner:
    """Runs the model over a batch whose K/V live in ``storage`` (see the module docstring)."""

    def __init__(
        self, model: Any, storage: KVBlockStorage, vlm: ImageTextModel | None = None
    ) -> None:
        self.model = model
        self.storage = storage
        self.device = storage.device
        #: The image-text adapter of a vision-language model (``None``: text only).
        self.vlm = vlm
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        #: Seconds spent in the model's forward, summed over passes (the rest of a step is
        #: the engine's own work), and the sequences those passes computed.
        self.forward_seconds = 0.0
        self.passes = 0
        self.pass_sequences = 0

    def execute(self, batch: Sequence[tuple[Seq, int]]) -> RunnerOutput:
        """Compute ``n`` new tokens of each ``(sequence, n)``; sample where a sequence is done.

        A sequence whose images fail to encode is reported in ``failed`` and
        left out of the pass; a pass that raises reports every sequence.
        """
        out = RunnerOutput()
        chunks = list(batch)
        if any(seq.mm is not None for seq, _ in chunks):
            from kvtier.mm.engine import fetch_features

            chunks, out.failed = fetch_features(chunks)
            if not chunks:
                return out
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        rows: list[int] = []
        samplers: list[Seq] = []
        for seq, n in chunks:
            table = seq.table
            assert table is not None
            start = seq.computed
            ids.extend(seq.token_range(start, start + n))
            positions.extend(range(start, start + n))
            if start + n > table.capacity:
                raise ValueError(
                    f"sequence {seq.seq_id} computes up to position {start + n}, past its "
                    f"blocks' {table.capacity}"
                )
            slices.append(SeqSlice(start, n, TableSlots(table.blocks, table.block_size, start + n)))
            if start + n == seq.num_tokens:  # its whole sequence is in: it samples
                rows.append(len(ids) - 1)
                samplers.append(seq)
        device = self.device
        try:
            meta = BatchMeta(self.storage, slices)
            inputs: dict[str, torch.Tensor] = {
                "input_ids": torch.tensor([ids], dtype=torch.long, device=device)
            }
            if any(seq.mm is not None for seq, _ in chunks):
                from kvtier.mm.engine import input_embeddings

                inputs = {"inputs_embeds": input_embeddings(self.vlm, chunks, inputs["input_ids"])}
            started = time.perf_counter()
            with torch.no_grad():
                result = self.model(
                    **inputs,
                    position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                    attention_mask=self._no_mask,
                    use_cache=False,
                    logits_to_keep=torch.tensor(rows, dtype=torch.long, device=device),
                    kvtier_batch=meta,
                )
            logits = result.logits[0]
            # A tier load landing layer by layer was read by every layer of the pass: what
            # is left is to know its copies done, so its source may be reused.
            self.storage.settle_fill()
            self.forward_seconds += time.perf_counter() - started
            self.passes += 1
            self.pass_sequences += len(chunks)
        except Exception as exc:
            log.exception("the forward pass of %d sequences failed", len(chunks))
            with contextlib.suppress(KvTierError):  # a failed load by layer said so above
                self.storage.settle_fill()
            out.pass_error = error = f"{type(exc).__name__}: {exc}"
            out.failed.extend((seq, error) for seq, _ in chunks)
            return out
        out.ran = True
        out.computed = chunks
        # Plain greedy rows (no bias, penalties, constraint or logprobs) take one argmax
        # together; the others go through their own samplers.
        plain = [i for i, seq in enumerate(samplers) if seq.sampler.plain_greedy]
        greedy: dict[int, int] = {}
        if plain:
            picked = logits if len(plain) == len(samplers) else logits[plain]
            greedy = dict(zip(plain, torch.argmax(picked, dim=-1).tolist(), strict=True))
        for i, seq in enumerate(samplers):
            row = logits[i]
            token = greedy.get(i)
            logprob: TokenLogprob | None = None
            if token is None:
                try:
                    token, logprob = seq.sampler.sample(row)
                except Exception as exc:
                    log.exception("sampling for request %s failed", seq.request_id)
                    out.failed.append((seq, f"{type(exc).__name__}: {exc}"))
                    continue
            out.sampled.append(SampledToken(seq, token, logprob, row))
        return out
