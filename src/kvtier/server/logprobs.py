"""Log probabilities in OpenAI's shapes, with each token's text and exact bytes.

Chat completions report ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}``; text completions report the older
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` lists. A
token's bytes are exact even when it holds part of a multi-byte character
(byte-level BPE vocabularies map each byte to one printable character, which
:class:`TokenText` maps back); its text is those bytes decoded, with U+FFFD
for an incomplete character.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.sampling import TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Token ids to text and bytes, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        special = getattr(tokenizer, "all_special_ids", None) or []
        self._special = {int(t) for t in special}
        probe = tokenizer.convert_ids_to_tokens(
            tokenizer.encode(" the quick", add_special_tokens=False)
        )
        self._byte_level = any("Ġ" in str(t) for t in probe)
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id not in self._special:
            if self._byte_level and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                try:
                    return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
                except ValueError:
                    pass
            if not self._byte_level:
                return piece.replace("▁", " ").encode("utf-8", errors="replace")
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return str(text).encode("utf-8", errors="replace")

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._cache) < 1 << 17:
                self._cache[token_id] = hit
        return hit

    def longest_token_chars(self) -> int:
        """The most characters any one token of the vocabulary decodes to (at least 1)."""
        vocab = self._tok.get_vocab()
        # A token's stored form has at least as many characters as its text:
        # one per byte (byte level), one per character otherwise.
        return max((len(piece) for piece in vocab), default=1) or 1


def chat_logprobs(text: TokenText, entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or of one streamed chunk)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s, raw = text.get(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {
                **one(e.token_id, e.logprob),
                "top_logprobs": [one(t, lp) for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    text: TokenText, entries: list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """``choice.logprobs`` of a text completion; ``offset`` is where its text starts."""
    tokens: list[str] = []
    offsets: list[int] = []
    for e in entries:
        s = text.get(e.token_id)[0]
        offsets.append(offset)
        offset += len(s)
        tokens.append(s)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text.get(t)[0]: lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
