"""Constrained decoding of tool calls with xgrammar.

For ``tool_choice`` ``"required"`` or a named function the answer must be
calls. :class:`ToolGrammars` compiles, per request, a grammar for Hermes
blocks, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
whose JSON follows the called tool's parameter schema (any of the tools for
``"required"``), followed by an end-of-sequence token: one block or more
(at most :data:`MAX_FORCED_CALLS`, back to back) when ``parallel_tool_calls``
is on (OpenAI's default), exactly one when it is off. Each sequence gets an
:class:`XGrammarConstraint` (a :class:`~kvtier.engine.sampling.TokenConstraint`):
before every token it fills xgrammar's bitmask of the tokens the grammar
allows and sets the other logits to ``-inf``, so even a random model writes
well-formed calls.

The JSON is written compactly (``", "`` and ``": "`` separators, no other
whitespace): free whitespace would let a weak model pad forever. xgrammar
is imported on first use; without it a constrained request is refused.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

import torch

from kvtier.engine.sampling import ConstraintFactory
from kvtier.errors import BadRequestError
from kvtier.server.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolRequest, ToolSpec


def call_schema(tools: Iterable[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call object ``{"name", "arguments"}`` to any of ``tools``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    if len(options) == 1:
        return options[0]
    return {"anyOf": options}


#: Most calls in one constrained answer with ``parallel_tool_calls``. A weak model
#: that keeps calling is ended here while its calls are still whole, rather than
#: cut inside one by ``max_tokens``.
MAX_FORCED_CALLS = 8


def calls_tag(call_ebnf: str, parallel: bool) -> dict[str, Any]:
    """xgrammar's structural tag for Hermes blocks whose JSON follows ``call_ebnf``.

    One block, or with ``parallel`` one to :data:`MAX_FORCED_CALLS` blocks
    written back to back. Nothing goes between blocks: after a closing tag a
    model's likeliest token is a newline, whether prose, another call or
    nothing was to follow, and a grammar that allowed the newline and then
    only a call would turn a model that meant to stop into one that calls
    again (SmolLM2-135M-Instruct did, until ``max_tokens``). Without a
    separator the model's choice after each block is between the end of the
    answer and the start of another block.
    """
    block = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": TOOL_CALL_OPEN + "\n"},
            {"type": "grammar", "grammar": call_ebnf},
            {"type": "const_string", "value": "\n" + TOOL_CALL_CLOSE},
        ],
    }
    if not parallel:
        return {"type": "structural_tag", "format": block}
    more = {"type": "repeat", "min": 0, "max": MAX_FORCED_CALLS - 1, "content": block}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [block, more]}}


class XGrammarConstraint:
    """One sequence's grammar state: masks logits and follows the tokens picked."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any) -> None:
        self._matcher = matcher
        self._xgr = xgr
        self._vocab = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self._matcher.is_terminated():
            return logits  # nothing left to constrain; the sequence ends on its stop token
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask.to(logits.device, non_blocking=True)
        size = min(self._vocab, logits.shape[-1])
        self._xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask, vocab_size=size)
        if logits.shape[-1] > self._vocab:
            # Rows past the grammar's vocabulary (embedding padding) are never allowed.
            logits[self._vocab :] = float("-inf")
        return logits

    def accept(self, token: int) -> None:
        if self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar does not allow token {token}")

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class ToolGrammars:
    """Compiles tool-call grammars for one tokenizer (the compiler is built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, stop_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._xgr: Any = None
        self._info_vocab = 0

    def _load(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise BadRequestError(
                        'tool_choice "required" or a named function needs constrained '
                        "decoding, and this server lacks the xgrammar package: install it "
                        '(pip install xgrammar) or send tool_choice "auto"',
                        param="tool_choice",
                    ) from None
                tok = self._tokenizer
                vocab = max(self._vocab_size or 0, len(tok))
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=vocab, stop_token_ids=self._stop or None
                )
                self._info_vocab = info.vocab_size
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._xgr = xgr
            return self._compiler, self._xgr

    def constraint_for(self, req: ToolRequest) -> ConstraintFactory:
        """A factory of fresh constraints (one per sequence) for ``req``'s forced calls."""
        compiler, xgr = self._load()
        schema = call_schema(req.called_tools())
        try:
            # The compact JSON grammar goes in as EBNF text: a structural tag's own
            # JSON-schema format only bounds whitespace, it cannot forbid it.
            body = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
            grammar = xgr.Grammar.from_structural_tag(json.dumps(calls_tag(body, req.parallel)))
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:  # the schema is the client's: a construct xgrammar refuses
            raise BadRequestError(
                f"the tools' parameter schemas cannot be enforced: {exc}; simplify them or "
                'send tool_choice "auto"',
                param="tools",
            ) from None
        vocab = self._info_vocab

        def build() -> XGrammarConstraint:
            return XGrammarConstraint(xgr.GrammarMatcher(compiled), vocab, xgr)

        return build
