"""A forward pass that raises (injected here: a real one would be an OOM or a device fault) ends
the affected streams with an error event instead of leaving clients waiting, frees their blocks,
and the worker serves the next request."""

from __future__ import annotations

from tandem.testing.engine_helpers import ndjson_events, stream_tokens

BODY = {"prompt": "Hello, world!", "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}


async def test_failed_forward_ends_with_error_event(start_worker):
    w = await start_worker()
    real_forward = w.engine.runner.forward
    calls = {"n": 0}

    def failing_forward(items):
        calls["n"] += 1
        if calls["n"] == 2:  # fail mid-generation, after the first token went out
            raise RuntimeError("injected device fault")
        return real_forward(items)

    w.engine.runner.forward = failing_forward
    async with w.client.post("/internal/generate", json=dict(BODY, request_id="f1")) as resp:
        assert resp.status == 200
        events = await ndjson_events(resp)
    assert [e["type"] for e in events] == ["start", "token", "error"]
    assert events[-1]["error"]["code"] == "engine_error" and "injected" in events[-1]["error"]["message"]
    await w.wait_idle()
    async with w.client.post("/internal/generate", json=dict(BODY, request_id="f2")) as resp:
        events = await ndjson_events(resp)
    assert len(stream_tokens(events)) == 6 and events[-1]["type"] == "finish"
