"""Adjacent blocks become one transfer only when they are adjacent in both pools; a slice of KV
heads (prefill and decode with different tensor sizes) is one range per block."""

from __future__ import annotations

import pytest
from tandem.contracts.kv_layout import HeadSlice, KVLayout, pull_slices
from tandem.worker.kv.byte_ranges import blocks_touched, head_ranges

WHOLE = KVLayout(num_blocks=64, num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float32")
BB = WHOLE.block_bytes
ALL = HeadSlice(0, 0, 0, 4)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """head_ranges of whole blocks, in blocks."""
    return [(s // BB, d // BB, n // BB) for s, d, n in head_ranges(WHOLE, WHOLE, ALL, src, dst)]


def test_adjacent_on_both_sides_is_one_run() -> None:
    assert runs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]


def test_a_gap_on_either_side_splits_the_run() -> None:
    assert runs([4, 5, 6, 7], [10, 11, 20, 21]) == [(4, 10, 2), (6, 20, 2)]
    assert runs([4, 5, 9, 10], [0, 1, 2, 3]) == [(4, 0, 2), (9, 2, 2)]


def test_descending_or_single_blocks_stay_separate() -> None:
    assert runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert runs([7], [0]) == [(7, 0, 1)]
    assert runs([], []) == []


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError):
        runs([1, 2], [1])


def test_a_rank_reads_its_heads_as_one_range_per_block() -> None:
    half = KVLayout(num_blocks=64, num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float32",
                    tp_size=2, tp_rank=1)
    (s,) = pull_slices(4, 1, 2, 1)  # decode rank 1 of 2 reads heads 2 and 3 from the single prefill rank
    got = head_ranges(WHOLE, half, s, [4, 5], [0, 1])
    hb = WHOLE.head_bytes
    assert got == [(4 * BB + 2 * hb, 0, 2 * hb), (5 * BB + 2 * hb, half.block_bytes, 2 * hb)]
    # the other way: one decode rank reads both halves from two prefill ranks, whole blocks each
    back = [head_ranges(half, WHOLE, s, [0, 1], [4, 5]) for s in pull_slices(4, 2, 1, 0)]
    assert back[1] == [(0, 4 * BB + 2 * hb, 2 * hb), (half.block_bytes, 5 * BB + 2 * hb, 2 * hb)]
    assert list(blocks_touched(4 * BB + BB - 1, 2, BB)) == [4, 5]
