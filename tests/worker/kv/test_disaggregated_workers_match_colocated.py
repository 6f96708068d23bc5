"""Real prefill and decode worker processes hand KV over nixl/tcp: greedy output equals the colocated
worker and transformers' generate token for token, and every block is back in both pools after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from tandem.testing.engine_helpers import ndjson_events, reference_generate, stream_tokens
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(400)]

FLAGS = ("--num-blocks", "256", "--block-size", "8", "--kv-timeout-s", "5", "--drain-s", "1")
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


async def disaggregated(s: aiohttp.ClientSession, p: str, d: str, rid: str, ids: list[int]) -> list[int]:
    """POST /internal/prefill on P, then /internal/generate with its kv_source on D: the prefill's first
    token, then the decode stream (which never repeats it)."""
    async with s.post(f"{p}/internal/prefill", json={"request_id": rid, "prompt_token_ids": ids,
                                                     "sampling": GREEDY}) as r:
        res = await r.json()
        assert r.status == 200, res
    assert res["kv"]["backend"] in ("nixl", "tcp") and res["kv"]["num_tokens"] == len(ids)
    body = {"request_id": rid, "prompt_token_ids": ids, "sampling": GREEDY,
            "kv_source": res["kv"], "first_token_id": res["first_token_id"]}
    async with s.post(f"{d}/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [res["first_token_id"]] + stream_tokens(await ndjson_events(r))


async def colocated(s: aiohttp.ClientSession, c: str, rid: str, ids: list[int]) -> list[int]:
    async with s.post(f"{c}/internal/generate", json={"request_id": rid, "prompt_token_ids": ids,
                                                      "sampling": GREEDY}) as r:
        assert r.status == 200, await r.text()
        return stream_tokens(await ndjson_events(r))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lens = [1, 7, 8, 9, 60, 300]
    return [[0] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in lens]


async def test_prefill_plus_decode_equals_colocated_and_transformers(
        backend: str, toy_model_dir: Path, peer_process: list) -> None:
    from transformers import AutoModelForCausalLM

    procs = [WorkerProcess(toy_model_dir, "prefill", "--kv-backend", backend, *FLAGS),
             WorkerProcess(toy_model_dir, "decode", "--kv-backend", backend, *FLAGS),
             WorkerProcess(toy_model_dir, "colocated", *FLAGS)]
    peer_process.extend(procs)  # killed at the end whatever happens
    for w in procs:
        w.start()
    p, d, c = (w.url for w in procs)
    hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    async with aiohttp.ClientSession() as s:
        for i, ids in enumerate(prompts()):
            want = reference_generate(hf, ids, N)
            assert await colocated(s, c, f"c{i}", ids) == want, f"colocated differs at {len(ids)} tokens"
            assert await disaggregated(s, p, d, f"d{i}", ids) == want, \
                f"disaggregated differs at {len(ids)} tokens"
        # Several handoffs at once.
        many = prompts() * 2
        got = await asyncio.gather(*(disaggregated(s, p, d, f"m{i}", ids) for i, ids in enumerate(many)))
        for ids, toks in zip(many, got, strict=True):
            assert toks == reference_generate(hf, ids, N)
    await all_blocks_back(procs[:2])
    health = procs[1].get_json("/internal/kv/health")
    assert health["backend"] == backend and health["healthy"]
    assert health["transfers_total"]["pull"] == 18
    metrics = (await asyncio.to_thread(_text, procs[1].url + "/metrics"))
    assert "tandem_kv_transfer_bytes_total" in metrics


def _text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


async def all_blocks_back(workers: list[WorkerProcess], within_s: float = 10.0) -> None:
    """Every KV block free and nothing leased, on each worker (releases land asynchronously)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    for w in workers:
        while True:
            info = await asyncio.to_thread(w.get_json, "/internal/info")
            if info["kv_blocks_free"] == info["kv_blocks_total"] and not info["leased"]:
                break
            assert loop.time() < end, f"{w.argv[4]}: blocks not returned: {info}"
            await asyncio.sleep(0.05)
