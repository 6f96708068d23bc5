"""A decode worker forgets the prefill workers that are gone (issue 21, defect 9): under prefill
churn (each prefill worker pulled from once, then gone, a new address and engine id each time) its
peer table, its open file descriptors (pooled TCP connections, UCX endpoints of NIXL remote agents)
stay bounded by `kv_max_peers` instead of growing with every prefill worker it ever met; a peer
idle for `kv_peer_idle_s` is forgotten too, and one in use never is (the table on its own)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.kv.base import KVTransferConfig
from tandem.worker.kv.peer_table import PeerTable

CHURN = 12
MAX_PEERS = 3
FD_SETTLE_S = 15


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _churn_one(backend: str, decode: KVPeerProcess, i: int) -> None:
    prefill = KVPeer(backend, SMALL_LAYOUT, f"churn-{os.getpid()}-{i}", KVTransferConfig(backend=backend))
    await prefill.start()
    try:
        got = await decode.pull(f"r{i}", prefill.prefill(f"r{i}", 48, seed=i), seed=i)
        assert got["ok"] and got["identical"], got
    finally:
        await prefill.close()  # gone for good: a scaled-down or rescheduled prefill pod


async def test_peer_table_and_fds_stay_bounded_under_prefill_churn(backend, peer_process):
    decode = KVPeerProcess(backend, SMALL_LAYOUT, f"decode-churn-{os.getpid()}", fill=False,
                           extra={"kv_max_peers": MAX_PEERS})
    peer_process.append(decode)
    decode.start()
    for i in range(MAX_PEERS):  # warm up: its HTTP session, the first connections and agents
        await _churn_one(backend, decode, i)
    baseline = _fds(decode.proc.pid)
    for i in range(MAX_PEERS, CHURN):
        await _churn_one(backend, decode, i)
    peers = (await decode.health())["peers"]
    assert len(peers) <= MAX_PEERS, f"{len(peers)} peers kept after {CHURN} came and went"
    # A forgotten peer's sockets and UCX endpoints close asynchronously (a loaded machine can take a
    # while): wait for the count to settle; a leak never does.
    deadline = time.monotonic() + FD_SETTLE_S
    while (grown := _fds(decode.proc.pid) - baseline) > 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - another process's /proc: no event to await
        await asyncio.sleep(0.1)
    assert grown <= 2, f"{grown} more open fds after {CHURN - MAX_PEERS} more prefill workers came and went"


def test_the_table_forgets_idle_and_least_recently_used_peers_never_busy_ones():
    now = [100.0]
    table = PeerTable(idle_s=10.0, max_peers=2, clock=lambda: now[0])
    for url in ["a", "b", "c", "d"]:  # used at 100, 101, 102, 103
        table.put(url, {"engine_id": url})
        with table.using(url):
            pass
        now[0] += 1
    now[0] = 105.0
    with table.using("a"):
        assert table.stale() == ["b", "c"], "a is in use: b and c are the least recently used beyond 2"
        now[0] = 112.5
        assert table.stale() == ["b", "c"], "idle over 10 s, a in use"
        now[0] = 105.0
    assert table.stale() == ["b", "c"], "a was used just now"
    now[0] = 200.0
    for url in table.stale():
        table.pop(url)
    assert len(table) == 0 and table.stale() == []


@pytest.mark.parametrize("bad", [{"idle_s": 0}, {"max_peers": 0}])
def test_the_bounds_must_be_positive(bad):
    with pytest.raises(ValueError):
        PeerTable(**bad)

