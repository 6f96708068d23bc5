"""The router's own refusals, answered before any worker is involved, in OpenAI's error format.

A real router app with its workers' addresses pointing at a closed port: nothing is mocked, and
the `openai` client must surface each refusal as the right exception.
"""

from __future__ import annotations

import socket

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from tandem.router.app import build_app
from tandem.router.config import RouterConfig


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def router():
    port = _closed_port()
    config = RouterConfig(
        decode=[f"http://127.0.0.1:{port}"], model="toy", api_key="sekret", max_body_bytes=2048,
        max_tokens_limit=64, poll_interval_s=60,
    )
    server = TestServer(build_app(config), host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()


def _client(base: str, key: str = "sekret") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


def _assert_openai_error(body: dict, code: str | None = None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code


MSG = [{"role": "user", "content": "hi"}]


async def test_wrong_or_missing_api_key_is_401(router):
    with pytest.raises(openai.AuthenticationError) as info:
        await _client(router, "wrong").chat.completions.create(model="toy", messages=MSG)
    _assert_openai_error({"error": info.value.body}, "invalid_api_key")
    async with aiohttp.ClientSession() as s, s.get(router + "/v1/models") as r:
        assert r.status == 401
        _assert_openai_error(await r.json(), "invalid_api_key")


async def test_malformed_json_is_400(router):
    headers = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.post(router + "/v1/chat/completions", data=b"{not json", headers=headers) as r:
            assert r.status == 400
            _assert_openai_error(await r.json())
            assert r.headers["X-Request-Id"]
        async with s.post(router + "/v1/completions", data=b"[1,2]", headers=headers) as r:
            assert r.status == 400


async def test_body_over_the_limit_is_413(router):
    big = "x" * 4000
    with pytest.raises(openai.APIStatusError) as info:
        await _client(router).completions.create(model="toy", prompt=big)
    assert info.value.status_code == 413
    _assert_openai_error({"error": info.value.body}, "request_too_large")
    # chunked upload, no Content-Length: still our 413, still OpenAI-shaped
    async def chunks():
        for _ in range(8):
            yield b"x" * 1000

    async with aiohttp.ClientSession() as s, s.post(
        router + "/v1/completions", data=chunks(), headers={"Authorization": "Bearer sekret"}
    ) as r:
        assert r.status == 413
        _assert_openai_error(await r.json(), "request_too_large")


async def test_unknown_model_is_404(router):
    with pytest.raises(openai.NotFoundError) as info:
        await _client(router).chat.completions.create(model="gpt-17", messages=MSG)
    assert info.value.body["code"] == "model_not_found"


async def test_bad_max_tokens_is_400(router):
    for bad in (0, 65):
        with pytest.raises(openai.BadRequestError) as info:
            await _client(router).completions.create(model="toy", prompt="a", max_tokens=bad)
        assert info.value.body["param"] == "max_tokens"


async def test_n_beyond_the_limit_is_refused_clearly(router):
    with pytest.raises(openai.BadRequestError) as info:
        await _client(router).chat.completions.create(model="toy", messages=MSG, n=17)
    assert "'n' must be" in info.value.body["message"] and info.value.body["param"] == "n"


async def test_no_worker_ready_is_503_with_retry_after(router):
    with pytest.raises(openai.APIStatusError) as info:
        await _client(router).chat.completions.create(model="toy", messages=MSG, stream=True)
    assert info.value.status_code == 503
    assert int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.body["code"] == "no_worker_available"


async def test_health_ready_metrics_and_unknown_routes(router):
    async with aiohttp.ClientSession() as s:
        async with s.get(router + "/health") as r:
            assert r.status == 200
        async with s.get(router + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["workers"]["decode"] == {"ready": 0, "total": 1}
        async with s.get(router + "/nope") as r:
            assert r.status == 404
            _assert_openai_error(await r.json())
        async with s.get(router + "/v1/chat/completions") as r:
            assert r.status == 405
            _assert_openai_error(await r.json())
        async with s.post(router + "/v1/completions", json={"model": "toy", "prompt": "a"}) as r:
            assert r.status == 401
        async with s.get(router + "/metrics") as r:
            text = await r.text()
    assert 'tandem_requests_total{status="401"} 1.0' in text
    assert "tandem_requests_in_flight 0.0" in text
    assert 'tandem_router_workers{ready="false",role="decode"} 1.0' in text


async def test_without_a_configured_model_no_worker_means_503_not_404():
    config = RouterConfig(decode=[f"http://127.0.0.1:{_closed_port()}"], poll_interval_s=60)
    server = TestServer(build_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        assert (await client.models.list()).data == []
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model="anything", prompt="hi")
        assert info.value.status_code == 503
    finally:
        await server.close()
