"""A follower rank's own endpoint: its KV transport over its pool, and a small HTTP API beside it,
on a thread of its own (the process's main thread runs the steps).

    GET  /health               200 while the process lives (rank 0's /health speaks for the group)
    GET  /ready                200 once the rank serves (a follower pod's probes; 503 before)
    GET  /internal/kv/metadata its transport's metadata: another worker's ranks read its heads
    GET  /internal/kv/health   its transport's health
    POST /internal/rank/pull   {"request_id", "source" (a KVSource), "block_ids"}: rank 0 of a
                               decode worker has reserved block_ids and asks this rank to read its
                               heads of them (release=False: rank 0 releases once every rank read)
                               and, with "verify", check them against the source's digests; answers
                               {"ok", "bytes", "seconds", "transfers", "verify", "verify_detail"} or
                               {"ok": false, "error"}
    POST /internal/rank/digests {"block_ids", "algorithm"}: this rank's digests of its heads of the
                               blocks rank 0 hands out (worker/kv/verify.py): {"heads", "digests"}

/internal/* wants the service's internal secret, as every worker's does. A read of this rank's
blocks over tcp is checked against rank 0's lease table (RankLeases asks rank 0); NIXL READs
are one-sided, as on any worker (worker/kv/README.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Collection
from typing import Any

import aiohttp
from aiohttp import web
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_source import KVRank, KVSource
from tandem.contracts.protocol import REQUEST_ID_HEADER
from tandem.worker.kv.verify import Verdict, block_digests, verify

log = logging.getLogger("tandem.worker.engine.parallel")

STATE = web.AppKey("tandem_rank_server", object)


class RankLeases:
    """A rank's LeaseKeeper: the leases are rank 0's, so a read is checked there (a subset of a
    live lease's blocks, proven by its token); nothing is freed here."""

    def __init__(self, leader_url: str, secret: str | None, timeout_s: float = 5.0):
        self.leader_url = leader_url.rstrip("/")
        self.secret = secret
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None  # made on the server's loop, on first use

    async def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=auth_headers(self.secret))
        try:
            async with asyncio.timeout(self.timeout_s), self._session.post(
                    self.leader_url + "/internal/kv/check", json={
                        "request_id": request_id, "lease_token": lease_token, "block_ids": list(block_ids)},
                    headers={REQUEST_ID_HEADER: request_id}) as resp:
                return resp.status == 200 and bool((await resp.json()).get("ok"))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            log.warning("asking rank 0 about a lease failed: %s", e, extra={"request_id": request_id})
            return False

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class RankServer:
    """Starts the transport and the HTTP API on its own event loop thread; `start()` returns the
    rank's endpoint (a KVRank) once both are up."""

    def __init__(self, cfg: Any, agreement: Any, pool: Any, layout: Any):
        self.cfg, self.agreement, self.pool, self.layout = cfg, agreement, pool, layout
        self.engine_id = agreement.rank_engine_id(cfg.placement.rank)
        self.transport: Any = None
        self.serving = False  # set once the group serves: /ready
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-rank-server", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> KVRank:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    async def _start(self) -> KVRank:
        from tandem.worker.server.auth import internal_auth
        from tandem.worker.server.cli import advertise_url

        cfg, a = self.cfg, self.agreement
        app = web.Application(middlewares=[internal_auth(lambda: cfg.internal_secret)])
        app[STATE] = self
        app.router.add_get("/health", _health)
        app.router.add_get("/ready", _ready)
        app.router.add_get("/internal/kv/metadata", _kv_metadata)
        app.router.add_get("/internal/kv/health", _kv_health)
        app.router.add_post("/internal/rank/pull", _pull)
        app.router.add_post("/internal/rank/digests", _digests)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.host, cfg.port).start()
        url = advertise_url(cfg, self._runner.addresses[0][1])
        extra: dict[str, Any] = {}
        if a.kv_backend != "none":
            from tandem.worker.kv.base import KVTransferConfig
            from tandem.worker.kv.registry import create_transport

            host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
            kv = KVTransferConfig(backend=a.kv_backend, host=host, secret=cfg.internal_secret, port=cfg.kv_port,
                                  **a.kv)
            self.transport = create_transport(a.kv_backend, self.pool, self.layout, self.engine_id, kv)
            await self.transport.start()
            self.transport.leases = RankLeases(a.leader_url, cfg.internal_secret)
            extra = self.transport.source_extra()
        log.info("rank %d listening at %s (KV agent %s)", cfg.placement.rank, url, self.engine_id)
        return KVRank(url, self.engine_id, extra)

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.transport is not None:
            await self.transport.close()
            await self.transport.leases.close()


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "rank": request.app[STATE].cfg.placement.rank, "pid": os.getpid()})


async def _ready(request: web.Request) -> web.Response:
    if request.app[STATE].serving:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "loading", "message": "the group is starting"}, status=503)


def _no_transport() -> web.Response:
    return web.json_response({"error": {"message": "this worker has no KV transport", "type": "not_found",
                                        "param": None, "code": "no_kv_transport"}}, status=404)


async def _kv_metadata(request: web.Request) -> web.Response:
    t = request.app[STATE].transport
    return _no_transport() if t is None else web.json_response(t.metadata())


async def _kv_health(request: web.Request) -> web.Response:
    t = request.app[STATE].transport
    return _no_transport() if t is None else web.json_response(t.health().to_dict())


async def _pull(request: web.Request) -> web.Response:
    from tandem.worker.kv.base import KVTransferError

    t = request.app[STATE].transport
    if t is None:
        return _no_transport()
    doc = await request.json()
    rid = doc["request_id"]
    try:
        source, block_ids = KVSource(**doc["source"]), list(doc["block_ids"])
        stats = await t.pull(rid, source, block_ids, release=False)
    except KVTransferError as e:
        landing = t.still_writing(rid)
        if landing is not None:  # answer only once nothing writes into the blocks: rank 0 frees them then
            await landing
        return web.json_response({"ok": False, "error": str(e), "state": str(e.state)})
    verdict, detail = Verdict.OFF, ""
    if doc.get("verify"):  # this rank's heads of what it pulled, against the source's digests
        verdict, detail = await asyncio.to_thread(verify, t.pool, t.layout, source, block_ids)
    return web.json_response({"ok": True, "bytes": stats.bytes, "seconds": stats.seconds,
                              "transfers": stats.num_transfers, "verify": verdict.value,
                              "verify_detail": detail})


async def _digests(request: web.Request) -> web.Response:
    """This rank's digests of its KV heads of the blocks rank 0 is about to hand out."""
    state = request.app[STATE]
    doc = await request.json()
    values = await asyncio.to_thread(block_digests, state.pool, list(doc["block_ids"]), doc["algorithm"])
    heads = state.layout.kv_heads
    return web.json_response({"heads": [heads.start, heads.stop], "digests": values})
