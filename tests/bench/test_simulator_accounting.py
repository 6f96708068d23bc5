"""The autoscaling simulator's accounting: replica-seconds, tokens, latencies and no lost request.

Small hand-made traces whose answers can be worked out by hand; the day-long runs live in bench/.
"""

from __future__ import annotations

import math

import pytest
from tandem.planning.capacity import Capacity
from tandem.planning.planner_loop import PlannerPolicy
from tandem.planning.simulation import Simulation

from bench.simulator.policies import FixedPolicy, size_for_peak
from bench.simulator.replay import planner_spec, router_bounds
from bench.simulator.trace import Request, day, load_shape

CAP = Capacity(prefill_overhead_s=0.0, prefill_tokens_per_s=1000.0, decode_batches=(1, 2, 4, 8),
               decode_step_s=(0.02, 0.03, 0.05, 0.09), max_seqs=8, handoff_s=0.01, migrate_s=0.02, startup_s=30.0)


def sim(trace, decide, initial, day_s: float, cap: Capacity = CAP, **kw) -> Simulation:
    ttft_b, itl_b = router_bounds()
    return Simulation(cap, iter(trace), decide, initial, interval_s=15.0, day_s=day_s, ttft_slo=3.0,
                      tpot_slo=0.1, ttft_bounds=ttft_b, itl_bounds=itl_b, **kw).run()


def steady(every_s: float, until_s: float, prompt: int = 500, output: int = 50) -> list[Request]:
    return [Request(i, i * every_s, prompt, output, "chat") for i in range(int(until_s / every_s))]


def test_constant_load_on_a_fixed_fleet_costs_replicas_times_the_day():
    s = sim(steady(2.0, 600.0), FixedPolicy(), {"prefill": 2, "decode": 3}, day_s=600.0)
    assert s.replica_seconds == {"prefill": 1200.0, "decode": 1800.0}
    assert s.finished == 300 and s.in_flight == 0, "every request finishes, none is lost"
    assert len(s.outcomes.ttft) == 300


def test_one_request_alone_takes_its_prefill_then_one_step_per_token():
    s = sim([Request(0, 1.0, 500, 11, "chat")], FixedPolicy(), {"prefill": 1, "decode": 1}, day_s=60.0)
    assert math.isclose(s.outcomes.ttft[0], 0.5)  # 500 tokens at 1000 tokens/s
    # 10 more tokens: the first gap is the handoff (10 ms), half a step's wait and a step (30 ms),
    # then 9 steps of 20 ms: (0.01 + 0.03 + 9 * 0.02) / 10
    assert math.isclose(s.outcomes.tpot[0], 0.022)
    d = next(iter(s.replicas["decode"].values()))
    p = next(iter(s.replicas["prefill"].values()))
    assert math.isclose(d.gen_tokens, 10) and p.gen_tokens == 1
    assert p.prompt_tokens == 500 and d.prompt_tokens == 500, "decode admits the pulled prompt too"
    assert s.ttft_hist.frozen().count == 1 and math.isclose(s.itl_hist.frozen().count, 10)


def test_batched_sequences_share_the_step_time():
    trace = [Request(i, 1.0, 100, 101, "chat") for i in range(4)]
    s = sim(trace, FixedPolicy(), {"prefill": 4, "decode": 1}, day_s=60.0)
    # prefilled side by side, the four join together: after the handoff each one's first step (as if
    # alone: 1.5 x 20 ms), then 99 steps of 50 ms with 4 running
    assert list(s.outcomes.tpot) == pytest.approx([(0.01 + 0.03 + 99 * 0.05) / 100] * 4)
    d = next(iter(s.replicas["decode"].values()))
    assert d.steps == pytest.approx(99) and d.step_tokens == pytest.approx(400)


def test_without_prefill_replicas_decode_prefills_and_its_streams_stall():
    trace = [Request(0, 0.0, 100, 200, "chat"), Request(1, 1.0, 2000, 2, "chat")]
    s = sim(trace, FixedPolicy(), {"prefill": 0, "decode": 1}, day_s=60.0)
    assert s.routes == {"disaggregated": 0.0, "no_prefill_worker": 2.0, "prefill_saturated": 0.0}
    first_tpot = s.outcomes.tpot[1]  # the 200-token answer finishes last
    assert first_tpot > 0.02 + 2.0 / 199, "the 2 s prefill of the second prompt sits in its stream"


