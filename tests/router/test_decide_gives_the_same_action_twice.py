"""`decide(journey, outcome, snapshot)` is pure: the same journey, outcome and snapshot give the same
action and leave the journey in the same state, whatever else happens in the router between two
calls: the round-robin cursor moves on, the KV event feed changes what the prefix index says each
worker holds, other requests are decided with the same policy object.

Hypothesis plays whole journeys (arrival, prefill successes and failures, busy workers, stream
lines, deaths, migrations, waits) with every registered policy, over snapshots drawn per step, and
decides every step twice with that world moved on in between. The last two tests show the check
has teeth: a policy that keeps its own round-robin counter (as `RoundRobin` did) and one that reads
a live prefix index (as `PrefixAware` did) are both caught.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tandem.contracts.handoff_parity import ParityState
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, FinishReason, StreamEvent
from tandem.router.actions import Abort, Action, DecodeOn, PrefillOn, Read, Wait
from tandem.router.decide import decide
from tandem.router.journey import Journey, Rules
from tandem.router.outcomes import (
    Aborted,
    Arrived,
    CallFailed,
    Line,
    Outcome,
    Prefilled,
    Rejected,
    Waited,
)
from tandem.router.policies.base import (
    PairedPolicy,
    PolicySettings,
    RequestInfo,
    Snapshot,
    WorkerView,
)
from tandem.router.policies.prefix_aware import PrefixAware
from tandem.router.policies.registry import POLICIES, create_policy
from tandem.router.prefix_index import PrefixIndex
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.router.workers import WorkerSet
from tandem.testing.fake_workers import (
    FakeWorkers,
    busy,
    died,
    fail,
    finish,
    migrate,
    prefilled,
    start,
    token,
)

URLS = ("p1", "p2", "d1", "d2", "d3", "c1")
BLOCK = 4


def plain(x: object) -> object:
    """A value to compare two decisions by: dataclasses field by field, errors by what they say
    (a fresh RouterError is never `==` another), containers by content."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x).__name__, tuple((f.name, plain(getattr(x, f.name))) for f in dataclasses.fields(x) if f.compare)
    if isinstance(x, BaseException):
        return type(x).__name__, str(x), plain(vars(x))
    if isinstance(x, dict):
        return tuple(sorted(((plain(k), plain(v)) for k, v in x.items()), key=repr))
    if isinstance(x, set | frozenset):
        return tuple(sorted((plain(v) for v in x), key=repr))
    if isinstance(x, list | tuple):
        return tuple(plain(v) for v in x)
    return x


# --- the world that moves on between two decisions ----------------------------------------------


@dataclass
class World:
    """What changes in a running router between two decisions, none of which `decide` may read: the
    prefix index the KV events feed, the worker set's cursor and counts, other requests' decisions."""

    index: PrefixIndex
    workers: WorkerSet
    rules: Rules
    moves: int = 0

    @classmethod
    def new(cls, rules: Rules, index: PrefixIndex | None = None) -> World:
        return cls(index or PrefixIndex(), WorkerSet(FakeWorkers()), rules)

    def move_on(self, j: Journey, snap: Snapshot, action: Action) -> None:
        """Everything a router does between two decisions: the driver's bookkeeping of `action`, a
        KV event saying every worker but the one just chosen holds this prompt, another request
        decided with the same policy over the same snapshot."""
        self.moves += 1
        self.workers.account(j.request_id, j.charges)
        self.workers.took_turns((*action.turns, Role.PREFILL, Role.DECODE))
        chosen = getattr(action, "worker", None)
        held = [h.hex() for h in j.info.block_hashes(BLOCK)] if j.info is not None else []
        for w in snap.workers:
            blocks = held if chosen is None or w.url != chosen.url else []
            self.index.start(w.url, KVEventMessage(KVEventType.SNAPSHOT, self.moves, block_size=BLOCK, hashes=blocks))
        other = Journey(f"other-{self.moves}")
        decide(other, Arrived.of(j.request or request_of([1, 2, 3]), self.rules, other.request_id), snap)


def twice(world: World, a: Journey, b: Journey, outcome: Outcome, snap: Snapshot) -> Action:
    """Decide `outcome` for two equal journeys with the world moved on in between; they must agree."""
    before = plain(snap)
    first = decide(a, outcome, snap)
    world.move_on(a, snap, first)
    second = decide(b, outcome, snap)
    assert plain(first) == plain(second), f"{type(outcome).__name__}: {first} then {second}"
    assert plain(a) == plain(b), f"the journeys differ after {type(outcome).__name__}"
    assert plain(snap) == before, "decide changed the snapshot it was given"
    return first


