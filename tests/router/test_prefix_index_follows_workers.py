"""The router's prefix index fed over HTTP by workers' GET /internal/kv/events (real worker apps on
loopback over a fake prefix-cache engine, the router's own client and feed): it learns what each
worker stores and evicts, recovers after a worker restart (a new snapshot on reconnect), forgets a
worker that leaves or dies, and resyncs after a gap in the numbering."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.names import Role
from tandem.contracts.prefix import block_hashes
from tandem.router.kv_feed import KVEventFeed
from tandem.router.metrics import RouterMetrics
from tandem.router.policies.base import RequestInfo
from tandem.router.prefix_index import PrefixIndex
from tandem.router.worker_client import HttpWorkerClient, Timeouts
from tandem.testing.fake_prefix_cache import FakePrefixCache as FakeCache
from tandem.worker.server.app import WorkerSettings, WorkerState, create_app

SECRET = "prefix-index-secret-0123456789"
BS, SALT = 4, b"toy"


def prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def hashes(ids: list[int]) -> list[bytes]:
    return block_hashes(ids, BS, SALT)


def req(ids: list[int]) -> RequestInfo:
    return RequestInfo("r", len(ids), ids)


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Worker:
    """A worker app over a FakeCache on a loopback port that survives a restart."""

    def __init__(self, engine_id: str, cache: FakeCache, port: int | None = None) -> None:
        self.engine_id, self.cache, self.port = engine_id, cache, port
        self.server: TestServer | None = None

    async def start(self) -> Worker:
        state = WorkerState(WorkerSettings(role=Role.DECODE, advertise_url="", engine_id=self.engine_id,
                                           internal_secret=SECRET, heartbeat_s=0.2))
        state.engine, state.ready = SimpleNamespace(engine=self.cache), True
        self.server = TestServer(create_app(state), host="127.0.0.1", port=self.port)
        await self.server.start_server()
        self.port = self.server.port
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None


@pytest.fixture
async def router_side():
    session = aiohttp.ClientSession()
    index, metrics = PrefixIndex(), RouterMetrics()
    feed = KVEventFeed(HttpWorkerClient(session, Timeouts(chunk_s=5.0), secret=SECRET), index, metrics,
                       retry_min_s=0.05, retry_max_s=0.2)
    workers: list[Worker] = []
    yield SimpleNamespace(index=index, feed=feed, metrics=metrics, workers=workers)
    await feed.close()
    for w in workers:
        await w.stop()
    await session.close()


async def start_worker(side, engine_id: str, cache: FakeCache, port: int | None = None) -> Worker:
    w = await Worker(engine_id, cache, port).start()
    side.workers.append(w)
    return w


async def test_the_index_learns_what_each_worker_stores_and_evicts(router_side):
    side = router_side
    a, b = prompt(1), prompt(2)
    w1 = await start_worker(side, "w1-e1", FakeCache(hashes(a), block_size=BS, salt=SALT))
    w2 = await start_worker(side, "w2-e1", FakeCache(block_size=BS, salt=SALT))
    side.feed.set_targets([w1.url, w2.url])
    await until(lambda: side.index.engine_id(w1.url) == "w1-e1" and side.index.engine_id(w2.url) == "w2-e1",
                "both snapshots")
    assert side.index.cached_tokens(w1.url, req(a + [9])) == 24 and side.index.cached_tokens(w2.url, req(a)) == 0
    w2.cache.change(stored=hashes(b))
    w1.cache.change(removed=hashes(a)[3:])
    await until(lambda: side.index.cached_tokens(w2.url, req(b + [9])) == 24, "w2's stored blocks")
    await until(lambda: side.index.cached_tokens(w1.url, req(a + [9])) == 12, "w1's evictions")


async def test_a_restarted_worker_is_resynced_from_its_new_snapshot(router_side):
    side = router_side
    old, new = prompt(3), prompt(4)
    w = await start_worker(side, "w-epoch1", FakeCache(hashes(old), block_size=BS, salt=SALT))
    side.feed.set_targets([w.url])
    await until(lambda: side.index.cached_tokens(w.url, req(old + [1])) == 24, "the first snapshot")
    await w.stop()  # the worker dies: what it held goes with it
    await until(lambda: side.index.engine_id(w.url) is None, "the dead worker forgotten")
    assert side.index.cached_tokens(w.url, req(old + [1])) == 0
    restarted = await start_worker(side, "w-epoch2", FakeCache(hashes(new), block_size=BS, salt=SALT), port=w.port)
    await until(lambda: side.index.engine_id(w.url) == "w-epoch2", "the restarted worker's snapshot")
    assert side.index.cached_tokens(w.url, req(new + [1])) == 24
    assert side.index.cached_tokens(w.url, req(old + [1])) == 0
    restarted.cache.change(stored=hashes(old))  # and its updates apply on top, numbered afresh
    await until(lambda: side.index.cached_tokens(w.url, req(old + [1])) == 24, "an update after the restart")


async def test_a_worker_that_leaves_is_forgotten_at_once(router_side):
    side = router_side
    a = prompt(5)
    w1 = await start_worker(side, "w1", FakeCache(hashes(a), block_size=BS, salt=SALT))
    w2 = await start_worker(side, "w2", FakeCache(hashes(a), block_size=BS, salt=SALT))
    side.feed.set_targets([w1.url, w2.url])
    await until(lambda: side.index.blocks(w1.url) and side.index.blocks(w2.url), "both snapshots")
    side.feed.set_targets([w2.url])
    assert side.index.blocks(w1.url) == 0 and side.index.cached_tokens(w1.url, req(a + [1])) == 0
    assert side.index.cached_tokens(w2.url, req(a + [1])) == 24


async def test_a_gap_in_the_numbering_forces_a_resync(router_side):
    """A stand-in worker whose first stream skips an update; the feed reconnects for a snapshot."""
    side = router_side
    a, b = prompt(6), prompt(7)
    streams = 0

    def line(**msg) -> bytes:
        return (json.dumps(msg) + "\n").encode()

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal streams
        streams += 1
        assert request.headers["Authorization"] == auth_headers(SECRET)["Authorization"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        snap = dict(type="snapshot", engine_id="gappy", block_size=BS, salt=SALT.hex(), enabled=True)
        if streams == 1:
            await resp.write(line(seq=0, hashes=[h.hex() for h in hashes(a)], **snap))
            await resp.write(line(type="update", seq=2, stored=[h.hex() for h in hashes(b)], removed=[]))
        else:
            await resp.write(line(seq=5, hashes=[h.hex() for h in hashes(b)], **snap))
        await asyncio.Event().wait()  # hold the stream open until the test ends
        return resp

    app = web.Application()
    app.router.add_get("/internal/kv/events", events)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        url = f"http://127.0.0.1:{server.port}"
        side.feed.set_targets([url])
        await until(lambda: streams == 2 and side.index.cached_tokens(url, req(b + [1])) == 24, "the resync")
        assert side.index.cached_tokens(url, req(a + [1])) == 0  # the skipped-over state is not kept
        assert side.metrics.registry.get_sample_value("tandem_router_kv_event_resyncs_total") == 1
    finally:
        await side.feed.close()
        await server.close()
