"""The TCP KV port serves only the blocks of a live lease proven by its token, to a peer that holds
the service's secret: a read of blocks that are not leased, or with a wrong token, is refused and
nothing is sent; a duplicate release or one with a wrong token frees nothing; a subset of a
lease's blocks may be read (decode pulls only what it lacks)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import pytest
import torch
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeerProcess, block_pattern, prefill_and_decode
from tandem.worker.kv.base import KVTransferError
from tandem.worker.kv.tcp_wire import LEN, HandshakeError, client_handshake, recv_frame, send_frame

pytestmark = [pytest.mark.timeout(120)]

SECRET = "kv-guard-test-secret-0123456789"


async def _raw(port: int, secret: str | None) -> socket.socket:
    """A connection to the KV port that has passed the handshake with `secret`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    try:
        await asyncio.wait_for(client_handshake(loop, sock, secret), 10)
    except BaseException:
        sock.close()
        raise
    return sock


async def _kv_port(p: KVPeerProcess) -> int:
    return (await p._call("GET", "/internal/kv/metadata"))["tcp_port"]


async def test_reads_without_a_live_lease_and_its_token_are_refused(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode("tcp", SMALL_LAYOUT, "guard-1", peer_process, secret=SECRET)
    try:
        src = await prefill.prefill("r1", 5 * SMALL_LAYOUT.block_size, seed=11)
        other = await prefill.prefill("r2", SMALL_LAYOUT.block_size, seed=12)
        for what, token in {"wrong token": "guessed-" + "x" * 40, "no token": "",
                            "another lease's token": other.lease_token}.items():
            dst = decode.allocate(len(src.block_ids))
            with pytest.raises(KVTransferError, match="no live lease") as err:
                await decode.transport.pull("r1", dataclasses.replace(src, lease_token=token), dst)
            assert "refused" in str(err.value), what
            assert not decode.pool[dst].any(), f"{what}: bytes arrived although the read was refused"
            decode.free_blocks(dst)
        assert (await prefill.blocks())["leased"] == 2, "a refused read (and its release) freed a lease"

        # With the right token, blocks outside the lease are refused too, and no byte follows.
        loop = asyncio.get_running_loop()
        sock = await _raw(await _kv_port(prefill), SECRET)
        try:
            bb = SMALL_LAYOUT.block_bytes
            first, theirs = src.block_ids[0] * bb, other.block_ids[0] * bb
            for ranges in ([[first + 100 * bb, bb]], [[theirs, 1]], [[first, 5 * bb], [theirs, bb]],
                           [[0, 10**6 * bb]], [[(src.block_ids[-1] + 1) * bb - 1, 2]]):  # last: into a neighbour
                await send_frame(loop, sock, {"op": "read", "request_id": "r1", "engine_id": src.engine_id,
                                              "lease_token": src.lease_token, "ranges": ranges})
                reply = await asyncio.wait_for(recv_frame(loop, sock), 10)
                assert reply["ok"] is False, ranges
                # The next frame on the wire answers the next request: nothing was sent in between.
                await send_frame(loop, sock, {"op": "release", "request_id": "none", "lease_token": "t"})
                nxt = await asyncio.wait_for(recv_frame(loop, sock), 10)
                assert nxt["ok"] is False and "not held" in nxt["error"], nxt
        finally:
            sock.close()
        assert (await prefill.blocks())["leased"] == 2

        # The lease's own token reads it, and a subset of its blocks is allowed.
        tail = dataclasses.replace(src, block_ids=src.block_ids[2:], num_tokens=3 * SMALL_LAYOUT.block_size)
        dst = decode.allocate(3)
        await decode.transport.pull("r1", tail, dst)
        for i, b in enumerate(dst):
            assert torch.equal(decode.pool[b], block_pattern(SMALL_LAYOUT, 11, i + 2))
        decode.free_blocks(dst)
        assert (await prefill.blocks())["leased"] == 1, "the pull released the whole lease"
        # ...and only once: the lease is gone, so a second read of it is refused.
        again = await decode.pull("r1", src, seed=None)
        assert not again["ok"] and "no live lease" in again["error"], again
    finally:
        await decode.close()


async def test_duplicate_or_wrong_token_release_frees_nothing(peer_process: list) -> None:
    prefill = KVPeerProcess("tcp", SMALL_LAYOUT, "prefill-guard-2", secret=SECRET)  # we speak the wire
    peer_process.append(prefill)
    prefill.start()
    src = await prefill.prefill("r", 3 * SMALL_LAYOUT.block_size, seed=5)
    loop = asyncio.get_running_loop()
    sock = await _raw(await _kv_port(prefill), SECRET)
    try:
        async def release(token: str) -> dict:
            await send_frame(loop, sock, {"op": "release", "request_id": "r", "lease_token": token})
            return await asyncio.wait_for(recv_frame(loop, sock), 10)

        assert (await release("wrong"))["ok"] is False
        assert (await prefill.blocks())["leased"] == 1
        assert (await release(src.lease_token))["ok"] is True
        assert (await release(src.lease_token))["ok"] is False  # a duplicate: nothing left to free
        blocks = await prefill.blocks()
        assert blocks["free"] == SMALL_LAYOUT.num_blocks and blocks["released"] == 1
    finally:
        sock.close()
    # Over HTTP too: the same rule, behind the secret.
    src = await prefill.prefill("h", SMALL_LAYOUT.block_size, seed=6)
    assert (await prefill._call("POST", "/internal/kv/release",
                                {"request_id": "h", "lease_token": "nope"}))["released"] is False
    assert (await prefill._call("POST", "/internal/kv/release",
                                {"request_id": "h", "lease_token": src.lease_token}))["released"] is True


async def test_a_peer_with_another_secret_is_refused_at_the_handshake(peer_process: list) -> None:
    prefill, decode = await prefill_and_decode("tcp", SMALL_LAYOUT, "guard-3", peer_process, secret=SECRET)
    try:
        port = await _kv_port(prefill)
        for wrong in ("another-service-secret-000000", None):
            with pytest.raises(HandshakeError, match="refused our internal secret"):
                await _raw(port, wrong)
        (await _raw(port, SECRET)).close()

        # A decode worker whose secret no longer matches its peer's KV port (say, rotated on one
        # side only) gets a clear KVTransferError from the handshake.
        warm = await decode.pull("warm", await prefill.prefill("warm", 1, seed=1), seed=1)
        assert warm["ok"] and warm["identical"], warm
        decode.pool.zero_()
        decode.transport.config.secret = "rotated-on-one-side-only-0000"
        for md in list(decode.transport._peers.values()):  # no pooled connection: a new handshake
            await decode.transport._forget_peer(md)
            await decode.transport._add_peer(md)
        src = await prefill.prefill("r", 40, seed=2)
        res = await decode.pull("r", src, seed=None)
        assert not res["ok"] and "refused our internal secret" in res["error"], res
        assert not decode.pool.any(), "bytes arrived over a connection that failed the handshake"
    finally:
        await decode.close()


async def test_the_decode_side_checks_the_server_too() -> None:
    """Mutual: a listener that accepts any answer but cannot prove the secret is not trusted."""
    loop = asyncio.get_running_loop()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.dumps({"tandem_kv": 1, "nonce": "ab" * 32}).encode()
        writer.write(LEN.pack(len(hello)) + hello)
        head = await reader.readexactly(4)
        await reader.readexactly(LEN.unpack(head)[0])
        ok = json.dumps({"ok": True, "mac": "00" * 32}).encode()
        writer.write(LEN.pack(len(ok)) + ok)
        await writer.drain()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, server.sockets[0].getsockname())
        with pytest.raises(HandshakeError, match="did not prove"):
            await asyncio.wait_for(client_handshake(loop, sock, SECRET), 10)
        sock.close()
    finally:
        server.close()
        await server.wait_closed()
