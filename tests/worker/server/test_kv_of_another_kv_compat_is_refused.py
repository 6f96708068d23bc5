"""KV computed by one kv_compat of a service never reaches a worker of another (issue 21, defect 1):
a KVSource names the kv_compat of the worker that leased it (a prefill worker's result, a draining
decode worker's MIGRATE line), and a decode worker of another kv_compat refuses it with 400
`kv_compat_mismatch` (param kv_source: the router's fault, never the client's; it recomputes
elsewhere) before a block is reserved or pulled, so nothing of it enters its prefix cache. The
lease stays for the router to free (or to hand to a worker of the right kv_compat)."""

from __future__ import annotations

from tandem.testing.engine_helpers import events_until, ndjson_events, stream_tokens

IDS = [0] + list(range(40, 70))  # 31 tokens: three full blocks of 8 and more
SAMPLING = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


async def _prefill(p, rid: str) -> dict:
    resp = await p.client.post("/internal/prefill", json={"request_id": rid, "prompt_token_ids": IDS,
                                                          "sampling": SAMPLING})
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _handoff(rid: str, res: dict) -> dict:
    return {"request_id": rid, "prompt_token_ids": IDS, "sampling": SAMPLING, "kv_source": res["kv"],
            "generated_token_ids": [res["first_token_id"]]}


async def test_a_handoff_from_another_kv_compat_is_refused_before_any_block_moves(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory", kv_compat="g1")
    old = await start_worker(role="decode", kv_backend="memory", kv_compat="g0")
    res = await _prefill(p, "h")
    assert res["kv"]["kv_compat"] == "g1"
    resp = await old.client.post("/internal/generate", json=_handoff("h", res))
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("kv_compat_mismatch", "kv_source")
    assert "g1" in err["message"] and "g0" in err["message"]
    assert old.engine.allocator.num_used == 0 and not old.engine.cached_block_hashes()
    assert old.engine.prefix_cache.stats.query_tokens_total == 0, "not even looked up"
    assert p.engine.lease_token("h") == res["kv"]["lease_token"], "the lease is the router's to free"

    same = await start_worker(role="decode", kv_backend="memory", kv_compat="g1")
    async with same.client.post("/internal/generate", json=_handoff("h", res)) as ok:
        assert ok.status == 200, await ok.text()
        assert len(stream_tokens(await ndjson_events(ok))) == SAMPLING["max_tokens"] - 1
    assert same.engine.cached_block_hashes(), "a handoff of its own kv_compat is cached as usual"
    await p.wait_idle()


async def test_a_migrating_decode_worker_stamps_its_own_kv_compat(start_worker):
    a = await start_worker(role="decode", kv_backend="memory", kv_compat="g2")
    other = await start_worker(role="decode", kv_backend="memory", kv_compat="g3")

    def drain() -> None:
        a.state.ready, a.state.draining = False, True
        a.state.engine.start_migration()

    body = {"request_id": "m", "prompt_token_ids": IDS, "sampling": dict(SAMPLING, max_tokens=40)}
    async with a.client.post("/internal/generate", json=body) as resp:
        events = await events_until(resp, 3, drain)
    kv = events[-1]["kv"]
    assert events[-1]["type"] == "migrate" and kv["kv_compat"] == "g2"
    moved = {"request_id": "m", "prompt_token_ids": IDS, "sampling": body["sampling"], "kv_source": kv,
             "generated_token_ids": events[-1]["generated_token_ids"], "migrated_from": a.url}
    refused = await other.client.post("/internal/generate", json=moved)
    assert refused.status == 400 and (await refused.json())["error"]["code"] == "kv_compat_mismatch"
    assert other.engine.allocator.num_used == 0
    await a.client.post("/internal/kv/release", json={"request_id": "m", "lease_token": kv["lease_token"]})
