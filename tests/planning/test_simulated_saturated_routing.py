"""The simulator routes as the router does when the prefill pool is saturated: a prompt that finds
every prefill replica with at least `prefill_saturated_tokens` outstanding goes to a decode replica
with headroom, which prefills it itself (route `prefill_saturated`). Before, the simulator queued
every prompt behind prefill, so `tandem plan` predicted TTFTs 5-10x what a measured run showed."""

from __future__ import annotations

import pytest
from tandem.planning.capacity import Capacity
from tandem.planning.simulation import Simulation
from tandem.planning.workload import Request

CAP = Capacity(prefill_overhead_s=0.0, prefill_tokens_per_s=1000.0, decode_batches=(1, 2, 4),
               decode_step_s=(0.02, 0.03, 0.05), max_seqs=4, handoff_s=0.01)
BOUNDS = (*(0.001 * 1.05 ** i for i in range(200)), float("inf"))


def run(saturated_tokens: int, headroom: int = 16) -> Simulation:
    # Four 1,000-token prompts at once on one prefill replica (1 s each) and one idle decode replica.
    trace = [Request(i, 0.0, 1000, 2, "chat") for i in range(4)]
    return Simulation(CAP, iter(trace), lambda s, now: {}, {"prefill": 1, "decode": 1}, interval_s=60.0,
                      day_s=60.0, ttft_slo=1.0, tpot_slo=1.0, ttft_bounds=BOUNDS, itl_bounds=BOUNDS,
                      decode_chunk_tokens=250, prefill_saturated_tokens=saturated_tokens,
                      decode_headroom_sequences=headroom).run()


def test_prompts_past_the_saturation_point_are_prefilled_on_decode():
    s = run(saturated_tokens=2000)
    # 1,000 and 2,000 tokens outstanding are below 2,000 and at it: the first two go to prefill; the
    # third finds 2,000 queued there and the decode replica with none: decode prefills it; the fourth
    # finds decode with 1,000 of its own, fewer than prefill's 2,000: decode again.
    assert s.routes == {"disaggregated": 2, "no_prefill_worker": 0, "prefill_saturated": 2}
    # Prefill: 1 s and 2 s. Decode, 250 tokens a step (0.25 s): the third at 1 s, the fourth at 2 s
    # and the few ms of the step that carries the third's last token beside its chunk.
    ttft = sorted(s.outcomes.ttft)
    assert ttft[:3] == pytest.approx([1.0, 1.0, 2.0], abs=1e-6)
    assert 2.0 < ttft[3] < 2.05


def test_without_the_rule_every_prompt_queues_behind_prefill():
    s = run(saturated_tokens=0)
    assert s.routes == {"disaggregated": 4, "no_prefill_worker": 0, "prefill_saturated": 0}
    assert sorted(s.outcomes.ttft) == pytest.approx([1.0, 2.0, 3.0, 4.0], abs=1e-6)


def test_a_decode_replica_without_headroom_leaves_the_prompt_to_prefill():
    s = run(saturated_tokens=2000, headroom=1)
    # The third prompt takes the decode replica's one seat; the fourth finds it full.
    assert s.routes == {"disaggregated": 3, "no_prefill_worker": 0, "prefill_saturated": 1}
