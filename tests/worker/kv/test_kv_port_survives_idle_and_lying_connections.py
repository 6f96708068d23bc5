"""Hundreds of connections to the TCP KV port that never speak, announce huge frames or stall
mid-frame leave the prefill process's memory bounded and are all closed, while a real pull goes
through meanwhile; an idle connection is closed by the server, and the decode side never reuses a
pooled connection the server has closed (no spurious pull failure)."""

from __future__ import annotations

import asyncio
import socket
import time

import psutil
import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeerProcess, prefill_and_decode
from tandem.worker.kv.tcp_wire import LEN, client_handshake, recv_frame

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECRET = "flood-test-secret-0123456789ab"
EACH = 100  # connections of each kind


async def _wait(predicate, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline, f"not {what} within {within_s} s"
        await asyncio.sleep(0.05)


async def _open(loop: asyncio.AbstractEventLoop, port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _closed_by_server(loop: asyncio.AbstractEventLoop, sock: socket.socket, within_s: float) -> bool:
    """Read (and drop) what the server sends until it closes the connection; False on timeout."""
    try:
        async with asyncio.timeout(within_s):
            while await loop.sock_recv(sock, 4096):
                pass
    except TimeoutError:
        return False
    except OSError:  # reset: closed as well
        pass
    return True


async def test_flood_leaves_memory_bounded_and_the_port_serving(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode("tcp", SMALL_LAYOUT, "flood", peer_process, secret=SECRET)
    loop = asyncio.get_running_loop()
    port = (await prefill._call("GET", "/internal/kv/metadata"))["tcp_port"]
    proc = psutil.Process(prefill.proc.pid)
    flood: list[socket.socket] = []
    try:
        warm = await decode.pull("warm", await prefill.prefill("warm", 64, seed=1), seed=1)
        assert warm["ok"], warm
        rss_before = proc.memory_info().rss
        for _ in range(EACH):  # never speaks
            flood.append(await _open(loop, port))
        for _ in range(EACH):  # announces a 256 MiB frame and sends nothing more
            sock = await _open(loop, port)
            await loop.sock_sendall(sock, LEN.pack(256 << 20))
            flood.append(sock)
        for _ in range(EACH):  # starts a plausible frame and stalls in the middle of it
            sock = await _open(loop, port)
            await loop.sock_sendall(sock, LEN.pack(300) + b'{"nonce": "')
            flood.append(sock)

        # Meanwhile the port serves a real pull, byte-exact.
        src = await prefill.prefill("real", 40 * SMALL_LAYOUT.block_size, seed=7)
        res = await decode.pull("real", src, seed=7)
        assert res["ok"] and res["identical"], res

        rss_peak = proc.memory_info().rss
        closed = await asyncio.gather(*(_closed_by_server(loop, s, 30.0) for s in flood))
        assert all(closed), f"{closed.count(False)} flood connections still open after 30 s"
        await _wait(lambda: _no_pending(prefill), 10.0, "every pending handshake gone")
        growth = max(rss_peak, proc.memory_info().rss) - rss_before
        assert growth < 24 << 20, f"the prefill process grew by {growth >> 20} MiB under the flood"
        # A lie after the handshake (a peer of the service with a bug) is bounded too.
        sock = await _open(loop, port)
        await asyncio.wait_for(client_handshake(loop, sock, SECRET), 10)
        await loop.sock_sendall(sock, LEN.pack(512 << 20) + b"{")
        assert await _closed_by_server(loop, sock, 10.0)
        sock.close()
        again = await decode.pull("again", await prefill.prefill("again", 100, seed=9), seed=9)
        assert again["ok"] and again["identical"], again
        assert (await prefill.blocks())["free"] == SMALL_LAYOUT.num_blocks
    finally:
        for s in flood:
            s.close()
        await decode.close()


async def _no_pending(prefill: KVPeerProcess) -> bool:
    return (await prefill.blocks())["connections"]["pending"] == 0


async def test_idle_connections_are_closed_and_never_reused_after(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode("tcp", SMALL_LAYOUT, "idle", peer_process, secret=SECRET,
                                               extra={"tcp_idle_s": 0.5})
    loop = asyncio.get_running_loop()
    try:
        for i in range(3):
            res = await decode.pull(f"r{i}", await prefill.prefill(f"r{i}", 50, seed=i), seed=i)
            assert res["ok"] and res["identical"], res
            # The pooled connection idles past the server's limit and the server closes it...
            await _wait(lambda: _authenticated(prefill, 0), 10.0, "the idle connection closed")
        # ...and the next pull took a fresh one each time instead of failing on the dead one.
        assert decode.transport.health().failures_total.get("pull", 0) == 0

        # A raw connection that authenticates and then says nothing is closed the same way.
        port = (await prefill._call("GET", "/internal/kv/metadata"))["tcp_port"]
        sock = await _open(loop, port)
        await asyncio.wait_for(client_handshake(loop, sock, SECRET), 10)
        assert await _closed_by_server(loop, sock, 10.0)
        sock.close()
        with pytest.raises((ConnectionError, OSError)):  # and a closed one refuses further frames
            await asyncio.wait_for(recv_frame(loop, sock), 1)
    finally:
        await decode.close()


async def _authenticated(prefill: KVPeerProcess, n: int) -> bool:
    return (await prefill.blocks())["connections"]["authenticated"] == n
