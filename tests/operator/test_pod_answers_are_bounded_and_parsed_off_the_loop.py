"""What a pod answers the shared operator is bounded (issue 21.2): an InferenceService author chooses
the image, so a pod may answer the router report's read or the metrics scrape with gigabytes, or a gzip bomb.
The operator reads at most a fixed number of bytes, never inflates a compressed answer, and parses
metrics off its event loop. Real HTTP servers on loopback, no cluster."""

from __future__ import annotations

import asyncio
import gzip
import json

from aiohttp import web
from tandem.contracts.kv_health import KVHealth
from tandem.operator import probe
from tandem.operator.probe import METRICS_MAX_BYTES, get_all, read_metrics
from tandem.operator.router_parity import PARITY_MAX_BYTES

HEALTHY = KVHealth(backend="tcp", healthy=True).to_dict()
BIG = 64 * 1024 * 1024


class Hostile:
    """A pod's HTTP server: endless bodies, a gzip bomb, a large valid metrics page; counts bytes sent."""

    def __init__(self) -> None:
        self.sent = 0
        self.app = web.Application()
        self.app.router.add_get("/endless", self.endless)
        self.app.router.add_get("/bomb", self.bomb)
        self.app.router.add_get("/announced", self.announced)

    async def endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"# " + b"x" * (1 << 20) + b"\n"
        try:
            while self.sent < BIG:
                await resp.write(chunk)
                self.sent += len(chunk)
        except (ConnectionResetError, ConnectionError):
            pass
        return resp

    async def bomb(self, _: web.Request) -> web.Response:
        # A valid document followed by 64 MiB of whitespace: ~64 KiB on the wire.
        body = gzip.compress(json.dumps(HEALTHY).encode() + b" " * BIG, compresslevel=9)
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    async def announced(self, _: web.Request) -> web.Response:
        return web.Response(body=b" " * (PARITY_MAX_BYTES + 1), content_type="application/json")

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


async def test_an_endless_metrics_page_is_cut_at_the_limit():
    server = Hostile()
    async with server as url:
        (scrape,) = await read_metrics([("d-0", "decode", True, url + "/endless")], timeout_s=30)
    assert scrape.reading is None and f"more than {METRICS_MAX_BYTES} bytes" in scrape.error
    assert server.sent < 4 * METRICS_MAX_BYTES, f"the operator kept reading: {server.sent} bytes sent"


async def test_a_gzip_bomb_is_refused_not_inflated():
    async with Hostile() as url:
        ((body, error),) = await get_all([url + "/bomb"], 30, PARITY_MAX_BYTES)
    assert body is None and "Content-Encoding gzip" in error, error


async def test_an_announced_oversize_answer_is_refused_before_reading():
    async with Hostile() as url:
        ((body, error),) = await get_all([url + "/announced"], 30, PARITY_MAX_BYTES)
    assert body is None and f"more than {PARITY_MAX_BYTES} bytes" in error, error


def _large_page(series: int) -> str:
    lines = ["# TYPE tandem_worker_running_sequences gauge"]
    lines += [f'tandem_worker_running_sequences{{slot="{i}"}} 1' for i in range(series)]
    return "\n".join(lines) + "\n"


async def test_a_large_page_is_parsed_while_the_loop_keeps_running():
    """The loop serves other work while a page close to the limit is parsed (the GIL is shared, the
    loop is not blocked): a ticker task advances during the parse."""
    page = _large_page(30_000)
    assert len(page) < METRICS_MAX_BYTES
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        before = ticks
        (scrape,) = await probe.parse_pages([("d-0", "decode", True, page, None)])
        during = ticks - before
    finally:
        task.cancel()
    assert scrape.error and "lack" in scrape.error, "a worker page without the engine series is unreadable"
    assert during > 1, "the event loop did not run while the page was parsed"
