"""/health answers at once, /ready only once the engine is attached; /v1/models, /internal/info and
/metrics (Prometheus, tandem_ prefix, no per-request labels) describe the worker."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from tandem.contracts.protocol import WorkerInfo
from tandem.testing.engine_helpers import ndjson_events


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


async def test_ready_only_after_the_engine_is_attached(start_worker):
    w = await start_worker(attach=False)
    assert (await w.client.get("/health")).status == 200
    r = await w.client.get("/ready")
    assert r.status == 503 and (await r.json())["status"] == "loading"
    r = await w.client.post("/internal/generate", json={"request_id": "early", "prompt": "hi"})
    assert r.status == 503 and (await r.json())["error"]["code"] == "not_ready"
    await w.serve()
    assert (await w.client.get("/ready")).status == 200


async def test_info_models_and_metrics(start_worker):
    w = await start_worker(role="decode", served_name="toy")
    info = WorkerInfo.from_dict(await (await w.client.get("/internal/info")).json())
    assert info.role == "decode" and info.model == "toy" and info.ready and info.kv_compat == "g1"
    assert info.engine_id == w.state.settings.engine_id and info.kv_usage == 0.0
    models = await (await w.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "toy"

    body = {"request_id": "m1", "prompt": "Hello", "sampling": {"max_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=body) as resp:
        await ndjson_events(resp)
    text = await (await w.client.get("/metrics")).text()
    s = _samples(text)
    assert s["tandem_worker_kv_blocks_total"] == 128
    assert s["tandem_worker_kv_blocks_used"] == 0
    assert s["tandem_worker_running_sequences"] == 0
    assert s["tandem_worker_generation_tokens_total"] == 5
    assert s["tandem_worker_prompt_tokens_total"] == len(w.engine.tokenizer("Hello")["input_ids"])
    assert s["tandem_worker_step_seconds_count"] >= 5
    assert "request_id" not in text and "m1" not in text
    assert all(name.startswith("tandem_") for name in s)


def _labelled(text: str, name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


async def test_the_model_server_protocol_metrics_follow_the_kv_pool(start_worker):
    """What a gateway's endpoint picker reads (issue 31 item 3): the queue and running gauges, KV cache
    usage as one 0..1 gauge, the block size as a label; a prefilled prompt's leased blocks count."""
    w = await start_worker(role="prefill", kv_backend="memory", block_size=8)
    idle = await (await w.client.get("/metrics")).text()
    assert _samples(idle)["tandem_worker_kv_cache_usage_perc"] == 0.0
    assert _labelled(idle, "tandem_worker_cache_config_info") == [
        {"block_size": "8", "num_blocks": str(w.engine.allocator.num_blocks), "cache_dtype": w.engine.layout.dtype}]
    resp = await w.client.post("/internal/prefill", json={"request_id": "lease", "prompt": "Hello there " * 6,
                                                          "sampling": {"max_tokens": 4, "temperature": 0}})
    assert resp.status == 200, await resp.text()
    kv = (await resp.json())["kv"]
    s = _samples(await (await w.client.get("/metrics")).text())
    assert s["tandem_worker_kv_blocks_used"] > 0, "the lease holds the prompt's blocks until a decode worker pulls"
    assert s["tandem_worker_kv_cache_usage_perc"] == s["tandem_worker_kv_blocks_used"] / s["tandem_worker_kv_blocks_total"]
    assert {"tandem_worker_waiting_sequences", "tandem_worker_running_sequences"} <= set(s)
    await w.client.post("/internal/kv/release", json={"request_id": "lease", "lease_token": kv["lease_token"]})
    s = _samples(await (await w.client.get("/metrics")).text())
    assert s["tandem_worker_kv_cache_usage_perc"] == 0.0, "a released lease frees its blocks (the prefix cache keeps them free)"
