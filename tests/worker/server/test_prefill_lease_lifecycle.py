"""The prefill role returns the first token and a KVSource whose blocks stay leased until the
peer releases them (quoting the lease token), the request is aborted with the token, or the lease
expires; then every block is free. A wrong token or a second release frees nothing."""

from __future__ import annotations

from tandem.contracts.protocol import PrefillResult
from tandem.testing.engine_helpers import reference_generate

PROMPT = "Once upon a time there was a little model that wanted to speak"


def _body(rid, max_tokens=8):
    return {"request_id": rid, "prompt": PROMPT,
            "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


async def _prefill(w, rid, max_tokens=8) -> PrefillResult:
    resp = await w.client.post("/internal/prefill", json=_body(rid, max_tokens))
    assert resp.status == 200, await resp.text()
    return PrefillResult.from_dict(await resp.json())


async def test_prefill_result_and_release(start_worker, server_hf_toy, server_loaded_toy):
    w = await start_worker(role="prefill", kv_backend="memory")
    res = await _prefill(w, "p1")
    ids = server_loaded_toy.tokenizer(PROMPT)["input_ids"]
    assert res.prompt_token_ids == ids
    assert res.first_token_id == reference_generate(server_hf_toy, ids, 1)[0]
    assert res.finish_reason is None
    kv = res.kv
    assert kv.url == w.url and kv.engine_id == w.state.settings.engine_id
    assert kv.num_tokens == len(ids) and len(kv.block_ids) == -(-len(ids) // 8)
    assert w.engine.allocator.num_used == len(kv.block_ids)  # leased, not freed
    assert len(kv.lease_token) >= 32
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1", "lease_token": "guess"})
    assert resp.status == 200 and (await resp.json())["released"] is False
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "lease_token"
    assert w.engine.allocator.num_used == len(kv.block_ids)  # neither freed anything
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1", "lease_token": kv.lease_token})
    assert (await resp.json())["released"] is True
    assert w.engine.allocator.num_used == 0
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1", "lease_token": kv.lease_token})
    assert (await resp.json())["released"] is False


async def test_abort_frees_a_lease_only_with_its_token(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory")
    res = await _prefill(w, "p2")
    assert w.engine.allocator.num_used == len(res.kv.block_ids)
    for body in ({"request_id": "p2"}, {"request_id": "p2", "lease_token": "not-it"}):
        resp = await w.client.post("/internal/abort", json=body)
        assert (await resp.json())["aborted"] is False
        assert w.engine.allocator.num_used == len(res.kv.block_ids)
    resp = await w.client.post("/internal/abort", json={"request_id": "p2", "lease_token": res.kv.lease_token})
    assert (await resp.json())["aborted"] is True
    assert w.engine.allocator.num_used == 0


async def test_lease_expires(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory", lease_s=0.3)
    res = await _prefill(w, "p3")
    assert w.engine.allocator.num_used == len(res.kv.block_ids)
    await w.wait_idle(within=10)  # the engine thread reclaims it once the lease runs out


async def test_first_token_that_finishes_leases_nothing(start_worker):
    w = await start_worker(role="colocated", kv_backend="memory")
    res = await _prefill(w, "p4", max_tokens=1)
    assert res.finish_reason == "length" and res.kv is None
    assert w.engine.allocator.num_used == 0


async def test_prefill_waits_for_leased_blocks_then_proceeds(start_worker, server_loaded_toy):
    """When leases hold the whole pool a new prompt waits (not fails); a release lets it run."""
    import asyncio

    per_prompt = -(-len(server_loaded_toy.tokenizer(PROMPT)["input_ids"]) // 8)
    # Without prefix caching: the three equal prompts would otherwise share their full blocks.
    w = await start_worker(role="prefill", kv_backend="memory", num_blocks=2 * per_prompt, max_model_len=8 * per_prompt,
                           prefix_caching=False)
    first = await _prefill(w, "full")
    second = await _prefill(w, "full2")
    assert w.engine.allocator.num_free == 0
    waiting = asyncio.create_task(_prefill(w, "queued"))
    for _ in range(500):  # until the request has reached the engine's queue
        if w.engine.num_waiting:
            break
        await asyncio.sleep(0.02)
    for _ in range(10):  # and stays there: no blocks free
        await asyncio.sleep(0.02)
    assert not waiting.done() and w.engine.num_waiting == 1
    await w.client.post("/internal/kv/release", json={"request_id": "full", "lease_token": first.kv.lease_token})
    third = await asyncio.wait_for(waiting, 30)
    assert third.kv is not None and third.first_token_id == first.first_token_id
    for rid, res in (("full2", second), ("queued", third)):
        await w.client.post("/internal/kv/release", json={"request_id": rid, "lease_token": res.kv.lease_token})


async def test_worker_without_transport_refuses_to_prefill_for_peers(start_worker):
    w = await start_worker(role="colocated")
    resp = await w.client.post("/internal/prefill", json=_body("nt"))
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "kv_backend_mismatch"
    assert w.engine.allocator.num_used == 0
