"""vLLM's KV events drive the router's prefix index (issue 29 item 3): the vllm runtime's client
subscribes to each server's ZMQ publisher, names every stored block with tandem.contracts.prefix
(as the router names a prompt's blocks, a tenant's cache_salt included), and the real KVEventFeed
and PrefixIndex then know which server holds a prompt that was served there, and no other does."""

from __future__ import annotations

import asyncio

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.router.kv_feed import KVEventFeed
from tandem.router.policies.base import RequestInfo
from tandem.router.prefix_index import PrefixIndex
from tandem.router.tokenizer import RouterTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TEXT = ("A paged key value cache keeps fixed size blocks in one pool allocated at start up, and the "
        "router remembers which worker holds which block so a repeated prompt goes back there. ")


async def serve(client, url: str, ids: list[int], rid: str, salt: str | None = None) -> None:
    req = GenerateRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(max_tokens=2, temperature=0.0),
                          cache_salt=salt)
    async for _ in client.generate(url, req):
        pass


async def until(check, what: str, timeout_s: float = 60.0) -> None:
    """Until check() is true (polled; the index changes as events arrive), at most timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.1)


async def test_a_served_prompt_appears_in_the_index_for_the_server_that_holds_it(vllm_servers, vllm_client,
                                                                                  vllm_toy_model_dir):
    tok = RouterTokenizer.from_dir(vllm_toy_model_dir)
    colocated, prefill, decode = vllm_servers.colocated.url, vllm_servers.prefill.url, vllm_servers.decode.url
    index = PrefixIndex()
    feed = KVEventFeed(vllm_client, index)
    feed.set_targets([colocated, prefill, decode])
    try:
        await until(lambda: index.workers() == 3, "a snapshot from every server")
        block = vllm_client._engines[colocated].block_size
        # ZMQ subscriptions start a moment after they connect: serve new prompts until one is seen
        for i in range(30):
            warm = tok.encode_prompt(f"{i} warming up the subscription. " + TEXT)
            await serve(vllm_client, colocated, warm, f"warm-{i}")
            if index.cached_tokens(colocated, RequestInfo("w", len(warm), warm)) > 0:
                break
        else:
            pytest.fail("no KV event from the colocated server named a prompt it served")

        ids = tok.encode_prompt(TEXT * 2)
        info = RequestInfo("r", len(ids), ids)
        full = (len(ids) // block) * block
        assert all(index.cached_tokens(u, info) == 0 for u in (colocated, prefill, decode))
        await serve(vllm_client, colocated, ids, "served")
        await until(lambda: index.cached_tokens(colocated, info) == min(full, len(ids) - 1),
                    "the served prompt's blocks named for the colocated server")
        assert index.cached_tokens(prefill, info) == index.cached_tokens(decode, info) == 0

        salted = RequestInfo("s", len(ids), ids, cache_salt="tenant-a")
        assert index.cached_tokens(colocated, salted) == 0  # another tenant's blocks are not this one's
        await serve(vllm_client, colocated, ids, "salted", salt="tenant-a")
        await until(lambda: index.cached_tokens(colocated, salted) == min(full, len(ids) - 1),
                    "a salted prompt's blocks named with its salt")
    finally:
        await feed.close()
