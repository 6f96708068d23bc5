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


def test_shared_blocks_count_references():
    a = BlockAllocator(4)
    x = a.allocate(2)
    assert a.register(x[0], b"h0") and a.register(x[1], b"h1")
    assert a.lookup([b"h0", b"h1", b"h2"]) == x
    a.take(x)  # a second sequence shares both
    assert a.refcount(x[0]) == 2 and a.num_used == 2
    a.free(reversed(x))
    assert a.num_used == 2 and a.num_free == 2  # still held once
    a.free(reversed(x))
    assert a.num_used == 0 and a.num_free == 4 and a.num_cached_free == 2
    assert a.num_to_take(x) == 2
    a.take(x[:1])  # a hit on a free cached block takes it off the free list
    assert a.num_free == 3 and a.num_used == 1
    a.free(x[:1])


def test_plain_blocks_go_first_then_the_least_recently_freed_cached_one():
    a = BlockAllocator(4)
    x = a.allocate(4)
    for i, b in enumerate(x[:3]):
        a.register(b, f"h{i}".encode())
    a.free([x[2], x[1], x[0]])  # a sequence's tail first
    a.free([x[3]])  # never named
    assert a.allocate(1) == [x[3]] and a.evictions_total == 0
    assert a.allocate(1) == [x[2]] and a.evictions_total == 1
    assert a.lookup([b"h0", b"h1", b"h2"]) == [x[0], x[1]]  # h2 is gone with its block
    assert a.hash_of(x[2]) is None


def test_a_hash_names_one_block_and_only_blocks_in_use():
    a = BlockAllocator(3)
    x = a.allocate(2)
    assert a.register(x[0], b"h") and not a.register(x[1], b"h")  # a duplicate stays unnamed
    assert not a.register(x[0], b"other")  # named once
    a.free(x)
    with pytest.raises(ValueError, match="not in use"):
        a.register(x[1], b"z")
    with pytest.raises(ValueError, match="holds no cached prefix"):
        a.take([x[1]])


def test_events_are_net_and_match_the_cached_hashes():
    a = BlockAllocator(2)
    x = a.allocate(2)
    a.register(x[0], b"a")
    a.register(x[1], b"b")
    assert sorted(a.cached_hashes()) == []  # nobody has been told yet
    stored, removed = a.take_events()
    assert sorted(stored) == [b"a", b"b"] and removed == []
    a.free(x)
    y = a.allocate(2)  # evicts both
    a.register(y[0], b"a")  # stored again: net, nothing changed for "a"
    stored, removed = a.take_events()
    assert stored == [] and removed == [b"b"]
    assert a.cached_hashes() == [b"a"]
    z = a.allocate(0)
    assert z == [] and a.take_events() == ([], [])
    a.free(y)