class ScaleTo:
    """A policy that asks for fixed sizes from a given time on."""

    def __init__(self, at: float, sizes: dict[str, int]):
        self.at, self.sizes = at, sizes

    def __call__(self, sim, now):
        return {r: (n, ()) for r, n in self.sizes.items()} if now >= self.at else {}


def test_new_replicas_cost_from_provisioning_and_serve_after_start_up():
    s = sim(steady(1.0, 300.0), ScaleTo(0.0, {"decode": 3}), {"prefill": 1, "decode": 1}, day_s=300.0)
    # two decode replicas provisioned at t=0: all three are paid for the whole 300 s
    assert s.replica_seconds["decode"] == pytest.approx(900.0)
    ready = {t: d for t, _, _, _, d in s.timeline}
    assert ready[15.0] == 1 and ready[30.0] == 3, "ready 30 s (startup_s) after provisioning"


def test_removed_decode_replicas_hand_their_streams_over_and_nothing_is_lost():
    trace = steady(0.5, 120.0, prompt=100, output=400)  # long answers: many streams run at 60 s
    s = sim(trace, ScaleTo(60.0, {"decode": 1}), {"prefill": 2, "decode": 4}, day_s=120.0)
    assert s.finished == len(trace) and s.in_flight == 0
    assert len(s.replicas["decode"]) == 1
    # 4 replicas for 60 s, then 1
    assert s.replica_seconds["decode"] == pytest.approx(4 * 60.0 + 1 * 60.0)
    generated = sum(r.gen_tokens for role in ("prefill", "decode") for r in s.replicas[role].values())
    assert generated <= sum(r.output for r in trace), "a moved stream does not restart its answer"


def test_removed_prefill_replicas_drain_their_queue_first():
    trace = [Request(i, 14.0 + i * 0.01, 4000, 2, "chat") for i in range(6)]  # 4 s each, queued
    # (the router's load-aware rule off: with it, the decode replica would take the last prompts)
    s = sim(trace, ScaleTo(15.0, {"prefill": 1}), {"prefill": 3, "decode": 1}, day_s=60.0, prefill_saturated_tokens=0)
    assert s.finished == 6
    # two replicas leave at 15 s only once their queues (two 4 s prompts each, from 14 s) are done
    assert s.replica_seconds["prefill"] == pytest.approx(60.0 + 2 * 22.0, abs=0.1)


def test_the_planner_runs_on_the_readings_a_simulated_fleet_exports():
    fleet = size_for_peak(CAP, 4.0, 0.1)
    policy = PlannerPolicy(planner_spec(fleet, 3.0, 0.1, prefill_min=0))
    s = sim(day(4.0, day_s=3600.0, seed=1), policy, {"prefill": 1, "decode": 1}, day_s=3600.0)
    assert s.in_flight == 0 and s.finished == len(s.outcomes.ttft)
    biggest = max(d for _, _, d, _, _ in s.timeline)
    assert biggest > 1, "the day's peak made it scale decode up"
    assert policy.state.decode_seats is not None, "it learned what a decode pod holds"
    assert {role for role, _ in policy.reasons} == {"prefill", "decode"}


def test_the_day_has_its_shape_and_is_reproducible():
    a, b = list(day(2.0, day_s=86400.0, seed=3)), list(day(2.0, day_s=86400.0, seed=3))
    assert a == b
    expected = sum(2.0 * load_shape(m / 60.0) * 60.0 for m in range(24 * 60))
    assert abs(len(a) - expected) < 4 * math.sqrt(expected), "Poisson count around the shape's integral"
    by_kind = {k: [r for r in a if r.kind == k] for k in ("chat", "document", "long-answer")}
    assert min(r.prompt for r in by_kind["document"]) >= 512 and min(r.output for r in by_kind["long-answer"]) >= 256
