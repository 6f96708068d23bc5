"""Rank 0 of a tensor-parallel decode worker pulls on every rank at once and releases the lease
once, only when all have read; a rank that fails fails the pull (naming it), and neither a failure
nor a cancelled request returns while another rank may still be writing into the blocks."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.worker.engine.parallel.group_transport import GroupTransport
from tandem.worker.kv.base import KVTransferConfig, KVTransferError, TransferStats

SOURCE = KVSource("http://prefill", "p-1", "tcp", [3, 4], 20, "token")


class Local:
    """Rank 0's own transport: pulls (slowly, if asked), releases at the source, records health."""

    def __init__(self, delay: float = 0.0):
        self.pool = self.layout = None
        self.engine_id, self.name = "d-1", "tcp"
        self.config = KVTransferConfig(backend="tcp", timeout_s=2.0)
        self.delay, self.pulling, self.released, self.failures = delay, False, [], []
        self.kv_health = type("H", (), {"success": lambda *a, **k: None})()

    async def pull(self, rid, source, blocks, release=True):
        assert release is False  # ranks never release on their own
        self.pulling = True
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.pulling = False
        return TransferStats(rid, 100, self.delay, len(blocks), 1)

    async def _release_lease(self, rid, source):
        self.released.append(rid)

    async def _failed(self, rid, source, moving, error):
        self.failures.append(error)

    def still_writing(self, rid):
        return None  # rank 0's own pull stops its transfers before it returns

    async def close(self):
        pass


async def rank_server(answer: dict, delay: float = 0.0, asked: asyncio.Event | None = None
                      ) -> tuple[TestServer, list]:
    seen: list = []

    async def pull(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if asked is not None:
            asked.set()
        await asyncio.sleep(delay)
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/internal/rank/pull", pull)
    server = TestServer(app)
    await server.start_server()
    return server, seen


async def test_every_rank_pulls_then_the_lease_is_released_once():
    server, seen = await rank_server({"ok": True, "bytes": 50, "seconds": 0.01, "transfers": 2})
    local = Local()
    t = GroupTransport(local, [KVRank(str(server.make_url("")), "d-1-r1")])
    try:
        stats = await t.pull("r", SOURCE, [7, 8])
        assert (stats.bytes, stats.num_transfers) == (150, 3) and local.released == ["r"]
        assert seen[0]["block_ids"] == [7, 8] and seen[0]["source"]["lease_token"] == "token"
        assert t.source_ranks() == [KVRank(str(server.make_url("")), "d-1-r1")]
    finally:
        await server.close()


async def test_a_failed_rank_fails_the_pull_after_every_rank_is_done():
    server, _ = await rank_server({"ok": False, "error": "peer refused", "state": "failed"})
    local = Local(delay=0.3)
    t = GroupTransport(local, [KVRank(str(server.make_url("")), "d-1-r1")])
    try:
        with pytest.raises(KVTransferError, match="rank 1 .*peer refused"):
            await t.pull("r", SOURCE, [7, 8])
        assert not local.pulling and not local.released and "peer refused" in local.failures[0]
    finally:
        await server.close()


async def test_blocks_a_rank_may_still_write_into_stay_out_of_use_until_it_answers():
    """A cancelled pull (the client went away) returns at once; still_writing() then waits for the
    rank that has not answered yet, as the engine does before it frees the blocks."""
    asked = asyncio.Event()
    server, _ = await rank_server({"ok": True, "bytes": 50, "seconds": 0.5, "transfers": 1}, delay=0.5, asked=asked)
    t = GroupTransport(Local(), [KVRank(str(server.make_url("")), "d-1-r1")])
    try:
        task = asyncio.ensure_future(t.pull("r", SOURCE, [7, 8]))
        await asyncio.wait_for(asked.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        landing = t.still_writing("r")
        assert landing is not None and not landing.done(), "rank 1 may still be writing into the blocks"
        await asyncio.wait_for(landing, 10)
        assert t.still_writing("r") is None
    finally:
        await t.close()
        await server.close()


async def test_a_rank_that_does_not_answer_in_time_fails_the_pull_and_holds_its_blocks():
    server, _ = await rank_server({"ok": True, "bytes": 50, "seconds": 0.1, "transfers": 1}, delay=8.5)
    local = Local()
    local.config = KVTransferConfig(backend="tcp", timeout_s=0.5)  # answers are awaited 5 s longer
    t = GroupTransport(local, [KVRank(str(server.make_url("")), "d-1-r1")])
    try:
        with pytest.raises(KVTransferError, match="rank 1"):
            await t.pull("r", SOURCE, [7, 8])
        assert t.still_writing("r") is not None and not local.released
    finally:
        await t.close()
        await server.close()