# --- what hypothesis draws ----------------------------------------------------------------------


def request_of(prompt: str | list[int], max_tokens: int = 4):
    return parse_request({"model": "toy", "prompt": prompt, "max_tokens": max_tokens}, Endpoint.COMPLETION, Limits())


LOADS = st.tuples(st.sampled_from(["g1", "g1", "g1", "g2"]), st.sampled_from([True, True, True, False]),
                  st.integers(0, 20), st.sampled_from([0.0, 0.5, 0.95]), st.integers(0, 3000), st.integers(0, 3),
                  st.sampled_from([None, None, None, ParityState.VERIFIED, ParityState.MISMATCH]))


@st.composite
def snapshots(draw: st.DrawFn, prompt_tokens: int) -> Snapshot:
    """Some of the workers, each with its kv_compat, readiness, load and parity; what each caches
    of the prompt; the round-robin cursor."""
    views, cached = [], {}
    for url in draw(st.lists(st.sampled_from(URLS), unique=True, min_size=2, max_size=len(URLS))):
        gen, ready, running, kv, queued, inflight, parity = draw(LOADS)
        role = {"p": Role.PREFILL, "c": Role.COLOCATED}.get(url[0], Role.DECODE)
        views.append(WorkerView(url, role, gen, ready, first_seen=running % 3, running=running, kv_usage=kv,
                                outstanding_prompt_tokens=queued, router_inflight=inflight, parity=parity))
        if queued % 2:
            cached[url] = queued % prompt_tokens
    turns = {Role.PREFILL: draw(st.integers(0, 7)), Role.DECODE: draw(st.integers(0, 7))}
    return Snapshot(views, cached, turns)


@st.composite
def rules(draw: st.DrawFn) -> Rules:
    policy_settings = PolicySettings(
        short_prompt_threshold=draw(st.sampled_from([0, 8, 64])),
        prefill_saturated_tokens=draw(st.sampled_from([0, 500, 2048])),
        decode_headroom_sequences=draw(st.sampled_from([4, 16])))
    policy = create_policy(draw(st.sampled_from(sorted(POLICIES))), policy_settings)
    return Rules(policy, max_prefill_attempts=draw(st.integers(1, 3)), max_resumes=draw(st.integers(0, 2)),
                 busy_wait_s=draw(st.sampled_from([0.0, 3.0, 10.0])))


def next_outcome(draw: st.DrawFn, j: Journey, action: Action, now: float) -> Outcome | None:
    """What a driver could report after `action` (None: the journey is over)."""
    if isinstance(action, PrefillOn):
        url, ids = action.worker.url, j.prompt_ids or [5, 6, 7, 8, 9]
        return draw(st.sampled_from([
            Prefilled(url, prefilled(url, ids, 7, "A"), now=now),
            Prefilled(url, prefilled(url, ids, 7, "A", FinishReason.STOP), now=now),
            CallFailed(url, died(), now=now), CallFailed(url, busy(), now=now),
            CallFailed(url, fail(503, "not_ready", type_="service_unavailable"), now=now),
            Rejected(fail(400, "invalid_value", "max_tokens"), now=now)]))
    if isinstance(action, DecodeOn | Read):
        return decode_line(draw, j, now)
    if isinstance(action, Abort):
        return Aborted(action.url, now=now)
    if isinstance(action, Wait):
        return Waited(now=now + action.seconds)
    return None


def decode_line(draw: st.DrawFn, j: Journey, now: float) -> Outcome:
    url = j.decode_url or "d1"
    n = len(j.generated)
    error = {"message": "bad", "type": draw(st.sampled_from(["invalid_request_error", "server_error"]))}
    return draw(st.sampled_from([
        Line(url, start(j.prompt_tokens or 5), now=now), Line(url, token(10 + n, "x"), now=now),
        Line(url, token(10 + n, ""), now=now), Line(url, StreamEvent(EventType.HEARTBEAT), now=now),
        Line(url, finish(), now=now), Line(url, finish(FinishReason.ABORT), now=now),
        Line(url, StreamEvent(EventType.ERROR, error=error), now=now),
        Line(url, migrate(url, list(j.generated), 5 + n, with_kv=draw(st.booleans())), now=now),
        CallFailed(url, died(), now=now), CallFailed(url, busy(429, "2"), now=now),
        CallFailed(url, fail(400, "kv_mismatch", "kv_source"), now=now)]))


