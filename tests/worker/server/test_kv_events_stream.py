"""GET /internal/kv/events over an engine that implements the prefix-cache interface (a fake: the
engine's cache is another engineer's): a snapshot first, then numbered updates in order (also
from another thread), heartbeats when idle, long snapshots split over lines, a reader that falls
behind cut off, an engine without a cache publishing an empty snapshot, 503 before the model is
loaded, 401 without the secret, and the stream ending when the worker shuts down."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.names import Role
from tandem.testing.fake_prefix_cache import FakePrefixCache as FakeCache
from tandem.worker.server import kv_events
from tandem.worker.server.app import WorkerSettings, WorkerState, create_app
from tandem.worker.server.kv_events import KVEventSource

SECRET = "kv-events-secret-0123456789"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Lines:
    """The NDJSON lines of one open stream, read one at a time with a timeout."""

    def __init__(self, resp) -> None:
        self.resp = resp

    async def next(self, timeout_s: float = 10.0) -> KVEventMessage | None:
        line = await asyncio.wait_for(self.resp.content.readline(), timeout_s)
        return KVEventMessage.from_dict(json.loads(line)) if line else None

    async def next_update(self) -> KVEventMessage:
        while (msg := await self.next()).type is KVEventType.HEARTBEAT:
            pass
        return msg


@pytest.fixture
async def serve():
    clients = []

    async def start(engine=None, ready: bool = True, secret: str | None = None,
                    heartbeat_s: float = 5.0) -> TestClient:
        state = WorkerState(WorkerSettings(role=Role.DECODE, advertise_url="", engine_id="w-1",
                                           heartbeat_s=heartbeat_s, internal_secret=secret))
        if engine is not None:
            state.engine, state.ready = SimpleNamespace(engine=engine), ready
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()


async def open_stream(client: TestClient, **headers) -> Lines:
    resp = await client.get("/internal/kv/events", headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/x-ndjson")
    return Lines(resp)


def test_the_fake_implements_the_engine_interface():
    cache: KVEventSource = FakeCache({h(1)}, block_size=4, salt=b"s")
    seen = []
    assert cache.follow_kv_events(lambda *snap: seen.append(snap), lambda stored, removed: None)
    assert seen == [(4, b"s", [h(1)])]
    assert not FakeCache(enabled=False).follow_kv_events(seen.append, lambda stored, removed: None)


async def test_snapshot_then_numbered_updates_in_order(serve):
    cache = FakeCache({h(1), h(2)}, block_size=4, salt=b"s1")
    lines = await open_stream(await serve(cache))
    snap = await lines.next()
    assert snap.type is KVEventType.SNAPSHOT and snap.enabled
    assert (snap.engine_id, snap.block_size, snap.salt) == ("w-1", 4, b"s1".hex())
    assert sorted(snap.hashes) == [h(1).hex(), h(2).hex()]
    cache.change(stored=[h(3)], removed=[h(1)])
    cache.change(stored=[h(4), h(5)])
    first, second = await lines.next_update(), await lines.next_update()
    assert (first.type, first.seq, first.stored, first.removed) == (
        KVEventType.UPDATE, snap.seq + 1, [h(3).hex()], [h(1).hex()])
    assert (second.seq, second.stored, second.removed) == (snap.seq + 2, [h(4).hex(), h(5).hex()], [])


async def test_a_second_reader_of_one_worker_gets_a_snapshot_as_of_the_last_update(serve):
    cache = FakeCache({h(1)})
    client = await serve(cache)
    a = await open_stream(client)
    assert (await a.next()).seq == 0
    cache.change(stored=[h(2)])
    assert (await a.next_update()).seq == 1
    b = await open_stream(client)
    snap = await b.next()
    assert snap.seq == 1 and sorted(snap.hashes) == sorted([h(1).hex(), h(2).hex()])
    cache.change(removed=[h(1)])
    assert (await a.next_update()).seq == (await b.next_update()).seq == 2


async def test_changes_made_on_the_engine_thread_arrive_in_order(serve):
    cache = FakeCache()
    lines = await open_stream(await serve(cache))
    await lines.next()
    thread = threading.Thread(target=lambda: [cache.change(stored=[h(i)]) for i in range(200)])
    thread.start()
    got = [await lines.next_update() for _ in range(200)]
    thread.join(timeout=10)
    assert [m.seq for m in got] == list(range(1, 201))
    assert [m.stored for m in got] == [[h(i).hex()] for i in range(200)]


async def test_an_idle_stream_gets_heartbeats_with_the_last_seq(serve):
    cache = FakeCache()
    lines = await open_stream(await serve(cache, heartbeat_s=0.05))
    await lines.next()
    cache.change(stored=[h(7)])
    assert (await lines.next_update()).seq == 1
    beat = await lines.next()
    assert (beat.type, beat.seq) == (KVEventType.HEARTBEAT, 1)


async def test_a_large_snapshot_and_a_large_update_are_split_over_lines(serve):
    n = kv_events.LINE_HASHES + 5
    cache = FakeCache({h(i) for i in range(n)})
    lines = await open_stream(await serve(cache))
    first, second = await lines.next(), await lines.next()
    assert first.type is second.type is KVEventType.SNAPSHOT and first.seq == second.seq == 0
    assert len(first.hashes) == kv_events.LINE_HASHES and len(second.hashes) == 5
    assert {*first.hashes, *second.hashes} == {h(i).hex() for i in range(n)}
    cache.change(removed=[h(i) for i in range(n)])
    a, b = await lines.next_update(), await lines.next_update()
    assert (a.seq, b.seq) == (1, 2) and len(a.removed) + len(b.removed) == n


async def test_a_reader_that_falls_behind_is_cut_off(serve, monkeypatch):
    monkeypatch.setattr(kv_events, "QUEUE_LINES", 8)
    cache = FakeCache()
    lines = await open_stream(await serve(cache))
    await lines.next()
    for i in range(20):  # on the loop, without yielding: the stream cannot drain in between
        cache.change(stored=[h(i)])
    assert await lines.next() is None  # the stream ended: the reader reconnects and resyncs
    snap = await (await open_stream(await serve(cache))).next()
    assert len(snap.hashes) == 20


async def test_an_engine_without_a_prefix_cache_publishes_an_empty_snapshot(serve):
    lines = await open_stream(await serve(FakeCache(enabled=False)))
    snap = await lines.next()
    assert snap.type is KVEventType.SNAPSHOT and not snap.enabled and snap.hashes == []


async def test_before_the_model_is_loaded_the_stream_is_503(serve):
    client = await serve(None)
    resp = await client.get("/internal/kv/events")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_ready"


async def test_the_stream_needs_the_internal_secret(serve):
    client = await serve(FakeCache(), secret=SECRET)
    resp = await client.get("/internal/kv/events")
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_internal_secret"
    assert (await (await open_stream(client, **auth_headers(SECRET))).next()).type is KVEventType.SNAPSHOT


async def test_the_stream_ends_when_the_worker_shuts_down(serve):
    client = await serve(FakeCache({h(1)}))
    lines = await open_stream(client)
    await lines.next()
    await asyncio.wait_for(client.server.runner.shutdown(), 10)
    assert await lines.next() is None
