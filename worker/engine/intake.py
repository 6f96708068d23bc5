"""A GenerateRequest made into a EngineSequence: its parameters checked and its prompt tokenized where
they enter (request_checks.py), its grammar compiled, and tokens it generated elsewhere replayed, so the
engine continues from exactly the state of the worker that sampled them."""

from __future__ import annotations

import random
import time
from typing import Any

from tandem.contracts.protocol import FinishReason, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.grammar import GrammarCompiler
from tandem.worker.engine.output_processor import append_token
from tandem.worker.engine.request_checks import (
    check_cache_salt,
    check_flow,
    check_sampling,
    generated_ids,
    tokenize,
)
from tandem.worker.engine.sequence import EngineSequence


class Intake:
    """What a request must satisfy to become a sequence of this model: the tokenizer, the vocabulary,
    the context length and the end-of-sequence tokens. Pure CPU work, safe on any thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.grammars = GrammarCompiler(tokenizer, vocab_size)

    def tokenize(self, req: GenerateRequest) -> list[int]:
        return tokenize(self.tokenizer, req, self.vocab_size)

    def sequence(self, req: GenerateRequest, *, prefill_only: bool = False) -> tuple[EngineSequence, FinishReason | None]:
        """Tokenize and validate a request; raises RequestError (a 4xx) for anything wrong with it.
        With the sequence, why the tokens it generated elsewhere already end it (else None)."""
        if not isinstance(req.request_id, str) or not req.request_id:
            raise RequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(req.sampling, SamplingParams):
            raise RequestError("sampling must be an object", param="sampling")
        check_sampling(req.sampling, self.vocab_size)
        prompt = self.tokenize(req)
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        resumed = generated_ids(req, self.vocab_size)
        if len(prompt) + len(resumed) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt)} tokens" + (f" (+{len(resumed)} already generated)" if resumed else "")
                + ", leaving no room for a completion. Please shorten the prompt.",
                param="messages" if req.messages is not None else "prompt", code="context_length_exceeded",
            )
        if len(resumed) >= req.sampling.max_tokens:
            raise RequestError(
                f"generated_token_ids already holds {len(resumed)} tokens, max_tokens is "
                f"{req.sampling.max_tokens}: nothing left to generate", param="max_tokens", code="invalid_value")
        p = req.sampling
        flow, priority = check_flow(req.fairness_id, req.priority)
        seq = EngineSequence(
            request_id=req.request_id, prompt_ids=prompt, params=p, max_total_len=self.max_model_len,
            seed=p.seed if p.seed is not None else random.getrandbits(62), eos_ids=self.eos_ids,
            prefill_only=prefill_only, arrival=time.monotonic(), num_resumed=len(resumed),
            stop_ids=frozenset(p.stop_token_ids), cache_salt=check_cache_salt(req.cache_salt),
            flow=flow, priority=priority,
        )
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, p.stop)
        if p.structured is not None:
            seq.grammar = self.grammars.compile(p.structured)
        return seq, _replay(seq, resumed, req.emitted_chars)


def _replay(seq: EngineSequence, resumed: list[int], emitted_chars: int | None) -> FinishReason | None:
    """Run tokens generated elsewhere through the stop rules and the detokenizer, as the worker that
    sampled them did, so this one continues from the same state; why those tokens already end the
    request (its producer died before it could say so), else None."""
    ended = None
    for i, tok in enumerate(resumed):
        reason = append_token(seq, tok)
        seq.detok.take()
        if reason is not None:
            if i != len(resumed) - 1:
                raise RequestError(f"generated_token_ids go on after token {i} ended the request",
                                   param="generated_token_ids")
            ended = reason
    if emitted_chars is not None:
        try:
            seq.detok.resume_at(emitted_chars)
        except ValueError as e:
            raise RequestError(f"emitted_chars: {e}", param="emitted_chars") from e
    return ended
