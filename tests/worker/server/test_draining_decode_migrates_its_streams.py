"""A draining decode worker ends each stream with MIGRATE (its KV leased: prompt and generated
tokens but the last); another decode worker given that KV source continues the stream, pulling the
KV instead of recomputing it, and the two streams together equal transformers' greedy output.
While it drains, the worker answers new requests 503 `draining` with Retry-After (busy)."""

from __future__ import annotations

from tandem.testing.engine_helpers import (
    events_until,
    ndjson_events,
    reference_generate,
    stream_text,
    stream_tokens,
)

PROMPT = "Kubernetes schedules pods onto nodes, and an operator reconciles"
# Long enough that the engine is still generating when the drain starts: the test reads 6 tokens
# first, and the engine can be far ahead of what the client has read (a fresh clone once saw all 24
# generated before the drain).
MAX_TOKENS = 160
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def _metric(w, name: str) -> float:
    from prometheus_client import generate_latest

    for line in generate_latest(w.state.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the worker's metrics")


async def test_migrated_stream_continues_on_another_decode_worker(start_worker, server_hf_toy, server_loaded_toy):
    a = await start_worker(role="decode", kv_backend="memory", block_size=8)
    b = await start_worker(role="decode", kv_backend="memory", block_size=8)

    def drain() -> None:
        a.state.ready, a.state.draining = False, True
        a.state.engine.start_migration()

    async with a.client.post("/internal/generate", json={"request_id": "mig", "prompt": PROMPT,
                                                          "sampling": SAMPLING}) as resp:
        first = await events_until(resp, 6, drain)
    last = first[-1]
    assert last["type"] == "migrate", last
    generated = stream_tokens(first)
    assert last["generated_token_ids"] == generated and 6 <= len(generated) < MAX_TOKENS
    kv = last["kv"]
    prompt_ids = server_loaded_toy.tokenizer(PROMPT)["input_ids"]
    assert kv["num_tokens"] == len(prompt_ids) + len(generated) - 1 and kv["url"] == a.url

    refused = await a.client.post("/internal/generate", json={"request_id": "late", "prompt": PROMPT,
                                                                "sampling": SAMPLING})
    assert refused.status == 503 and refused.headers.get("Retry-After")
    assert (await refused.json())["error"]["code"] == "draining"

    body = {"request_id": "mig", "prompt_token_ids": prompt_ids, "sampling": SAMPLING, "kv_source": kv,
            "generated_token_ids": generated, "emitted_chars": len(stream_text(first)), "migrated_from": a.url}
    async with b.client.post("/internal/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        second = await ndjson_events(resp)
    assert second[-1]["type"] == "finish"
    assert generated + stream_tokens(second) == reference_generate(server_hf_toy, prompt_ids, MAX_TOKENS)
    full = server_loaded_toy.tokenizer.decode(generated + stream_tokens(second), skip_special_tokens=True)
    assert stream_text(first) + stream_text(second) == full
    assert _metric(b, "tandem_worker_prefill_tokens_computed_total") == 0, "b recomputed nothing"
    assert _metric(b, "tandem_worker_migration_pulled_tokens_total") == kv["num_tokens"]
    assert _metric(a, 'tandem_worker_migrations_out_total{how="kv"}') == 1
    await a.wait_idle()  # the pull released a's lease


async def test_kv_source_must_cover_all_but_the_last_token(start_worker, server_loaded_toy):
    a = await start_worker(role="decode", kv_backend="memory", block_size=8)
    b = await start_worker(role="decode", kv_backend="memory", block_size=8)
    async with a.client.post("/internal/generate", json={"request_id": "short", "prompt": PROMPT,
                                                          "sampling": SAMPLING}) as resp:
        first = await events_until(resp, 4, a.state.engine.start_migration)
    kv, generated = first[-1]["kv"], first[-1]["generated_token_ids"]
    body = {"request_id": "short", "prompt": PROMPT, "sampling": SAMPLING, "kv_source": kv,
            "generated_token_ids": generated[:-1]}  # one token fewer than the KV was computed for
    resp = await b.client.post("/internal/generate", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "kv_mismatch"
    assert b.engine.allocator.num_used == 0
    await a.client.post("/internal/kv/release", json={"request_id": "short", "lease_token": kv["lease_token"]})
