"""`tandem plan`'s recommendation (pure): the smallest fleet the simulator finds within both targets,
which layout, which chunk size, and a clear answer when no fleet can meet the targets."""

from __future__ import annotations

import dataclasses

import pytest
from tandem.planning.capacity import Capacity
from tandem.planning.predict import Layout, predict
from tandem.planning.recommend import chunk_within, recommend, typical_batch
from tandem.planning.workload import Workload

CAP = Capacity(prefill_overhead_s=0.0, prefill_tokens_per_s=1000.0, decode_batches=(1, 8, 32),
               decode_step_s=(0.01, 0.02, 0.05), max_seqs=32)
QUICK = 600  # simulated requests per candidate fleet


def workload(rate: float, prompt="200-600", output=50, ttft=1.0, itl=0.05, itl_percentile=90) -> Workload:
    return Workload.from_dict({"rate": rate, "prompt": prompt, "output": output, "targets": {
        "ttft": {"seconds": ttft}, "itl": {"seconds": itl, "percentile": itl_percentile}}})


def test_the_recommended_fleet_meets_the_targets_and_one_worker_fewer_does_not():
    wl = workload(4.0)
    plan = recommend(CAP, wl, layouts=(Layout.DISAGGREGATED,), requests=QUICK)
    fleet, goal = plan.chosen.fleet, wl.within(0.9)
    assert plan.chosen.problem is None and fleet.layout is Layout.DISAGGREGATED
    assert not any(plan.chosen.prediction.misses(goal))
    # 4 prompts/s of 400 tokens at 1,000 tokens/s: 1.6 busy workers, so at least 2
    assert fleet.prefill >= 2
    fewer = [dataclasses.replace(fleet, prefill=fleet.prefill - 1)]
    if fleet.decode > 1:
        fewer.append(dataclasses.replace(fleet, decode=fleet.decode - 1))
    for smaller in fewer:
        assert any(predict(CAP, goal, smaller, requests=QUICK).misses(goal)), f"{smaller} would have done"


def test_more_load_needs_more_workers_but_less_than_in_proportion():
    small = recommend(CAP, workload(4.0), layouts=(Layout.DISAGGREGATED,), requests=QUICK).chosen.fleet
    big = recommend(CAP, workload(8.0), layouts=(Layout.DISAGGREGATED,), requests=QUICK).chosen.fleet
    # 8 prompts/s of 400 tokens are 3.2 busy workers; a larger pool absorbs bursts better (pooling)
    assert 4 <= big.prefill <= 2 * small.prefill
    assert big.decode >= small.decode


def test_a_prompt_longer_than_the_ttft_target_allows_is_answered_plainly():
    plan = recommend(CAP, workload(1.0, prompt=3000, ttft=1.0), requests=QUICK)
    assert plan.chosen.fleet is None and plan.others == ()
    assert "3000 tokens" in plan.why and "more workers cannot help" in plan.why


def test_a_light_load_with_a_loose_itl_target_runs_colocated_on_one_worker():
    plan = recommend(CAP, workload(0.2, prompt="100-200", output=32, itl=0.2), requests=QUICK)
    fleet = plan.chosen.fleet
    assert (fleet.layout, fleet.prefill, fleet.decode) == (Layout.COLOCATED, 0, 1)
    assert fleet.decode_chunk and fleet.decode_chunk % 16 == 0
    assert CAP.chunk_step_s(1, fleet.decode_chunk) <= 0.2 * 0.9, "a step with a chunk fits the ITL target"
    other = plan.others[0]
    assert other.fleet.layout is Layout.DISAGGREGATED and other.fleet.workers == 2


def test_an_itl_target_no_chunk_step_fits_needs_separate_prefill_workers():
    # one sequence's step is 10 ms; a step with even 16 prompt tokens takes 26 ms. Answers of 200
    # tokens: the first gap after each handoff (10 + 1.5 x 10 ms) is one gap in 199, under the p99
    plan = recommend(CAP, workload(0.5, output=200, itl=0.02, itl_percentile=99), requests=QUICK)
    assert plan.chosen.fleet.layout is Layout.DISAGGREGATED and plan.chosen.problem is None
    colocated = next(s for s in plan.others if s.layout is Layout.COLOCATED)
    assert colocated.fleet is None and "only separate prefill workers" in colocated.problem


def test_short_answers_put_the_first_gap_after_a_handoff_into_the_p99():
    # answers of 50 tokens: one gap in 49 is a handoff's first (25 ms), over a 20 ms p99 at any size
    plan = recommend(CAP, workload(0.5, itl=0.02, itl_percentile=99), requests=QUICK)
    assert plan.chosen.fleet is not None and plan.chosen.fleet.layout is Layout.DISAGGREGATED
    assert plan.chosen.problem is not None and "misses ITL p99" in plan.chosen.problem
    assert plan.chosen.prediction.itl_q == pytest.approx(0.025, rel=0.1)


def test_decode_chunks_for_the_prompts_it_prefills_stay_within_two_ordinary_steps():
    assert chunk_within(CAP, 1, 0.05, 16) == 32  # (50 - 10 ms) at 1,000 tokens/s: 40 tokens, in blocks of 16
    assert chunk_within(CAP, 1, 0.02, 16) == 0
    wl = workload(4.0)
    fleet = recommend(CAP, wl, layouts=(Layout.DISAGGREGATED,), requests=QUICK).chosen.fleet
    n = typical_batch(CAP, wl, fleet.decode)
    assert fleet.decode_chunk >= 16
    assert CAP.chunk_step_s(n, fleet.decode_chunk) <= 2 * CAP.step_s(n) or fleet.decode_chunk == 16


@pytest.mark.parametrize("n", [1, 8, 20, 32])
def test_a_chunk_step_costs_the_decode_step_plus_the_chunk(n):
    assert CAP.chunk_step_s(n, 100) == pytest.approx(CAP.step_s(n) + 0.1)
    assert CAP.chunk_step_s(0, 100) == pytest.approx(0.1)
