"""vLLM's KV events drive the router's prefix index (issue 29 item 3): the vllm runtime's client
subscribes to each server's ZMQ publisher, names every stored block with tandem.contracts.prefix
(as the router names a prompt's blocks, a tenant's cache_salt included), and the real KVEventFeed
and PrefixIndex then know which server holds a prompt that was served there, and no other does."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.contracts.vllm_serve import CPU_BLOCK_SIZE
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
    nonce = uuid.uuid4().hex[:8]  # prompts no server has cached yet (vLLM names only new blocks)
    colocated, prefill, decode = vllm_servers.colocated.url, vllm_servers.prefill.url, vllm_servers.decode.url
    index = PrefixIndex()
    feed = KVEventFeed(vllm_client, index)
    feed.set_targets([colocated, prefill, decode])
    try:
        await until(lambda: index.workers() == 3, "a snapshot from every server")
        block = vllm_client._engines[colocated].block_size
        # ZMQ subscriptions start a moment after they connect: serve new prompts until one is seen
        for i in range(30):
            warm = tok.encode_prompt(f"{nonce} {i} warming up the subscription. " + TEXT)
            await serve(vllm_client, colocated, warm, f"warm-{i}")
            if index.cached_tokens(colocated, RequestInfo("w", len(warm), warm)) > 0:
                break
        else:
            pytest.fail("no KV event from the colocated server named a prompt it served")

        ids = tok.encode_prompt(f"{nonce} " + TEXT * 2)
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


def test_the_router_finds_a_repeated_prompts_prefix_from_vllms_events(vllm_router, vllm_servers):
    """Through `tandem router --runtime vllm --policy prefix-aware`: a prompt served once reaches the
    router's index as its workers' KV events, and the same prompt again is routed where its blocks are
    (counted in tandem_router_prefix_cached_tokens), with the same text."""
    import openai
    from tandem.testing.cluster import wait_until

    api = openai.OpenAI(base_url=vllm_router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = f"{uuid.uuid4().hex[:8]} " + TEXT * 3

    def cached() -> float:
        return sum(vllm_router.metric(f'tandem_router_prefix_cached_tokens_total{{role="{r}"}}')
                   for r in ("prefill", "decode"))

    before, blocks = cached(), vllm_router.metric("tandem_router_prefix_index_blocks")
    kw = {"model": "toy", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    first = api.completions.create(**kw).choices[0].text
    wait_until(lambda: vllm_router.metric("tandem_router_prefix_index_blocks") >= blocks + 2, timeout=60,
               what="the served prompt's blocks in the router's index, from vLLM's KV events")
    assert api.completions.create(**kw).choices[0].text == first
    assert cached() - before >= 2 * CPU_BLOCK_SIZE  # at least two of the CPU build's blocks found where they are


# vLLM's own publisher (its ZmqEventPublisher, msgpack encoding and numbering) sending the batches a
# test asks for, one JSON line each: what a server emits when blocks are evicted, the cache is
# reset, or the server restarts (numbering from 0 again), which a short test cannot make a real
# server do.
PUBLISHER = """
import json, sys
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], topic=sys.argv[2])
print("up", flush=True)
for line in sys.stdin:
    events = []
    for e in json.loads(line):
        if e["type"] == "stored":
            events.append(BlockStored(block_hashes=e["hashes"], parent_block_hash=e["parent"], token_ids=e["tokens"],
                                      block_size=e["size"], lora_id=None, medium="GPU", lora_name=None,
                                      extra_keys=e.get("extra")))
        elif e["type"] == "removed":
            events.append(BlockRemoved(block_hashes=e["hashes"], medium="GPU"))
        else:
            events.append(AllBlocksCleared())
    pub.publish(KVEventBatch(ts=0.0, events=events))
    print("sent", flush=True)
