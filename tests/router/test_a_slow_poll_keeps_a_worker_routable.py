"""Found by the vLLM decode-loss test: a loaded vLLM server's /metrics missed one 2 s poll, and the
router, which took any failed poll for a dead worker, answered the next request 503 "no worker is
ready to serve this request" while the server was serving.

A poll that only times out now keeps the worker as last polled for `slow_poll_grace_s` after its
last good poll; a refused connection, a wrong answer, or timeouts past the grace still take it out
at once. Real HTTP: the router's own client polls a real aiohttp server on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
from aiohttp import web
from tandem.contracts.names import Role
from tandem.contracts.protocol import WorkerInfo
from tandem.router.worker_client import HttpWorkerClient, Timeouts
from tandem.router.workers import Target, WorkerSet

INFO = WorkerInfo(role=Role.DECODE, model="toy", max_model_len=4096, engine_id="e-1", kv_compat="g1",
                  kv_backend="tcp", ready=True, running=0, waiting=0, kv_usage=0.0, outstanding_prompt_tokens=0)


class Worker:
    """/internal/info that answers, stalls past the poll's timeout, or answers 500, as told."""

    def __init__(self) -> None:
        self.mode = "answer"
        self.stalled = asyncio.Event()

    async def info(self, request: web.Request) -> web.Response:
        if self.mode == "stall":
            self.stalled.set()
            await asyncio.sleep(5)
        if self.mode == "error":
            return web.json_response({"error": "broken"}, status=500)
        return web.json_response(dataclasses.asdict(INFO) | {"role": INFO.role.value})


async def _serve(worker: Worker):
    app = web.Application()
    app.router.add_get("/internal/info", worker.info)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _ready(pool: WorkerSet) -> bool:
    return pool.can_serve()


async def test_a_poll_that_times_out_keeps_the_worker_within_the_grace_and_not_after():
    worker = Worker()
    runner, url = await _serve(worker)
    try:
        async with aiohttp.ClientSession() as session:
            pool = WorkerSet(HttpWorkerClient(session, Timeouts(info_s=0.2)), slow_poll_grace_s=30.0)
            pool.set_targets([Target(url)])
            await pool.poll_once()
            assert _ready(pool)
            worker.mode = "stall"
            await pool.poll_once()
            assert worker.stalled.is_set(), "the poll did not reach the stalled handler"
            assert _ready(pool), "one slow poll took a serving worker out"
            assert "TimeoutError" in pool._entries[url].last_error
            pool.slow_poll_grace_s = 0.1  # now past the grace: a hung worker does go
            await pool.poll_once()
            assert not _ready(pool)
            worker.mode = "answer"
            await pool.poll_once()
            assert _ready(pool)
    finally:
        await runner.cleanup()


async def test_a_wrong_answer_or_a_refused_connection_takes_the_worker_out_at_once():
    worker = Worker()
    runner, url = await _serve(worker)
    try:
        async with aiohttp.ClientSession() as session:
            pool = WorkerSet(HttpWorkerClient(session, Timeouts(info_s=0.5)), slow_poll_grace_s=60.0)
            pool.set_targets([Target(url)])
            await pool.poll_once()
            assert _ready(pool)
            worker.mode = "error"
            await pool.poll_once()
            assert not _ready(pool)
            worker.mode = "answer"
            await pool.poll_once()
            assert _ready(pool)
            await runner.cleanup()  # the worker is gone: its port refuses
            await pool.poll_once()
            assert not _ready(pool)
            assert "Cannot connect" in pool._entries[url].last_error or "Connect" in pool._entries[url].last_error
    finally:
        await runner.cleanup()
