"""A schema-constrained answer from the random-weight toy model parses and validates in every path a
sequence can take between workers: its first token sampled under the grammar on a prefill worker,
the KV handed to a decode worker (TCP and NIXL), the decode worker draining mid-stream so another
pulls its KV and continues (migration), and a resume that recomputes from the tokens so far. Each
receiving worker replays the tokens through the grammar, so the joined stream is the one an
undisturbed run gives."""

from __future__ import annotations

import json

from tandem.testing.engine_helpers import events_until, ndjson_events, stream_text, stream_tokens
from tandem.testing.schemas import PERSON, validate_person

PROMPT = "Describe a person as JSON:"
SAMPLING = {"max_tokens": 150, "temperature": 1.0, "seed": 5, "structured": {"json_schema": PERSON}}


async def _whole(w, rid: str) -> list[dict]:
    async with w.client.post("/internal/generate", json={"request_id": rid, "prompt": PROMPT,
                                                          "sampling": SAMPLING}) as resp:
        assert resp.status == 200, await resp.text()
        return await ndjson_events(resp)


async def test_prefill_handoff_then_migration_keeps_the_grammar(start_worker, backend, server_loaded_toy):
    p = await start_worker(role="prefill", kv_backend=backend)
    d1 = await start_worker(role="decode", kv_backend=backend, serve_kv=True)  # it migrates: it serves its KV
    d2 = await start_worker(role="decode", kv_backend=backend)
    undisturbed = await _whole(await start_worker(role="colocated"), "ref")
    assert undisturbed[-1]["finish_reason"] == "stop"
    ids = server_loaded_toy.tokenizer(PROMPT)["input_ids"]

    resp = await p.client.post("/internal/prefill", json={"request_id": "so", "prompt_token_ids": ids,
                                                          "sampling": SAMPLING})
    assert resp.status == 200, await resp.text()
    res = await resp.json()

    def drain() -> None:
        d1.state.ready, d1.state.draining = False, True
        d1.state.engine.start_migration()

    body = {"request_id": "so", "prompt_token_ids": ids, "sampling": SAMPLING, "kv_source": res["kv"],
            "generated_token_ids": [res["first_token_id"]], "emitted_chars": len(res["first_token_text"])}
    async with d1.client.post("/internal/generate", json=body) as r:
        first = await events_until(r, 6, drain)
    mig = first[-1]
    assert mig["type"] == "migrate" and mig["kv"] is not None, mig
    generated = [res["first_token_id"]] + stream_tokens(first)
    body = {"request_id": "so", "prompt_token_ids": ids, "sampling": SAMPLING, "kv_source": mig["kv"],
            "generated_token_ids": generated, "emitted_chars": len(res["first_token_text"] + stream_text(first)),
            "migrated_from": d1.url}
    async with d2.client.post("/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        second = await ndjson_events(r)
    assert second[-1]["type"] == "finish" and second[-1]["finish_reason"] == "stop"
    assert generated + stream_tokens(second) == stream_tokens(undisturbed)
    text = res["first_token_text"] + stream_text(first) + stream_text(second)
    validate_person(json.loads(text))
    await d1.wait_idle()


async def test_a_resume_recomputes_and_keeps_the_grammar(start_worker):
    a = await start_worker(role="colocated")
    b = await start_worker(role="colocated")
    whole = await _whole(a, "whole")
    toks = stream_tokens(whole)
    k = len(toks) // 2
    prefix_text = a.engine.tokenizer.decode(toks[:k], skip_special_tokens=True)
    body = {"request_id": "resumed", "prompt": PROMPT, "sampling": SAMPLING, "generated_token_ids": toks[:k],
            "emitted_chars": len(prefix_text)}
    async with b.client.post("/internal/generate", json=body) as r:
        rest = await ndjson_events(r)
    assert toks[:k] + stream_tokens(rest) == toks
    validate_person(json.loads(prefix_text + stream_text(rest)))
    validate_person(json.loads(stream_text(whole)))
