"""The TCP backend: plain asyncio sockets, for clusters without NIXL and as the benchmark baseline.

The prefill side listens on a port (advertised in its metadata); the decode
side keeps a small pool of connections per peer. One pull on a connection:

    decode -> prefill   frame {"op": "read", "request_id", "engine_id", "runs": [[first, count], ...]}
    prefill -> decode   frame {"ok": true, "bytes": N} then N raw bytes, the runs in order
                        (or {"ok": false, "error"} when the blocks cannot be served)
    decode -> prefill   frame {"op": "release", "request_id"}
    prefill -> decode   frame {"ok": true}   after on_released(request_id) ran; {"ok": false} when
                        on_released returned False (the lease had expired: the blocks may have
                        been reused mid-send, so the decode side fails instead of using them)

A frame is a 4-byte big-endian length and JSON. The bytes go from a memoryview
of the sender's pool storage straight into a memoryview of the receiver's pool
(sock_sendall / sock_recv_into): no tensor serialisation, no copy in Python.
The engine_id in "read" makes a restarted prefill worker that reuses the port
refuse instead of serving someone else's blocks. A connection that breaks
mid-request is never reused; the prefill side then frees the request's blocks
(the decode side has failed the pull and will not ask again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.kv.base import KVTransferConfig, KVTransferError
from tandem.worker.kv.pulling import PullTransport, pool_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_MAX_FRAME = 16 << 20
_SOCK_BUF = 4 << 20


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    await _recv_exact(loop, sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > _MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes: not a Tandem KV peer")
    body = bytearray(n)
    await _recv_exact(loop, sock, memoryview(body))
    return json.loads(body)


async def _send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    await loop.sock_sendall(sock, _LEN.pack(len(body)) + body)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


class TcpTransport(PullTransport):
    """Pull over plain TCP sockets: each side sends from / receives into its registered pool memory."""

    name = "tcp"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, engine_id: str, config: KVTransferConfig):
        super().__init__(pool, layout, engine_id, config)
        self._mem = pool_bytes(pool)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conn_tasks: set[asyncio.Task] = set()
        self._idle: dict[str, list[socket.socket]] = {}  # peer engine_id -> idle connections
        self.port: int | None = None
        self.serving: set[str] = set()  # request ids whose bytes are being sent now

    async def start(self) -> None:
        bind = self.config.extra.get("tcp_bind", self.config.host)
        lsock = socket.create_server((bind, int(self.config.extra.get("tcp_port", 0))),
                                     reuse_port=False, backlog=128)
        lsock.setblocking(False)
        self._listener = lsock
        self.port = lsock.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
        for t in list(self._conn_tasks):
            t.cancel()
        await asyncio.gather(*([self._accept_task] if self._accept_task else []), *self._conn_tasks,
                             return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        await self._close_shared()

    def metadata(self) -> dict[str, Any]:
        return self._base_metadata() | {"tcp_host": self.config.host, "tcp_port": self.port}

    def health(self) -> KVHealth:
        return self.kv_health.report(peers={u: m["engine_id"] for u, m in self._peers.items()},
                                     serving=len(self.serving))

    def source_extra(self) -> dict[str, Any]:
        return {"tcp_host": self.config.host, "tcp_port": self.port}

    # --- prefill side: serve reads ------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            _tune(conn)
            task = loop.create_task(self._serve(conn))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        bb = self.layout.block_bytes
        current: str | None = None  # request whose bytes are in flight
        try:
            while True:
                try:
                    msg = await _recv_frame(loop, conn)
                except ConnectionError:
                    return  # an idle connection closed by its owner
                if msg.get("op") == "release":
                    # False from the engine: the lease had expired, so the blocks may have been
                    # reused while we sent them; the puller must not trust those bytes.
                    held = self.on_released(msg["request_id"]) is not False
                    current = None
                    await _send_frame(loop, conn, {"ok": held, "error": None if held else (
                        "the lease on these blocks expired before the pull finished")})
                    continue
                if msg.get("op") != "read":
                    raise ConnectionError(f"unknown op {msg.get('op')!r}")
                runs = msg["runs"]
                if msg.get("engine_id") != self.engine_id:
                    await _send_frame(loop, conn, {"ok": False, "error": (
                        f"this is {self.engine_id}, not {msg.get('engine_id')}: the blocks are gone")})
                    continue
                if any(c <= 0 or not 0 <= s or s + c > self.layout.num_blocks for s, c in runs):
                    await _send_frame(loop, conn, {"ok": False, "error": "block ids out of range"})
                    continue
                current = msg["request_id"]
                self.serving.add(current)
                t0 = time.monotonic()
                total = sum(c for _, c in runs) * bb
                await _send_frame(loop, conn, {"ok": True, "bytes": total})
                for s, c in runs:
                    await loop.sock_sendall(conn, self._mem[s * bb:(s + c) * bb])
                self.serving.discard(current)
                self.kv_health.success("serve", total, time.monotonic() - t0)
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            if current is not None:
                self.serving.discard(current)
                # The puller is gone or gave up mid-request: it will not ask again, free now.
                self.kv_health.failure("serve", f"{current}: {type(e).__name__}: {e}")
                log.warning("kv peer dropped %s mid-transfer (%s): freeing its blocks", current, e)
                self.on_released(current)
        finally:
            conn.close()

    # --- decode side: pull --------------------------------------------------------------------

    async def _add_peer(self, md: dict[str, Any]) -> None:
        self._idle.setdefault(md["engine_id"], [])

    async def _forget_peer(self, md: dict[str, Any]) -> None:
        for s in self._idle.pop(md["engine_id"], []):
            s.close()

    async def _connect(self, md: dict[str, Any]) -> socket.socket:
        idle = self._idle.get(md["engine_id"])
        if idle:
            return idle.pop()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in md["tcp_host"] else socket.AF_INET,
                             socket.SOCK_STREAM)
        try:
            _tune(sock)
            await loop.sock_connect(sock, (md["tcp_host"], md["tcp_port"]))
        except BaseException:
            sock.close()
            raise
        return sock

    async def _read(self, md: dict[str, Any], request_id: str, runs: list[tuple[int, int, int]]) -> int:
        loop = asyncio.get_running_loop()
        bb = self.layout.block_bytes
        sock = await self._connect(md)
        ok = False
        try:
            await _send_frame(loop, sock, {"op": "read", "request_id": request_id,
                                           "engine_id": md["engine_id"],
                                           "runs": [[s, c] for s, _, c in runs]})
            reply = await _recv_frame(loop, sock)
            if not reply.get("ok"):
                raise KVTransferError(f"peer {md['engine_id']} refused: {reply.get('error')}")
            if reply["bytes"] != sum(c for _, _, c in runs) * bb:
                raise KVTransferError(f"peer {md['engine_id']} announced {reply['bytes']} bytes")
            for _, d, c in runs:
                await _recv_exact(loop, sock, self._mem[d * bb:(d + c) * bb])
            await _send_frame(loop, sock, {"op": "release", "request_id": request_id})
            ack = await _recv_frame(loop, sock)
            ok = True  # the exchange is complete: the connection can be reused either way
            if not ack.get("ok"):
                raise KVTransferError(f"peer {md['engine_id']}: {ack.get('error')}: re-run prefill")
        finally:
            # A connection is reused only after a clean exchange; otherwise bytes may still be in flight.
            if ok and not self._closed and md["engine_id"] in self._idle:
                self._idle[md["engine_id"]].append(sock)
            else:
                sock.close()
        return len(runs)
