"""The TCP KV port validates a read's byte ranges before it expands them into blocks or asks the
lease keeper (issue 21, defect 13): ranges that overlap (the same bytes asked for twice, which
also multiplies what one lease lets a peer pull) or more of them than the pool could hold are
refused at once, so one authenticated frame cannot make the prefill worker's event loop walk
millions of blocks; a read of a lease's own blocks, each once, is served as before."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer
from tandem.worker.kv.base import KVTransferConfig
from tandem.worker.kv.tcp_wire import client_handshake, recv_frame, send_frame

BB = SMALL_LAYOUT.block_bytes


class CountingKeeper:
    """The prefill peer's lease keeper, counting the blocks each check is asked about."""

    def __init__(self, peer: KVPeer) -> None:
        self.peer = peer
        self.asked: list[int] = []

    def check_read(self, request_id, lease_token, block_ids):
        self.asked.append(len(block_ids))
        return self.peer.check_read(request_id, lease_token, block_ids)

    def release_lease(self, request_id, lease_token):
        return self.peer.release_lease(request_id, lease_token)


@pytest.fixture
async def prefill():
    peer = KVPeer("tcp", SMALL_LAYOUT, f"ranges-{os.getpid()}", KVTransferConfig(backend="tcp"))
    await peer.start()
    peer.transport.leases = keeper = CountingKeeper(peer)
    yield peer, keeper
    await peer.close()


async def _read(peer: KVPeer, request_id: str, token: str, ranges: list[list[int]]) -> dict:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", peer.transport.port))
        await client_handshake(loop, sock, None)
        await send_frame(loop, sock, {"op": "read", "request_id": request_id, "engine_id": peer.transport.engine_id,
                                      "lease_token": token, "ranges": ranges, "release": False})
        return await recv_frame(loop, sock, wait_s=30.0, frame_s=30.0)
    finally:
        sock.close()


async def test_overlapping_ranges_are_refused_before_any_lease_check(prefill):
    peer, keeper = prefill
    src = peer.prefill("r", 4 * SMALL_LAYOUT.block_size, seed=1)
    first = src.block_ids[0] * BB
    whole_pool = [0, SMALL_LAYOUT.num_blocks * BB]
    answer = await _read(peer, "r", src.lease_token, [whole_pool] * 20_000)
    assert answer["ok"] is False and "overlap" in answer["error"], answer
    again = await _read(peer, "r", src.lease_token, [[first, BB]] * 3)  # its own block, three times
    assert again["ok"] is False and "overlap" in again["error"], again
    assert keeper.asked == [], "the lease keeper was asked about blocks of a read that was refused anyway"
    peer.release_lease("r", src.lease_token)


async def test_a_lease_s_blocks_each_read_once_are_served(prefill):
    peer, keeper = prefill
    src = peer.prefill("ok", 4 * SMALL_LAYOUT.block_size, seed=2)
    ranges = [[b * BB, BB] for b in reversed(src.block_ids)]  # any order, no byte twice
    answer = await _read(peer, "ok", src.lease_token, ranges)
    assert answer == {"ok": True, "bytes": 4 * BB}
    assert keeper.asked == [4]
    peer.release_lease("ok", src.lease_token)
