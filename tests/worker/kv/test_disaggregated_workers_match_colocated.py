"""Real prefill and decode worker processes hand KV over nixl/tcp: greedy output equals the colocated
worker and transformers' generate token for token, and every block is back in both pools after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from tandem.testing.engine_helpers import reference_generate
from tandem.testing.worker_http import all_blocks_back, colocated, disaggregated
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(400)]

FLAGS = ("--num-blocks", "256", "--block-size", "8", "--kv-timeout-s", "5", "--drain-s", "1")
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


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
            assert await colocated(s, c, f"c{i}", ids, GREEDY) == want, f"colocated differs at {len(ids)} tokens"
            assert await disaggregated(s, p, d, f"d{i}", ids, GREEDY) == want, \
                f"disaggregated differs at {len(ids)} tokens"
        # Several handoffs at once.
        many = prompts() * 2
        got = await asyncio.gather(*(disaggregated(s, p, d, f"m{i}", ids, GREEDY) for i, ids in enumerate(many)))
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
