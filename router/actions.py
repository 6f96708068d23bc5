"""What the router's driver does next for a request: the actions `decide` gives (outcomes.py holds
its input).

One next step (prefill on a worker, decode on a worker, keep reading the open stream, abort and
wait for it, wait, end with an error, finish) plus effects the driver performs first: events for
the client, fire-and-forget aborts, a worker to blame (count its failure), the route to count, a
migration to measure, the pools whose round-robin turn a choice took, log lines.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason
from tandem.router.errors import RouterError
from tandem.router.journey import Charge, Event, Tokens
from tandem.router.policies.base import Route, WorkerView
from tandem.router.worker_client import WorkerFailed


class Why(enum.StrEnum):
    """Why a worker is asked: the first time, or which recovery."""

    ROUTED = "routed"  # the route's worker
    RETRY = "retry"  # another worker after a failed or busy one, the same KV lease if any
    FALLBACK = "fallback"  # decode-side prefill: the prefill pool failed or was full
    RESUME = "resume"  # after a decode failure, every token so far replayed (counted as a resume)
    MIGRATE = "migrate"  # the decode worker is leaving and handed the sequence on


@dataclass(frozen=True)
class Blame:
    """The worker a failure is counted against (and, when dead, kept out until its next good poll)."""

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
    blame: Blame | None = None  # a worker failure to count
    route: Route | None = None  # a new route: count its prefix cache hits
    route_reason: RouteReason | None = None  # the request's route is known: count it (once per request)
    moved: Moved | None = None
    turns: tuple[Role, ...] = ()  # the pools (Role.PREFILL, Role.DECODE) where the policy chose: the cursor moves on
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, message)


@dataclass(frozen=True)
class PrefillOn(Action):
    """POST /internal/prefill to `worker`, counting `work` prompt tokens there meanwhile."""

    worker: WorkerView
    work: int
    why: Why = Why.ROUTED


@dataclass(frozen=True)
class DecodeOn(Action):
    """POST /internal/generate to `worker` (the journey says what to send) and read its first line;
    `queued` prompt tokens wait there until its first token (a decode-side prefill)."""

    worker: WorkerView
    queued: int
    why: Why = Why.ROUTED


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
class EndWithError(Action):
    """End the request with `error` (the client sees it)."""

    error: RouterError


@dataclass(frozen=True)
class Finish(Action):
    """The request is complete (its `Finished` event is in `emit`)."""


def charges(action: Action, held: dict[str, Charge], planned: str | None) -> dict[str, Charge]:
    """What a request counts on each worker while `action` is under way (`held`: before it; `planned`:
    its route's decode worker), the load the workers' polls do not show yet: a prefill call and its
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
