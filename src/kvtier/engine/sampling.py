"""Sampling parameters and the token sampler.

:class:`SamplingParams` is everything a request says about how to pick
tokens, checked on construction (a bad value is a
:class:`~kvtier.errors.BadRequestError` naming the field). :class:`Sampler`
applies them to one row of logits, in OpenAI's order: ``logit_bias``, then
the presence and frequency penalties over the tokens generated so far, then
temperature (0 is greedy) and nucleus (``top_p``) sampling. Log
probabilities, when asked for, are those of the model's own distribution
(``log_softmax`` of the raw logits, before bias, penalties and temperature),
as vLLM reports them by default.

A request may also carry a :class:`TokenConstraint` factory
(``SamplingParams.constraint``): each sampler builds its own constraint,
which masks the processed logits before the token is picked (so only tokens
a grammar allows can be chosen) and is told every token picked. The engine
knows nothing of grammars; the server supplies the constraint. A request
without one samples exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.errors import BadRequestError

#: OpenAI's bounds: ``seed`` is a signed 64-bit integer.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
#: Most top log probabilities a request may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: Most choices (``n``) one request may ask for.
MAX_N = 16
#: Temperatures below this sample greedily: dividing logits by less overflows to inf.
GREEDY_BELOW = 1e-5


def _number(value: object, name: str, low: float, high: float) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or math.isnan(value)
        or not low <= value <= high
    ):
        raise BadRequestError(
            f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name
        )
    return float(value)


def _integer(value: object, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequestError(
            f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name
        )
    return value


class TokenConstraint(Protocol):
    """Limits which tokens one sequence may pick next (a grammar, for instance).

    One constraint follows one sequence: :meth:`mask` is called on each row
    of logits before sampling, :meth:`accept` with each token picked.
    """

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``, float32, owned by the caller: may be changed in place)
        with every token the constraint forbids next set to ``-inf``."""
        ...

    def accept(self, token: int) -> None:
        """Advance past ``token``, which :meth:`mask` allowed."""
        ...

    def is_terminated(self) -> bool:
        """Whether the constraint is complete and allows nothing more."""
        ...


