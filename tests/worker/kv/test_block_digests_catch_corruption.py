"""The per-block, per-head digests that verify every KV transfer (worker/kv/verify.py): each
algorithm catches a flipped byte, a block left unwritten, stale content and bytes moved within a
block; the decode side's verdict names the blocks that differ, and says why when it cannot check;
ranks that hold different shares of the heads each check theirs against one source's digests."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVSource
from tandem.worker.kv.verify import Verdict, algorithm_for, block_digests, merge, verify

LAYOUT = KVLayout(num_blocks=12, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _pool(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape, generator=g)


def _bytes(pool: torch.Tensor, block: int, head: int = 0) -> torch.Tensor:
    return pool[block, head].reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_equal_blocks_equal_digests_wherever_they_lie(algorithm):
    a, b = _pool(), torch.zeros(LAYOUT.shape)
    b[[5, 0, 9]] = a[[1, 2, 3]]
    assert block_digests(a, [1, 2, 3], algorithm) == block_digests(b, [5, 0, 9], algorithm)
    assert len(set(block_digests(a, [1, 2, 3], algorithm))) == 6  # 3 blocks x 2 heads


def test_crc32_is_zlibs_over_each_heads_bytes_of_a_block():
    pool = _pool()
    assert block_digests(pool, [4, 1], "crc32") == [zlib.crc32(_bytes(pool, b, h).numpy().tobytes())
                                                   for b in (4, 1) for h in (0, 1)]


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_each_kind_of_bad_block_changes_its_digest_alone(algorithm):
    pool = _pool()
    ids = [1, 2, 3, 4]
    want = block_digests(pool, ids, algorithm)

    def changed(mutate) -> list[int]:  # the blocks (positions in ids) whose digests changed
        bad = pool.clone()
        mutate(bad)
        got = block_digests(bad, ids, algorithm)
        return sorted({i // 2 for i, (x, y) in enumerate(zip(want, got, strict=True)) if x != y})

    def flip_one_byte(p):
        _bytes(p, 2, 1)[377] ^= 0x01

    def unwritten(p):  # a partial transfer: the block never arrived
        p[3].zero_()

    def stale(p):  # a stale block reference: another block's KV
        p[1] = pool[7]

    def moved_within(p):  # bytes of the right block, in the wrong places (a bad byte range)
        flat = _bytes(p, 4, 1)
        flat[:64], flat[64:128] = flat[64:128].clone(), flat[:64].clone()

    assert changed(flip_one_byte) == [1]
    assert changed(unwritten) == [2]
    assert changed(stale) == [0]
    assert changed(moved_within) == [3]


def test_the_algorithm_follows_the_pools_device():
    assert algorithm_for(_pool()) == "crc32"
    assert algorithm_for(torch.empty(0, device="meta")) == "wsum64"


def _src(pool: torch.Tensor, ids: list[int], **kw) -> KVSource:
    return KVSource(url="http://p", engine_id="p-1", backend="memory", block_ids=ids,
                    num_tokens=len(ids) * LAYOUT.block_size, lease_token="t", digest_algorithm="crc32",
                    digest_heads=LAYOUT.num_kv_heads, block_digests=block_digests(pool, ids, "crc32"), **kw)


def test_the_verdict_on_what_landed():
    there, here = _pool(1), torch.zeros(LAYOUT.shape)
    src = _src(there, [3, 4, 5])
    here[[0, 1, 2]] = there[[3, 4, 5]]
    assert verify(here, LAYOUT, src, [0, 1, 2])[0] is Verdict.VERIFIED
    here[1, 0, 0, 0, 0, 0] += 1.0
    verdict, detail = verify(here, LAYOUT, src, [0, 1, 2])
    assert verdict is Verdict.FAILED and "1 of 3 blocks" in detail and "[1]" in detail
    verdict, detail = verify(here, LAYOUT, src, [0, 1])
    assert verdict is Verdict.FAILED and "6 digests of 2 heads for 2 blocks" in detail


def test_what_cannot_be_checked_says_why():
    pool = _pool()
    plain = dataclasses.replace(_src(pool, [1, 2]), digest_algorithm="", digest_heads=0, block_digests=[])
    verdict, why = verify(pool, LAYOUT, plain, [1, 2])
    assert verdict is Verdict.SKIPPED and "no block digests" in why


def _rank_pools(whole: torch.Tensor, tp: int) -> list[tuple[KVLayout, torch.Tensor]]:
    """`whole`'s blocks split over `tp` ranks as a tensor-parallel worker holds them."""
    out = []
    for r in range(tp):
        layout = dataclasses.replace(LAYOUT, tp_size=tp, tp_rank=r)
        out.append((layout, whole[:, layout.kv_heads.start:layout.kv_heads.stop].contiguous()))
    return out


def test_a_tensor_parallel_source_and_puller_check_each_ranks_heads():
    whole = _pool(3)
    ids = [2, 5, 7]
    ranks = _rank_pools(whole, 2)  # prefill with tensor parallelism 2: one head each
    digests = merge([(layout.kv_heads, block_digests(p, ids, "crc32")) for layout, p in ranks], 2, len(ids))
    assert digests == block_digests(whole, ids, "crc32"), "the ranks' digests are the one-rank source's"
    src = dataclasses.replace(_src(whole, ids), block_digests=digests)
    for layout, pool in _rank_pools(whole, 2):  # a puller with tensor parallelism 2: each rank its head
        here = torch.zeros(layout.shape)
        here[[0, 1, 2]] = pool[ids]
        assert verify(here, layout, src, [0, 1, 2])[0] is Verdict.VERIFIED
        here[2].view(-1)[5] += 1.0
        verdict, detail = verify(here, layout, src, [0, 1, 2])
        assert verdict is Verdict.FAILED and "[2]" in detail and f"heads {layout.tp_rank}-{layout.tp_rank}" in detail
    with pytest.raises(ValueError, match="no rank's digests for KV heads \\[1\\]"):
        merge([(ranks[0][0].kv_heads, block_digests(ranks[0][1], ids, "crc32"))], 2, len(ids))
