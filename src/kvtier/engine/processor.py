"""The input processor: a request's prompt, checked once, made into a sequence the scheduler queues.

:class:`InputProcessor` tokenizes (chat template, plain prompts), checks a
request against what the engine can ever run (token ids in the vocabulary,
the context length, ``n`` against ``max_num_seqs``, ``logit_bias``), parses
its agent hints and cache salt, checks its images' placeholders, and builds
the :class:`~kvtier.engine.request.Sequence`. It reads configuration only,
so a server thread can run it before handing the sequence to the engine
thread; nothing downstream validates the request again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.request import RequestMetrics
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.errors import BadRequestError
from kvtier.hints import Hints, parse_hints

if TYPE_CHECKING:
    from kvtier.engine.scheduler import SchedulerLimits
    from kvtier.mm.prompt import MultimodalPrompt
    from kvtier.mm.vlm import ImageTextModel

#: The longest ``cache_salt`` a request may carry.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> None:
    """Raise :class:`BadRequestError` unless ``salt`` is ``None`` or a usable cache salt."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise BadRequestError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
            f"characters, got {salt!r:.40}",
            param="cache_salt",
        )


def bare_chat_tokens(tokenizer: Any) -> int | None:
    """Tokens of an empty user message under the chat template (``None``: no template).

    The shortest chat request there is: a KV cache that cannot hold it serves no chat.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


class InputProcessor:
    """Tokenizes, validates and builds requests for one engine (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        model_id: str,
        vocab_size: int | None,
        limits: SchedulerLimits,
        vlm: ImageTextModel | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.vocab_size = vocab_size
        self.limits = limits
        self.vlm = vlm

    # -- prompts ------------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ready for the reply."""
        if not messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequestError(
                f"model {self.model_id} has no chat template: use /v1/completions", param="messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template raising on odd input is the caller's input
            raise BadRequestError(
                f"messages do not fit the chat template: {exc}", param="messages"
            ) from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise BadRequestError("prompt must be a non-empty string", param="prompt")
        return list(self.tokenizer.encode(prompt))

    # -- checks -------------------------------------------------------------------------
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequestError` unless the request can ever run."""
        n = len(prompt_ids)
        if n == 0:
            raise BadRequestError("the prompt is empty", param="messages")
        vocab = self.vocab_size or 2**32
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise BadRequestError(
                    f"prompt token id {t!r} is outside [0, {vocab})", param="prompt"
                )
        limits = self.limits
        if params.n > limits.max_num_seqs:
            raise BadRequestError(
                f"n={params.n} choices exceed the {limits.max_num_seqs} sequences this engine "
                "runs at once (max_num_seqs): ask for fewer",
                param="n",
            )
        if self.vocab_size is not None and params.logit_bias:
            top = max(params.logit_bias)
            if top >= self.vocab_size:
                raise BadRequestError(
                    f"logit_bias names token id {top}, outside the vocabulary of "
                    f"{self.vocab_size}",
                    param="logit_bias",
                )
        max_len = limits.max_model_len
        if n + params.max_tokens > max_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens" if n < max_len else "messages",
            )

    def check_multimodal(self, prompt_ids: Sequence[int], mm: MultimodalPrompt) -> None:
        """Raise unless ``mm``'s placeholders sit on this model's image tokens in ``prompt_ids``."""
        vlm = self.vlm
        if vlm is None or mm.model is not vlm:
            raise BadRequestError(
                f"this request's images were prepared for another model than {self.model_id}",
                param="messages",
            )
        token = vlm.image_token_id
        for p in mm.placeholders:
            if p.offset + p.length > len(prompt_ids) or any(
                prompt_ids[q] != token for q in p.positions
            ):
                raise BadRequestError(
                    "the prompt's image placeholders do not match its token ids", param="messages"
                )

    # -- requests -------------------------------------------------------------------------
    def process(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        *,
        arrival_time: float | None = None,
        mm: MultimodalPrompt | None = None,
        hints: Hints | Mapping[str, object] | None = None,
        cache_salt: str | None = None,
        hints_field: str = "hints",
    ) -> Seq:
        """Check a request once and build its sequence; :class:`BadRequestError` for bad input.

        ``hints_field`` names the hints in error messages (``kvtier`` over HTTP).
        """
        ids = list(prompt_ids)
        checked = parse_hints(hints, where=hints_field)
        check_cache_salt(cache_salt)
        self.check_request(ids, params)
        if mm is not None:
            self.check_multimodal(ids, mm)
        now = time.perf_counter() if arrival_time is None else arrival_time
        seq = Seq(
            request_id,
            ids,
            params,
            Sampler(params),
            IncrementalDetokenizer(self.tokenizer, params.stop),
            RequestMetrics(now, len(ids)),
            seq_id=request_id,
            forked=params.n == 1,
            hints=checked,
            cache_salt=cache_salt,
        )
        seq.mm = mm
        return seq
