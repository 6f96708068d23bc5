"""A decode worker's chunk for prompts it prefills itself is sized from measured step times, so a
step carrying it lasts at most `stall_factor` ordinary steps (issue 23: no gap over two ordinary
gaps); alone, a prompt takes the whole configured chunk; before anything is measured, a block."""

from __future__ import annotations

import pytest
from tandem.worker.engine.chunk_sizing import ChunkSizer


def settle(sizer: ChunkSizer, step_s, decoding: int = 8, steps: int = 60) -> tuple[int, float]:
    """Run a synthetic worker whose step time is step_s(prompt tokens); (last chunk, its step)."""
    chunk = 0
    for i in range(steps):
        if i % 3 == 0:
            sizer.observe(step_s(0), decoding, 0)  # a decode-only step now and then
        chunk = sizer.budget(decoding)
        sizer.observe(step_s(chunk), decoding, chunk)
    return chunk, step_s(chunk)


def test_the_chunk_settles_where_its_step_lasts_two_ordinary_steps():
    # 10 ms ordinary; a chunk adds 3 ms of eager layers and 0.2 ms a token: room for (10 - 3) / 0.2 = 35
    sizer = ChunkSizer(max_tokens=256, stall_factor=2.0)
    chunk, took = settle(sizer, lambda c: 0.010 + (0.003 + 0.0002 * c if c else 0.0))
    assert chunk == pytest.approx(35, abs=2)
    assert took <= 2 * 0.010 * 1.01


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_larger_factor_allows_a_larger_chunk_never_past_the_configured_one(factor):
    sizer = ChunkSizer(max_tokens=64, stall_factor=factor)
    chunk, took = settle(sizer, lambda c: 0.010 + (0.0002 * c if c else 0.0))
    assert chunk == min(64, int((factor - 1) * 0.010 / 0.0002))
    assert took <= factor * 0.010 * 1.01


def test_with_nothing_decoding_the_whole_chunk_and_before_any_measure_a_block():
    sizer = ChunkSizer(max_tokens=256, stall_factor=2.0, min_tokens=16)
    assert sizer.budget(0) == 256
    assert sizer.budget(4) == 16, "nothing measured yet: one block, then measured"
    sizer.observe(0.010, 4, 0)
    sizer.observe(0.020, 0, 200)  # a prompt alone: 0.1 ms a token, all of its step counted
    assert sizer.budget(4) == 100


def test_a_chunk_whose_fixed_cost_alone_exceeds_the_room_still_advances_by_a_block():
    sizer = ChunkSizer(max_tokens=256, stall_factor=2.0, min_tokens=16)
    chunk, _ = settle(sizer, lambda c: 0.010 + (0.015 + 0.0001 * c if c else 0.0))
    assert chunk == 16


def test_a_factor_of_one_or_less_is_refused():
    with pytest.raises(ValueError, match="above 1"):
        ChunkSizer(max_tokens=64, stall_factor=1.0)
