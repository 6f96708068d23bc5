"""What can happen to a request on its journey: the outcomes the driver observed, the input of
`decide` (actions.py holds its output).

A request arrived, a prefill worker answered, a call to a worker failed (`CallFailed`:
worker-failed, worker-died or worker-busy, by its error), a client-side refusal came back
(`Rejected`), one line of a decode stream came (`Line`: tokens, start, heartbeat, finish, error,
migrate), an abort or a wait is over. Each carries the monotonic time it happened, so `decide`
reads no clock; the workers it may choose from come beside it in a `Snapshot` (policies/base.py),
taken where a choice may follow (`may_choose`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.contracts.protocol import EventType, PrefillResult, StreamEvent
from tandem.router.errors import RouterError
from tandem.router.journey import Rules, request_info
from tandem.router.policies.base import RequestInfo
from tandem.router.validation import ParsedRequest
from tandem.router.worker_client import WorkerFailed

# the lines after which a worker sends nothing more on that stream
TERMINAL_LINES = frozenset({EventType.FINISH, EventType.ERROR, EventType.MIGRATE})


@dataclass(frozen=True, kw_only=True)
class Outcome:
    now: float = 0.0  # monotonic seconds


@dataclass(frozen=True)
class Arrived(Outcome):
    """A client request to serve, under these rules; `info` is what a policy sees of it (the
    snapshot's `cached` is computed for it)."""

    request: ParsedRequest
    rules: Rules
    info: RequestInfo

    @classmethod
    def of(cls, request: ParsedRequest, rules: Rules, request_id: str, now: float = 0.0) -> Arrived:
        return cls(request, rules, request_info(request, request_id), now=now)


@dataclass(frozen=True)
class Prefilled(Outcome):
    url: str
    result: PrefillResult


@dataclass(frozen=True)
class CallFailed(Outcome):
    """A call to `url` failed for the worker's own reasons: busy (WorkerBusy), dead (error.dead:
    unreachable, cut off) or failed (a 5xx, a refused handoff)."""

    url: str
    error: WorkerFailed


@dataclass(frozen=True)
class Rejected(Outcome):
    """A worker refused the request for the client's own reasons (a 4xx passed through)."""

    error: RouterError


@dataclass(frozen=True)
class Line(Outcome):
    """One line of the decode stream from `url`."""

    url: str
    event: StreamEvent


@dataclass(frozen=True)
class Aborted(Outcome):
    """The request's copy on `url` is gone (the abort an `Abort` action waited for returned)."""

    url: str


@dataclass(frozen=True)
class Waited(Outcome):
    """The wait for busy decode workers is over."""


def may_choose(outcome: Outcome) -> bool:
    """A worker may be chosen after `outcome`: the driver takes a snapshot for it (a token line or a
    client's refusal needs none)."""
    if isinstance(outcome, Line):
        return outcome.event.type in TERMINAL_LINES
    return not isinstance(outcome, Rejected)
