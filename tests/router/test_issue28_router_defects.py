"""Issue 28's router defects 4, 5, 10 (seeds) and 13, through the router's real event loop (an
in-process router app; a real colocated worker process where a worker must compute). Each test
failed before its fix:
4. a non-streamed request with n=16, max_tokens=4096 and top_logprobs=20 built a gigabyte-sized answer
   on the event loop; now n x max_tokens and its log probabilities are bounded per request (a 400
   naming the parameter; a request naming no max_tokens gets its choices' share), and the answer is
   built in a worker thread while the loop serves others;
5. JSON nested deep inside a string (guided_json, structured_outputs.json, a tool call's arguments)
   was a RecursionError (500) in the router, or passed it and was refused by the worker as a body
   "nested more than 32 levels"; now one decoder with one depth limit refuses it with a 400 naming
   the field, and what it lets through the worker takes;
10. seed 2**64-1 with n >= 2 gave choice 1 the seed 2**64, which the worker refused; seeds now wrap;
13. /v1/models listed the model while only a prefill worker was ready (the decode worker still
   compiling), so a client waiting for the list then got 503s; now the list and /ready agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.contracts.json_body import MAX_DOCUMENT_DEPTH
from tandem.contracts.names import Role
from tandem.contracts.protocol import WorkerInfo
from tandem.router import answer_body
from tandem.router.app import ROUTER_KEY, build_app
from tandem.router.config import RouterConfig
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def worker_url(toy_model_dir):
    worker = WorkerProcess(toy_model_dir, "colocated")
    try:
        worker.start()
        yield worker.url
    finally:
        worker.kill()


@contextlib.asynccontextmanager
async def _router(**config: Any) -> AsyncIterator[tuple[web.Application, aiohttp.ClientSession]]:
    app = build_app(RouterConfig(**{"poll_interval_s": 0.5} | config))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            yield app, session
    finally:
        await server.close()


async def _post(session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(path, json=body) as r:
        return r.status, await r.json()


def _assert_400(status: int, body: dict[str, Any], param: str, says: str) -> None:
    assert status == 400, body
    err = body["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err
    assert says in err["message"], err["message"]


# --- 4. one request, a gigabyte --------------------------------------------------------------------


async def test_the_issues_request_is_refused_naming_top_logprobs(worker_url, model_name):
    async with _router(decode=[worker_url]) as (_, s):  # the default limits
        status, body = await _post(s, "/v1/chat/completions", {
            "model": model_name, "messages": [{"role": "user", "content": "hi"}], "n": 16,
            "max_tokens": 4096, "logprobs": True, "top_logprobs": 20})
    _assert_400(status, body, "top_logprobs", "16 x 4096 x 21 = 1376256 log probabilities")


async def test_configured_limits_bound_n_times_max_tokens(worker_url, model_name):
    async with _router(decode=[worker_url], max_request_output_tokens=8, max_request_logprobs=12) as (_, s):
        status, body = await _post(s, "/v1/completions", {"model": model_name, "prompt": "a", "n": 3,
                                                            "max_tokens": 3})
        _assert_400(status, body, "n", "3 x 3 = 9 output tokens, more than this server generates for one request (8)")
        status, body = await _post(s, "/v1/completions", {"model": model_name, "prompt": "a", "max_tokens": 5,
                                                            "logprobs": 2})
        _assert_400(status, body, "logprobs", "1 x 5 x 3 = 15")
        # naming no max_tokens, the choices share the budget: 4 choices of 2 tokens
        status, body = await _post(s, "/v1/completions", {"model": model_name, "prompt": "a", "n": 4,
                                                            "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 8 and len(body["choices"]) == 4


async def test_the_answer_is_built_off_the_event_loop(worker_url, model_name, monkeypatch):
    """The build waits until the router has answered /health meanwhile: on the event loop it could not."""
    building, health_answered = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    real = answer_body.build

    def build(*args: Any) -> bytes:
        seen["thread"] = threading.current_thread()
        building.set()
        seen["loop_was_free"] = health_answered.wait(60)
        return real(*args)

    monkeypatch.setattr(answer_body, "build", build)
    async with _router(decode=[worker_url]) as (_, s):
        answer = asyncio.create_task(_post(s, "/v1/chat/completions", {
            "model": model_name, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 6,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}))
        assert await asyncio.to_thread(building.wait, 120)
        async with s.get("/health") as r:
            assert r.status == 200
        health_answered.set()
        status, body = await answer
    assert status == 200, body
    assert seen["loop_was_free"] and seen["thread"] is not threading.main_thread()
    assert [len(c["logprobs"]["content"]) for c in body["choices"]] == [6, 6]
    assert all(len(e["top_logprobs"]) == 3 for c in body["choices"] for e in c["logprobs"]["content"])


def test_long_lists_encode_in_slices_as_json_does():
    value = {"a": [{"t": i, "u": "é\n"} for i in range(3 * answer_body.SLICE + 5)], "b": [[], {}, None, 1.5],
             "c": [list(range(answer_body.SLICE + 1))]}
    assert answer_body.encode(value) == json.dumps(value, separators=(",", ":")).encode()


# --- 5. JSON nested inside strings -------------------------------------------------------------------


def _schema(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):  # 2 JSON levels per schema level
        s = {"type": "object", "properties": {"a": s}}
    return s


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("field", "value"), [
    ("guided_json", _nested(100_000)),  # RecursionError before
    ("guided_json", json.dumps(_schema(15))),  # passed the router, refused by the worker's body check
    ("structured_outputs", {"json": _nested(50_000)}),
    ("structured_outputs", {"json": _schema(13)}),  # as an object: the same limit
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(13)}}),
])
async def test_deep_json_in_a_schema_is_a_400_naming_the_field(worker_url, model_name, field, value):
    async with _router(decode=[worker_url]) as (_, s):
        status, body = await _post(s, "/v1/completions", {"model": model_name, "prompt": "a", "max_tokens": 2,
                                                            field: value})
    _assert_400(status, body, field, f"nested more than {MAX_DOCUMENT_DEPTH} levels deep")


async def test_deep_tool_call_arguments_are_a_400_naming_messages(worker_url, model_name):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _nested(100_000)}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    async with _router(decode=[worker_url]) as (_, s):
        status, body = await _post(s, "/v1/chat/completions", {"model": model_name, "messages": messages,
                                                                 "max_tokens": 2})
        _assert_400(status, body, "messages", "messages[1].tool_calls[0].function.arguments is nested more than")
        # arguments at the limit reach the worker (untokenized here) and are served
        call["function"]["arguments"] = _nested(MAX_DOCUMENT_DEPTH)
    async with _router(decode=[worker_url], tokenizer="off") as (_, s):
        status, body = await _post(s, "/v1/chat/completions", {"model": model_name, "messages": messages,
                                                                 "max_tokens": 2})
    assert status == 200, body


async def test_the_deepest_schema_the_router_passes_the_worker_serves(worker_url, model_name):
    schema = _schema((MAX_DOCUMENT_DEPTH - 1) // 2)  # 2k + 1 levels: the limit or one below it
    async with _router(decode=[worker_url]) as (_, s):
        for field, value in (("guided_json", json.dumps(schema)), ("structured_outputs", {"json": schema})):
            status, body = await _post(s, "/v1/completions", {"model": model_name, "prompt": "a", "max_tokens": 4,
                                                                field: value})
            assert status == 200, (field, body)


# --- 10. the seeds of n choices ----------------------------------------------------------------------


async def test_the_largest_seed_with_two_choices_wraps_to_zero(worker_url, model_name):
    body = {"model": model_name, "prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    async with _router(decode=[worker_url]) as (_, s):
        status, two = await _post(s, "/v1/completions", body | {"n": 2, "seed": 2**64 - 1})
        assert status == 200, two
        status, zero = await _post(s, "/v1/completions", body | {"seed": 0})
        assert status == 200, zero
    # choice 1 of seed 2**64 - 1 is seeded 2**64 - 1 + 1, wrapped: 0
    assert two["choices"][1]["text"] == zero["choices"][0]["text"]


# --- 13. a model listed before it can be served ------------------------------------------------------


@contextlib.asynccontextmanager
async def _info_worker(role: Role, ready: bool) -> AsyncIterator[tuple[str, dict[str, bool]]]:
    """A worker that only answers /internal/info (a model named, `ready` switchable)."""
    state = {"ready": ready}

    async def info(request: web.Request) -> web.Response:
        return web.json_response(WorkerInfo(
            role=role, model="toy", max_model_len=64, engine_id=f"{role.value}-1", kv_compat="g", kv_backend="tcp",
            ready=state["ready"], running=0, waiting=0, kv_usage=0.0, outstanding_prompt_tokens=0).to_dict())

    app = web.Application()
    app.router.add_get("/internal/info", info)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", state
    finally:
        await server.close()


async def test_the_model_is_listed_once_a_decode_worker_can_serve():
    async with _info_worker(Role.PREFILL, True) as (prefill, _), _info_worker(Role.DECODE, False) as (decode, d):
        async with _router(prefill=[prefill], decode=[decode], poll_interval_s=60, tokenizer="off",
                           parity_probe=False) as (app, s):
            async with s.get("/v1/models") as r:  # the decode worker still compiles: nothing to list
                assert r.status == 200 and (await r.json())["data"] == []
            async with s.get("/ready") as r:
                assert r.status == 503
            d["ready"] = True
            await app[ROUTER_KEY].workers.poll_once()
            async with s.get("/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["toy"]
            async with s.get("/ready") as r:
                assert r.status == 200
