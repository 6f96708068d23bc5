"""An engine thread that stops making progress (wedged in a step) or dies turns /health and /ready
to 503, so the liveness probe restarts the pod; a stream waiting on it ends with an error event
(engine_unhealthy) instead of heartbeats forever, so the router resumes it elsewhere; new work is
refused with 503. A thread that recovers is healthy again."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tandem.testing.engine_helpers import ndjson_events

BODY = {"prompt": "Hello, world!", "sampling": {"max_tokens": 50, "temperature": 0, "ignore_eos": True}}


async def _health_becomes(w, status: int, within: float = 20.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        resp = await w.client.get("/health")
        if resp.status == status:
            return await resp.json()
        assert time.monotonic() < deadline, f"/health stayed {resp.status}"
        await asyncio.sleep(0.05)


async def test_a_wedged_engine_fails_health_and_ends_its_streams(start_worker):
    w = await start_worker(stall_s=0.5)
    w.state.settings.heartbeat_s = 0.1
    release = threading.Event()
    real = w.engine.runner.forward

    def forward(items):
        if w.engine.stats.steps_total >= 3:
            release.wait(60)  # wedged until the test lets it go
        return real(items)

    w.engine.runner.forward = forward
    async with w.client.post("/internal/generate", json=dict(BODY, request_id="w")) as resp:
        events = await ndjson_events(resp)
    # heartbeats (every 0.1 s of silence) may come between them on a loaded machine
    assert [e["type"] for e in events if e["type"] != "heartbeat"][:4] == ["start", "token", "token", "token"]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_unhealthy"
    assert "no progress" in (await _health_becomes(w, 503))["message"]
    assert (await w.client.get("/ready")).status == 503
    assert "tandem_worker_engine_healthy 0.0" in await (await w.client.get("/metrics")).text()
    refused = await w.client.post("/internal/generate", json=dict(BODY, request_id="new"))
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "engine_unhealthy"
    release.set()
    assert (await _health_becomes(w, 200))["status"] == "ok"
    await w.wait_idle()  # the stream's end aborted its sequence once the step returned


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
async def test_a_dead_engine_thread_fails_health(start_worker):
    w = await start_worker()

    def die():
        raise SystemExit("injected: the engine thread ends")

    w.engine.has_work = die
    w.state.engine._wake.set()
    assert "died" in (await _health_becomes(w, 503))["message"]
    assert (await w.client.get("/ready")).status == 503
