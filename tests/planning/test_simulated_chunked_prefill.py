"""A decode worker that prefills a prompt itself in chunks (colocated, or no prefill worker ready):
its streams keep advancing, one token per step, each such step costing the decode step plus the
chunk; without a chunk size the streams wait out the whole prompt, as before."""

from __future__ import annotations

import pytest
from tandem.planning.capacity import Capacity
from tandem.planning.simulation import Simulation
from tandem.planning.workload import Request

CAP = Capacity(prefill_overhead_s=0.0, prefill_tokens_per_s=1000.0, decode_batches=(1, 2, 4),
               decode_step_s=(0.02, 0.03, 0.05), max_seqs=4, handoff_s=0.01)
BOUNDS = (*(0.001 * 1.05 ** i for i in range(200)), float("inf"))


def run(chunk: int | None) -> Simulation:
    # A long answer starts alone; one second later a 200-token prompt arrives at the same worker.
    trace = [Request(0, 0.0, 100, 200, "chat"), Request(1, 1.0, 200, 2, "chat")]
    return Simulation(CAP, iter(trace), lambda s, now: {}, {"prefill": 0, "decode": 1}, interval_s=60.0,
                      day_s=60.0, ttft_slo=1.0, tpot_slo=1.0, ttft_bounds=BOUNDS, itl_bounds=BOUNDS,
                      decode_chunk_tokens=chunk).run()


def test_a_chunked_prompt_takes_one_chunk_step_per_chunk_beside_the_stream():
    s = run(chunk=50)
    # alone: 2 chunks of 50 tokens at 50 ms; beside one stream: 4 chunks, each 20 + 50 ms
    assert sorted(s.outcomes.ttft) == pytest.approx([0.1, 0.28])
    gaps = s.itl_hist.frozen()
    assert gaps.count == pytest.approx(199 + 1), "the stream's 199 gaps, and the second request's one"
    assert gaps.quantile(0.97) < 0.025, "the stream's ordinary gaps stay 20 ms"
    assert gaps.quantile(0.99) == pytest.approx(0.07, rel=0.05), "four gaps of a step carrying a chunk"


def test_the_stream_keeps_decoding_while_the_prompt_is_chunked():
    chunked, whole = run(chunk=50), run(chunk=None)
    # The answer's 199 gaps: 4 steps carrying a chunk (70 ms), one beside the second request (30 ms),
    # the rest alone (20 ms); finished last. Whole: one gap of the 200 ms prompt and a step instead.
    assert chunked.outcomes.tpot[-1] == pytest.approx((194 * 0.02 + 0.03 + 4 * 0.07) / 199, rel=0.01)
    assert whole.outcomes.tpot[-1] == pytest.approx(chunked.outcomes.tpot[-1]), "the same prompt work, spread"
    assert whole.itl_hist.frozen().quantile(0.999) == pytest.approx(0.22, rel=0.05)
    assert chunked.itl_hist.frozen().quantile(0.999) < 0.08, "no gap holds the whole prompt"
