"""A colocated worker of two ranks (two processes) serves greedy output equal to transformers'
generate through every path of the engine: the compiled decode step (a shape it did not compile
fails the test, rather than running eagerly), batches joining mid-way, chunked prefill, prefix-cache
hits, and preemption when its pool runs out. A model its head counts cannot split is refused at
start with the numbers. A follower rank killed mid-stream fails the worker: the stream ends with
an error at once, /health turns 503, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import torch
from tandem.testing.engine_helpers import reference_generate, stream_tokens
from tandem.testing.worker_http import all_blocks_back, colocated
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]

# 24 blocks of 8 tokens: six sequences of ~60 tokens cannot all fit, so some are preempted.
FLAGS = ("--tensor-parallel", "2", "--num-blocks", "24", "--block-size", "8", "--prefill-chunk-tokens", "16",
         "--max-num-seqs", "6", "--dtype", "float32", "--compile", "on")


@pytest.fixture(scope="module")
def tp2(toy_model_dir):
    w = WorkerProcess(toy_model_dir, "colocated", *FLAGS, env={"TANDEM_RECOMPILE_STANCE": "fail_on_recompile"})
    try:
        yield w.start(ready_timeout_s=900)  # a fresh inductor cache compiles for minutes on 2 busy cores
    finally:
        w.kill()


@pytest.fixture(scope="module")
def hf(toy_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, 512, (int(k) - 1,), generator=g).tolist()
            for k in torch.randint(2, 48, (n,), generator=g)]


def greedy(n: int) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True}


async def test_batched_chunked_and_preempted_sequences_equal_transformers(tp2, hf):
    batch = prompts(6, seed=1)
    preempted = tp2.metric("tandem_worker_preemptions_total")
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(*(colocated(s, tp2.url, f"b{i}", ids, greedy(20)) for i, ids in enumerate(batch)))
    for ids, toks in zip(batch, got, strict=True):
        assert toks == reference_generate(hf, ids, 20), f"{len(ids)} prompt tokens"
    assert tp2.metric("tandem_worker_preemptions_total") > preempted, "the pool was meant to run out"
    await all_blocks_back([tp2])


async def test_prefix_cache_hits_keep_the_output(tp2, hf):
    ids = prompts(1, seed=2)[0] + list(range(5, 45))  # longer than a few blocks
    hits = tp2.metric("tandem_worker_prefix_cache_hit_tokens_total")
    async with aiohttp.ClientSession() as s:
        for i in range(2):
            assert await colocated(s, tp2.url, f"p{i}", ids, greedy(12)) == reference_generate(hf, ids, 12)
    assert tp2.metric("tandem_worker_prefix_cache_hit_tokens_total") >= hits + 40
    await all_blocks_back([tp2])


def test_a_model_the_group_cannot_split_is_refused_at_start(toy_model_dir):
    w = WorkerProcess(toy_model_dir, "colocated", "--tensor-parallel", "3")
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        w.start(ready_timeout_s=300)
    assert "tensor parallelism 3 does not divide the model's 4 attention heads" in str(e.value)


async def test_a_killed_follower_rank_fails_the_worker_without_a_hung_client(tp2):
    """Last in the module: it breaks the worker."""
    (rank1,) = tp2.get_json("/internal/info")["ranks"]
    assert _json(rank1["url"] + "/ready")["status"] == "ready"  # what a follower pod's probes read
    pid = (await asyncio.to_thread(_json, rank1["url"] + "/health"))["pid"]
    events: list[dict] = []
    t0 = None
    async with aiohttp.ClientSession() as s, s.post(f"{tp2.url}/internal/generate", json={
            "request_id": "victim", "prompt_token_ids": prompts(1, seed=3)[0], "sampling": greedy(1000)},
            timeout=aiohttp.ClientTimeout(total=60)) as r:
        async for line in r.content:
            if line.strip():
                events.append(json.loads(line))
                if t0 is None and len(stream_tokens(events)) >= 3:
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
    assert events[-1]["type"] == "error", events[-1]
    assert time.monotonic() - t0 < 30
    assert tp2.status("/health") == 503
    assert "tensor-parallel group failed" in json.loads(_text(tp2.url + "/health", ok=False))["message"]
    async with aiohttp.ClientSession() as s, s.post(f"{tp2.url}/internal/generate", json={
            "request_id": "after", "prompt_token_ids": [0, 5, 6], "sampling": greedy(4)}) as r:
        assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unhealthy"


def _json(url: str) -> dict:
    return json.loads(_text(url))


def _text(url: str, ok: bool = True) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if ok:
            raise
        return e.read().decode()
