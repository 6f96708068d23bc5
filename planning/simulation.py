"""The discrete-event simulation: a router, prefill and decode replicas, a policy on a timer.

One request: the router sends the prompt to the ready prefill replica with the fewest outstanding
prompt tokens (exact below 9 replicas, the best of 4 sampled above: the real router scans them all,
which is too slow to simulate at hundreds); its first token leaves at the end of that prefill
(TTFT); after the KV handoff it joins the least-loaded ready decode replica, which runs it to its
last token (its first gap: the handoff and 1.5 steps). With no ready prefill replica, a decode
replica prefills the prompt itself (route `no_prefill_worker`, as the router does): its running
sequences stall for the whole prompt, or, with `decode_chunk_tokens`, wait one chunk per step (the
engine's chunked prefill). So does a prompt that finds every ready prefill replica with at least
`prefill_saturated_tokens` prompt tokens outstanding, when a decode replica has headroom (fewer than
`decode_headroom_sequences` sequences, fewer prompt tokens of its own to prefill than the least busy
prefill replica): the router's load-aware disaggregation (route `prefill_saturated`,
router/policies/base.py), with its defaults (its KV-room condition is not simulated: the simulated
KV pool does not fill).

Scaling: a new replica is provisioned at once and ready `startup_s` later. A prefill replica being
removed takes no new prompt and leaves when its queue is empty; a decode replica being removed
hands its sequences to the other decode replicas (decode-to-decode KV move, `migrate_s` each),
as issue 14 plans. Replica-seconds count every replica from provisioning to removal.
"""

from __future__ import annotations

import heapq
import itertools
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterator

from tandem.contracts.routing import DECODE_HEADROOM_SEQUENCES, PREFILL_SATURATED_TOKENS
from tandem.planning.autoscaling.scrape import RouterReading
from tandem.planning.autoscaling.snapshot import PodScrape, ScrapeRound
from tandem.planning.capacity import Capacity
from tandem.planning.replicas import (
    DRAINING,
    READY,
    STARTING,
    DecodeReplica,
    Hist,
    PrefillReplica,
    Seq,
)
from tandem.planning.workload import Request

ARRIVE, PREFILL_DONE, DECODE, JOIN, UP, TICK, FIRST_STEP = range(7)
ROLES = ("prefill", "decode")
# Decide(sim, now) -> {role: (desired replicas, pods to remove first)}
Decide = Callable[["Simulation", float], dict[str, tuple[int, tuple[str, ...]]]]


class Outcomes:
    """Per-request results, compact: TTFT and TPOT per finished request, in arrival-hour bins."""

    def __init__(self, ttft_slo: float, tpot_slo: float, hour_s: float):
        self.ttft, self.tpot = array("d"), array("d")
        self.ttft_slo, self.tpot_slo, self.hour_s = ttft_slo, tpot_slo, hour_s
        self.met_by_hour, self.all_by_hour = [0] * 24, [0] * 24

    def add(self, req: Request, ttft: float, tpot: float) -> None:
        self.ttft.append(ttft)
        self.tpot.append(tpot)
        h = min(23, int(req.t / self.hour_s))
        self.all_by_hour[h] += 1
        self.met_by_hour[h] += ttft <= self.ttft_slo and tpot <= self.tpot_slo


