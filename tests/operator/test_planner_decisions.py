"""The planner's pure decision, table-driven: load moves each role apart, noise and limits do not.

Snapshots are built the way the operator builds them: two scrape rounds of typed readings (the
router's histograms with the router's own buckets) taken `WINDOW` seconds apart.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.planning.autoscaling.planner import PlannerState, Reason, Seats, plan
from tandem.planning.autoscaling.scrape import Histogram, RouterReading, WorkerReading, parse_router
from tandem.planning.autoscaling.snapshot import MetricsWindow, PodScrape, ScrapeRound, Snapshot
from tandem.router.metrics import RouterMetrics

WINDOW = 60.0
_EMPTY = parse_router(generate_latest(RouterMetrics().registry).decode())
TTFT_BOUNDS, ITL_BOUNDS = _EMPTY.ttft.bounds, _EMPTY.itl.bounds

SPEC = AutoscalingSpec.from_dict({
    "targets": {"ttft": {"seconds": 2.0, "percentile": 90}, "itl": {"seconds": 0.1, "percentile": 90}},
    "prefill": {"minReplicas": 0, "maxReplicas": 10},
    "decode": {"minReplicas": 1, "maxReplicas": 10},
})


def hist(bounds: tuple[float, ...], values: float | list[tuple[float, int]] | None, count: int) -> Histogram:
    """`count` observations of one value, or a list of (value, count); bucketed as Prometheus does."""
    cum = [0.0] * len(bounds)
    if values is None:
        return Histogram(bounds, tuple(cum), 0.0)
    mix = [(values, count)] if isinstance(values, float | int) else values
    for value, n in mix:
        first = next(i for i, b in enumerate(bounds) if value <= b)
        for i in range(first, len(bounds)):
            cum[i] += n
    return Histogram(bounds, tuple(cum), sum(v * n for v, n in mix))


def worker(name: str, *, ready: bool = True, running: float = 0, waiting: float = 0, leased: float = 0,
           kv: float = 0.0, prompt_rate: float = 0.0, gen_rate: float = 0.0, busy: float = 0.0,
           outstanding: float | None = None, readable: bool = True, done: float | None = None) -> dict:
    """One worker pod; `done` is the tokens its steps process per second (default: prompt_rate)."""
    return dict(name=name, ready=ready, running=running, waiting=waiting, leased=leased, kv=kv,
                prompt_rate=prompt_rate, gen_rate=gen_rate, busy=busy, outstanding=outstanding,
                readable=readable, done=prompt_rate if done is None else done)


def _reading(p: dict, at: float) -> WorkerReading:
    return WorkerReading(running=p["running"], waiting=p["waiting"], leased=p["leased"],
                         kv_blocks_used=p["kv"] * 1000, kv_blocks_total=1000.0,
                         prompt_tokens=p["prompt_rate"] * at, generation_tokens=p["gen_rate"] * at,
                         busy_seconds=p["busy"] * at, steps=100.0 * at, step_tokens=p["done"] * at,
                         outstanding_prompt_tokens=p["outstanding"])


def snapshot(*, prefill=(), decode=(), ttft: float | None = None, ttft_n: int = 100, itl: float | None = None,
             itl_n: int = 1000, routes: dict | None = None, router: bool = True, t0: float = 0.0) -> Snapshot:
    """Two rounds `WINDOW` apart; in the window the router saw ttft_n first tokens at `ttft`, etc."""
    rounds = []
    for at in (0.0, WINDOW):
        pods = []
        if router:
            r = RouterReading(ttft=hist(TTFT_BOUNDS, ttft if at else None, ttft_n),
                              itl=hist(ITL_BOUNDS, itl if at else None, itl_n), in_flight=0.0, requests=0.0,
                              routes={k: v * at for k, v in (routes or {}).items()})
            pods.append(PodScrape("router-0", "router", True, r))
        else:
            pods.append(PodScrape("router-0", "router", True, None, "connection refused"))
        for role, ps in (("prefill", prefill), ("decode", decode)):
            for p in ps:
                reading = _reading(p, at) if p["readable"] else None
                pods.append(PodScrape(p["name"], role, p["ready"], reading, None if reading else "timed out"))
        rounds.append(ScrapeRound(t0 + at, tuple(pods)))
    w = MetricsWindow(WINDOW)
    for r in rounds:
        w = w.add(r)
    return w.snapshot()


def pods(role: str, n: int, **kw) -> list[dict]:
    return [worker(f"{role}-{i}", **kw) for i in range(n)]


# (id, snapshot, current {prefill, decode}, expected {role: (desired, reason)}).
# Percentiles are read from the router's buckets: first tokens all at 3 s sit in (2 s, 5 s], where
# histogram_quantile puts p90 at 4.7 s (2.35x the target). A window over the TTFT target moves
# prefill by at most 25%; prompts arriving faster than the pods process them move it by the deficit.
CASES = [
    ("prompt-load-rising-scales-prefill-only",
     snapshot(prefill=pods("p", 2, busy=0.95, prompt_rate=280), decode=pods("d", 2, running=4, kv=0.3),
              ttft=3.0, itl=0.08),
     {"prefill": 2, "decode": 2},
     {"prefill": (3, Reason.TTFT_ABOVE_TARGET), "decode": (2, Reason.WITHIN_TARGET)}),
    ("ttft-far-above-moves-a-quarter-a-window",
     snapshot(prefill=pods("p", 2, busy=0.95, prompt_rate=280), decode=pods("d", 2, running=4, kv=0.3),
              ttft=6.0, itl=0.08),
     {"prefill": 2, "decode": 2},
     {"prefill": (3, Reason.TTFT_ABOVE_TARGET)}),
    ("prompts-outrunning-prefill-scale-it-by-the-deficit",  # 1200 tokens/s arrive, 560 are done
     snapshot(prefill=pods("p", 2, busy=1.0, prompt_rate=600, done=280), decode=pods("d", 2, running=4),
              ttft=6.0, itl=0.08),
     {"prefill": 2, "decode": 2},
     {"prefill": (6, Reason.PREFILL_BUSY)}),
    ("busy-prefill-scales-before-ttft-suffers",
     snapshot(prefill=pods("p", 2, busy=0.98, prompt_rate=280), decode=pods("d", 2, running=4, kv=0.3),
              ttft=1.9, itl=0.09),
     {"prefill": 2, "decode": 2},
     {"prefill": (3, Reason.PREFILL_BUSY), "decode": (2, Reason.WITHIN_TARGET)}),
    ("prompt-backlog-scales-prefill",
     snapshot(prefill=pods("p", 2, busy=0.9, prompt_rate=300, outstanding=1000), decode=pods("d", 2, running=2),
              ttft=1.9, itl=0.09),
     {"prefill": 2, "decode": 2},
     {"prefill": (6, Reason.PROMPT_BACKLOG), "decode": (2, Reason.WITHIN_TARGET)}),
    # gaps at 300 ms: p90 read in (200 ms, 500 ms], surely 2x the target: a pod holds 10 / 2
    ("concurrency-rising-scales-decode-only",
     snapshot(prefill=pods("p", 2, busy=0.5, prompt_rate=150), decode=pods("d", 2, running=10, kv=0.5),
              ttft=1.5, itl=0.3),
     {"prefill": 2, "decode": 2},
     {"prefill": (2, Reason.WITHIN_TARGET), "decode": (4, Reason.ITL_ABOVE_TARGET)}),
    # gaps at 150 ms: p90 read as 190 ms but only surely above 100 ms: seats cut by 1.25, not 1.9
    ("slightly-above-target-is-a-gentle-step",
     snapshot(prefill=pods("p", 2, busy=0.5, prompt_rate=150), decode=pods("d", 4, running=10, kv=0.5),
              ttft=1.5, itl=0.15),
     {"prefill": 2, "decode": 4},
     {"decode": (5, Reason.ITL_ABOVE_TARGET)}),
    ("kv-saturation-scales-decode",
     snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150), decode=pods("d", 4, running=8, kv=0.96),
              ttft=1.5, itl=0.1),
     {"prefill": 1, "decode": 4},
     {"prefill": (1, Reason.WITHIN_TARGET), "decode": (5, Reason.KV_SATURATED)}),
    ("queued-sequences-scale-decode",
     snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150), decode=pods("d", 2, running=8, waiting=4),
              ttft=1.5, itl=0.1),
     {"prefill": 1, "decode": 2},
     {"prefill": (1, Reason.WITHIN_TARGET), "decode": (3, Reason.QUEUE_BUILDING)}),
    ("step-limit-caps-a-big-jump",
     snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150), decode=pods("d", 2, running=20),
              ttft=1.5, itl=2.0),
     {"prefill": 1, "decode": 2},
     {"decode": (6, Reason.ITL_ABOVE_TARGET)}),
    ("max-holds",
     snapshot(prefill=pods("p", 10, busy=1.0, prompt_rate=300), decode=pods("d", 10, running=30),
              ttft=9.0, itl=0.5),
     {"prefill": 10, "decode": 10},
     {"prefill": (10, Reason.AT_MAX), "decode": (10, Reason.AT_MAX)}),
    ("min-holds-decode-at-one",
     snapshot(prefill=[], decode=pods("d", 1)),
     {"prefill": 0, "decode": 1},
     {"prefill": (0, Reason.IDLE), "decode": (1, Reason.AT_MIN)}),
    ("ttft-high-with-idle-prefill-is-not-a-reason-to-scale",
     snapshot(prefill=pods("p", 2, busy=0.2, prompt_rate=60), decode=pods("d", 2, running=2),
              ttft=4.0, itl=0.05),
     {"prefill": 2, "decode": 2},
     {"prefill": (2, Reason.TARGET_UNREACHABLE)}),
    ("prefill-from-zero-when-decode-prefills-and-ttft-suffers",
     snapshot(prefill=[], decode=pods("d", 2, running=3, prompt_rate=400), ttft=5.0, itl=0.09,
              routes={"no_prefill_worker": 1.0}),
     {"prefill": 0, "decode": 2},
     {"prefill": (1, Reason.TTFT_ABOVE_TARGET), "decode": (2, Reason.WITHIN_TARGET)}),
    ("prefill-stays-at-zero-while-ttft-is-fine",
     snapshot(prefill=[], decode=pods("d", 2, running=3, prompt_rate=100), ttft=0.5, itl=0.05,
              routes={"no_prefill_worker": 0.5}),
     {"prefill": 0, "decode": 2},
     {"prefill": (0, Reason.IDLE)}),
    ("outside-limits-is-corrected-at-once",
     snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150), decode=pods("d", 1, running=1), ttft=1.0, itl=0.05),
     {"prefill": 14, "decode": 0},
     {"prefill": (10, Reason.OUTSIDE_LIMITS), "decode": (1, Reason.OUTSIDE_LIMITS)}),
    ("router-unreadable-holds-both",
     snapshot(prefill=pods("p", 2, busy=0.99, prompt_rate=300), decode=pods("d", 2, running=9), router=False),
     {"prefill": 2, "decode": 2},
     {"prefill": (2, Reason.METRICS_UNAVAILABLE), "decode": (2, Reason.METRICS_UNAVAILABLE)}),
    ("most-decode-pods-unreadable-holds-decode",
     snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150),
              decode=[worker("d-0", running=9), worker("d-1", readable=False), worker("d-2", readable=False)],
              ttft=1.0, itl=0.5),
     {"prefill": 1, "decode": 3},
     {"decode": (3, Reason.METRICS_UNAVAILABLE)}),
]


@pytest.mark.parametrize(("case", "snap", "current", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decision_table(case, snap, current, expected):
    decision, _ = plan(snap, current, SPEC, PlannerState(), now=snap.time)
    for role, (desired, reason) in expected.items():
        d = decision.roles[role]
        assert (d.desired, d.reason) == (desired, reason), f"{role}: {d.message}"
        assert d.message, "every decision explains itself"


def _round_at(at: float, prefill_names: tuple[str, ...]) -> ScrapeRound:
    """Busy prefill pods, two decode pods, first tokens at 4 s (2x the target) within the window."""
    out = [PodScrape("router-0", "router", True, RouterReading(
        ttft=hist(TTFT_BOUNDS, 4.0 if at else None, 100), itl=hist(ITL_BOUNDS, 0.08 if at else None, 1000),
        in_flight=0.0, requests=0.0))]
    out += [PodScrape(n, "prefill", True, _reading(worker(n, busy=0.7, prompt_rate=200), at)) for n in prefill_names]
    out += [PodScrape(p["name"], "decode", True, _reading(p, at)) for p in pods("d", 2, running=4)]
    return ScrapeRound(at, tuple(out))


def test_latency_from_before_new_pods_served_does_not_wind_up():
    """A pod that came up within the window (no reading at its start) is not in that window's
    latencies: TTFT over target then asks for no more prefill pods on top of it."""
    def decide(first: tuple[str, ...]):
        w = MetricsWindow(WINDOW).add(_round_at(0.0, first)).add(_round_at(WINDOW, ("p-0", "p-1")))
        decision, _ = plan(w.snapshot(), {"prefill": 2, "decode": 2}, SPEC, PlannerState(), now=WINDOW)
        return decision.roles["prefill"]

    assert decide(("p-0", "p-1")).desired == 3, "both served the whole window: TTFT moves prefill up"
    d = decide(("p-0",))
    assert d.desired == 2 and "1 new prefill pods are not in this window yet" in d.message


def test_the_table_covers_every_scale_up_reason():
    reasons = {r for _, _, _, exp in CASES for _, r in exp.values()}
    assert {Reason.TTFT_ABOVE_TARGET, Reason.ITL_ABOVE_TARGET, Reason.PREFILL_BUSY, Reason.PROMPT_BACKLOG,
            Reason.KV_SATURATED, Reason.QUEUE_BUILDING} <= reasons


def test_missing_metrics_say_what_is_missing_in_the_condition():
    snap = snapshot(prefill=pods("p", 2), decode=pods("d", 2), router=False)
    decision, _ = plan(snap, {"prefill": 2, "decode": 2}, SPEC, PlannerState(), now=snap.time)
    c = decision.condition
    assert (c["type"], c["status"], c["reason"]) == ("Autoscaling", "False", "MetricsUnavailable")
    assert "no router could be read" in c["message"]
    assert "holding 2 decode replicas" in decision.roles["decode"].message


def test_first_round_only_collects():
    w = MetricsWindow(WINDOW).add(ScrapeRound(0.0, (PodScrape("d-0", "decode", True, _reading(worker("d"), 0)),)))
    decision, _ = plan(w.snapshot(), {"prefill": 1, "decode": 3}, SPEC, PlannerState(), now=0.0)
    assert decision.condition["status"] == "Unknown" and decision.condition["reason"] == "CollectingMetrics"
    assert {r: d.desired for r, d in decision.roles.items()} == {"prefill": 1, "decode": 3}


def test_limits_show_in_the_condition():
    snap = snapshot(prefill=pods("p", 10, busy=1.0, prompt_rate=300), decode=pods("d", 3, running=3),
                    ttft=9.0, itl=0.1)
    decision, _ = plan(snap, {"prefill": 10, "decode": 3}, SPEC, PlannerState(), now=snap.time)
    c = decision.condition
    assert (c["status"], c["reason"]) == ("True", "LimitedByMax")
    assert "maxReplicas 10" in c["message"]


def _run(states: list[dict], current: dict, spec: AutoscalingSpec = SPEC, interval: float = 15.0,
         state: PlannerState | None = None):
    """Feeds one snapshot per interval; returns every decision (replicas follow what it decides)."""
    state, out = state or PlannerState(), []
    for i, kw in enumerate(states):
        snap = snapshot(t0=i * interval, **kw)
        decision, state = plan(snap, current, spec, state, now=snap.time)
        current = {r: d.desired for r, d in decision.roles.items()}
        out.append(decision)
    return out


def _decode_load(itl, per_pod: float = 6, n: int = 4) -> dict:
    return dict(prefill=pods("p", 1, busy=0.5, prompt_rate=150), decode=pods("d", n, running=per_pod, kv=0.4),
                ttft=1.0, itl=itl)


def test_noise_around_the_target_does_not_flap():
    # 1000 gaps a window, 89-95% of them within the 100 ms target (in the (60 ms, 100 ms] bucket),
    # the rest in (100 ms, 200 ms]: p90 is read between 98 ms and 109 ms, inside the 10% tolerance;
    # concurrency moves by a sequence or so per pod.
    shares = [0.93, 0.89, 0.95, 0.9, 0.91, 0.89, 0.94] * 6
    per_pod = [6, 6.5, 5.5, 6, 6.4, 5.7, 6.2] * 6
    noisy = [_decode_load([(0.08, round(1000 * f)), (0.15, 1000 - round(1000 * f))], c)
             for f, c in zip(shares, per_pod, strict=True)]
    decisions = _run(noisy, {"prefill": 1, "decode": 4})
    assert {d.roles["decode"].desired for d in decisions} == {4}
    assert {d.roles["prefill"].desired for d in decisions} == {1}


def test_a_short_dip_does_not_scale_down_but_a_lasting_drop_does_after_the_window():
    # At target with 6 sequences a pod (known: once over target at 7.5); then 2 a pod, ITL well under.
    high, low = _decode_load(0.09, 6), _decode_load(0.03, 2)
    known = PlannerState(decode_seats=Seats(6.0, bounded=True))
    dip = _run([high] * 4 + [low] * 2 + [high] * 4, {"prefill": 1, "decode": 4}, state=known)
    assert {d.roles["decode"].desired for d in dip} == {4}
    assert dip[4].roles["decode"].reason is Reason.STABILIZING

    drop = _run([high] * 4 + [low] * 30, {"prefill": 1, "decode": 4}, state=known)
    desired = [d.roles["decode"].desired for d in drop]
    first_down = next(i for i, n in enumerate(desired) if n < 4)
    # 300 s down window at 15 s per decision: the first lower recommendation came at index 4
    assert first_down * 15.0 >= 4 * 15.0 + 300.0
    assert all(b >= a - 1 for a, b in zip(desired, desired[1:], strict=False)), "one pod per step"
    assert desired[-1] < 4
    assert drop[first_down].roles["decode"].remove, "a scale-down names the pods to remove"


def test_a_spike_is_followed_at_once_with_no_up_window():
    # 6 a pod at target, then 300 ms gaps (surely 2x over): a pod holds 3, 24 sequences need 8
    decisions = _run([_decode_load(0.09)] * 2 + [_decode_load(0.3)], {"prefill": 1, "decode": 4})
    assert decisions[-1].roles["decode"].desired == 8


def test_up_window_waits_for_a_sustained_rise():
    spec = AutoscalingSpec.from_dict({"decode": {"maxReplicas": 20, "scaleUp": {"stabilizationWindowSeconds": 30}}})
    decisions = _run([_decode_load(0.09)] * 2 + [_decode_load(0.3)] * 4, {"decode": 4}, spec=spec)
    desired = [d.roles["decode"].desired for d in decisions]
    assert desired[2] == 4 and decisions[2].roles["decode"].reason is Reason.STABILIZING
    assert desired[-1] > 4


def test_decode_learns_what_a_pod_holds_and_sizes_on_concurrency():
    """Over target at 16 a pod, on target at 12: it settles on 12 a pod and sizes 48 sequences at 4 pods."""
    over = _decode_load(0.3, 16)
    decisions = _run([over, _decode_load(0.09, 12, n=8)], {"prefill": 1, "decode": 4})
    assert decisions[0].roles["decode"].desired == 8  # 64 sequences at 8 a pod
    state = PlannerState()
    for i, kw in enumerate([over, _decode_load(0.09, 12, n=8)]):
        snap = snapshot(t0=i * 15.0, **kw)
        _, state = plan(snap, {"prefill": 1, "decode": 4 if i == 0 else 8}, SPEC, state, now=snap.time)
    assert state.decode_seats == Seats(12.0, bounded=True)


def test_idle_prefill_goes_to_zero_after_the_down_window():
    idle = dict(prefill=pods("p", 2), decode=pods("d", 1, running=1), ttft=0.3, itl=0.05)
    busy = dict(prefill=pods("p", 2, busy=0.7, prompt_rate=200), decode=pods("d", 1, running=1), ttft=1.5, itl=0.05)
    decisions = _run([busy] + [idle] * 30, {"prefill": 2, "decode": 1})
    desired = [d.roles["prefill"].desired for d in decisions]
    assert desired[-1] == 0 and decisions[-1].roles["prefill"].reason is Reason.IDLE
    assert min(i for i, n in enumerate(desired) if n < 2) * 15.0 >= 300.0


def test_scale_down_removes_not_ready_pods_then_the_least_busy():
    snap = snapshot(prefill=pods("p", 1, busy=0.5, prompt_rate=150),
                    decode=[worker("d-a", running=5), worker("d-b", running=1), worker("d-c", running=2),
                            worker("d-d", running=0), worker("d-e", ready=False)],
                    ttft=1.0, itl=0.02)
    spec = AutoscalingSpec.from_dict({"decode": {"maxReplicas": 10, "scaleDown": {
        "stabilizationWindowSeconds": 0, "maxStep": 3}}})
    known = PlannerState(decode_seats=Seats(6.0, bounded=True))
    decision, _ = plan(snap, {"decode": 5}, spec, known, now=snap.time)
    d = decision.roles["decode"]
    assert d.desired == 2 and d.reason is Reason.LOAD_DROPPED
    assert d.remove == ("d-e", "d-d", "d-b")


def test_external_mode_leaves_replicas_alone():
    spec = AutoscalingSpec.from_dict({"decode": {"mode": "External"}})
    snap = snapshot(prefill=pods("p", 1), decode=pods("d", 2, running=30), ttft=1.0, itl=1.0)
    decision, _ = plan(snap, {"prefill": 1, "decode": 2}, spec, PlannerState(), now=snap.time)
    d = decision.roles["decode"]
    assert (d.desired, d.reason, d.owned) == (2, Reason.EXTERNAL, False)
    assert "prefill" not in decision.roles, "a role left out of spec.autoscaling is not planned"
    assert decision.condition["reason"] == "External"


def test_state_is_small_and_forgets_old_recommendations():
    decisions_state = PlannerState()
    for i in range(200):
        snap = snapshot(t0=i * 15.0, **_decode_load(0.09))
        _, decisions_state = plan(snap, {"prefill": 1, "decode": 4}, SPEC, decisions_state, now=snap.time)
    # 300 s down window at 15 s: at most 21 entries per role
    assert all(len(h) <= 21 for h in decisions_state.history.values())
    assert math.isclose(decisions_state.prefill_tokens_per_busy_s, 300.0)
