"""The TCP KV port's wire: length-prefixed JSON frames read within deadlines, and the handshake.

Frames are a 4-byte big-endian length and JSON. A frame's body is read as its bytes arrive, in
chunks, so a length announced but never sent costs nothing; `limit` caps what a frame may
announce (tiny before the handshake, modest after it), and a frame that starts and stalls
fails after `frame_s`.

Handshake (mutual HMAC challenge-response keyed by the service's internal secret; the secret
never crosses the wire; no secret on either side is the empty key, so a worker with a secret
and one without refuse each other):

    server -> client   {"tandem_kv": 1, "nonce": Ns}
    client -> server   {"nonce": Nc, "mac": HMAC(key, "client" Ns Nc)}
    server -> client   {"ok": true, "mac": HMAC(key, "server" Ns Nc)}   or {"ok": false, "error"}

Fresh 32-byte nonces on both sides stop replay; the role labels stop a reflected answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

VERSION = 1
LEN = struct.Struct(">I")
PRE_AUTH_FRAME = 512  # the handshake's frames are ~150 bytes
MAX_FRAME = 1 << 20  # a read listing every block of a large pool as its own run still fits
_CHUNK = 64 << 10


class HandshakeError(ConnectionError):
    """The other end is not a member of this service (wrong secret, or not a Tandem KV peer)."""


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


async def _recv_body(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    body = bytearray()
    while len(body) < n:
        chunk = await loop.sock_recv(sock, min(n - len(body), _CHUNK))
        if not chunk:
            raise ConnectionError("peer closed the connection mid-frame")
        body += chunk
    return bytes(body)


async def recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int = MAX_FRAME,
                     *, wait_s: float | None = None, frame_s: float | None = None) -> dict[str, Any]:
    """The next frame as a JSON object. TimeoutError when none starts within wait_s (None: wait
    forever) or one that started is not complete within frame_s; ConnectionError for a frame
    over `limit`, a closed connection or a body that is not a JSON object."""
    head = bytearray(LEN.size)
    async with asyncio.timeout(wait_s):
        n = await loop.sock_recv_into(sock, head)
    if n == 0:
        raise ConnectionError("peer closed the connection")
    async with asyncio.timeout(frame_s):
        if n < LEN.size:
            await recv_exact(loop, sock, memoryview(head)[n:])
        (size,) = LEN.unpack(head)
        if size > limit:
            raise ConnectionError(f"a frame of {size} bytes (at most {limit} here): not a Tandem KV peer")
        body = await _recv_body(loop, sock, size)
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise ConnectionError(f"a frame that is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ConnectionError("a frame that is not a JSON object")
    return msg


async def send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    await loop.sock_sendall(sock, LEN.pack(len(body)) + body)


def _key(secret: str | None) -> bytes:
    return (secret or "").encode()


def _mac(secret: str | None, role: str, server_nonce: str, client_nonce: str) -> str:
    msg = f"tandem-kv/{VERSION}/{role}/{server_nonce}/{client_nonce}".encode()
    return hmac.new(_key(secret), msg, hashlib.sha256).hexdigest()


def _nonce(msg: dict[str, Any]) -> str:
    nonce = msg.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 64:
        raise HandshakeError("the handshake carried no valid nonce: not a Tandem KV peer")
    return nonce


async def server_handshake(loop: asyncio.AbstractEventLoop, sock: socket.socket, secret: str | None) -> None:
    """Prove the connecting peer holds the secret, and prove we do; HandshakeError otherwise.
    The caller bounds it in time."""
    server_nonce = secrets.token_hex(32)
    await send_frame(loop, sock, {"tandem_kv": VERSION, "nonce": server_nonce})
    msg = await recv_frame(loop, sock, PRE_AUTH_FRAME)
    client_nonce = _nonce(msg)
    mac = msg.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(
            mac.encode(), _mac(secret, "client", server_nonce, client_nonce).encode()):
        await send_frame(loop, sock, {"ok": False, "error": "wrong internal secret"})
        raise HandshakeError("a KV peer failed the handshake (wrong internal secret)")
    await send_frame(loop, sock, {"ok": True, "mac": _mac(secret, "server", server_nonce, client_nonce)})


async def client_handshake(loop: asyncio.AbstractEventLoop, sock: socket.socket, secret: str | None) -> None:
    """Answer the server's challenge and check its answer to ours; HandshakeError when either
    side lacks the secret. The caller bounds it in time."""
    hello = await recv_frame(loop, sock, PRE_AUTH_FRAME)
    if hello.get("tandem_kv") != VERSION:
        raise HandshakeError(f"not a Tandem KV port (or another version): {str(hello)[:80]}")
    server_nonce = _nonce(hello)
    client_nonce = secrets.token_hex(32)
    await send_frame(loop, sock, {"nonce": client_nonce,
                                  "mac": _mac(secret, "client", server_nonce, client_nonce)})
    reply = await recv_frame(loop, sock, PRE_AUTH_FRAME)
    if not reply.get("ok"):
        raise HandshakeError(f"refused our internal secret ({reply.get('error')}): every worker of a "
                             "service must run with the same secret (TANDEM_INTERNAL_SECRET)")
    mac = reply.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(
            mac.encode(), _mac(secret, "server", server_nonce, client_nonce).encode()):
        raise HandshakeError("did not prove it holds this service's internal secret: "
                             "not a worker of this service")
