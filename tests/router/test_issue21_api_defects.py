"""Issue 21's defects 4, 10 and 11 (each test failed before its fix):
4. the router tokenized chat messages on its event loop when their contents were short, however
   many messages there were (a body of hundreds of thousands of empty ones blocked every stream);
   now a message counts for template work whatever its content, and their number is bounded;
10. prompt token ids of 2**63 and more passed validation and reached a struct.pack (prefix hashes):
   a 500; now any id beyond 32 bits is a 400 naming the prompt;
11. /v1/models listed an empty model id while a worker was still loading; now it lists none (and
   requests get a 503 until a worker names its model)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.contracts.names import Role
from tandem.contracts.prefix import block_hashes
from tandem.contracts.protocol import WorkerInfo
from tandem.router.app import build_app
from tandem.router.config import RouterConfig
from tandem.router.errors import RouterError
from tandem.router.tokenizer_sync import TokenizerSync
from tandem.router.validation import Endpoint, Limits, ParsedRequest, parse_request


class _RecordingTokenizer:
    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode_chat(self, messages, options=None):
        self.threads.append(threading.current_thread())
        return [1] * len(messages)


async def test_many_empty_messages_are_tokenized_off_the_event_loop():
    sync = TokenizerSync(client=None, source="off")
    sync.tokenizer, sync.active = _RecordingTokenizer(), True
    from tandem.contracts.sampling import SamplingParams

    req = ParsedRequest(Endpoint.CHAT, "m", SamplingParams(), messages=[{"role": "user", "content": ""}] * 3000)
    assert await sync.token_ids(req) == [1] * 3000
    assert sync.tokenizer.threads == [t for t in sync.tokenizer.threads if t is not threading.main_thread()]
    assert sync.tokenizer.threads and sync.tokenizer.threads[0] is not threading.current_thread()


def test_the_number_of_messages_is_bounded():
    body = {"model": "m", "messages": [{"role": "user", "content": ""}] * 300_000}
    with pytest.raises(RouterError) as info:
        parse_request(body, Endpoint.CHAT, Limits())
    assert (info.value.status, info.value.body["error"]["param"]) == (400, "messages")


@pytest.mark.parametrize("token", [2**63, 2**64 + 5, 2**31])
def test_token_ids_beyond_32_bits_are_a_400_naming_the_prompt(token):
    with pytest.raises(RouterError) as info:
        parse_request({"model": "m", "prompt": [1, token]}, Endpoint.COMPLETION, Limits())
    assert (info.value.status, info.value.body["error"]["param"]) == (400, "prompt")
    # the largest accepted id hashes (it used to be the struct.pack that raised)
    ids = parse_request({"model": "m", "prompt": [2**31 - 1] * 4}, Endpoint.COMPLETION, Limits()).prompt_token_ids
    assert len(block_hashes(ids, 2, b"")) == 2


@pytest.fixture
async def loading_worker():
    """A worker that answers /internal/info as one still loading its model does."""
    async def info(request: web.Request) -> web.Response:
        return web.json_response(WorkerInfo(
            role=Role.COLOCATED, model="", max_model_len=0, engine_id="w-1", kv_compat="g", kv_backend="tcp",
            ready=False, running=0, waiting=0, kv_usage=0.0, outstanding_prompt_tokens=0).to_dict())

    app = web.Application()
    app.router.add_get("/internal/info", info)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()


async def test_models_lists_no_empty_id_while_a_worker_loads(loading_worker):
    server = TestServer(build_app(RouterConfig(decode=[loading_worker], poll_interval_s=60, tokenizer="off")),
                        host="127.0.0.1")
    await server.start_server()
    try:
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"] == []
            async with s.post(base + "/v1/completions", json={"model": "toy", "prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "no_worker_available"
    finally:
        await server.close()
        await asyncio.sleep(0)
