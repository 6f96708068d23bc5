"""GET /internal/kv/events: what this worker's prefix cache holds, streamed to the router's index.

The engine interface (`KVEventSource`): `follow_kv_events(on_snapshot, on_change)` calls
`on_snapshot(block_size, salt, hashes)` with every block hash it holds now, then
`on_change(stored, removed)` whenever that set changes (hashes of
tandem.contracts.prefix.block_hashes over `block_size` tokens with `salt`; a hash in at most one of
the two lists per call), both under the engine's lock, never blocking and never calling back into
the engine; batching a step's changes into one call is best. Taking the snapshot and starting the
changes under one lock makes the snapshot exact: no change is lost or counted twice. An engine
without a prefix cache answers False and the stream publishes an empty snapshot with
`enabled: false` and nothing after it.

The stream (NDJSON of tandem.contracts.kv_events.KVEventMessage): a snapshot as of `seq` (split
over several lines of at most LINE_HASHES hashes, all with that seq), then one UPDATE per change,
numbered seq+1, seq+2, ..., and a HEARTBEAT repeating the last seq whenever `heartbeat_s` passes
without one. A reader that falls QUEUE_LINES behind is cut off; it reconnects and resyncs from a
new snapshot, as after any gap or restart. The publisher mirrors the engine's set, so a snapshot
never takes the engine's lock (which a step holds).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.protocol import NDJSON, openai_error

log = logging.getLogger("tandem.worker.server")

LINE_HASHES = 2048  # hashes per NDJSON line (about 70 KB): below the readers' line limits
QUEUE_LINES = 4096  # lines a reader may fall behind before it is cut off to resync


class KVEventSource(Protocol):
    """What an engine offers the event stream (see the module docstring)."""

    def follow_kv_events(self, on_snapshot: Callable[[int, bytes, list[bytes]], None],
                         on_change: Callable[[list[bytes], list[bytes]], None]) -> bool: ...


def _line(msg: KVEventMessage) -> bytes:
    return (json.dumps(msg.to_dict(), separators=(",", ":")) + "\n").encode()


def _chunks(items: list[str]) -> list[list[str]]:
    return [items[i:i + LINE_HASHES] for i in range(0, len(items), LINE_HASHES)] or [[]]


class _Reader:
    """One open stream: lines queued on the event loop, and why it must end, once it must."""

    def __init__(self) -> None:
        self.lines: collections.deque[bytes] = collections.deque()
        self.wake = asyncio.Event()
        self.cut: str | None = None  # "behind" (too slow: resync) or "shutdown"

    def offer(self, lines: list[bytes]) -> None:
        if self.cut is not None:
            return
        if len(self.lines) + len(lines) > QUEUE_LINES:
            self.cut = "behind"
        else:
            self.lines.extend(lines)
        self.wake.set()

    def end(self, why: str) -> None:
        self.cut = self.cut or why
        self.wake.set()


class KVEventPublisher:
    """Mirrors the engine's cached hashes and fans its changes out to every open stream."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._lock = threading.Lock()  # taken under the engine's lock, never the other way round
        self._held: set[bytes] = set()
        self._seq = 0
        self._readers: set[_Reader] = set()
        self._bound: Any = None
        self._enabled = False
        self._block_size = 0
        self._salt = b""
        self._bind_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def bind(self, engine: KVEventSource) -> None:
        """Start following `engine` (once): its hashes now, then every change."""
        async with self._bind_lock:
            if self._bound is engine:
                return
            self._loop = asyncio.get_running_loop()
            self._enabled = await asyncio.to_thread(engine.follow_kv_events, self._snapshot, self.on_kv_event)
            if not self._enabled:
                log.info("the engine keeps no prefix cache: KV events publish an empty snapshot")
            self._bound = engine

    def _snapshot(self, block_size: int, salt: bytes, hashes: list[bytes]) -> None:
        """Called by the engine under its lock, before any on_kv_event."""
        with self._lock:
            self._held = set(hashes)
            self._block_size = int(block_size)
            self._salt = bytes(salt)

    def on_kv_event(self, stored: list[bytes], removed: list[bytes]) -> None:
        """Called by the engine (any thread, under its lock): record and fan out the change."""
        stored_hex, removed_hex = [h.hex() for h in stored], [h.hex() for h in removed]
        if len(stored_hex) + len(removed_hex) <= LINE_HASHES:
            parts = [(stored_hex, removed_hex)]
        else:  # removals first, as the reader applies them
            parts = [([], r) for r in _chunks(removed_hex) if r] + [(s, []) for s in _chunks(stored_hex) if s]
        with self._lock:
            self._held.difference_update(removed)
            self._held.update(stored)
            lines = []
            for s, r in parts:
                self._seq += 1
                lines.append(_line(KVEventMessage(KVEventType.UPDATE, self._seq, stored=s, removed=r)))
            readers = list(self._readers)
        if self._loop is not None:
            for r in readers:
                self._loop.call_soon_threadsafe(r.offer, lines)

    def subscribe(self) -> tuple[_Reader, int, list[bytes]]:
        """A new reader, the seq its snapshot is as of, and the snapshot's lines."""
        reader = _Reader()
        with self._lock:
            seq, held = self._seq, [h.hex() for h in self._held]
            self._readers.add(reader)
        lines = [_line(KVEventMessage(KVEventType.SNAPSHOT, seq, engine_id=self.engine_id,
                                      block_size=self._block_size, salt=self._salt.hex(),
                                      enabled=self._enabled, hashes=part))
                 for part in _chunks(held)]
        return reader, seq, lines

    def unsubscribe(self, reader: _Reader) -> None:
        with self._lock:
            self._readers.discard(reader)

    def close(self) -> None:
        """End every stream (the worker shuts down)."""
        with self._lock:
            readers = list(self._readers)
        for r in readers:
            r.end("shutdown")


async def _stream(request: web.Request, state: Any, publisher: KVEventPublisher) -> web.StreamResponse:
    if state.engine is None or not state.ready:
        return web.json_response(openai_error("the model is still loading", "service_unavailable", None,
                                              "not_ready"), status=503)
    await publisher.bind(state.engine.engine)
    reader, seq, snapshot = publisher.subscribe()
    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    try:
        await resp.prepare(request)
        for line in snapshot:
            await resp.write(line)
        while reader.cut is None:
            try:
                await asyncio.wait_for(reader.wake.wait(), state.settings.heartbeat_s)
            except TimeoutError:
                await resp.write(_line(KVEventMessage(KVEventType.HEARTBEAT, seq)))
                continue
            reader.wake.clear()
            while reader.lines and reader.cut is None:
                seq += 1
                await resp.write(reader.lines.popleft())
        if reader.cut == "behind":
            log.info("a KV event reader fell %d lines behind: cut off, it resyncs", QUEUE_LINES)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("a KV event reader went away")
    finally:
        publisher.unsubscribe(reader)
    return resp


def add_routes(app: web.Application, state: Any) -> None:
    """GET /internal/kv/events over `state` (WorkerState: its engine appears once loaded)."""
    publisher = KVEventPublisher(state.settings.engine_id)

    async def kv_events(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, publisher)

    async def close(_: web.Application) -> None:
        publisher.close()

    app.on_shutdown.append(close)
    app.router.add_get("/internal/kv/events", kv_events)
