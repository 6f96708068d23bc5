"""A sequence's grammar state (llguidance's matcher) and the batch's token masks.

Each constrained sequence owns a `Grammar`: the matcher advances with every token the sequence
takes, sampled here or replayed (a handoff's first token, a resume's or a migration's tokens so
far), so any worker that continues a sequence holds exactly the state of the one before. The
masks of a step's constrained rows are computed together (llguidance's executor, in parallel,
without the GIL) into one bitmask, unpacked into a boolean [rows, vocab] tensor with tensor ops.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from tandem.contracts.structured_output import StructuredOutputError, validate
from tandem.worker.engine.errors import RequestError

_executor: Any = None
_executor_lock = threading.Lock()


def _shared_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            from llguidance import LLExecutor

            _executor = LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
        return _executor


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over a token; True when the grammar is complete (the output must end here).
        RequestError when the token breaks the grammar (only replayed tokens can)."""
        m = self.matcher
        if not m.consume_token(token_id):
            raise RequestError(f"token {token_id} does not follow the request's grammar: {m.get_error()[:200]}",
                               param="generated_token_ids")
        return bool(m.is_stopped())


class GrammarCompiler:
    """Builds Grammars for one engine's tokenizer and vocabulary (the tokenizer is converted once)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self.tokenizer))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab)
            return self._ll_tokenizer

    def compile(self, spec: dict[str, Any], param: str = "response_format") -> Grammar:
        """A fresh Grammar for `spec`; RequestError (400) when the spec makes no valid grammar."""
        from llguidance import LLMatcher

        try:
            grammar = validate(spec)
        except StructuredOutputError as e:
            raise RequestError(str(e), param=param, code="invalid_value") from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid grammar: {matcher.get_error()[:500]}", param=param, code="invalid_value")
        return Grammar(matcher)


def allowed_tokens(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """[len(grammars), vocab_size] booleans: the tokens each grammar allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(len(grammars), words, dtype=torch.int32)
    _shared_executor().unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                               bitmask.data_ptr(), words * 4, len(grammars))
    # little-endian words: byte j of the mask holds tokens 8j..8j+7, bit k token 8j+k
    bits = _BYTE_BITS[bitmask.view(torch.uint8).long()]
    return bits.reshape(len(grammars), words * 32)[:, :vocab_size]


# Each byte value's 8 bits as booleans, lowest first: unpacking a mask is one table lookup.
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