class Simulation:
    def __init__(self, cap: Capacity, trace: Iterator[Request], decide: Decide, initial: dict[str, int],
                 *, interval_s: float, day_s: float, ttft_slo: float, tpot_slo: float,
                 ttft_bounds: tuple[float, ...], itl_bounds: tuple[float, ...], seed: int = 0,
                 export_outstanding: bool = False, decode_chunk_tokens: int | None = None,
                 prefill_saturated_tokens: int = PREFILL_SATURATED_TOKENS,
                 decode_headroom_sequences: int = DECODE_HEADROOM_SEQUENCES):
        self.cap, self.trace, self.decide = cap, trace, decide
        self.interval_s, self.day_s, self.export_outstanding = interval_s, day_s, export_outstanding
        self.decode_chunk_tokens = decode_chunk_tokens
        self.saturated_tokens, self.headroom_seqs = prefill_saturated_tokens, decode_headroom_sequences
        self.rng = random.Random(seed)
        self.events: list = []
        self._tie = itertools.count()
        self.now = 0.0
        self.replicas: dict[str, dict[str, PrefillReplica | DecodeReplica]] = {r: {} for r in ROLES}
        self.pool: dict[str, list] = {r: [] for r in ROLES}  # the ready ones, which the router uses
        self.first_token_at: dict[int, float] = {}
        self._names = itertools.count()
        self.ttft_hist, self.itl_hist = Hist(ttft_bounds), Hist(itl_bounds)
        self.in_flight, self.finished = 0, 0
        self.routes = {"disaggregated": 0.0, "no_prefill_worker": 0.0, "prefill_saturated": 0.0}
        self.outcomes = Outcomes(ttft_slo, tpot_slo, day_s / 24.0)
        self.replica_seconds = dict.fromkeys(ROLES, 0.0)
        self._counted_to = dict.fromkeys(ROLES, 0.0)
        self.timeline: list[tuple[float, int, int, int, int]] = []  # t, prefill, decode provisioned, ready
        for role in ROLES:
            for _ in range(initial.get(role, 0)):
                self._provision(role, ready_now=True)

    # ---- events ---------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj=None, version: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._tie), kind, obj, version))

    def run(self) -> Simulation:
        first = next(self.trace, None)
        if first is not None:
            self._push(first.t, ARRIVE, first)
        self._push(0.0, TICK)
        handlers = {ARRIVE: self._arrive, PREFILL_DONE: self._prefill_done, DECODE: self._decode_event,
                    JOIN: self._join, UP: self._up, TICK: self._tick, FIRST_STEP: self._first_step}
        while self.events:
            t, _, kind, obj, version = heapq.heappop(self.events)
            if kind == TICK and t >= self.day_s and (self.in_flight == 0 or t > self.day_s + 7200):
                break
            self.now = t
            if kind in (PREFILL_DONE, DECODE) and version != obj.version:
                continue  # superseded: the replica's state changed since this was scheduled
            handlers[kind](obj)
        for role in ROLES:
            self._count(role, self.day_s)  # what is left runs to the end of the day
        return self

    def _count(self, role: str, upto: float) -> None:
        """Replica-seconds of `role` up to `upto` (only the day itself is counted)."""
        upto = min(upto, self.day_s)
        if upto > self._counted_to[role]:
            self.replica_seconds[role] += len(self.replicas[role]) * (upto - self._counted_to[role])
            self._counted_to[role] = upto

    # ---- the data path ----------------------------------------------------------------------

    def _least(self, pool: list):
        if len(pool) > 8:
            pool = self.rng.sample(pool, 4)
        return min(pool, key=lambda r: r.load())

    def _arrive(self, req: Request) -> None:
        nxt = next(self.trace, None)
        if nxt is not None:
            self._push(nxt.t, ARRIVE, nxt)
        self.in_flight += 1
        self._route(req)

    def _route(self, req: Request) -> None:
        prefill = self.pool["prefill"]
        helper = self._saturated_helper(prefill) if prefill else None
        if prefill and helper is None:
            self.routes["disaggregated"] += 1
            p = self._least(prefill)
            p.queue.append(req)
            p.outstanding += req.prompt
            p.prompt_tokens += req.prompt  # a worker counts a prompt when it is added, as the engine does
            if p.current is None:
                self._start_prefill(p)
            return
        self.routes["prefill_saturated" if helper is not None else "no_prefill_worker"] += 1
        d = helper or self._decode_target()
        d.local.append(req)
        d.prompt_tokens += req.prompt
        if d.stall_req is None:
            self._start_local_prefill(d)

    def _saturated_helper(self, prefill: list) -> DecodeReplica | None:
        """The decode replica that prefills a prompt itself because every prefill replica is
        saturated (the router's rule); None: the prompt goes to prefill."""
        if self.saturated_tokens <= 0:
            return None
        queued = min(p.outstanding for p in prefill)
        if queued < self.saturated_tokens:
            return None
        room = [d for d in self.pool["decode"]
                if d.load() < self.headroom_seqs and d.local_prompt_tokens() < queued]
        return self._least(room) if room else None

    def _start_prefill(self, p: PrefillReplica) -> None:
        req = p.queue.popleft()
        p.current, p.started = req, self.now
        p.version += 1
        self._push(self.now + self.cap.prefill_s(req.prompt), PREFILL_DONE, p, p.version)

    def _prefill_done(self, p: PrefillReplica) -> None:
        req = p.current
        p.busy_s += self.now - p.started
        p.steps += 1
        p.step_tokens += req.prompt
        p.gen_tokens += 1
        p.outstanding -= req.prompt
        p.current = None
        self._first_token(req)
        if req.output > 1:
            self._push(self.now + self.cap.handoff_s, JOIN, Seq(req, req.output - 1))
        if p.queue:
            self._start_prefill(p)
        elif p.state == DRAINING:
            self._remove(p)

    def _first_token(self, req: Request) -> None:
        ttft = self.now - req.t
        self.ttft_hist.add(ttft)
        self.first_token_at[req.id] = self.now
        if req.output == 1:
            self._finish(req)

    def _finish(self, req: Request) -> None:
        first = self.first_token_at.pop(req.id)
        tpot = (self.now - first) / (req.output - 1) if req.output > 1 else 0.0
        self.outcomes.add(req, first - req.t, tpot)
        self.in_flight -= 1
        self.finished += 1

    def _decode_target(self) -> DecodeReplica:
        pool = self.pool["decode"] or [r for r in self.replicas["decode"].values() if r.state != DRAINING]
        return self._least(pool)

    def _join(self, seq: Seq) -> None:
        d = self._decode_target()
        d.advance(self.now, self.cap, self.itl_hist)
        if seq.remaining == seq.req.output - 1:
            d.prompt_tokens += seq.req.prompt  # a pulled prompt is admitted (counted) on decode too
            # its first token there closes one gap: the pull, half a step's wait for the step under way
            # and its own step (BENCHMARKS.md, "The first gap after a handoff"); then it joins the fluid
            first = 1.5 * self.cap.step_s(len(d.running) + 1)
            self.itl_hist.add(self.cap.handoff_s + first)
            seq.remaining -= 1
            d.gen_tokens += 1
            d.step_tokens += 1
            self._push(self.now + first, FIRST_STEP, (d, seq))
            return
        self._seat_or_wait(d, seq)

    def _first_step(self, pair: tuple[DecodeReplica, Seq]) -> None:
        d, seq = pair
        if not seq.remaining:
            self._finish(seq.req)
        elif d.name not in self.replicas["decode"] or d.state == DRAINING:
            self._join(seq)  # its replica left meanwhile: as a migrated sequence
        else:
            d.advance(self.now, self.cap, self.itl_hist)
            self._seat_or_wait(d, seq)

    def _seat_or_wait(self, d: DecodeReplica, seq: Seq) -> None:
        d.waiting.append(seq)  # seated at once when d is ready with room (no one waits then)
        self._admit_waiting(d)
        self._reschedule(d)

    def _start_local_prefill(self, d: DecodeReplica) -> None:
        d.advance(self.now, self.cap, self.itl_hist)
        req = d.local.popleft()
        if d.chunk is not None:  # a chunk per step beside the streams (advance() counts their gaps)
            d.stall_req, d.local_left = req, float(req.prompt)
            self._reschedule(d)
            return
        dur = self.cap.prefill_s(req.prompt)
        n = len(d.running)
        if n:
            self.itl_hist.add(dur + self.cap.step_s(n), n)  # every running stream waits out the prefill
        d.stall_end, d.stall_req = self.now + dur, req
        self._reschedule(d)

    def _decode_event(self, d: DecodeReplica) -> None:
        d.advance(self.now, self.cap, self.itl_hist)
        if d.local_done(self.now):
            req = d.stall_req
            d.stall_end, d.stall_req, d.local_left = None, None, 0.0
            d.steps += 1
            d.step_tokens += req.prompt
            d.gen_tokens += 1
            self._first_token(req)
            if req.output > 1:
                seq = Seq(req, req.output - 1)
                if len(d.running) < self.cap.max_seqs:
                    d.seat(seq)
                else:
                    d.waiting.append(seq)
            if d.local:
                self._start_local_prefill(d)
                return
        while d.running and d.running[0][0] <= d.v + 1e-9:
            _, _, seq = heapq.heappop(d.running)
            d.unseat(seq)
            self._finish(seq.req)
        self._admit_waiting(d)
        self._reschedule(d)

    def _admit_waiting(self, d: DecodeReplica) -> None:
        while d.waiting and d.state == READY and len(d.running) < self.cap.max_seqs:
            d.seat(d.waiting.popleft())

    def _reschedule(self, d: DecodeReplica) -> None:
        d.version += 1
        t = d.next_event(self.cap)
        if t is not None:
            self._push(t, DECODE, d, d.version)

    # ---- scaling ----------------------------------------------------------------------------

    def _provision(self, role: str, ready_now: bool = False) -> None:
        self._count(role, self.now)
        name = f"{role}-{next(self._names)}"
        r = (PrefillReplica(name, self.now) if role == "prefill"
             else DecodeReplica(name, self.now, chunk=self.decode_chunk_tokens))
        self.replicas[role][name] = r
        if ready_now:
            r.state = READY
            self.pool[role].append(r)
        else:
            self._push(self.now + self.cap.startup_s, UP, r)

    def _up(self, r) -> None:
        if r.name not in self.replicas[r.role]:
            return  # removed while it was starting
        r.state = READY
        self.pool[r.role].append(r)
        if isinstance(r, DecodeReplica):
            r.t_last = self.now
            self._admit_waiting(r)
            self._reschedule(r)

    def _leave_pool(self, r) -> None:
        if r in self.pool[r.role]:
            self.pool[r.role].remove(r)

    def _remove(self, r) -> None:
        self._count(r.role, self.now)
        self._leave_pool(r)
        del self.replicas[r.role][r.name]
        r.version += 1

    def provisioned(self, role: str) -> int:
        """The role's replicas as a Deployment counts them (starting or ready, not leaving)."""
        return sum(r.state != DRAINING for r in self.replicas[role].values())

    def _scale(self, role: str, desired: int, remove: tuple[str, ...]) -> None:
        current = self.provisioned(role)
        for _ in range(max(0, desired - current)):
            self._provision(role)
        if desired >= current:
            return
        live = {n: r for n, r in self.replicas[role].items() if r.state != DRAINING}
        order = [live[n] for n in remove if n in live]
        rest = sorted((r for r in live.values() if r not in order), key=lambda r: (r.state == READY, r.load()))
        for r in (order + rest)[:current - desired]:
            if r.state == STARTING:
                self._remove(r)
            elif role == "prefill":
                r.state = DRAINING
                self._leave_pool(r)
                if r.idle():
                    self._remove(r)
            else:
                self._migrate_away(r)

    def _migrate_away(self, d: DecodeReplica) -> None:
        """A decode replica leaves: its sequences move to the others, prompts it held are re-routed."""
        d.advance(self.now, self.cap, self.itl_hist)
        d.state = DRAINING
        moving = []
        for _, _, seq in d.running:
            d.unseat(seq)
            seq.remaining = max(0.0, seq.v_end - d.v)
            moving.append(seq)
        moving.extend(d.waiting)
        held = ([d.stall_req] if d.stall_req is not None else []) + list(d.local)
        d.running, d.waiting, d.local, d.stall_req, d.stall_end = [], deque(), deque(), None, None
        self._remove(d)
        for seq in moving:
            self.itl_hist.add(self.cap.migrate_s)
            self._push(self.now + self.cap.migrate_s, JOIN, seq)
        for req in held:
            self._route(req)  # its prefill is lost with the pod: prefilled again elsewhere

    def _tick(self, _obj) -> None:
        plan = self.decide(self, self.now)
        for role, (desired, remove) in plan.items():
            self._scale(role, desired, remove)
        ready = {role: sum(r.state == READY for r in self.replicas[role].values()) for role in ROLES}
        self.timeline.append((self.now, self.provisioned("prefill"), self.provisioned("decode"),
                              ready["prefill"], ready["decode"]))
        self._push(self.now + self.interval_s, TICK)

    # ---- what the planner reads -------------------------------------------------------------

    def scrape(self) -> ScrapeRound:
        """Every pod's /metrics now, as typed readings (what the operator would parse)."""
        pods = [PodScrape("router-0", "router", True, RouterReading(
            ttft=self.ttft_hist.frozen(), itl=self.itl_hist.frozen(), in_flight=float(self.in_flight),
            requests=float(self.finished), routes=dict(self.routes)))]
        for role in ROLES:
            for r in self.replicas[role].values():
                if r.state == STARTING:
                    pods.append(PodScrape(r.name, role, False, None, "starting: loading the model"))
                    continue
                if isinstance(r, DecodeReplica):
                    r.advance(self.now, self.cap, self.itl_hist)
                    reading = r.reading()
                else:
                    reading = r.reading(self.now, self.export_outstanding)
                pods.append(PodScrape(r.name, role, r.state == READY, reading))
        return ScrapeRound(self.now, tuple(pods))
