"""A stand-in decode worker that speaks the internal protocol at a set pace, with no model: for the
router's tests that need a stream of known length in time (graceful shutdown), or a worker that
says it is full (429/503 with Retry-After), on a 2-core machine where a real model's speed varies.

Run as a process: `python -m tandem.testing.paced_worker --port P --tokens N --interval-s S`.
GET /test/stats says what it was asked (generate calls, busy refusals, aborts, streams open);
POST /test/mode {"busy": true, "status": 429, "retry_after": 1} switches it to refusing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web
from tandem.contracts.names import Role
from tandem.contracts.protocol import (
    NDJSON,
    EventType,
    FinishReason,
    StreamEvent,
    WorkerInfo,
    openai_error,
)
from tandem.worker.local.processes import ManagedProcess, free_port


@dataclass
class Paced:
    tokens: int
    interval_s: float
    model: str = "paced"
    busy: bool = False
    busy_status: int = 429
    retry_after: str = "1"
    stats: dict[str, int] = field(default_factory=lambda: {"generate": 0, "busy": 0, "aborts": 0, "open": 0,
                                                           "finished": 0})

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(WorkerInfo(
            role=Role.DECODE, model=self.model, max_model_len=100_000, engine_id="paced-1", kv_compat="",
            kv_backend="none", ready=True, running=self.stats["open"], waiting=0, kv_usage=0.0,
            outstanding_prompt_tokens=0).to_dict())

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.stats["generate"] += 1
        if self.busy:
            self.stats["busy"] += 1
            return web.json_response(openai_error("the queue is full", "service_unavailable", None,
                                                  "server_overloaded"),
                                     status=self.busy_status, headers={"Retry-After": self.retry_after})
        n = min(self.tokens, body["sampling"]["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": NDJSON})
        await resp.prepare(request)
        self.stats["open"] += 1
        try:
            await resp.write(_line(StreamEvent(EventType.START, prompt_tokens=3)))
            for i in range(n):
                await asyncio.sleep(self.interval_s)  # the pace is the point of this worker
                await resp.write(_line(StreamEvent(EventType.TOKEN, token_ids=[i % 50], text=f" t{i}")))
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            await resp.write(_line(StreamEvent(EventType.FINISH, finish_reason=FinishReason.LENGTH, usage=usage)))
            await resp.write_eof()
            self.stats["finished"] += 1
            return resp
        finally:
            self.stats["open"] -= 1

    async def abort(self, request: web.Request) -> web.Response:
        self.stats["aborts"] += 1
        return web.json_response({"aborted": True})

    async def mode(self, request: web.Request) -> web.Response:
        m = await request.json()
        self.busy = bool(m.get("busy", False))
        self.busy_status = int(m.get("status", 429))
        self.retry_after = str(m.get("retry_after", 1))
        return web.json_response({"busy": self.busy})

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats_endpoint(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)


def _line(ev: StreamEvent) -> bytes:
    return (json.dumps(ev.to_dict()) + "\n").encode()


def build_app(paced: Paced) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", paced.ok)
    app.router.add_get("/ready", paced.ok)
    app.router.add_get("/internal/info", paced.info)
    app.router.add_post("/internal/generate", paced.generate)
    app.router.add_post("/internal/abort", paced.abort)
    app.router.add_get("/test/stats", paced.stats_endpoint)
    app.router.add_post("/test/mode", paced.mode)
    return app


def start_paced_worker(*args: str) -> ManagedProcess:
    """This module as a process on a free loopback port, once it answers /ready."""
    import sys

    port = free_port()
    argv = [sys.executable, "-m", "tandem.testing.paced_worker", "--port", str(port), *args]
    proc = ManagedProcess("paced worker", argv, url=f"http://127.0.0.1:{port}", role="decode").start()
    proc.wait_ready("/ready", 60)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--interval-s", type=float, default=0.1)
    parser.add_argument("--busy", action="store_true")
    args = parser.parse_args()
    paced = Paced(args.tokens, args.interval_s, busy=args.busy)
    web.run_app(build_app(paced), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
