"""KV whose lease expired on the prefill side (so its blocks may be reused) fails the pull instead of
being decoded from. tcp and memory check it in the completion exchange; NIXL's completion is a
one-way notification, so there the guard is lease_s >> timeout_s (see worker/kv/nixl.py)."""

from __future__ import annotations

import asyncio

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.kv.base import KVTransferConfig, KVTransferError


async def test_tcp_pull_after_lease_expiry_fails(peer_process: list) -> None:
    prefill = KVPeerProcess("tcp", SMALL_LAYOUT, "prefill-lease-1", lease_s=0.3)
    peer_process.append(prefill)
    prefill.start()
    decode = KVPeer("tcp", SMALL_LAYOUT, "decode-lease-1", KVTransferConfig(backend="tcp", timeout_s=3))
    await decode.start()
    try:
        assert (await decode.pull("fresh", await prefill.prefill("fresh", 30, seed=1), seed=1))["ok"]
        src = await prefill.prefill("late", 30, seed=2)
        await asyncio.sleep(0.8)  # the prefill side reclaims the blocks
        res = await decode.pull("late", src, seed=2)
        assert not res["ok"] and "lease" in res["error"], res
        assert len(decode.free) == SMALL_LAYOUT.num_blocks
        # The connection and the peer stay usable.
        assert (await decode.pull("again", await prefill.prefill("again", 30, seed=3), seed=3))["ok"]
    finally:
        await decode.close()


async def test_memory_pull_after_lease_expiry_fails() -> None:
    p = KVPeer("memory", SMALL_LAYOUT, "mem-lease-p", KVTransferConfig(backend="memory", lease_s=0.2))
    d = KVPeer("memory", SMALL_LAYOUT, "mem-lease-d", KVTransferConfig(backend="memory"), fill=False)
    await p.start()
    await d.start()
    try:
        src = p.prefill("late", 30, seed=2)
        await asyncio.sleep(0.5)
        assert not p.leases
        with pytest.raises(KVTransferError, match="lease"):
            await d.transport.pull("late", src, [0, 1])
    finally:
        await p.close()
        await d.close()
