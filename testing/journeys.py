"""Journeys for tests of the router's pure state machine (tandem.router.decide): snapshots of
workers, a request that arrives, and the outcomes a driver would report, each decided over a
snapshot of the workers given, with no event loop, no pool and no fake workers (microseconds each)."""

from __future__ import annotations

from tandem.contracts.names import Role
from tandem.router.actions import Action
from tandem.router.decide import decide
from tandem.router.journey import Journey, Rules
from tandem.router.outcomes import Arrived, CallFailed, Line, Prefilled
from tandem.router.policies.base import Snapshot, WorkerView
from tandem.router.policies.registry import create_policy
from tandem.router.validation import Endpoint, Limits, ParsedRequest, parse_request
from tandem.testing.fake_workers import prefilled

PROMPT = "a prompt long enough to be worth a prefill worker"
IDS = [1, 2, 3, 4, 5]


def worker(url: str, role: Role = Role.DECODE, kv_compat: str = "g1", **load) -> WorkerView:
    """A ready worker as the pool would show it (`load`: running, waiting, kv_usage, ...)."""
    return WorkerView(url=url, role=role, kv_compat=kv_compat, ready=True, **load)


def pool(*urls: str, kv_compat: str = "g1") -> tuple[WorkerView, ...]:
    """Ready workers by name: p* prefill, c* colocated, others decode; "d2@g2" sets a kv_compat."""
    views = []
    for name in urls:
        url, _, gen = name.partition("@")
        role = {"p": Role.PREFILL, "c": Role.COLOCATED}.get(url[0], Role.DECODE)
        views.append(worker(url, role, gen or kv_compat))
    return tuple(views)


def request(max_tokens: int = 16, limits: Limits | None = None, prompt: str | list[int] = PROMPT) -> ParsedRequest:
    return parse_request({"model": "toy", "prompt": prompt, "max_tokens": max_tokens}, Endpoint.COMPLETION,
                         limits or Limits())


def rules(policy: str = "least-loaded", **kw) -> Rules:
    return Rules(create_policy(policy), **kw)


def arrive(workers: tuple[WorkerView, ...], req: ParsedRequest | None = None, r: Rules | None = None,
           request_id: str = "r1", **snapshot) -> tuple[Journey, Action]:
    """A new journey and its first action (`snapshot`: the Snapshot's cached, turns)."""
    j = Journey(request_id)
    return j, decide(j, Arrived.of(req or request(), r or rules(), request_id), Snapshot(workers, **snapshot))


def handed_off(workers: tuple[WorkerView, ...], req: ParsedRequest | None = None, r: Rules | None = None
               ) -> tuple[Journey, Action]:
    """A journey whose prefill on p1 succeeded (first token 7, text "A"): its first decode action."""
    j, _ = arrive(workers, req, r)
    return j, decide(j, Prefilled("p1", prefilled("p1", IDS, 7, "A")), Snapshot(workers))


def feed(j: Journey, url: str, *items, workers: tuple[WorkerView, ...] = (), now: float = 0.0) -> list[Action]:
    """Stream lines (or a failure) from `url`, one decision each, over a snapshot of `workers`."""
    actions = []
    for item in items:
        outcome = CallFailed(url, item, now=now) if isinstance(item, Exception) else Line(url, item, now=now)
        actions.append(decide(j, outcome, Snapshot(workers)))
    return actions
