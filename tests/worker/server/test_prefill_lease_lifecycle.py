"""The prefill role returns the first token and a KVSource whose blocks stay leased until the
peer releases them, the request is aborted, or the lease expires; then every block is free."""

from __future__ import annotations

from tandem.testing.engine_helpers import reference_generate
from tandem.worker.protocol import PrefillResult

PROMPT = "Once upon a time there was a little model that wanted to speak"


def _body(rid, max_tokens=8):
    return {"request_id": rid, "prompt": PROMPT,
            "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


async def _prefill(w, rid, max_tokens=8) -> PrefillResult:
    resp = await w.client.post("/internal/prefill", json=_body(rid, max_tokens))
    assert resp.status == 200, await resp.text()
    return PrefillResult.from_dict(await resp.json())


async def test_prefill_result_and_release(start_worker, server_hf_toy, server_loaded_toy):
    w = await start_worker(role="prefill")
    res = await _prefill(w, "p1")
    ids = server_loaded_toy.tokenizer(PROMPT)["input_ids"]
    assert res.prompt_token_ids == ids
    assert res.first_token_id == reference_generate(server_hf_toy, ids, 1)[0]
    assert res.first_token_logprob is not None and res.first_token_logprob <= 0
    assert res.finish_reason is None
    kv = res.kv
    assert kv.url == w.url and kv.engine_id == w.state.settings.engine_id
    assert kv.num_tokens == len(ids) and len(kv.block_ids) == -(-len(ids) // 8)
    assert w.engine.allocator.num_used == len(kv.block_ids)  # leased, not freed
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1"})
    assert (await resp.json())["released"] is True
    assert w.engine.allocator.num_used == 0
    resp = await w.client.post("/internal/kv/release", json={"request_id": "p1"})
    assert (await resp.json())["released"] is False


async def test_abort_frees_a_lease(start_worker):
    w = await start_worker(role="prefill")
    res = await _prefill(w, "p2")
    assert w.engine.allocator.num_used == len(res.kv.block_ids)
    resp = await w.client.post("/internal/abort", json={"request_id": "p2"})
    assert (await resp.json())["aborted"] is True
    assert w.engine.allocator.num_used == 0


async def test_lease_expires(start_worker):
    w = await start_worker(role="prefill", lease_s=0.3)
    res = await _prefill(w, "p3")
    assert w.engine.allocator.num_used == len(res.kv.block_ids)
    await w.wait_idle(within=10)  # the engine thread reclaims it once the lease runs out


async def test_first_token_that_finishes_leases_nothing(start_worker):
    w = await start_worker(role="colocated")
    res = await _prefill(w, "p4", max_tokens=1)
    assert res.finish_reason == "length" and res.kv is None
    assert w.engine.allocator.num_used == 0
