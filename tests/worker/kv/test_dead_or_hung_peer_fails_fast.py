"""A prefill peer that dies or hangs mid-handoff fails the pull within the bound, and both sides recover."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from tandem.testing.kv_peer import BENCH_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.kv.base import KVTransferConfig, TransferState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BIG = dataclasses.replace(BENCH_LAYOUT, num_blocks=256)  # 256 KiB blocks: 200 of them is 50 MiB
TIMEOUT_S = 3.0


async def _decode(backend: str, n: int) -> KVPeer:
    peer = KVPeer(backend, BIG, f"decode-{os.getpid()}-{n}",
                  KVTransferConfig(backend=backend, timeout_s=TIMEOUT_S), fill=False)
    await peer.start()
    return peer


async def _wait_free(prefill: KVPeerProcess, within_s: float) -> dict:
    end = time.monotonic() + within_s
    while True:
        b = await prefill.blocks()
        if b["free"] == b["total"] or time.monotonic() > end:
            return b
        await asyncio.sleep(0.05)


async def test_prefill_killed_mid_handoff_raises_within_bound(backend: str, peer_process: list) -> None:
    prefill = KVPeerProcess(backend, BIG, "prefill-k-1", fill=False)
    peer_process.append(prefill)
    prefill.start()
    decode = await _decode(backend, 1)
    try:
        warm = await decode.pull("warm", await prefill.prefill("warm", 1, seed=1), seed=None)
        assert warm["ok"], warm  # metadata cached, connection made: the next pull goes straight to bytes
        src = await prefill.prefill("big", 200 * BIG.block_size, seed=2)
        prefill.signal(signal.SIGSTOP)
        task = asyncio.create_task(decode.pull("big", src, seed=None))
        await asyncio.sleep(0.3)
        assert not task.done(), "the handoff finished although the peer was stopped"
        killed_at = time.monotonic()
        prefill.kill()
        res = await task
        elapsed = time.monotonic() - killed_at
        assert not res["ok"]
        assert res["state"] in (TransferState.FAILED, TransferState.TIMED_OUT)
        assert elapsed < TIMEOUT_S + 1.0, f"failure surfaced after {elapsed:.1f} s"
        assert len(decode.free) == BIG.num_blocks, "the decode side leaked destination blocks"
        h = decode.transport.health()
        assert h.failures_total["pull"] == 1 and not h.healthy and h.last_error

        # The decode worker is fine: a new prefill worker serves it.
        fresh = KVPeerProcess(backend, BIG, "prefill-k-2")
        peer_process.append(fresh)
        fresh.start()
        res = await decode.pull("next", await fresh.prefill("next", 100, seed=3), seed=3)
        assert res["ok"] and res["identical"], res
        assert decode.transport.health().healthy
    finally:
        await decode.close()


async def test_hung_prefill_times_out_then_serves_again(backend: str, peer_process: list) -> None:
    prefill = KVPeerProcess(backend, BIG, "prefill-h-1", lease_s=2.0)
    peer_process.append(prefill)
    prefill.start()
    decode = await _decode(backend, 2)
    try:
        assert (await decode.pull("warm", await prefill.prefill("warm", 1, seed=1), seed=1))["ok"]
        src = await prefill.prefill("hung", 64 * BIG.block_size, seed=2)
        prefill.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        res = await decode.pull("hung", src, seed=None)
        elapsed = time.monotonic() - t0
        prefill.signal(signal.SIGCONT)
        assert not res["ok"] and res["state"] == TransferState.TIMED_OUT, res
        assert TIMEOUT_S - 0.1 < elapsed < TIMEOUT_S + 1.0, elapsed
        assert len(decode.free) == BIG.num_blocks
        # The prefill side frees the abandoned blocks: release message, broken connection or lease.
        b = await _wait_free(prefill, within_s=2.0 + 1.5)
        assert b["free"] == b["total"], b
        # Both sides are healthy for the next request, through fresh metadata.
        res = await decode.pull("after", await prefill.prefill("after", 500, seed=4), seed=4)
        assert res["ok"] and res["identical"], res
        assert (await _wait_free(prefill, 3.0))["free"] == BIG.num_blocks
    finally:
        await decode.close()
