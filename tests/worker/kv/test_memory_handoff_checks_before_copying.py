"""The in-process backend copies exact blocks and refuses what the real backends refuse, before a byte moves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer
from tandem.worker.kv.base import KVTransferConfig, KVTransferError

CFG = KVTransferConfig(backend="memory", timeout_s=2.0)


@pytest.fixture
async def pair():
    p = KVPeer("memory", SMALL_LAYOUT, "mem-prefill-1", CFG)
    d = KVPeer("memory", SMALL_LAYOUT, "mem-decode-1", CFG, fill=False)
    await p.start()
    await d.start()
    yield p, d
    await p.close()
    await d.close()


async def test_blocks_copied_exactly_and_released(pair) -> None:
    p, d = pair
    src = p.prefill("r1", 1000, seed=9, scatter=True)
    res = await d.pull("r1", src, seed=9, scatter=True)
    assert res["ok"] and res["identical"]
    assert p.released == ["r1"] and len(p.free) == SMALL_LAYOUT.num_blocks
    assert len(d.free) == SMALL_LAYOUT.num_blocks


async def test_a_wrong_seed_is_detected(pair) -> None:
    """The pattern check itself can fail: the bit-identical tests are not vacuous."""
    p, d = pair
    res = await d.pull("r2", p.prefill("r2", 40, seed=1), seed=2)
    assert res["ok"] and res["identical"] is False


async def test_unknown_engine_fails_and_is_counted(pair) -> None:
    p, d = pair
    src = dataclasses.replace(p.prefill("r3", 40, seed=1), engine_id="mem-prefill-0")
    with pytest.raises(KVTransferError, match="no engine"):
        await d.transport.pull("r3", src, [0, 1, 2])
    assert d.transport.health().failures_total == {"pull": 1}


async def test_bad_block_lists_are_refused(pair) -> None:
    p, d = pair
    src = p.prefill("r4", 40, seed=1)  # 3 blocks
    with pytest.raises(KVTransferError, match="destination blocks"):
        await d.transport.pull("r4", src, [0, 1])
    with pytest.raises(KVTransferError, match="outside this pool"):
        await d.transport.pull("r4", src, [0, 1, SMALL_LAYOUT.num_blocks])
    bad = dataclasses.replace(src, block_ids=[0, 1, SMALL_LAYOUT.num_blocks + 5])
    with pytest.raises(KVTransferError, match="outside the peer's pool"):
        await d.transport.pull("r4", bad, [0, 1, 2])
    short = dataclasses.replace(src, num_tokens=400)
    with pytest.raises(KVTransferError, match="need"):
        await d.transport.pull("r4", short, [0, 1, 2])


async def test_a_failed_pull_frees_the_prefill_blocks_at_once(pair) -> None:
    p, d = pair
    src = p.prefill("r5", 40, seed=1)
    with pytest.raises(KVTransferError):
        await d.transport.pull("r5", src, [0, 1])
    for _ in range(10):  # the release is sent in the background
        if not p.leases:
            break
        await asyncio.sleep(0.01)
    assert not p.leases and len(p.free) == SMALL_LAYOUT.num_blocks


async def test_incompatible_layouts_are_refused() -> None:
    other = dataclasses.replace(SMALL_LAYOUT, head_dim=32)
    p = KVPeer("memory", SMALL_LAYOUT, "mem-prefill-2", CFG)
    d = KVPeer("memory", other, "mem-decode-2", CFG, fill=False)
    await p.start()
    await d.start()
    try:
        with pytest.raises(KVTransferError, match="layouts differ"):
            await d.transport.pull("r6", p.prefill("r6", 16, seed=1), [0])
    finally:
        await p.close()
        await d.close()
