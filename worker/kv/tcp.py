"""The TCP backend: plain asyncio sockets, for clusters without NIXL and as the benchmark baseline.

The prefill side listens on a fixed port (config.port; advertised in its metadata); the decode
side keeps a small pool of connections per peer. Every connection opens with the mutual HMAC
handshake of tcp_wire.py; then, per pull:

    decode -> prefill   {"op": "read", "request_id", "engine_id", "lease_token",
                         "ranges": [[offset, bytes], ...], "release": true}
    prefill -> decode   {"ok": true, "bytes": N} then N raw bytes, the ranges in order
                        (or {"ok": false, "error"}, nothing sent, when the engine_id is not ours,
                        ranges fall outside the pool or overlap (checked before they are expanded
                        into blocks), or no live lease with that token holds every block they touch)
    decode -> prefill   {"op": "release", "request_id", "lease_token"} (only after a read with
                        "release": true; a rank of a tensor-parallel pull reads with false, and the
                        lease is released once at the source's rank 0, see pull_transport.py)
    prefill -> decode   {"ok": true} once the lease is freed; {"ok": false} when it was not ours
                        to free (expired: the blocks may have been reused mid-send, so the decode
                        side fails instead of using them; or a wrong token)

The bytes go from a memoryview of the sender's pool storage straight into a memoryview of the
receiver's pool (sock_sendall / sock_recv_into): no serialisation, no copy in Python. A connection
that breaks mid-request is never reused; the prefill side then frees the request's lease.

Guards on the port (config.extra, defaults in TcpLimits): the handshake must finish within
tcp_handshake_s; at most tcp_max_pending connections may be mid-handshake (the oldest is dropped
for a newcomer, so a flood cannot lock real peers out) and tcp_max_connections authenticated
(the oldest idle one makes way); a connection idle for tcp_idle_s is closed (the decode side
reuses one only while it is idle for less than half that, which the metadata advertises); a frame
that starts must finish within tcp_frame_s; sending a read's bytes must finish within tcp_send_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_layout import KVLayout
from tandem.worker.kv import throttle
from tandem.worker.kv.base import KVTransferConfig, KVTransferError
from tandem.worker.kv.byte_ranges import Range, blocks_touched, overlapping
from tandem.worker.kv.corruption import Corruption
from tandem.worker.kv.pull_transport import PullTransport, pool_bytes
from tandem.worker.kv.tcp_wire import (
    HandshakeError,
    client_handshake,
    recv_exact,
    recv_frame,
    send_frame,
    server_handshake,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SOCK_BUF = 4 << 20


@dataclass(frozen=True)
class TcpLimits:
    handshake_s: float = 2.0
    idle_s: float = 60.0
    frame_s: float = 5.0
    send_s: float = 30.0
    max_pending: int = 64
    max_connections: int = 256

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> TcpLimits:
        return cls(**{f: type(getattr(cls, f))(extra[f"tcp_{f}"]) for f in cls.__dataclass_fields__
                      if f"tcp_{f}" in extra})


def _tune(sock: socket.socket, buffers: tuple[int, ...] = (socket.SO_SNDBUF, socket.SO_RCVBUF)) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in buffers:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


class _Conn:
    """One accepted connection: pending until its handshake succeeds, then idle or busy."""

    __slots__ = ("sock", "task", "idle", "started")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.task: asyncio.Task | None = None
        self.idle = False
        self.started = False  # its task has begun: from then on the task's finally closes the socket


class TcpTransport(PullTransport):
    """Pull over plain TCP sockets: each side sends from / receives into its registered pool memory."""

    name = "tcp"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, engine_id: str, config: KVTransferConfig):
        super().__init__(pool, layout, engine_id, config)
        self._mem = pool_bytes(pool)
        self.limits = TcpLimits.from_extra(config.extra)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._pending: dict[_Conn, None] = {}  # mid-handshake, oldest first
        self._authed: dict[_Conn, None] = {}  # past the handshake, oldest first
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # peer engine_id -> (conn, idle since)
        self.port: int | None = None
        self.serving: set[str] = set()  # request ids whose bytes are being sent now
        self._throttle = throttle.rate_from_env()  # tests only: a transport below the bandwidth floor
        self._corrupt = Corruption()  # tests only: reads that arrive wrong (the pullers' digests catch them)

    async def start(self) -> None:
        if not self.config.serve:
            return  # a decode-only worker: nobody reads from it, so it opens no port
        bind = self.config.extra.get("tcp_bind", self.config.host)
        lsock = socket.create_server((bind, self.config.port), reuse_port=False, backlog=128)
        lsock.setblocking(False)
        self._listener = lsock
        self.port = lsock.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
        conns = [*self._pending, *self._authed]
        for c in conns:
            self._evict(c)
        await asyncio.gather(*[t for t in (self._accept_task, *(c.task for c in conns)) if t is not None],
                             return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        await self._close_shared()

    def metadata(self) -> dict[str, Any]:
        return self._base_metadata() | {"tcp_host": self.config.host, "tcp_port": self.port,
                                        "tcp_idle_s": self.limits.idle_s}

    def health(self) -> KVHealth:
        return self.kv_health.report(peers={u: m["engine_id"] for u, m in self._peers.items()},
                                     serving=len(self.serving))

    def source_extra(self) -> dict[str, Any]:
        return {"tcp_host": self.config.host, "tcp_port": self.port}

    def connections(self) -> dict[str, int]:
        """Open connections on the KV port: mid-handshake and authenticated (for tests and health)."""
        return {"pending": len(self._pending), "authenticated": len(self._authed)}

    # --- prefill side: admit connections --------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # e.g. out of file descriptors: keep the port, retry shortly
                log.warning("KV port: accept failed (%s)", e)
                await asyncio.sleep(0.1)
                continue
            _tune(sock, buffers=())  # big buffers only once the peer has proven itself
            if len(self._pending) >= self.limits.max_pending:
                self._evict(next(iter(self._pending)))  # the oldest: a real peer answers in one RTT
            conn = _Conn(sock)
            self._pending[conn] = None
            conn.task = loop.create_task(self._serve(conn))

    def _evict(self, conn: _Conn) -> None:
        self._pending.pop(conn, None)
        self._authed.pop(conn, None)
        if conn.task is not None:
            conn.task.cancel()
        if not conn.started:  # cancelled before it ran: no finally will close it
            conn.sock.close()

    def _admit(self, conn: _Conn) -> bool:
        """Move a conn that passed the handshake to the authenticated set, making room if full."""
        self._pending.pop(conn, None)
        if len(self._authed) >= self.limits.max_connections:
            oldest_idle = next((c for c in self._authed if c.idle), None)
            if oldest_idle is None:
                log.warning("KV port: %d authenticated connections, all busy: refusing another",
                            len(self._authed))
                return False
            self._evict(oldest_idle)
        self._authed[conn] = None
        _tune(conn.sock, buffers=(socket.SO_SNDBUF,))
        return True

    async def _serve(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        conn.started = True
        try:
            try:
                async with asyncio.timeout(self.limits.handshake_s):
                    await server_handshake(loop, conn.sock, self.config.secret)
            except (TimeoutError, OSError, ConnectionError) as e:
                log.info("KV port: a connection failed the handshake: %s", e or type(e).__name__)
                return
            if self._admit(conn):
                await self._requests(loop, conn)
        finally:
            self._pending.pop(conn, None)
            self._authed.pop(conn, None)
            conn.sock.close()
            conn.task = None

    # --- prefill side: serve reads ------------------------------------------------------------

    async def _requests(self, loop: asyncio.AbstractEventLoop, conn: _Conn) -> None:
        current: tuple[str, str] | None = None  # (request_id, lease_token) whose bytes are in flight
        sock = conn.sock
        try:
            while True:
                conn.idle = current is None
                try:
                    msg = await recv_frame(loop, sock, wait_s=self.limits.idle_s,
                                           frame_s=self.limits.frame_s)
                except (TimeoutError, ConnectionError) as e:
                    if current is not None:
                        raise ConnectionError(f"no release after the bytes: {e or 'timed out'}") from e
                    return  # an idle connection closed by its owner, or idle too long
                conn.idle = False
                op = msg.get("op")
                rid, token = msg.get("request_id"), msg.get("lease_token")
                if not isinstance(rid, str) or not isinstance(token, str):
                    raise ConnectionError("a request without request_id and lease_token strings")
                if op == "release":
                    held = self.leases.release_lease(rid, token)
                    current = None
                    await send_frame(loop, sock, {"ok": held, "error": None if held else (
                        "the lease on these blocks was not held with that token (expired, released "
                        "or another token)")})
                elif op == "read":
                    refusal = await self._refusal(msg, rid, token)
                    if refusal is not None:
                        log.warning("KV port refused a read: %s", refusal, extra={"request_id": rid})
                        await send_frame(loop, sock, {"ok": False, "error": refusal})
                        continue
                    current = (rid, token) if msg.get("release", True) else None
                    await self._send_ranges(loop, sock, rid, msg["ranges"])
                else:
                    raise ConnectionError(f"unknown op {op!r}")
        except (OSError, ConnectionError, ValueError, TypeError) as e:
            if current is not None:
                rid, token = current
                self.serving.discard(rid)
                # The puller is gone or gave up mid-request: it will not ask again, free now.
                self.kv_health.failure("serve", f"{rid}: {type(e).__name__}: {e}")
                log.warning("kv peer dropped %s mid-transfer (%s): freeing its blocks", rid, e)
                self.leases.release_lease(rid, token)

    async def _refusal(self, msg: dict[str, Any], rid: str, token: str) -> str | None:
        """Why a read must not be served (nothing is sent then), or None."""
        if msg.get("engine_id") != self.engine_id:
            return f"this is {self.engine_id}, not {msg.get('engine_id')}: the blocks are gone"
        ranges, release = msg.get("ranges"), msg.get("release", True)
        if not isinstance(ranges, list) or not isinstance(release, bool) or not all(
                isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges):
            return "ranges must be a list of [offset, bytes] integer pairs, release true or false"
        if any(n <= 0 or s < 0 or s + n > len(self._mem) for s, n in ranges):
            return "byte ranges outside the pool"
        if overlapping(ranges):  # checked before expanding: the blocks touched stay below pool + ranges
            return "byte ranges overlap: a read asks for each byte of the pool at most once"
        blocks = {b for s, n in ranges for b in blocks_touched(s, n, self.layout.block_bytes)}
        allowed = self.leases.check_read(rid, token, sorted(blocks))
        if inspect.isawaitable(allowed):  # a rank asks its group's rank 0, which holds the leases
            allowed = await allowed
        if not allowed:
            return f"no live lease of {rid} with that token holds these blocks"
        return None

    async def _send_ranges(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, rid: str,
                           ranges: list[list[int]]) -> None:
        """The header and the ranges' bytes, straight from the pool, within tcp_send_s."""
        self.serving.add(rid)
        t0 = time.monotonic()
        total = sum(n for _, n in ranges)
        async with asyncio.timeout(self.limits.send_s):
            await send_frame(loop, sock, {"ok": True, "bytes": total})
            sent = 0
            for i, (s, n) in enumerate(ranges):
                data = self._mem[s:s + n]
                await loop.sock_sendall(sock, self._corrupt.garble(data) if i == 0 else data)
                sent += n
                await throttle.pace(sent, t0, self._throttle)
        self.serving.discard(rid)
        self.kv_health.success("serve", total, time.monotonic() - t0)

    # --- decode side: pull --------------------------------------------------------------------

    async def _add_peer(self, md: dict[str, Any]) -> None:
        self._idle.setdefault(md["engine_id"], [])

    async def _forget_peer(self, md: dict[str, Any]) -> None:
        for s, _ in self._idle.pop(md["engine_id"], []):
            s.close()

    async def _connect(self, md: dict[str, Any]) -> tuple[socket.socket, bool]:
        """(a connection that has passed the handshake, whether it is a pooled one)."""
        idle = self._idle.get(md["engine_id"], [])
        # Reuse only well inside the peer's idle timeout, so it has not closed the other end.
        fresh_after = time.monotonic() - float(md.get("tcp_idle_s") or TcpLimits.idle_s) / 2
        while idle:
            sock, since = idle.pop()
            if since >= fresh_after:
                return sock, True
            sock.close()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in md["tcp_host"] else socket.AF_INET,
                             socket.SOCK_STREAM)
        try:
            _tune(sock)
            await loop.sock_connect(sock, (md["tcp_host"], md["tcp_port"]))
            await client_handshake(loop, sock, self.config.secret)
        except HandshakeError as e:
            sock.close()
            raise KVTransferError(f"KV peer {md['engine_id']} at {md['tcp_host']}:{md['tcp_port']}: "
                                  f"{e}") from None
        except BaseException:
            sock.close()
            raise
        return sock, False

    async def _request(self, md: dict[str, Any], read: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
        """Send a read and get its answer; a pooled connection the peer closed meanwhile (nothing
        was served on it) is replaced by a fresh one once."""
        loop = asyncio.get_running_loop()
        while True:
            sock, pooled = await self._connect(md)
            try:
                await send_frame(loop, sock, read)
                return sock, await recv_frame(loop, sock)
            except (ConnectionError, OSError):
                sock.close()
                if not pooled:
                    raise
            except BaseException:
                sock.close()
                raise

    async def _read(self, md: dict[str, Any], request_id: str, lease_token: str, ranges: list[Range],
                    release: bool) -> int:
        loop = asyncio.get_running_loop()
        sock, reply = await self._request(md, {
            "op": "read", "request_id": request_id, "engine_id": md["engine_id"],
            "lease_token": lease_token, "ranges": [[s, n] for s, _, n in ranges], "release": release})
        ok = False
        try:
            if not reply.get("ok"):
                ok = True  # refused before any byte: the connection is clean
                raise KVTransferError(f"peer {md['engine_id']} refused: {reply.get('error')}")
            if reply.get("bytes") != sum(n for _, _, n in ranges):
                raise KVTransferError(f"peer {md['engine_id']} announced {reply.get('bytes')} bytes")
            for _, d, n in ranges:
                await recv_exact(loop, sock, self._mem[d:d + n])
            if not release:
                ok = True
                return len(ranges)
            await send_frame(loop, sock, {"op": "release", "request_id": request_id,
                                          "lease_token": lease_token})
            ack = await recv_frame(loop, sock)
            ok = True  # the exchange is complete: the connection can be reused either way
            if not ack.get("ok"):
                raise KVTransferError(f"peer {md['engine_id']}: {ack.get('error')}: re-run prefill")
        finally:
            # A connection is reused only after a clean exchange; otherwise bytes may still be in flight.
            if ok and not self._closed and md["engine_id"] in self._idle:
                self._idle[md["engine_id"]].append((sock, time.monotonic()))
            else:
                sock.close()
        return len(ranges)
