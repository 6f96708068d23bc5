"""With a per-service secret, every /internal/* endpoint that moves data or changes state answers 401
(OpenAI's error format) to a caller without it and works with it; probes and metrics stay open;
a decode worker pulls from a prefill worker of its own service, and a worker with another secret
gets a clear error. The secret comes from the environment or a file, never from flags or YAML."""

from __future__ import annotations

import argparse

import pytest
from tandem.contracts.internal_auth import SECRET_ENV, auth_headers
from tandem.testing.engine_helpers import ndjson_events, stream_tokens
from tandem.worker.server.cli import add_arguments, resolve_settings
from tandem.worker.server.config import WorkerConfig

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
        assert len(stream_tokens(await ndjson_events(resp))) == SAMPLING["max_tokens"]
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


def _settings(tmp_path, text: str, *flags: str) -> WorkerConfig:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_settings(parser.parse_args(["--config", str(path), *flags]))


def test_secret_comes_from_the_environment_or_a_file_never_from_flags_or_yaml(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert _settings(tmp_path, "model: /m\n").internal_secret is None
    monkeypatch.setenv(SECRET_ENV, SECRET + "\n")
    cfg = _settings(tmp_path, "model: /m\nrole: prefill\nkv_backend: tcp\n")
    assert cfg.internal_secret == SECRET
    assert SECRET not in repr(cfg) and "internal_secret" not in cfg.public()
    kv = cfg.kv_transfer_config("10.0.0.1")
    assert kv.secret == SECRET and kv.port == 5601 and kv.serve and SECRET not in repr(kv)
    assert not _settings(tmp_path, "model: /m\nrole: decode\n").kv_transfer_config("h").serve

    mounted = tmp_path / "secret"
    mounted.write_text("from-a-mounted-secret-file-789\n")
    cfg = _settings(tmp_path, "model: /m\n", "--internal-secret-file", str(mounted), "--kv-port", "0")
    assert cfg.internal_secret == "from-a-mounted-secret-file-789" and cfg.kv_port == 0  # the file wins

    with pytest.raises(ValueError, match="never a setting"):
        _settings(tmp_path, f"model: /m\ninternal_secret: {SECRET}\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):  # refused, not taken as an abbreviation of --internal-secret-file
        parser.parse_args(["--model", "/m", "--internal-secret", SECRET])
    assert "never a flag" in capsys.readouterr().err
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters") as err:
        _settings(tmp_path, "model: /m\n")
    assert "short" not in str(err.value)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(OSError):
        _settings(tmp_path, "model: /m\n", "--internal-secret-file", str(tmp_path / "missing"))


def test_auth_headers_without_a_secret_are_empty():
    assert auth_headers(None) == {} and auth_headers(SECRET) == {"Authorization": f"Bearer {SECRET}"}