"""


class Publisher:
    """vLLM's ZmqEventPublisher in vLLM's interpreter, publishing what it is told."""

    def __init__(self, endpoint: str) -> None:
        import subprocess

        from tandem.contracts.vllm_serve import KV_EVENTS_TOPIC
        from tandem.worker.vllm.install import vllm_python

        self.proc = subprocess.Popen([str(vllm_python()), "-c", PUBLISHER, endpoint.replace("127.0.0.1", "*"),
                                      KV_EVENTS_TOPIC], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "up"

    async def publish(self, *events: dict) -> None:
        import json

        self.proc.stdin.write(json.dumps(list(events)) + "\n")
        self.proc.stdin.flush()
        assert (await asyncio.to_thread(self.proc.stdout.readline)).strip() == "sent"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def publish_until(publisher: Publisher, check, what: str, *events: dict, timeout_s: float = 60.0) -> None:
    """Publish `events` again and again until check() (a ZMQ subscription starts a moment after it
    connects, and a resubscription after a restart later still)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await publisher.publish(*events)
        await asyncio.sleep(0.05)
        if check():
            return
        assert loop.time() < deadline, f"not within {timeout_s:g} s: {what}"


def stored(hashes: list[int], tokens: list[int], size: int, parent: int | None = None, salt: str | None = None) -> dict:
    return {"type": "stored", "hashes": hashes, "parent": parent, "tokens": tokens, "size": size,
            "extra": None if salt is None else [[salt]] + [None] * (len(hashes) - 1)}


async def test_evictions_resets_and_restarts_follow_vllms_publisher(vllm_servers, vllm_client):
    """Stored blocks chain on their parent (a salted first block names the tenant), an evicted block
    leaves the index, a cleared cache empties it, and a publisher that numbers from 0 again (a
    restarted server) is followed from a new, empty snapshot."""
    from tandem.worker.local.processes import free_port

    url = vllm_servers.decode.url
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    vllm_client.kv_events_endpoints[url] = endpoint
    await vllm_client.info(url)
    size = vllm_client._engines[url].block_size
    ids = list(range(10, 10 + 3 * size + 5))
    info, salted = RequestInfo("r", len(ids), ids), RequestInfo("s", len(ids), ids, cache_salt="tenant-b")
    index = PrefixIndex()
    feed = KVEventFeed(vllm_client, index, retry_min_s=0.05)
    publisher = Publisher(endpoint)
    try:
        feed.set_targets([url])
        await until(lambda: index.workers() == 1, "the subscription's snapshot")
        await publish_until(publisher, lambda: index.cached_tokens(url, info) == size, "the first block seen",
                            stored([1], ids[:size], size))
        await publisher.publish(stored([2, 3], ids[size:3 * size], size, parent=1),
                                stored([7], ids[:size], size, salt="tenant-b"))
        await until(lambda: index.cached_tokens(url, info) == 3 * size, "a chain stored on its parent")
        await until(lambda: index.cached_tokens(url, salted) == size, "a salted first block")
        await publisher.publish({"type": "removed", "hashes": [2]})
        await until(lambda: index.cached_tokens(url, info) == size, "an evicted block gone, and what hangs on it")
        await publisher.publish({"type": "cleared"})
        await until(lambda: index.blocks(url) == 0, "a reset cache")
        await publisher.publish(stored([1], ids[:size], size))
        await until(lambda: index.cached_tokens(url, info) == size, "blocks stored after the reset")
        publisher.stop()
        publisher = Publisher(endpoint)  # a restarted server numbers its batches from 0, its cache empty
        other = list(range(300, 300 + size + 1))
        fresh = RequestInfo("f", len(other), other)
        await publish_until(publisher, lambda: index.cached_tokens(url, fresh) == size,
                            "the restarted publisher followed from its new numbering", stored([21], other[:size], size))
        assert index.cached_tokens(url, info) == 0  # and what the old server held is forgotten
    finally:
        publisher.stop()
        await feed.close()
