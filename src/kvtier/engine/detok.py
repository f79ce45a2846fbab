"""Incremental detokenization with stop strings, for streaming.

Decoding one token at a time breaks multi-byte characters and words whose
text depends on the next token, and decoding everything at every step is
quadratic. :class:`IncrementalDetokenizer` decodes a short window of recent
tokens and emits only text that is final, and holds back any tail that
could still become a stop string, so a stop string is never streamed.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns generated token ids into streamed text deltas."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        #: The decoded text so far (including held-back text).
        self.text = ""
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=True)
        return text

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text that became final.

        After a stop string appears, :attr:`stopped` is True, the text is cut
        before it, and later calls return nothing.
        """
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return self._push(delta)

    def _push(self, delta: str) -> str:
        before = len(self.text)
        self.text += delta
        if not self._stop:
            return self._emit(len(self.text))
        start = max(0, before - self._max_stop + 1)
        cut = -1
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            return self._emit(cut)
        return self._emit(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def get_state(self) -> dict[str, object]:
        """Where decoding stands, as JSON-able data (to move a request to another engine)."""
        return {
            "ids": list(self.ids),
            "text": self.text,
            "emitted": self._emitted,
            "prefix_offset": self._prefix_offset,
            "read_offset": self._read_offset,
            "stopped": self.stopped,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`get_state` (same tokenizer and stop strings)."""
        self.ids = [int(t) for t in state["ids"]]
        self.text = str(state["text"])
        self._emitted = int(state["emitted"])
        self._prefix_offset = int(state["prefix_offset"])
        self._read_offset = int(state["read_offset"])
        self.stopped = bool(state["stopped"])

    def flush(self) -> str:
        """At the end of generation: whatever text was still held back."""
        out = ""
        if not self.stopped and self._read_offset < len(self.ids):
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.ids[self._prefix_offset :])
            self._read_offset = len(self.ids)
            if len(full) > len(prefix):
                out = self._push(full[len(prefix) :])
        if self.stopped:
            return out
        return out + self._emit(len(self.text))
