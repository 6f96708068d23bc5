"""Which tensor-parallel sizes a model's head counts allow, which rank holds which KV heads, and
where each decode rank finds its heads in a prefill group of another size."""

from __future__ import annotations

import itertools

import pytest
from tandem.contracts.kv_layout import KVLayout, kv_heads_of_rank, pull_slices, ranks_holding
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.contracts.parallelism import ParallelismError, check_parallelism


def test_heads_are_shared_equally_or_replicated():
    assert [kv_heads_of_rank(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # more ranks than KV heads: each head on tp // kv ranks, in order
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert list(ranks_holding(2, 4, 1)) == [2, 3]
    assert list(ranks_holding(8, 4, 5)) == [2]
    with pytest.raises(ValueError, match="neither divides"):
        kv_heads_of_rank(8, 3, 0)


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (8, 2), (1, 8)])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_every_decode_head_comes_from_a_prefill_rank_that_holds_it(kv, p, d):
    if check_problem(32, kv, p, d):
        return
    for j in range(d):
        got = {}
        for s in pull_slices(kv, p, d, j):
            src = kv_heads_of_rank(kv, p, s.source_rank)
            for i in range(s.count):
                got[s.dest_head + i] = src[s.source_head + i]
        assert got == dict(enumerate(kv_heads_of_rank(kv, d, j))), (kv, p, d, j)


def check_problem(h, kv, p, d):
    try:
        check_parallelism(h, kv, p, d)
    except ParallelismError:
        return True
    return False


def test_consecutive_heads_from_one_rank_are_one_slice():
    # decode 1 rank holds heads 0..7; prefill 2 ranks hold 0..3 and 4..7: two slices of four
    plan = pull_slices(8, 2, 1, 0)
    assert [(s.source_rank, s.source_head, s.dest_head, s.count) for s in plan] == [(0, 0, 0, 4), (1, 0, 4, 4)]
    # decode 2 ranks from one prefill rank: each reads its half from rank 0's pool
    assert [(s.source_rank, s.source_head, s.dest_head, s.count) for s in pull_slices(8, 1, 2, 1)] == [(0, 4, 0, 4)]
    # replicated prefill heads: decode ranks read different replicas
    assert {pull_slices(1, 2, 2, j)[0].source_rank for j in range(2)} == {0, 1}


def test_impossible_sizes_name_the_numbers():
    with pytest.raises(ParallelismError, match=r"decode tensor parallelism 3 does not divide the model's 32 attention"):
        check_parallelism(32, 8, 2, 3)
    with pytest.raises(ParallelismError, match=r"prefill tensor parallelism 6 cannot share the model's 4 KV heads"):
        check_parallelism(48, 4, 6, 1)
    with pytest.raises(ParallelismError, match="integer >= 1"):
        check_parallelism(32, 8, 0, 1)
    check_parallelism(32, 8, 16, 1)  # more ranks than KV heads: replicated
    for p, d in itertools.product([1, 2, 4, 8], repeat=2):
        check_parallelism(32, 8, p, d)


def test_layout_of_a_rank_holds_its_heads_outermost_after_the_block():
    lay = KVLayout(num_blocks=10, num_layers=3, block_size=16, num_kv_heads=4, head_dim=8, dtype="float32",
                   tp_size=2, tp_rank=1)
    assert lay.kv_heads == range(2, 4) and lay.shape == (10, 2, 3, 2, 16, 8)
    assert lay.head_bytes == 3 * 2 * 16 * 8 * 4 and lay.block_bytes == 2 * lay.head_bytes
    whole = KVLayout(num_blocks=7, num_layers=3, block_size=16, num_kv_heads=4, head_dim=8, dtype="float32")
    assert whole.compatible_with(lay) and whole.block_bytes == 2 * lay.block_bytes
    assert KVLayout(**lay.to_dict()) == lay
    with pytest.raises(ValueError):
        KVLayout(num_blocks=1, num_layers=1, block_size=1, num_kv_heads=4, head_dim=1, dtype="float32", tp_size=3)


def test_kv_source_carries_every_rank_through_json():
    src = KVSource("http://p0", "p0-1", "tcp", [1, 2], 20, "tok", {"tcp_port": 1},
                   ranks=[KVRank("http://p1", "p0-1-r1", {"tcp_port": 2})])
    import dataclasses

    back = KVSource(**dataclasses.asdict(src))
    assert back == src and back.tensor_parallel == 2
    assert back.rank(0) == KVRank("http://p0", "p0-1", {"tcp_port": 1}) and back.rank(1).url == "http://p1"
    assert KVSource("u", "e", "tcp", [], 0).tensor_parallel == 1
