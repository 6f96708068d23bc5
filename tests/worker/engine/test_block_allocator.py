"""The block allocator hands out each block once, takes each back once, and says when it is empty."""

from __future__ import annotations

import pytest
from tandem.worker.engine.block_allocator import BlockAllocator, OutOfBlocksError


def test_allocate_and_free_round_trip():
    a = BlockAllocator(8)
    x = a.allocate(3)
    y = a.allocate(5)
    assert len(set(x) | set(y)) == 8 and a.num_free == 0 and a.num_used == 8
    assert a.try_allocate(1) is None
    with pytest.raises(OutOfBlocksError, match="asked for 1 KV blocks, 0 free"):
        a.allocate(1)
    a.free(x)
    assert a.num_free == 3
    assert sorted(a.allocate(3)) == sorted(x)


def test_double_free_is_an_error():
    a = BlockAllocator(4)
    x = a.allocate(2)
    a.free(x)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(x[:1])


def test_empty_pool_is_refused():
    with pytest.raises(ValueError):
        BlockAllocator(0)
