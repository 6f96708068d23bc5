"""What became of each request of a chaos soak, judged against an undisturbed run (pure; unit-tested).

Greedy decoding makes every request's text a known answer, so a request either streamed exactly
that answer, or ended with an error its client saw and can retry (a 5xx, 408 or 429, an error event,
a broken connection), or was refused as if it were wrong (any other 4xx: every request here is
valid, and a client takes a 4xx as final), or did something a client cannot detect: ended
"successfully" short of the answer, streamed another answer, or went silent.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum

from bench.lib.loadgen import NO_TOKEN
from bench.lib.metrics import RequestRecord


class Outcome(StrEnum):
    IDENTICAL = "identical"  # [DONE] after exactly the undisturbed run's text
    CLEAN_ERROR = "clean_error"  # the client saw an error (5xx/408/429, error event, broken stream): retryable
    REFUSED = "refused"  # a valid request answered with another 4xx: the client gives up
    TRUNCATED = "truncated"  # ended without an error, short of the answer (or without [DONE])
    WRONG_TEXT = "wrong_text"  # completed, but with text the undisturbed run did not produce
    HUNG = "hung"  # silent past the client's read timeout


SILENT_FAILURES = (Outcome.TRUNCATED, Outcome.WRONG_TEXT, Outcome.HUNG)
FAILURES = (Outcome.REFUSED, *SILENT_FAILURES)
RETRYABLE_4XX = (408, 429)


def classify(rec: RequestRecord, expected: str) -> Outcome:
    """One request's outcome; `expected` is its text in the undisturbed run."""
    if rec.timed_out:
        return Outcome.HUNG
    if rec.error is not None and rec.error != NO_TOKEN:
        status = int(rec.error[5:8]) if rec.error.startswith("HTTP ") else 0
        return Outcome.REFUSED if 400 <= status < 500 and status not in RETRYABLE_4XX else Outcome.CLEAN_ERROR
    if not rec.done or len(rec.text) < len(expected) and expected.startswith(rec.text):
        return Outcome.TRUNCATED
    return Outcome.IDENTICAL if rec.text == expected else Outcome.WRONG_TEXT


def error_kind(rec: RequestRecord) -> str:
    """A clean error's kind for the report: 'HTTP 503', 'stream error', 'ClientPayloadError', ..."""
    err = rec.error or ""
    return "stream error event" if err.startswith("stream error") else err.split(":", 1)[0]


def tally(records: list[RequestRecord], expected: dict[int, str]) -> dict:
    """Counts per outcome, errors by kind, and the details of every failure (refused or silent)."""
    outcomes = {o.value: 0 for o in Outcome}
    kinds: Counter[str] = Counter()
    failures: list[dict] = []
    for rec in records:
        o = classify(rec, expected[rec.index])
        outcomes[o.value] += 1
        if o in (Outcome.CLEAN_ERROR, Outcome.REFUSED):
            kinds[error_kind(rec)] += 1
        if o in FAILURES:
            failures.append({"index": rec.index, "outcome": o.value, "send_s": rec.send_s, "end_s": rec.end_s,
                             "chars": len(rec.text), "expected_chars": len(expected[rec.index]),
                             "done": rec.done, "finish_reason": rec.finish_reason, "error": (rec.error or "")[:300]})
    return {"requests": len(records), "outcomes": outcomes, "errors_by_kind": dict(kinds.most_common()),
            "failures": failures}
