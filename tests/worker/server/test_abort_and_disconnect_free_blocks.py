"""Cancelling a generation, by /internal/abort or by the client going away, stops the sequence and
returns its blocks to the pool; the HTTP side keeps answering while the engine generates."""

from __future__ import annotations

import json

from tandem.testing.engine_helpers import ndjson_events

LONG = {"prompt": "Hello, world!", "sampling": {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}}


async def test_abort_ends_the_stream_and_frees_blocks(start_worker):
    w = await start_worker()
    async with w.client.post("/internal/generate", json=dict(LONG, request_id="ab")) as resp:
        assert json.loads(await resp.content.readline())["type"] == "start"
        assert json.loads(await resp.content.readline())["type"] == "token"
        # The event loop answers while the engine thread is generating.
        info = await (await w.client.get("/internal/info")).json()
        assert info["running"] == 1 and info["kv_blocks_free"] < info["kv_blocks_total"]
        assert (await w.client.get("/health")).status == 200
        r = await w.client.post("/internal/abort", json={"request_id": "ab"})
        assert (await r.json())["aborted"] is True
        events = await ndjson_events(resp)
    assert events[-1]["type"] == "finish" and events[-1]["finish_reason"] == "abort"
    assert sum(len(e.get("token_ids", [])) for e in events) < 1500
    await w.wait_idle()


async def test_client_disconnect_aborts(start_worker):
    w = await start_worker()
    resp = await w.client.post("/internal/generate", json=dict(LONG, request_id="dc"))
    await resp.content.readline()
    await resp.content.readline()
    assert w.engine.allocator.num_used > 0
    resp.close()  # drop the connection mid-stream
    await w.wait_idle()
    assert w.engine.stats.requests_finished.get("abort") == 1


async def test_abort_of_unknown_request_is_harmless(start_worker):
    w = await start_worker()
    r = await w.client.post("/internal/abort", json={"request_id": "nobody"})
    assert r.status == 200 and (await r.json())["aborted"] is False
    r = await w.client.post("/internal/abort", json={})
    assert r.status == 400
