"""A non-streamed answer's bytes, built off the event loop.

Every choice's text and log probabilities are held until the end, so an answer can be tens of
megabytes of Python objects (bounded per request: request_budget.py). Building it and dumping it to
JSON on the event loop would stall every other request for seconds, so `build` runs in a worker
thread, and long lists are dumped a slice at a time: json.dumps runs in C holding the GIL, and
between two slices the event loop gets it back.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.router import tools
from tandem.router.sse import ResponseShape, logprobs_body
from tandem.router.validation import ParsedRequest

SLICE = 256  # items of a long list dumped by one json.dumps call
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _encode(value: Any, out: list[str]) -> None:
    """`value` as JSON into `out`: containers piece by piece, a long list in slices of SLICE items."""
    if isinstance(value, dict):
        out.append("{")
        for i, (k, v) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(str(k)) + ":")
            _encode(v, out)
        out.append("}")
    elif isinstance(value, list) and len(value) > SLICE:
        out.append("[" + ",".join(_dumps(value[s:s + SLICE])[1:-1] for s in range(0, len(value), SLICE)) + "]")
    elif isinstance(value, list):
        out.append("[")
        for i, v in enumerate(value):
            if i:
                out.append(",")
            _encode(v, out)
        out.append("]")
    else:
        out.append(_dumps(value))


def encode(value: Any) -> bytes:
    """The compact JSON of `value` (the same text as json.dumps with compact separators)."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode()


def build(parsed: ParsedRequest, shape: ResponseShape, texts: dict[int, list[str]],
          logprobs: dict[int, list[dict[str, Any]]], reasons: dict[int, str], usage: tuple[int, int]) -> bytes:
    """The whole answer: each choice's text (or chat message with its tool calls), finish reason and
    logprobs, and the usage (prompt, completion tokens)."""
    want_lp = parsed.sampling.logprobs is not None
    out: list[tuple[str | dict, str, dict | None]] = []
    for i in range(parsed.n):
        text: str | dict = "".join(texts[i])
        reason = reasons[i]
        if parsed.tools is not None:
            text, called = tools.message(str(text), parsed.tools)
            reason = "tool_calls" if called else reason
        out.append((text, reason, logprobs_body(shape.endpoint, logprobs[i]) if want_lp else None))
    return encode(shape.full(out, *usage))
