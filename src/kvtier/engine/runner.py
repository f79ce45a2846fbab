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

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.engine.paged import BatchMeta, SeqSlice
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import TokenLogprob
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
            assert seq.table is not None
            start = seq.computed
            ids.extend(seq.tokens[start : start + n])
            positions.extend(range(start, start + n))
            slices.append(SeqSlice(start, n, seq.table.slot_mapping(0, start + n)))
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
        except Exception as exc:
            log.exception("the forward pass of %d sequences failed", len(chunks))
            out.pass_error = error = f"{type(exc).__name__}: {exc}"
            out.failed.extend((seq, error) for seq, _ in chunks)
            return out
        out.ran = True
        out.computed = chunks
        for i, seq in enumerate(samplers):
            row = logits[i]
            try:
                token, logprob = seq.sampler.sample(row)
            except Exception as exc:
                log.exception("sampling for request %s failed", seq.request_id)
                out.failed.append((seq, f"{type(exc).__name__}: {exc}"))
                continue
            out.sampled.append(SampledToken(seq, token, logprob, row))
        return out
