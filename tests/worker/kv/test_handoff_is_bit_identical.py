"""Blocks computed by a prefill process arrive bit-identical in the decode pool, and every block comes back."""

from __future__ import annotations

import asyncio

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer, KVPeerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _all_back(prefill: KVPeerProcess, deadline_s: float = 5.0) -> dict:
    """Completion reaches the prefill side asynchronously (NIXL notification): wait for it, bounded."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        b = await prefill.blocks()
        if b["free"] == b["total"] or loop.time() > end:
            return b
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("scatter", [False, True], ids=["adjacent", "scattered"])
async def test_prompts_from_one_token_to_thousands(backend: str, decode_peer: KVPeer,
                                                   peer_process: list, scatter: bool) -> None:
    prefill = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-a-1")
    peer_process.append(prefill)
    prefill.start()
    for i, n in enumerate([1, 15, 16, 17, 300, 4000]):
        src = await prefill.prefill(f"r{i}", n, seed=100 + i, scatter=scatter)
        assert len(src.block_ids) == SMALL_LAYOUT.blocks_for(n)
        res = await decode_peer.pull(f"r{i}", src, seed=100 + i, scatter=scatter)
        assert res["ok"], res
        assert res["identical"], f"{n} tokens: blocks differ after the handoff"
        assert res["stats"]["bytes"] == len(src.block_ids) * SMALL_LAYOUT.block_bytes
        if not scatter:  # adjacent on both sides: one transfer however many blocks
            assert res["stats"]["num_transfers"] == 1
            # NIXL's completion reaches the prefill side a moment after the pull: wait for it, so
            # the next prompt's blocks are adjacent there too.
            assert (await _all_back(prefill))["free"] == SMALL_LAYOUT.num_blocks
    assert (await _all_back(prefill))["free"] == SMALL_LAYOUT.num_blocks
    assert len(decode_peer.free) == SMALL_LAYOUT.num_blocks
    health = await prefill.health()
    assert health["transfers_total"]["serve"] == 6 and health["healthy"]


async def test_concurrent_handoffs_do_not_mix_blocks(backend: str, decode_peer: KVPeer,
                                                     peer_process: list) -> None:
    prefill = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-b-1")
    peer_process.append(prefill)
    prefill.start()
    sizes = [1, 40, 700, 1500, 33, 2000, 250, 900]
    sources = [await prefill.prefill(f"c{i}", n, seed=7 * i, scatter=i % 2 == 1)
               for i, n in enumerate(sizes)]
    results = await asyncio.gather(*(decode_peer.pull(f"c{i}", s, seed=7 * i, scatter=i % 3 == 0)
                                     for i, s in enumerate(sources)))
    for n, res in zip(sizes, results, strict=True):
        assert res["ok"] and res["identical"], (n, res)
    assert (await _all_back(prefill))["free"] == SMALL_LAYOUT.num_blocks
    assert len(decode_peer.free) == SMALL_LAYOUT.num_blocks
    assert decode_peer.transport.health().transfers_total["pull"] == len(sizes)