# --- the property -------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), r=rules(), prompt=st.one_of(st.lists(st.integers(0, 500), min_size=1, max_size=40),
                                                   st.text("abcdef ", min_size=1, max_size=200)))
def test_every_step_of_a_journey_decides_the_same_twice(data, r, prompt):
    req = request_of(prompt, data.draw(st.integers(1, 6)))
    world = World.new(r)
    a, b = Journey("r1"), Journey("r1")
    outcome: Outcome | None = Arrived.of(req, r, "r1")
    pools = data.draw(st.lists(snapshots(len(prompt) if isinstance(prompt, list) else 50), min_size=1, max_size=3))
    for step in range(16):
        if outcome is None:
            break
        action = twice(world, a, b, outcome, data.draw(st.sampled_from(pools)))  # the workers change, or not
        event(f"{type(outcome).__name__} -> {type(action).__name__}")
        outcome = next_outcome(data.draw, a, action, now=float(step))
    assert world.moves >= 1


# --- the check has teeth ------------------------------------------------------------------------


class CountingRoundRobin(PairedPolicy):
    """Round-robin as it was: a counter of its own, moved on by every choice."""

    def __init__(self, policy_settings: PolicySettings | None = None) -> None:
        super().__init__(policy_settings)
        self.turns = {Role.PREFILL: 0, Role.DECODE: 0}

    def _next(self, pool: Role, candidates: list[WorkerView]) -> WorkerView:
        ordered = sorted(candidates, key=lambda w: w.url)
        self.turns[pool] += 1
        return ordered[(self.turns[pool] - 1) % len(ordered)]

    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return self._next(Role.PREFILL, candidates)

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return self._next(Role.DECODE, candidates)


class LivePrefixAware(PrefixAware):
    """Prefix-aware as it was: the live index the KV events feed, read at every choice."""

    index: PrefixIndex

    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=lambda w: -self.index.cached_tokens(w.url, request))

    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        return min(candidates, key=lambda w: -self.index.cached_tokens(w.url, request))


def a_pool() -> Snapshot:
    """Two prefill and three decode workers, idle: every choice is the policy's own (three decode
    workers, so the world's one other request cannot bring a counter back to the same turn)."""
    views = [WorkerView(url, role, "g1", ready=True) for url, role in
             (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE), ("d2", Role.DECODE),
              ("d3", Role.DECODE))]
    return Snapshot(views)


def test_a_policy_keeping_its_own_round_robin_counter_is_caught():
    r = Rules(CountingRoundRobin())
    with pytest.raises(AssertionError, match="Arrived"):
        twice(World.new(r), Journey("r1"), Journey("r1"), Arrived.of(request_of("x" * 80), r, "r1"), a_pool())
    pure = Rules(create_policy("round-robin"))  # the same inputs, the registered policy: no difference
    twice(World.new(pure), Journey("r1"), Journey("r1"), Arrived.of(request_of("x" * 80), pure, "r1"), a_pool())


def test_a_policy_reading_the_live_prefix_index_is_caught():
    live = LivePrefixAware()
    live.index = PrefixIndex()
    r = Rules(live)
    ids = list(range(100, 140))
    with pytest.raises(AssertionError, match="Arrived"):
        twice(World.new(r, live.index), Journey("r1"), Journey("r1"), Arrived.of(request_of(ids), r, "r1"),
              a_pool())
    pure = Rules(create_policy("prefix-aware"))
    world = World.new(pure, live.index)
    twice(world, Journey("r1"), Journey("r1"), Arrived.of(request_of(ids), pure, "r1"), a_pool())


def test_the_worlds_moves_reach_what_a_live_read_would_see():
    """The check's premise: between the two decisions the worker set's cursor and the prefix index
    do change (a check whose world stood still would catch nothing)."""
    r = Rules(create_policy("round-robin"))
    world, j = World.new(r), Journey("r1")
    action = decide(j, Arrived.of(request_of(list(range(100, 140))), r, "r1"), a_pool())
    before = (copy.deepcopy(world.workers.snapshot().turns), world.index.workers())
    world.move_on(j, a_pool(), action)
    assert world.workers.snapshot().turns != before[0] and world.index.workers() == 5 != before[1]
    urls = [w.url for w in a_pool().workers]
    held = world.index.cached(RequestInfo("r1", 40, list(range(100, 140))), urls)
    assert sorted(held) == sorted(set(urls) - {action.worker.url})
