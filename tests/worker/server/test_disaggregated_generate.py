"""Prefill on one worker, decode on another (KV pulled over the in-memory transport): the prefill's
first token then the decode stream (which starts at the second token: it never repeats the first)
equal the colocated stream token for token and text for text, and both pools end empty.
A pull that fails answers 503 kv_transfer_failed and frees the decode worker's blocks."""

from __future__ import annotations

import asyncio

from tandem.testing.engine_helpers import (
    ndjson_events,
    reference_generate,
    stream_text,
    stream_tokens,
)

PROMPT = "Kubernetes schedules pods onto nodes, and an operator reconciles"
SAMPLING = {"max_tokens": 14, "temperature": 0, "ignore_eos": True}


async def test_disaggregated_equals_colocated(start_worker, server_hf_toy, server_loaded_toy):
    p = await start_worker(role="prefill", kv_backend="memory", block_size=8)
    d = await start_worker(role="decode", kv_backend="memory", block_size=8)
    c = await start_worker(role="colocated")
    async with c.client.post("/internal/generate", json={"request_id": "co", "prompt": PROMPT,
                                                          "sampling": SAMPLING}) as resp:
        colocated = await ndjson_events(resp)

    resp = await p.client.post("/internal/prefill", json={"request_id": "dis", "prompt": PROMPT,
                                                          "sampling": SAMPLING})
    result = await resp.json()
    assert resp.status == 200, result
    assert result["kv"]["backend"] == "memory"
    body = {"request_id": "dis", "prompt": PROMPT, "sampling": SAMPLING, "kv_source": result["kv"],
            "generated_token_ids": [result["first_token_id"]], "emitted_chars": len(result["first_token_text"])}
    async with d.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200
        events = await ndjson_events(resp)
    ids = server_loaded_toy.tokenizer(PROMPT)["input_ids"]
    assert [result["first_token_id"]] + stream_tokens(events) == stream_tokens(colocated) \
        == reference_generate(server_hf_toy, ids, 14)
    assert result["first_token_text"] + stream_text(events) == stream_text(colocated)
    assert events[-1]["usage"] == colocated[-1]["usage"]
    await p.wait_idle()  # the pull released the prefill worker's lease


async def test_failed_pull_is_503_and_frees_blocks(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory", block_size=8)
    d = await start_worker(role="decode", kv_backend="memory", block_size=8)
    resp = await p.client.post("/internal/prefill", json={"request_id": "f", "prompt": PROMPT,
                                                          "sampling": SAMPLING})
    result = await resp.json()
    kv = dict(result["kv"], engine_id="gone-123")  # a prefill worker that restarted
    body = {"request_id": "f", "prompt": PROMPT, "sampling": SAMPLING, "kv_source": kv,
            "first_token_id": result["first_token_id"]}
    resp = await d.client.post("/internal/generate", json=body)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "kv_transfer_failed"
    assert d.engine.allocator.num_used == 0
    await p.client.post("/internal/kv/release", json={"request_id": "f", "lease_token": kv["lease_token"]})


async def test_mismatched_kv_source_is_refused(start_worker):
    p = await start_worker(role="prefill", kv_backend="memory", block_size=8)
    d = await start_worker(role="decode", kv_backend="memory", block_size=8)
    resp = await p.client.post("/internal/prefill", json={"request_id": "m", "prompt": PROMPT,
                                                          "sampling": SAMPLING})
    result = await resp.json()
    body = {"request_id": "m", "prompt": PROMPT + " and more words here", "sampling": SAMPLING,
            "kv_source": result["kv"], "first_token_id": result["first_token_id"]}
    resp = await d.client.post("/internal/generate", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "kv_mismatch"
    await asyncio.gather(p.client.post("/internal/kv/release", json={"request_id": "m",
                                                                       "lease_token": result["kv"]["lease_token"]}))
