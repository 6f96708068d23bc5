"""A request id is unique on a worker: a second request with an id that is running, queued, leased
or being pulled here gets 409 duplicate_request_id on every endpoint that starts work, and
allocates nothing (before, a second prefill overwrote the first's lease and leaked its blocks)."""

from __future__ import annotations

import json

from tandem.testing.engine_helpers import ndjson_events, stream_tokens

PROMPT = "Kubernetes schedules pods onto nodes, and an operator reconciles"
SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


async def _is_duplicate(resp) -> None:
    assert resp.status == 409
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"]) == ("duplicate_request_id", "request_id")


async def test_a_duplicate_prefill_id_is_409_and_leaks_nothing(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory")
    body = {"request_id": "dup", "prompt": PROMPT, "sampling": SAMPLING}
    first = await p.client.post("/internal/prefill", json=body)
    assert first.status == 200
    kv = (await first.json())["kv"]
    used = p.engine.allocator.num_used
    assert used == len(kv["block_ids"]) > 0
    await _is_duplicate(await p.client.post("/internal/prefill", json=body))
    assert p.engine.allocator.num_used == used  # nothing computed or held for the refused one
    assert p.engine.lease_token("dup") == kv["lease_token"]  # the first lease is intact
    released = await p.client.post("/internal/kv/release", json={"request_id": "dup",
                                                                  "lease_token": kv["lease_token"]})
    assert (await released.json())["released"] is True
    assert p.engine.allocator.num_used == 0


async def test_a_duplicate_generate_id_is_409_while_the_first_runs(start_worker):
    w = await start_worker()
    long = {"request_id": "g", "prompt": PROMPT, "sampling": dict(SAMPLING, max_tokens=1500)}
    async with w.client.post("/internal/generate", json=long) as first:
        assert json.loads(await first.content.readline())["type"] == "start"
        assert json.loads(await first.content.readline())["type"] == "token"  # it runs
        await _is_duplicate(await w.client.post("/internal/generate", json=dict(long, sampling=SAMPLING)))
    await w.wait_idle()  # closing the first stream aborted it
    async with w.client.post("/internal/generate", json=dict(long, sampling=SAMPLING)) as again:
        assert len(stream_tokens(await ndjson_events(again))) == 8  # the id is free again


async def test_a_duplicate_handoff_is_refused_before_any_pull(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory")
    d = await start_worker(role="decode", kv_backend="memory")
    res = await (await p.client.post("/internal/prefill", json={"request_id": "h", "prompt": PROMPT,
                                                                 "sampling": dict(SAMPLING, max_tokens=1500)})).json()
    handoff = {"request_id": "h", "prompt": PROMPT, "sampling": dict(SAMPLING, max_tokens=1500),
               "kv_source": res["kv"], "generated_token_ids": [res["first_token_id"]]}
    async with d.client.post("/internal/generate", json=handoff) as first:
        assert first.status == 200
        assert json.loads(await first.content.readline())["type"] == "start"
        pulls = d.state.metrics.kv_pull_seconds._sum.get()
        await _is_duplicate(await d.client.post("/internal/generate", json=handoff))
        assert d.state.metrics.kv_pull_seconds._sum.get() == pulls  # refused before a second pull
    await d.wait_idle()
    await p.wait_idle()
