"""What one request may make the workers generate and the router hold: n choices of max_tokens
tokens (`max_request_output_tokens`), and with logprobs 1 + top_logprobs entries per token
(`max_request_logprobs`). A request over either is a 400 naming the parameter that multiplies it;
a request naming no max_tokens gets the most its choices may share (tandem.contracts.request_limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.router.errors import bad_request
from tandem.router.openai_schema import Endpoint

if TYPE_CHECKING:
    from tandem.router.validation import Limits, ParsedRequest


def _per_token(logprobs: int | None) -> int:
    """Log probabilities one generated token carries: the chosen token's and its alternatives'."""
    return 0 if logprobs is None else 1 + logprobs


def choice_cap(n: int, logprobs: int | None, limits: Limits) -> int:
    """The largest max_tokens each of `n` choices may have within every limit (at least 1)."""
    cap = min(limits.max_tokens_limit, limits.max_request_output_tokens // n)
    if logprobs is not None:
        cap = min(cap, limits.max_request_logprobs // (n * _per_token(logprobs)))
    return max(1, cap)


def check(n: int, max_tokens: int, logprobs: int | None, endpoint: Endpoint, max_tokens_key: str,
          limits: Limits) -> None:
    """400 when n x max_tokens, or its log probabilities, exceed what one request may ask for."""
    tokens, most = n * max_tokens, limits.max_request_output_tokens
    if tokens > most:
        raise bad_request(f"n x {max_tokens_key} is {n} x {max_tokens} = {tokens} output tokens, more than this "
                          f"server generates for one request ({most}): ask for fewer choices or fewer tokens.",
                          "n" if n > 1 else max_tokens_key)
    entries, most = tokens * _per_token(logprobs), limits.max_request_logprobs
    if entries > most:
        lp = "top_logprobs" if endpoint is Endpoint.CHAT and logprobs else "logprobs"
        raise bad_request(f"n x {max_tokens_key} x (1 + {lp}) is {n} x {max_tokens} x {_per_token(logprobs)} = "
                          f"{entries} log probabilities, more than this server returns for one request ({most}): "
                          "ask for fewer choices, tokens or alternatives.", lp)


def apply(req: ParsedRequest, max_tokens_key: str, limits: Limits) -> None:
    """Fit a request naming no max_tokens within the budget (its choices share it), then check it."""
    s = req.sampling
    if not req.max_tokens_given:
        s.max_tokens = min(s.max_tokens, choice_cap(req.n, s.logprobs, limits))
        if s.min_tokens > s.max_tokens:
            raise bad_request(f"'min_tokens' is {s.min_tokens}, more than the {s.max_tokens} tokens each of {req.n} "
                              "choices may have here: name max_tokens, or ask for fewer choices.", "min_tokens")
    check(req.n, s.max_tokens, s.logprobs, req.endpoint, max_tokens_key, limits)
