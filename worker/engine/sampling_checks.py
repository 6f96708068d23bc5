"""The ranges of the sampling controls beyond temperature/top-k/top-p (request_checks.py checks those):
penalties, min_p, min_tokens, logit_bias, logprobs and the structured-output spec's shape, checked
where a request enters so nothing one request carries can fail a step that others share.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.contracts.sampling import LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS, SamplingParams
from tandem.worker.engine.errors import RequestError

MAX_LOGIT_BIAS_ENTRIES = 1024


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, param=param, code="invalid_value")


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_key(k: Any, vocab_size: int) -> bool:
    return isinstance(k, str) and k.isdigit() and len(k) < 12 and int(k) < vocab_size


def check_controls(p: SamplingParams, vocab_size: int) -> None:
    """RequestError (400) naming the first control out of range."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _real(v) or not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be a number in [-2, 2], got {v!r}", name)
    if not _real(p.repetition_penalty) or not 0 < p.repetition_penalty <= 10:
        raise _bad(f"repetition_penalty must be in (0, 10], got {p.repetition_penalty!r}", "repetition_penalty")
    if not _real(p.min_p) or not 0 <= p.min_p <= 1:
        raise _bad(f"min_p must be in [0, 1], got {p.min_p!r}", "min_p")
    if not _int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        raise _bad(f"min_tokens must be an integer in [0, max_tokens], got {p.min_tokens!r}", "min_tokens")
    if p.logprobs is not None and (not _int(p.logprobs) or not 0 <= p.logprobs <= MAX_TOP_LOGPROBS):
        raise _bad(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs!r}", "logprobs")
    bias = p.logit_bias
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _bad(f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers", "logit_bias")
    lo, hi = LOGIT_BIAS_RANGE
    for k, v in bias.items():
        if not _token_key(k, vocab_size):
            raise _bad(f"logit_bias keys must be token ids in [0, {vocab_size}), got {str(k)[:20]!r}", "logit_bias")
        if not _real(v) or not lo <= v <= hi:
            raise _bad(f"logit_bias values must be numbers in [{lo:g}, {hi:g}]", "logit_bias")
    if p.structured is not None and not isinstance(p.structured, dict):
        raise _bad("structured must be an object", "response_format")
    forced = p.forced_token_ids
    if not isinstance(forced, list) or len(forced) > p.max_tokens or not all(
            _int(t) and 0 <= t < vocab_size for t in forced):
        raise _bad(f"forced_token_ids must be at most max_tokens token ids in [0, {vocab_size})",
                   "forced_token_ids")
    if forced and p.structured is not None:
        raise _bad("forced_token_ids and a grammar exclude each other", "forced_token_ids")
