"""With a per-service secret, every /internal/* endpoint that moves data or changes state answers 401
(OpenAI's error format) to a caller without it and works with it; probes and metrics stay open;
a decode worker pulls from a prefill worker of its own service, and a worker with another secret
gets a clear error. (Where the secret comes from: test_worker_config_is_typed.py.)"""

from __future__ import annotations

import pytest
from tandem.contracts.internal_auth import auth_headers
from tandem.testing.engine_helpers import ndjson_events, stream_tokens

SECRET = "s3cret-for-this-service-only-0123"
PROMPT = "Kubernetes schedules pods onto nodes"
SAMPLING = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

# Every internal endpoint that moves data or changes state, with a body that works when authorized.
GUARDED = [
    ("GET", "/internal/info", None),
    ("GET", "/internal/kv/metadata", None),
    ("POST", "/internal/generate", {"request_id": "g", "prompt": PROMPT, "sampling": SAMPLING}),
    ("POST", "/internal/prefill", {"request_id": "p", "prompt": PROMPT, "sampling": SAMPLING}),
    ("POST", "/internal/abort", {"request_id": "nobody"}),
    ("POST", "/internal/kv/release", {"request_id": "nobody", "lease_token": "x"}),
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[p for _, p, _ in GUARDED])
async def test_guarded_endpoint_is_401_without_the_secret_and_works_with_it(start_worker, method, path, body):
    w = await start_worker(role="colocated", kv_backend="memory", secret=SECRET)
    for headers in ({}, {"Authorization": "Bearer wrong-secret-of-the-same-size"},
                    {"Authorization": SECRET}, {"Authorization": f"Basic {SECRET}"}):
        resp = await w.client.request(method, path, json=body, headers=headers | {"X-Request-Id": "r1"})
        assert resp.status == 401, (path, headers)
        err = (await resp.json())["error"]
        assert err["code"] == "invalid_internal_secret" and err["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in err["message"] and SECRET not in err["message"]
        assert resp.headers["X-Request-Id"] == "r1"
    assert w.engine.allocator.num_used == 0 and not w.engine.leases  # nothing ran
    async with w.client.request(method, path, json=body, headers=w.auth) as resp:
        assert resp.status == 200, await resp.text()
        if path == "/internal/generate":
            assert len(stream_tokens(await ndjson_events(resp))) == SAMPLING["max_tokens"]
        elif path == "/internal/prefill":
            kv = (await resp.json())["kv"]
            r = await w.client.post("/internal/kv/release", headers=w.auth,
                                    json={"request_id": "p", "lease_token": kv["lease_token"]})
            assert (await r.json())["released"] is True


async def test_probes_metrics_and_kv_health_stay_open(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory", secret=SECRET)
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/internal/kv/health"):
        assert (await w.client.get(path)).status == 200, path
    assert (await w.client.get("/internal/no-such-thing")).status == 401  # no route map for strangers


async def test_without_a_secret_internal_endpoints_stay_open(start_worker):
    w = await start_worker(role="colocated", kv_backend="memory")
    assert (await w.client.get("/internal/info")).status == 200
    assert (await w.client.get("/internal/kv/metadata")).status == 200


async def test_disaggregated_pull_carries_the_secret_and_a_stranger_is_refused(start_worker):
    p = await start_worker(role="prefill", kv_backend="tcp", secret=SECRET, block_size=8)
    d = await start_worker(role="decode", kv_backend="tcp", secret=SECRET, block_size=8)
    other = await start_worker(role="decode", kv_backend="tcp", secret="another-service-secret-456",
                               block_size=8)
    assert d.transport.port is None, "a decode-only worker opens no KV port"

    async def prefill(rid: str) -> dict:
        resp = await p.client.post("/internal/prefill", headers=p.auth,
                                   json={"request_id": rid, "prompt": PROMPT, "sampling": SAMPLING})
        assert resp.status == 200
        return await resp.json()

    res = await prefill("ok")
    body = {"request_id": "ok", "prompt": PROMPT, "sampling": SAMPLING, "kv_source": res["kv"],
            "first_token_id": res["first_token_id"]}
    async with d.client.post("/internal/generate", json=body, headers=d.auth) as resp:
        assert resp.status == 200
        # the decode worker streams from the second token: the first came with the prefill result
        assert len(stream_tokens(await ndjson_events(resp))) == SAMPLING["max_tokens"] - 1
    await p.wait_idle()

    res = await prefill("stranger")
    body = dict(body, request_id="stranger", kv_source=res["kv"], first_token_id=res["first_token_id"])
    resp = await other.client.post("/internal/generate", json=body, headers=other.auth)
    assert resp.status == 503
    err = (await resp.json())["error"]
    assert err["code"] == "kv_transfer_failed" and "internal secret" in err["message"]
    assert other.engine.allocator.num_used == 0
    assert p.engine.leases, "a stranger's failed pull must not free the lease"
    r = await p.client.post("/internal/kv/release", headers=p.auth,
                            json={"request_id": "stranger", "lease_token": res["kv"]["lease_token"]})
    assert (await r.json())["released"] is True


def test_auth_headers_without_a_secret_are_empty():
    assert auth_headers(None) == {} and auth_headers(SECRET) == {"Authorization": f"Bearer {SECRET}"}
