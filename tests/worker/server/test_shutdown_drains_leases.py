"""On SIGTERM a worker stops being ready and waits (bounded) until its leased KV has been pulled
or released, so scaling a prefill pool down does not break handoffs in flight."""

from __future__ import annotations

import asyncio

from tandem.worker.server.runtime import wait_drained

BODY = {"request_id": "d1", "prompt": "Hello, world!", "sampling": {"max_tokens": 5, "temperature": 0}}


async def test_drain_waits_for_the_lease(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory")
    resp = await w.client.post("/internal/prefill", json=BODY)
    assert resp.status == 200 and (kv := (await resp.json())["kv"]) is not None
    task = asyncio.create_task(wait_drained(w.engine, 60.0))
    for _ in range(10):
        await asyncio.sleep(0.06)
    assert not task.done(), "drain returned while a lease was outstanding"
    await w.client.post("/internal/kv/release", json={"request_id": "d1", "lease_token": kv["lease_token"]})
    await asyncio.wait_for(task, 10)


async def test_drain_gives_up_after_its_bound(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory")
    resp = await w.client.post("/internal/prefill", json=dict(BODY, request_id="d2"))
    assert resp.status == 200
    kv = (await resp.json())["kv"]
    assert not await asyncio.wait_for(wait_drained(w.engine, 0.2), 10)
    assert "d2" in w.engine.leases  # still there: drain only waits, the lease is freed on release
    await w.client.post("/internal/kv/release", json={"request_id": "d2", "lease_token": kv["lease_token"]})


async def test_drain_waits_for_every_stream_to_write_its_last_line(start_worker):
    """A sequence handed out without KV leaves no lease behind: only the open stream, still to write
    its MIGRATE line, says the drain is not over. Streams are counted while open."""
    w = await start_worker(role="colocated")
    body = {"request_id": "s1", "prompt": "Hello, world!", "sampling": {"max_tokens": 40, "temperature": 0,
                                                                         "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # START
        assert w.state.open_streams == 1
        await resp.read()
    assert w.state.open_streams == 0

    answers = iter([2, 1, 0])
    asked = []

    def open_streams() -> int:
        asked.append(1)
        return next(answers, 0)

    assert await asyncio.wait_for(wait_drained(w.engine, 60.0, open_streams), 10)
    assert len(asked) == 3, "drain returned with streams still open"
