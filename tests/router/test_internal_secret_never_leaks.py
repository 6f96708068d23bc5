"""The service's internal secret (the Authorization header on every /internal/* call) never reaches
the router's log, an error's text or repr, or a client, whatever a worker (or an impostor at its
address) answers: a 200 that is not JSON (aiohttp's error for it shows the request's headers),
bodies, lines and JSON fields that echo the header, bytes that are not UTF-8, a redirect, a cut
connection. Every call of HttpWorkerClient meets every such answer from a real aiohttp server on
loopback, and a router app serves a request against one."""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.contracts.names import Role
from tandem.contracts.protocol import GenerateRequest, WorkerInfo
from tandem.router.app import build_app
from tandem.router.config import RouterConfig
from tandem.router.errors import RouterError
from tandem.router.worker_client import HttpWorkerClient, Timeouts, WorkerFailed

SECRET = "s3cret-of-the-service-0123456789abcdef"
MODES = ["html", "echo_500", "echo_400", "json_400", "bytes_500", "bad_json", "bad_line", "redirect", "cut"]


def hostile_info(role: Role = Role.DECODE) -> dict:
    return WorkerInfo(role=role, model="toy", max_model_len=4096, engine_id="e-1", kv_compat="g1",
                      kv_backend="tcp", ready=True, running=0, waiting=0, kv_usage=0.0,
                      outstanding_prompt_tokens=0, tokenizer_sha256="ab" * 32).to_dict()


async def _answer(request: web.Request, mode: str) -> web.StreamResponse:
    """`mode`'s answer, echoing the Authorization header the router sent wherever it can."""
    echo = request.headers.get("Authorization", "")
    if mode == "ok_info":
        return web.json_response(hostile_info())
    if mode == "html":
        return web.Response(text=f"<html>{echo}</html>", content_type="text/html")
    if mode in ("echo_500", "echo_400"):
        return web.Response(status=int(mode[-3:]), text=f"refused: {echo}")
    if mode == "json_400":
        return web.json_response({"error": {"message": f"bad header {echo}", "type": "invalid_request_error",
                                             "param": None, "code": None}}, status=400)
    if mode == "bytes_500":
        return web.Response(status=500, body=b"\xff\xfe" + echo.encode(), content_type="text/plain")
    if mode == "bad_json":
        return web.json_response({"role": echo, "type": echo, "files": {echo: 1}, "first_token_id": echo})
    if mode == "redirect":
        raise web.HTTPTemporaryRedirect(f"/elsewhere?{echo}")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    if mode == "bad_line":
        await resp.write(json.dumps({"type": echo, "seq": echo}).encode() + b"\n")
        return resp
    await resp.write(b'{"type": "tok')  # "cut": half a line, then the connection goes away
    assert request.transport is not None
    request.transport.close()
    return resp


def hostile_worker(modes: dict[str, str]) -> web.Application:
    """A worker at every /internal/* path answering as `modes[path]` says (default: the same mode
    under the key "*")."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _answer(request, modes.get(request.path, modes["*"]))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


async def _consume(stream) -> None:
    async for _ in stream:
        pass


CALLS: dict[str, Callable] = {
    "info": lambda c, url: c.info(url),
    "prefill": lambda c, url: c.prefill(url, GenerateRequest("r1", prompt="hi")),
    "generate": lambda c, url: _consume(c.generate(url, GenerateRequest("r1", prompt="hi"))),
    "tokenizer": lambda c, url: c.tokenizer(url),
    "kv_events": lambda c, url: _consume(c.kv_events(url)),
    "abort": lambda c, url: c.abort(url, "r1", "lease-token"),
}


def exposed(exc: BaseException | None) -> str:
    """Everything about a failure that could be logged or shown: text, repr, traceback (with any
    chained cause) and the body a client would get."""
    if exc is None:
        return ""
    parts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    chain = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if chain is not None:
        parts.append(repr(chain))
    if isinstance(exc, RouterError):
        parts.append(json.dumps(exc.body))
    return "\n".join(parts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", list(CALLS))
async def test_no_answer_puts_the_secret_into_an_error_or_the_log(call, mode, caplog):
    caplog.set_level(logging.DEBUG)
    server = TestServer(hostile_worker({"*": mode}), host="127.0.0.1")
    await server.start_server()
    failure: BaseException | None = None
    try:
        async with aiohttp.ClientSession() as session:
            client = HttpWorkerClient(session, Timeouts(connect_s=2, prefill_s=5, chunk_s=5, abort_s=2, info_s=5),
                                      secret=SECRET)
            try:
                await CALLS[call](client, str(server.make_url("")).rstrip("/"))
            except (WorkerFailed, RouterError) as exc:
                failure = exc
    finally:
        await server.close()
    assert SECRET not in exposed(failure)
    assert SECRET not in caplog.text
    if call != "abort":
        assert failure is not None, f"{call} accepted a {mode} answer"


async def test_a_router_serving_against_an_impostor_never_shows_the_secret(caplog):
    """Through the whole router: its polls, tokenizer fetch, a request relayed to the client."""
    caplog.set_level(logging.DEBUG)
    worker = TestServer(hostile_worker({"/internal/info": "ok_info", "/internal/generate": "json_400",
                                        "*": "html"}), host="127.0.0.1")
    await worker.start_server()
    config = RouterConfig(decode=[str(worker.make_url("")).rstrip("/")], internal_secret=SECRET)
    router = TestServer(build_app(config), host="127.0.0.1")
    await router.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for stream in (False, True):
                async with session.post(router.make_url("/v1/completions"), json={
                        "model": "toy", "prompt": "hello", "max_tokens": 4, "stream": stream}) as resp:
                    body = await resp.text()
                    assert resp.status == 400, body  # the impostor's 4xx, passed through
                    assert SECRET not in body and "[redacted]" in body
    finally:
        await router.close()
        await worker.close()
    assert SECRET not in caplog.text
    assert "cannot load the tokenizer" in caplog.text  # the tokenizer path was taken, and logged
