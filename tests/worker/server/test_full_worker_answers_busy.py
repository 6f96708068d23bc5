"""A full worker says so, quickly and in a form the router reads as busy (429, or 503 with
Retry-After), never as dead: a full queue (429 queue_full), a prefill that could not start within
prefill_queue_s (429 prefill_queue_timeout, well under the router's prefill timeout), a KV cache
with no room for a handoff within kv_reserve_wait_s (503 kv_cache_full). Each refusal leaves
nothing allocated, and the refused request can be sent again once there is room."""

from __future__ import annotations

import json

from tandem.testing.engine_helpers import ndjson_events, stream_tokens

SAMPLING = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
IDS = [0] + [5 + i for i in range(18)]  # 19 tokens: 3 blocks of 8


async def _busy(resp, status: int, code: str) -> None:
    assert resp.status == status
    assert resp.headers["Retry-After"] == "1"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("service_unavailable", code)


def _refused(w, reason: str) -> float:
    return w.state.metrics.refused.labels(reason)._value.get()


async def test_a_full_queue_is_429_with_retry_after(start_worker):
    w = await start_worker(max_num_seqs=1, max_waiting=1)
    body = {"prompt_token_ids": IDS, "sampling": dict(SAMPLING, max_tokens=1500)}
    async with w.client.post("/internal/generate", json=dict(body, request_id="runs")) as running:
        assert json.loads(await running.content.readline())["type"] == "start"
        assert json.loads(await running.content.readline())["type"] == "token"  # holds the one seat
        async with w.client.post("/internal/generate", json=dict(body, request_id="waits")) as waiting:
            assert waiting.status == 200  # the one place in the queue
            await _busy(await w.client.post("/internal/generate", json=dict(body, request_id="refused")),
                        429, "queue_full")
            assert _refused(w, "queue_full") == 1
            assert "refused" not in w.engine.seqs and w.engine.num_waiting == 1
    await w.wait_idle()
    async with w.client.post("/internal/generate", json=dict(body, request_id="refused",
                                                             sampling=SAMPLING)) as again:
        assert len(stream_tokens(await ndjson_events(again))) == 6


async def test_a_prefill_that_cannot_start_in_time_is_429(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory", num_blocks=4, block_size=8)
    p.state.settings.prefill_queue_s = 0.2
    first = await p.client.post("/internal/prefill", json={"request_id": "a", "prompt_token_ids": IDS,
                                                            "sampling": SAMPLING})
    kv = (await first.json())["kv"]
    assert p.engine.allocator.num_free == 1  # the lease holds 3 of 4 blocks: "b" cannot start
    other = [0] + [t + 40 for t in IDS[1:]]  # shares no block with "a" (whose blocks it could reuse)
    second = {"request_id": "b", "prompt_token_ids": other, "sampling": SAMPLING}
    await _busy(await p.client.post("/internal/prefill", json=second), 429, "prefill_queue_timeout")
    assert "b" not in p.engine.seqs and p.engine.allocator.num_free == 1  # withdrawn, never run
    assert _refused(p, "prefill_queue_timeout") == 1
    await p.client.post("/internal/kv/release", json={"request_id": "a", "lease_token": kv["lease_token"]})
    retried = await p.client.post("/internal/prefill", json=second)
    assert retried.status == 200
    kv = (await retried.json())["kv"]
    await p.client.post("/internal/kv/release", json={"request_id": "b", "lease_token": kv["lease_token"]})


async def test_a_handoff_without_room_is_503_busy_and_its_lease_stays(start_worker, server_loaded_toy):
    p = await start_worker(role="prefill", kv_backend="memory")
    d = await start_worker(role="decode", kv_backend="memory")
    d.state.engine.kv.reserve_wait_s = 0.2
    res = await (await p.client.post("/internal/prefill", json={"request_id": "h", "prompt_token_ids": IDS,
                                                                 "sampling": SAMPLING})).json()
    handoff = {"request_id": "h", "prompt_token_ids": IDS, "sampling": SAMPLING, "kv_source": res["kv"],
               "generated_token_ids": [res["first_token_id"]]}
    held = d.engine.allocator.allocate(d.engine.allocator.num_free - 2)  # a pool all but full
    await _busy(await d.client.post("/internal/generate", json=handoff), 503, "kv_cache_full")
    assert d.engine.allocator.num_used == len(held) and not d.engine.seqs and not d.engine.num_waiting
    assert p.engine.lease_token("h") == res["kv"]["lease_token"]  # the router may retry the handoff
    with d.engine.lock:
        d.engine.allocator.free(held)
    async with d.client.post("/internal/generate", json=handoff) as resp:
        assert resp.status == 200
        assert len(stream_tokens(await ndjson_events(resp))) == 5  # the first came from prefill
    await p.wait_idle()
