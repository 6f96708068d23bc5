"""The load generator against a real aiohttp server speaking the OpenAI streaming format."""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from bench.lib.loadgen import request_body, run_closed_loop, run_open_loop, stream_into
from bench.lib.metrics import RequestRecord
from bench.lib.workload import PlannedRequest


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["max_tokens"] > 100:
        return web.json_response({"error": {"message": "too many", "type": "invalid_request_error",
                                            "param": "max_tokens", "code": None}}, status=400)
    assert body["stream"] is True and body["temperature"] == 0.0 and body["ignore_eos"] is True
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        await resp.write(sse({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}))
    if body["prompt"] == "end early":  # the body ends cleanly, without a finish chunk or [DONE]
        return resp
    if body["prompt"] == "go silent":
        await asyncio.sleep(3)
    await resp.write(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    await resp.write(sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def server():
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def req(i: int, max_tokens: int, at: float = 0.0) -> PlannedRequest:
    return PlannedRequest(i, "hello world", 3, max_tokens, at)


async def test_every_token_chunk_is_timed_and_the_finish_chunk_is_not(server):
    [r] = await run_closed_loop(server, "m", [req(0, 5)], concurrency=1)
    assert r.ok and r.error is None
    assert len(r.chunk_times_s) == 5 and r.completion_tokens == 5 and r.prompt_tokens == 7
    assert r.text == "t0 t1 t2 t3 t4 "
    assert r.send_s <= r.chunk_times_s[0] <= r.chunk_times_s[-1] <= r.end_s
    assert len(r.gaps) == 4
    assert r.done and r.finish_reason == "length" and not r.timed_out


async def _one(url: str, prompt: str, read_timeout_s: float | None = None) -> RequestRecord:
    rec = RequestRecord(0, 3, 2)
    planned = PlannedRequest(0, prompt, 3, 2, 0.0)
    async with aiohttp.ClientSession() as s:
        return await stream_into(s, f"{url}/v1/completions", request_body("m", planned), rec, time.perf_counter(),
                                 timeout_s=60, read_timeout_s=read_timeout_s)


async def test_a_stream_that_ends_without_done_is_told_apart_from_a_finished_one(server):
    r = await _one(server, "end early")
    assert r.text == "t0 t1 " and r.error is None and not r.done and r.finish_reason is None


async def test_a_silent_server_is_a_timeout_not_an_error_reply(server):
    r = await _one(server, "go silent", read_timeout_s=0.5)
    assert r.timed_out and r.text == "t0 t1 " and not r.done and "Timeout" in r.error


async def test_http_errors_are_recorded_not_raised(server):
    recs = await run_open_loop(server, "m", [req(0, 3, 0.01), req(1, 500, 0.02)])
    assert [r.index for r in recs] == [0, 1]
    assert recs[0].ok and not recs[1].ok
    assert recs[1].error.startswith("HTTP 400") and recs[1].ttft is None


async def test_closed_loop_serves_every_request_once(server):
    recs = await run_closed_loop(server, "m", [req(i, 2) for i in range(7)], concurrency=3)
    assert [r.index for r in recs] == list(range(7)) and all(r.ok for r in recs)
