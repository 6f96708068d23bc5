"""A decode worker killed during a handoff: the prefill side notices within the bound and frees the blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import aiohttp
import pytest
from tandem.testing.kv_peer import BENCH_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.kv.base import KVTransferConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BIG = dataclasses.replace(BENCH_LAYOUT, num_blocks=256)
LEASE_S = 2.0


async def test_prefill_frees_blocks_of_a_dead_decode(backend: str, peer_process: list) -> None:
    prefill = KVPeer(backend, BIG, f"prefill-{os.getpid()}-9",
                     KVTransferConfig(backend=backend, timeout_s=3.0, lease_s=LEASE_S), fill=False)
    await prefill.start()
    try:
        decode = KVPeerProcess(backend, BIG, "decode-d-1", fill=False)
        peer_process.append(decode)
        decode.start()
        src = prefill.prefill("doomed", 240 * BIG.block_size, seed=1)
        pull = asyncio.create_task(decode.pull("doomed", src))
        # Kill it once the handoff is under way: tcp, bytes are being sent; nixl, the decode side has
        # added our agent (next it posts the READ, which the prefill side cannot see: one-sided).
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if backend == "tcp" and "doomed" in prefill.transport.serving:
                break
            if backend == "nixl" and (await decode.health())["peers"]:
                await asyncio.sleep(0.01)
                break
            await asyncio.sleep(0.002)
        assert "doomed" in prefill.leases, "the handoff completed before the kill: nothing tested"
        killed_at = time.monotonic()
        decode.kill()
        with pytest.raises(aiohttp.ClientError):  # the HTTP call dies with the process
            await pull
        while time.monotonic() - killed_at < LEASE_S + 2:
            if not prefill.leases:
                break
            await asyncio.sleep(0.02)
        freed_after = time.monotonic() - killed_at
        assert not prefill.leases and len(prefill.free) == BIG.num_blocks
        # tcp sees the broken connection at once; nixl's one-sided READ leaves it to the lease.
        assert freed_after < (0.5 if backend == "tcp" else LEASE_S + 1.0), freed_after
        if backend == "tcp":
            assert prefill.transport.health().failures_total["serve"] == 1

        # The prefill worker serves the next decode worker normally.
        nxt = KVPeerProcess(backend, BIG, "decode-d-2")
        peer_process.append(nxt)
        nxt.start()
        prefill.fill = True
        res = await nxt.pull("next", prefill.prefill("next", 300, seed=5), seed=5)
        assert res["ok"] and res["identical"], res
    finally:
        await prefill.close()
