"""Sampling parameters and the token sampler: greedy, temperature and top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvtier.errors import BadRequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    ``temperature == 0`` is greedy decoding. ``top_p`` keeps the smallest set
    of tokens whose probability reaches it (nucleus sampling). ``stop``
    strings end generation and are not returned; ``seed`` makes sampling
    reproducible per request.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        mt = self.max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise BadRequestError(
                f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens"
            )
        t = self.temperature
        if (
            not isinstance(t, (int, float))
            or isinstance(t, bool)
            or not 0 <= t <= 2
            or math.isnan(t)
        ):
            raise BadRequestError(
                f"temperature must be a number in [0, 2], got {t!r}", param="temperature"
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise BadRequestError(f"top_p must be a number in (0, 1], got {p!r}", param="top_p")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        stop = tuple(self.stop)
        if len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
            raise BadRequestError(
                "stop must be a non-empty string or a list of at most 4 non-empty strings",
                param="stop",
            )
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise BadRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks the next token from one row of logits under :class:`SamplingParams`."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._gen: torch.Generator | None = None
        if not params.greedy:
            self._gen = torch.Generator()
            if params.seed is not None:
                self._gen.manual_seed(params.seed)
            else:
                self._gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits`` is ``[vocab]``; returns the chosen token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits.float() / p.temperature
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            # Keep every token up to and including the one that reaches top_p.
            keep = (cum - sorted_probs) < p.top_p
            sorted_probs = sorted_probs * keep
            choice = torch.multinomial(sorted_probs.cpu(), 1, generator=self._gen)
            return int(order[int(choice)])
        return int(torch.multinomial(probs.cpu(), 1, generator=self._gen))