#: Builds a fresh :class:`TokenConstraint` for each sequence of a request (its ``n`` choices).
ConstraintFactory = Callable[[], TokenConstraint]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    ``temperature == 0`` (or below ``1e-5``, where dividing overflows) is
    greedy decoding. ``top_p`` keeps the smallest set of tokens whose
    probability reaches it (nucleus sampling). ``stop``
    strings end generation and are not returned; ``seed`` makes sampling
    reproducible per request. ``presence_penalty`` / ``frequency_penalty``
    (in [-2, 2]) lower the logits of tokens already generated, once / per
    occurrence; ``logit_bias`` adds a value in [-100, 100] to chosen token
    ids. ``logprobs`` asks for the log probability of each generated token
    and of the ``logprobs`` most likely alternatives (``None``: none; 0: the
    chosen token's only). ``n`` choices share the prompt's KV blocks
    (computed once, forked copy-on-write). ``constraint`` builds each
    sequence's :class:`TokenConstraint` (``None``: unconstrained); it is
    not serializable, so a constrained request cannot move to another engine.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    n: int = 1
    constraint: ConstraintFactory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        mt = self.max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise BadRequestError(
                f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens"
            )
        _number(self.temperature, "temperature", 0.0, 2.0)
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
        if self.seed is not None:
            _integer(self.seed, "seed", SEED_MIN, SEED_MAX)
        _number(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _number(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        if not isinstance(self.logit_bias, Mapping):
            raise BadRequestError("logit_bias must map token ids to numbers", param="logit_bias")
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            tid = int(token) if isinstance(token, str) and token.isdigit() else token
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise BadRequestError(
                    f"logit_bias keys must be token ids (non-negative integers), got {token!r}",
                    param="logit_bias",
                )
            bias[tid] = _number(value, f"logit_bias[{tid}]", -100.0, 100.0)
        if len(bias) > 300:
            raise BadRequestError(
                f"logit_bias may name at most 300 tokens, got {len(bias)}", param="logit_bias"
            )
        object.__setattr__(self, "logit_bias", bias)
        if self.logprobs is not None:
            _integer(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
        _integer(self.n, "n", 1, MAX_N)
        if self.constraint is not None and not callable(self.constraint):
            raise BadRequestError(
                "constraint must be a callable building a TokenConstraint", param="constraint"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy with another seed (each of ``n`` choices samples with its own)."""
        import dataclasses

        return dataclasses.replace(self, seed=seed)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probability of a generated token and of its most likely alternatives."""

    token_id: int
    logprob: float
    #: ``(token id, log probability)``, most likely first (``SamplingParams.logprobs`` of them).
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Picks the next token from one row of logits under :class:`SamplingParams`.

    One sampler serves one sequence: it keeps the counts of the tokens it
    generated, for the penalties.
    """

    def __init__(self, params: SamplingParams, *, seed_offset: int = 0) -> None:
        self.params = params
        self._gen: torch.Generator | None = None
        self._counts: torch.Tensor | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.constraint: TokenConstraint | None = (
            None if params.constraint is None else params.constraint()
        )
        if not params.greedy:
            self._gen = torch.Generator()
            if params.seed is not None:
                # Two's complement into torch's accepted [0, 2**64) range.
                self._gen.manual_seed((params.seed + seed_offset) % 2**64)
            else:
                self._gen.seed()

    @property
    def plain_greedy(self) -> bool:
        """Whether the token is the row's argmax and nothing else: greedy, without
        ``logit_bias``, penalties, a constraint or logprobs (rows like that can be
        picked together, in one batched argmax)."""
        p = self.params
        return (
            p.greedy
            and not p.logit_bias
            and not p.penalized
            and p.logprobs is None
            and self.constraint is None
        )

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not p.logit_bias and not p.penalized:
            return logits
        out = logits.float().clone()
        if p.logit_bias:
            if self._bias is None or self._bias[0].device != out.device:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=out.device)
                vals = torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
                self._bias = (ids, vals)
            ids, vals = self._bias
            if int(ids.max()) >= out.shape[-1]:
                raise BadRequestError(
                    f"logit_bias names token id {int(ids.max())}, outside the vocabulary "
                    f"of {out.shape[-1]}",
                    param="logit_bias",
                )
            out.index_add_(0, ids, vals)
        if p.penalized and self._counts is not None:
            c = self._counts
            out -= p.frequency_penalty * c + p.presence_penalty * (c > 0).to(out.dtype)
        return out

    def observe(self, token: int, vocab: int, device: torch.device) -> None:
        """Count a generated token (for the penalties)."""
        if not self.params.penalized:
            return
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self._counts[token] += 1

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """``logits`` is ``[vocab]``: the chosen token and, if asked for, its log probabilities."""
        p = self.params
        scores = self._processed(logits)
        if self.constraint is not None:
            # The mask works on a copy: the raw row still gives the logprobs.
            owned = scores.float().clone() if scores is logits else scores.float()
            scores = self.constraint.mask(owned)
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            probs = torch.softmax(scores.float() / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                cum = torch.cumsum(sorted_probs, dim=-1)
                # Keep every token up to and including the one that reaches top_p;
                # the first always (a top_p that rounds to 0 in float32 would keep none).
                keep = (cum - sorted_probs) < p.top_p
                keep[0] = True
                sorted_probs = sorted_probs * keep
                choice = torch.multinomial(sorted_probs.cpu(), 1, generator=self._gen)
                token = int(order[int(choice)])
            else:
                token = int(torch.multinomial(probs.cpu(), 1, generator=self._gen))
        self.observe(token, logits.shape[-1], logits.device)
        if self.constraint is not None:
            self.constraint.accept(token)
        if p.logprobs is None:
            return token, None
        return token, token_logprob(logits, token, p.logprobs)

    def __call__(self, logits: torch.Tensor) -> int:
        return self.sample(logits)[0]

    def get_state(self) -> dict[str, object]:
        """What sampling depends on besides the params, as JSON-able data (to move a request)."""
        counts: dict[str, float] = {}
        if self._counts is not None:
            nz = torch.nonzero(self._counts).flatten().tolist()
            vals = self._counts[nz].tolist() if nz else []
            counts = {str(i): float(v) for i, v in zip(nz, vals, strict=True)}
        gen = None if self._gen is None else bytes(self._gen.get_state().tolist()).hex()
        vocab = None if self._counts is None else int(self._counts.shape[0])
        return {"generator": gen, "counts": counts, "vocab": vocab}

    def set_state(self, state: Mapping[str, object]) -> None:
        """Continue from :meth:`get_state` taken on another sampler with the same params."""
        gen = state.get("generator")
        if isinstance(gen, str) and self._gen is not None:
            data = bytes.fromhex(gen)
            self._gen.set_state(torch.tensor(list(data), dtype=torch.uint8))
        counts = state.get("counts")
        vocab = state.get("vocab")
        if isinstance(counts, Mapping) and isinstance(vocab, int) and counts:
            self._counts = torch.zeros(vocab, dtype=torch.float32)
            for tid, value in counts.items():
                self._counts[int(tid)] = float(value)


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log probability under ``logits`` and the ``top`` most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        vals, ids = torch.topk(logp, top)
        alternatives = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), alternatives)
