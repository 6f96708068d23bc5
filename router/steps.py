"""The vocabulary of a journey: what can happen to a request (outcomes, the input of `decide`) and
what the driver does next (actions, its output).

Outcomes are facts the driver observed: a request arrived, a prefill worker answered, a worker
failed (`Failed`: worker-failed, worker-died or worker-busy, by its error), a client-side refusal
came back (`Rejected`), one line of a decode stream came (`Line`: tokens, start, heartbeat,
finish, error, migrate), an abort or a wait is over. Each carries the monotonic time it happened,
so `decide` reads no clock; the workers it may choose from come beside it in a `Snapshot`
(policies/base.py), taken where a choice may follow (`may_choose`).

Actions are one next step (prefill on a worker, decode on a worker, keep reading the open
stream, abort and wait for it, wait, fail, finish) plus effects the driver performs first:
events for the client, fire-and-forget aborts, a worker failure to count, the route to count,
a migration to measure, the pools whose round-robin turn a choice took, log lines.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, PrefillResult, StreamEvent
from tandem.contracts.routing import RouteReason
from tandem.router.errors import RouterError
from tandem.router.journey import Charge, Event, Rules, Tokens, request_info
from tandem.router.policies.base import Plan, RequestInfo, WorkerView
from tandem.router.validation import ParsedRequest
from tandem.router.worker_client import WorkerFailed

# the lines after which a worker sends nothing more on that stream
TERMINAL_LINES = frozenset({EventType.FINISH, EventType.ERROR, EventType.MIGRATE})


# --- outcomes ----------------------------------------------------------------------------------


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
class Failed(Outcome):
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


# --- actions -----------------------------------------------------------------------------------


class Why(enum.StrEnum):
    """Why a worker is asked: the first time, or which recovery."""

    PLANNED = "planned"  # the plan's worker
    RETRY = "retry"  # another worker after a failed or busy one, the same KV lease if any
    FALLBACK = "fallback"  # decode-side prefill: the prefill pool failed or was full
    RESUME = "resume"  # after a decode failure, every token so far replayed (counted as a resume)
    MIGRATE = "migrate"  # the decode worker is leaving and handed the sequence on


@dataclass(frozen=True)
class Fault:
    """A worker failure to count (and, when dead, to keep that worker out until its next good poll)."""

    url: str
    role: str  # "prefill" | "decode"
    error: WorkerFailed


@dataclass(frozen=True)
class Moved:
    """A migration ended: how (kv, recompute, failed) and how long since the MIGRATE line."""

    source: str
    outcome: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Action:
    emit: tuple[Event, ...] = ()  # to the client, in order
    abort: tuple[str, ...] = ()  # fire-and-forget aborts there, each with the journey's lease token
    fault: Fault | None = None
    plan: Plan | None = None  # a new plan: count its prefix cache hits
    route: RouteReason | None = None  # the request's route is known: count it (once per request)
    moved: Moved | None = None
    turns: tuple[Role, ...] = ()  # the pools (Role.PREFILL, Role.DECODE) where the policy chose: the cursor moves on
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, message)


@dataclass(frozen=True)
class PrefillOn(Action):
    """POST /internal/prefill to `worker`, counting `work` prompt tokens there meanwhile."""

    worker: WorkerView
    work: int
    why: Why = Why.PLANNED


@dataclass(frozen=True)
class DecodeOn(Action):
    """POST /internal/generate to `worker` (the journey says what to send) and read its first line;
    `queued` prompt tokens wait there until its first token (a decode-side prefill)."""

    worker: WorkerView
    queued: int
    why: Why = Why.PLANNED


@dataclass(frozen=True)
class Read(Action):
    """Read the next line of the open decode stream."""


@dataclass(frozen=True)
class Abort(Action):
    """Abort the request on `url` and wait until that returns (it may get the resume: its copy must
    be gone first), then report `Aborted`."""

    url: str


@dataclass(frozen=True)
class Wait(Action):
    """Every decode worker is busy: wait, then report `Waited`."""

    seconds: float


@dataclass(frozen=True)
class Fail(Action):
    """End the request with `error` (the client sees it)."""

    error: RouterError


@dataclass(frozen=True)
class Finish(Action):
    """The request is complete (its `Finished` event is in `emit`)."""


def charges(action: Action, held: dict[str, Charge], planned: str | None) -> dict[str, Charge]:
    """What a request counts on each worker while `action` is under way (`held`: before it; `planned`:
    its plan's decode worker), the load the workers' polls do not show yet: a prefill call and its
    prompt there, and a sequence on the planned decode worker from then on (a burst planned during
    one prefill spreads); a decode call, and a prompt it prefills itself until its first token;
    nothing once the call is over."""
    match action:
        case PrefillOn():
            assert planned is not None
            return {planned: Charge(planned=1), action.worker.url: Charge(1, action.work)}
        case DecodeOn():
            return {action.worker.url: Charge(1, action.queued)}
        case Read() if any(isinstance(ev, Tokens) for ev in action.emit):
            return {url: dataclasses.replace(c, prompt_tokens=0) for url, c in held.items()}
        case Read():
            return held
    return {}
