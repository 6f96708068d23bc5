"""Malformed or impossible requests get a 4xx with an OpenAI-format error body, and the worker
keeps serving the next request."""

from __future__ import annotations

import pytest
from tandem.testing.engine_helpers import ndjson_events, stream_tokens

GOOD = {"request_id": "ok", "prompt": "Hello", "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}}


def _assert_openai_error(doc, code=None, param=None):
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"request_id": "x", "prompt": "The quick brown fox " * 20}, 400, "context_length_exceeded", "prompt"),
        ({"request_id": "x", "prompt": "hi", "sampling": {"max_tokens": 0}}, 400, "invalid_value", "max_tokens"),
        ({"request_id": "x", "prompt": "hi", "sampling": {"max_tokens": "many"}}, 400, "invalid_value", "max_tokens"),
        ({"request_id": "x", "prompt": "hi", "sampling": {"bogus": 1}}, 400, None, None),
        ({"request_id": "x"}, 400, None, "prompt"),
        ({"request_id": "x", "prompt": "hi", "kv_source": {"url": "http://x"}}, 400, None, None),
        ({"prompt": "hi"}, 400, None, "request_id"),
        ({"request_id": "x", "prompt": "hi", "fairness_id": 7}, 400, "invalid_value", "fairness_id"),
        ({"request_id": "x", "prompt": "hi", "fairness_id": "t" * 257}, 400, "invalid_value", "fairness_id"),
        ({"request_id": "x", "prompt": "hi", "priority": "high"}, 400, "invalid_value", "priority"),
        ({"request_id": "x", "prompt": "hi", "priority": 2**40}, 400, "invalid_value", "priority"),
    ],
)
async def test_generate_rejects(start_worker, body, status, code, param):
    w = await start_worker(max_model_len=32)
    resp = await w.client.post("/internal/generate", json=body)
    assert resp.status == status
    _assert_openai_error(await resp.json(), code, param)
    async with w.client.post("/internal/generate", json=GOOD) as resp:
        assert resp.status == 200
        assert len(stream_tokens(await ndjson_events(resp))) == 3


async def test_not_json_and_unknown_route(start_worker):
    w = await start_worker()
    resp = await w.client.post("/internal/generate", data=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status == 400
    _assert_openai_error(await resp.json())
    resp = await w.client.post("/internal/generate", json=["a", "list"])
    assert resp.status == 400
    resp = await w.client.get("/no/such/route")
    assert resp.status == 404
    _assert_openai_error(await resp.json())


async def test_roles_refuse_the_other_roles_routes(start_worker):
    p = await start_worker(role="prefill")
    resp = await p.client.post("/internal/generate", json=GOOD)
    assert resp.status == 400
    _assert_openai_error(await resp.json(), "wrong_role")
    d = await start_worker(role="decode")
    resp = await d.client.post("/internal/prefill", json=GOOD)
    assert resp.status == 400
    _assert_openai_error(await resp.json(), "wrong_role")


async def test_duplicate_request_id_is_409(start_worker):
    w = await start_worker()
    long = {"request_id": "dup", "prompt": "Hello", "sampling": {"max_tokens": 500, "temperature": 0,
                                                                  "ignore_eos": True}}
    async with w.client.post("/internal/generate", json=long) as first:
        await first.content.readline()  # the start event: the first one is registered
        resp = await w.client.post("/internal/generate", json=long)
        assert resp.status == 409
        _assert_openai_error(await resp.json(), "duplicate_request_id")
        await w.client.post("/internal/abort", json={"request_id": "dup"})
        events = await ndjson_events(first)
    assert events[-1]["finish_reason"] == "abort"
