"""Adjacent blocks become one transfer only when they are adjacent in both pools."""

from __future__ import annotations

import pytest
from tandem.worker.kv.pulling import merge_block_pairs


def test_adjacent_on_both_sides_is_one_run() -> None:
    assert merge_block_pairs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]


def test_a_gap_on_either_side_splits_the_run() -> None:
    assert merge_block_pairs([4, 5, 6, 7], [10, 11, 20, 21]) == [(4, 10, 2), (6, 20, 2)]
    assert merge_block_pairs([4, 5, 9, 10], [0, 1, 2, 3]) == [(4, 0, 2), (9, 2, 2)]


def test_descending_or_single_blocks_stay_separate() -> None:
    assert merge_block_pairs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert merge_block_pairs([7], [0]) == [(7, 0, 1)]
    assert merge_block_pairs([], []) == []


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError):
        merge_block_pairs([1, 2], [1])
