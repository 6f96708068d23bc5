"""What the vllm runtime's client reports of a vLLM server (issue 29 item 3), the router's WorkerInfo
from vLLM's own endpoints: the served model and context from /v1/models, ready from /health, the
engine from the process's start time (a new process, a new engine), the block size and the load
(running, waiting, KV usage) from /metrics, the role discovery gives, and the digest of the
tokenizer folder the router reads (what the tokenizer check compares)."""

from __future__ import annotations

import asyncio

import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.contracts.vllm_serve import CPU_BLOCK_SIZE
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.tokenizer_sync import read_dir
from tandem.router.worker_client import WorkerFailed

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def test_info_reads_identity_from_vllms_endpoints(vllm_servers, vllm_client, vllm_toy_model_dir):
    digest = read_dir(vllm_toy_model_dir).sha256
    ids = set()
    for server in vllm_servers.all():
        info = await vllm_client.info(server.url, server.role)
        assert (info.role, info.model, info.max_model_len, info.ready) == (server.role, "toy", 2048, True)
        assert info.tokenizer_sha256 == digest and info.outstanding_prompt_tokens == 0
        assert info.engine_id.startswith(server.url.removeprefix("http://") + "-")
        assert info.kv_backend == ("" if server.role is Role.COLOCATED else "nixl")
        assert 0.0 <= info.kv_usage <= 1.0
        ids.add(info.engine_id)
        assert (await vllm_client.info(server.url, server.role)).engine_id == info.engine_id  # stable
    assert len(ids) == 3
    assert (await vllm_client.info(vllm_servers.decode.url)).role is Role.COLOCATED  # no hint: it serves all
    assert vllm_client._engines[vllm_servers.decode.url].block_size == CPU_BLOCK_SIZE  # from cache_config_info


async def eventually(check, what: str, timeout_s: float = 60.0) -> None:
    """Until the async `check()` is true (polled), at most timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.2)


async def test_info_counts_a_running_request(vllm_servers, vllm_client, vllm_toy_model_dir):
    url = vllm_servers.colocated.url
    ids = RouterTokenizer.from_dir(vllm_toy_model_dir).encode_prompt("Count me while I run for a while.")
    req = GenerateRequest("info-load", prompt_token_ids=ids,
                          sampling=SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))

    async def running() -> int | None:
        try:
            return (await vllm_client.info(url, Role.COLOCATED)).running
        except WorkerFailed as e:  # a poll that timed out (a loaded machine): the router keeps the
            if e.slow:             # worker as last polled and asks again (test_a_slow_poll_keeps_...)
                return None
            raise

    stream = vllm_client.generate(url, req)
    try:
        assert (await anext(stream)).type is EventType.START
        await eventually(lambda: _at_least(running, 1), "vLLM reporting the request running")
    finally:
        await stream.aclose()  # closing the stream aborts the request in vLLM
    await eventually(lambda: _at_most(running, 0), "the aborted request leaving vLLM's running count")


async def _at_least(value, n: int) -> bool:
    v = await value()
    return v is not None and v >= n


async def _at_most(value, n: int) -> bool:
    v = await value()
    return v is not None and v <= n


async def test_an_unreachable_server_is_a_dead_worker(vllm_client):
    with pytest.raises(WorkerFailed) as failed:
        await vllm_client.info("http://127.0.0.1:9", Role.DECODE)
    assert failed.value.dead
    await vllm_client.abort("http://127.0.0.1:9", "any")  # nothing to send: closing a stream aborts it


async def test_a_router_without_vllms_key_fails_over_and_never_blames_the_client(vllm_servers, vllm_toy_model_dir):
    """vLLM answers /v1/* only with its API key, the service's internal secret: a router holding
    another is refused (401), which is the worker's failure (the router does not use it), never a
    4xx for the client, and the message names what to fix, not the secret."""
    import aiohttp
    from tandem.router.config import RouterConfig
    from tandem.router.runtimes.registry import create_client

    config = RouterConfig(runtime="vllm", tokenizer=str(vllm_toy_model_dir), parity_probe=False,
                          internal_secret="not-the-key")
    async with aiohttp.ClientSession() as session:
        client = create_client(session, config)
        with pytest.raises(WorkerFailed, match="refused the router's internal secret") as failed:
            await client.info(vllm_servers.decode.url, Role.DECODE)  # /v1/models: not a usable worker
        assert failed.value.dead and "not-the-key" not in str(failed.value)
        req = GenerateRequest("no-key", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2))
        with pytest.raises(WorkerFailed, match="refused the router's internal secret") as failed:
            await client.prefill(vllm_servers.prefill.url, req)
        assert "not-the-key" not in str(failed.value)
