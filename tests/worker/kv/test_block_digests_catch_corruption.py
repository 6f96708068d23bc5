"""The per-block digests that verify every KV transfer (worker/kv/verify.py): each algorithm
catches a flipped byte, a block left unwritten, stale content and bytes moved within a block; the
decode side's verdict names the blocks that differ, and says why when it cannot check."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.worker.kv.verify import Verdict, algorithm_for, block_digests, verify

LAYOUT = KVLayout(num_blocks=12, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _pool(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape, generator=g)


def _bytes(pool: torch.Tensor, block: int) -> torch.Tensor:
    return pool[block].view(-1).view(torch.uint8)


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_equal_blocks_equal_digests_wherever_they_lie(algorithm):
    a, b = _pool(), torch.zeros(LAYOUT.shape)
    b[[5, 0, 9]] = a[[1, 2, 3]]
    assert block_digests(a, [1, 2, 3], algorithm) == block_digests(b, [5, 0, 9], algorithm)
    assert len(set(block_digests(a, [1, 2, 3], algorithm))) == 3


def test_crc32_is_zlibs_over_the_blocks_bytes():
    pool = _pool()
    assert block_digests(pool, [4, 1], "crc32") == [zlib.crc32(_bytes(pool, 4).numpy().tobytes()),
                                                   zlib.crc32(_bytes(pool, 1).numpy().tobytes())]


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_each_kind_of_bad_block_changes_its_digest_alone(algorithm):
    pool = _pool()
    ids = [1, 2, 3, 4]
    want = block_digests(pool, ids, algorithm)

    def changed(mutate) -> list[int]:
        bad = pool.clone()
        mutate(bad)
        got = block_digests(bad, ids, algorithm)
        return [i for i, (x, y) in enumerate(zip(want, got, strict=True)) if x != y]

    def flip_one_byte(p):
        _bytes(p, 2)[777] ^= 0x01

    def unwritten(p):  # a partial transfer: the block never arrived
        p[3].zero_()

    def stale(p):  # a stale block reference: another block's KV
        p[1] = pool[7]

    def moved_within(p):  # bytes of the right block, in the wrong places (a bad byte range)
        flat = _bytes(p, 4)
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
                    block_digests=block_digests(pool, ids, "crc32"), **kw)


def test_the_verdict_on_what_landed():
    there, here = _pool(1), torch.zeros(LAYOUT.shape)
    src = _src(there, [3, 4, 5])
    here[[0, 1, 2]] = there[[3, 4, 5]]
    assert verify(here, LAYOUT, src, [0, 1, 2])[0] is Verdict.VERIFIED
    here[1, 0, 0, 0, 0, 0] += 1.0
    verdict, detail = verify(here, LAYOUT, src, [0, 1, 2])
    assert verdict is Verdict.FAILED and "1 of 3 blocks" in detail and "[1]" in detail
    verdict, detail = verify(here, LAYOUT, src, [0, 1])
    assert verdict is Verdict.FAILED and "3 digests for 2 blocks" in detail


def test_what_cannot_be_checked_says_why():
    pool = _pool()
    plain = dataclasses.replace(_src(pool, [1, 2]), digest_algorithm="", block_digests=[])
    verdict, why = verify(pool, LAYOUT, plain, [1, 2])
    assert verdict is Verdict.SKIPPED and "no block digests" in why
    tp_source = dataclasses.replace(_src(pool, [1, 2]), ranks=[KVRank("http://p1", "p-1-r1")])
    verdict, why = verify(pool, LAYOUT, tp_source, [1, 2])
    assert verdict is Verdict.SKIPPED and "tensor-parallel" in why
    tp_here = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=0)
    verdict, why = verify(torch.zeros(tp_here.shape), tp_here, _src(pool, [1, 2]), [1, 2])
    assert verdict is Verdict.SKIPPED and "tensor-parallel" in why
