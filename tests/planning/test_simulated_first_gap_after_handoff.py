"""A disaggregated request's first gap on its decode replica is the KV handoff, the wait for the
step under way (half a step on average) and its own first step: longer than an ordinary gap, which
is what sets a disaggregated fleet's ITL tail at low load (bench plan_check)."""

from __future__ import annotations

import pytest
from tandem.planning.capacity import Capacity
from tandem.planning.simulation import Simulation
from tandem.planning.workload import Request

CAP = Capacity(prefill_overhead_s=0.0, prefill_tokens_per_s=1000.0, decode_batches=(1, 2, 4),
               decode_step_s=(0.02, 0.03, 0.05), max_seqs=4, handoff_s=0.01)
BOUNDS = (*(0.001 * 1.05 ** i for i in range(200)), float("inf"))


def run(fleet: dict[str, int]) -> Simulation:
    # A long answer decoding alone; one second later a second request, three tokens long.
    trace = [Request(0, 0.0, 100, 200, "chat"), Request(1, 1.0, 100, 3, "chat")]
    return Simulation(CAP, iter(trace), lambda s, now: {}, fleet, interval_s=60.0, day_s=60.0,
                      ttft_slo=1.0, tpot_slo=1.0, ttft_bounds=BOUNDS, itl_bounds=BOUNDS,
                      decode_chunk_tokens=50).run()


def test_each_handed_off_request_has_one_first_gap_of_handoff_and_a_step_and_a_half():
    gaps = run({"prefill": 1, "decode": 1}).itl_hist.frozen()
    # the first request's first gap 10 + 1.5 x 20 ms = 40 ms; the second's beside the first 10 + 1.5 x 30 = 55 ms
    n = gaps.count
    assert gaps.quantile(1.0 - 0.5 / n) == pytest.approx(0.055, rel=0.05)
    assert gaps.quantile(1.0 - 1.5 / n) == pytest.approx(0.040, rel=0.05)
    assert gaps.quantile(1.0 - 2.5 / n) <= 0.031, "every other gap is an ordinary step (20 or 30 ms)"


def test_a_colocated_fleet_has_no_handoff_gap():
    gaps = run({"prefill": 0, "decode": 1}).itl_hist.frozen()
    # no handoff: the longest gaps are the steps that carry the second prompt's chunks (30 + 50 ms)
    assert gaps.quantile(1.0) < 0.085
    assert gaps.quantile(1.0 - 3.5 / gaps.count) < 0.035, "two 50-token chunks, then ordinary steps"
