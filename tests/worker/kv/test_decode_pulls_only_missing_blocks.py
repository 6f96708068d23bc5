"""A decode worker that already holds the leading blocks of a prompt (the conversation's previous
turn, or another request with the same prefix) takes them from its own prefix cache and pulls only
the rest from the prefill worker's lease: the bytes moved and saved are counted, the output still
equals transformers' generate token for token, and every block is back in both pools after. The
decode worker's KV event stream names what its cache holds. Real worker processes over nixl/tcp."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.prefix import block_hashes
from tandem.testing.engine_helpers import ndjson_events, reference_generate, stream_tokens
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(400)]

BS = 8
FLAGS = ("--num-blocks", "256", "--block-size", str(BS), "--kv-timeout-s", "5", "--drain-s", "1")
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def counters(w: WorkerProcess) -> dict[str, float]:
    """KV bytes this worker pulled, those its prefix cache saved it from pulling, and its pulls'
    verdicts against the source's block digests (narrowed with the blocks)."""
    out = {"pulled": 0.0, "saved": 0.0, "verified": 0.0, "verify_failures": 0.0}
    for fam in text_string_to_metric_families(w.get_text("/metrics")):
        for s in fam.samples:
            if s.name == "tandem_kv_transfer_bytes_total" and s.labels.get("direction") == "pull":
                out["pulled"] += s.value
            elif s.name == "tandem_worker_kv_pull_saved_bytes_total":
                out["saved"] += s.value
            elif s.name in ("tandem_kv_transfer_verified_total", "tandem_kv_transfer_verify_failures_total"):
                out[s.name.removeprefix("tandem_kv_transfer_").removesuffix("_total")] += s.value
    return out


async def handoff(s: aiohttp.ClientSession, p: str, d: str, rid: str, prompt: list[int]) -> list[int]:
    async with s.post(f"{p}/internal/prefill", json={"request_id": rid, "prompt_token_ids": prompt,
                                                     "sampling": GREEDY}) as r:
        res = await r.json()
        assert r.status == 200, res
    body = {"request_id": rid, "prompt_token_ids": prompt, "sampling": GREEDY, "kv_source": res["kv"],
            "first_token_id": res["first_token_id"]}
    async with s.post(f"{d}/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [res["first_token_id"]] + stream_tokens(await ndjson_events(r))


async def snapshot(s: aiohttp.ClientSession, d: str) -> dict:
    """The first line of the decode worker's KV event stream (the whole snapshot: few hashes)."""
    async with s.get(f"{d}/internal/kv/events") as r:
        assert r.status == 200
        return json.loads(await r.content.readline())


async def test_decode_pulls_only_the_blocks_it_lacks(backend: str, toy_model_dir: Path,
                                                    peer_process: list) -> None:
    from transformers import AutoModelForCausalLM

    procs = [WorkerProcess(toy_model_dir, "prefill", "--kv-backend", backend, *FLAGS),
             WorkerProcess(toy_model_dir, "decode", "--kv-backend", backend, *FLAGS)]
    peer_process.extend(procs)  # killed at the end whatever happens
    for w in procs:
        w.start()
    pw, dw = procs
    bb = KVLayout(**dw.get_json("/internal/info")["kv_layout"]).block_bytes
    hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    turn1 = [0] + ids(59, 1)  # 60 tokens: 7 full blocks and 4 tokens
    async with aiohttp.ClientSession() as s:
        c0 = await asyncio.to_thread(counters, dw)
        answer = await handoff(s, pw.url, dw.url, "turn1", turn1)
        assert answer == reference_generate(hf, turn1, N)
        c1 = await asyncio.to_thread(counters, dw)
        assert c1["pulled"] - c0["pulled"] == 8 * bb and c1["saved"] == c0["saved"]  # nothing held yet

        snap = await snapshot(s, dw.url)
        assert snap["enabled"] and snap["block_size"] == BS
        salt = bytes.fromhex(snap["salt"])
        # Decode computed the answer's first N-1 tokens after the pulled prompt: (60 + 7) // 8 blocks.
        held = block_hashes((turn1 + answer)[:60 + N - 1], BS, salt)
        assert {h.hex() for h in held} <= set(snap["hashes"])

        # The next turn resends the conversation: the decode worker holds its first 8 blocks.
        turn2 = turn1 + answer + ids(20, 2)  # 88 tokens: 11 blocks
        assert await handoff(s, pw.url, dw.url, "turn2", turn2) == reference_generate(hf, turn2, N)
        c2 = await asyncio.to_thread(counters, dw)
        assert c2["saved"] - c1["saved"] == 8 * bb and c2["pulled"] - c1["pulled"] == 3 * bb

        # Another request sharing the first 48 tokens (6 blocks) of the conversation.
        other = turn1[:48] + ids(30, 3)  # 78 tokens: 10 blocks
        assert await handoff(s, pw.url, dw.url, "other", other) == reference_generate(hf, other, N)
        c3 = await asyncio.to_thread(counters, dw)
        assert c3["saved"] - c2["saved"] == 6 * bb and c3["pulled"] - c2["pulled"] == 4 * bb

        # All 11 blocks of turn2's prompt held: the last is still pulled (it ends the peer's lease).
        again = await handoff(s, pw.url, dw.url, "again", turn2)
        assert again == reference_generate(hf, turn2, N)
        c4 = await asyncio.to_thread(counters, dw)
        assert c4["saved"] - c3["saved"] == 10 * bb and c4["pulled"] - c3["pulled"] == 1 * bb
        assert (c4["verified"], c4["verify_failures"]) == (4, 0), "a narrowed pull must keep its blocks' digests"
    for w in procs:
        await all_blocks_free(w)


async def all_blocks_free(w: WorkerProcess, within_s: float = 10.0) -> None:
    """Nothing in use and nothing leased (cached blocks nobody holds count as free)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while True:
        info = await asyncio.to_thread(w.get_json, "/internal/info")
        if info["kv_blocks_free"] == info["kv_blocks_total"] and not info["leased"]:
            assert info["kv_blocks_cached"] > 0
            return
        assert loop.time() < end, f"blocks not returned: {info}"
        await asyncio.sleep(0.05)


async def test_small_decode_pool_preempts_and_evicts_and_keeps_outputs(backend: str, toy_model_dir: Path,
                                                                       peer_process: list) -> None:
    """Handoffs into a decode pool too small for them all: pulled sequences are preempted and
    recomputed (from what the cache still holds), cached blocks are evicted, and every output
    still equals transformers' generate."""
    from transformers import AutoModelForCausalLM

    small = ("--num-blocks", "24", "--block-size", str(BS), "--kv-timeout-s", "20", "--drain-s", "1",
             "--max-num-seqs", "4")
    procs = [WorkerProcess(toy_model_dir, "prefill", "--kv-backend", backend, *FLAGS),
             WorkerProcess(toy_model_dir, "decode", "--kv-backend", backend, *small)]
    peer_process.extend(procs)
    for w in procs:
        w.start()
    pw, dw = procs
    hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    shared = [0] + ids(23, 4)  # 3 blocks every prompt starts with
    prompts = [shared + ids(17 + 3 * i, 10 + i) for i in range(6)]  # 40-55 tokens, + 24 generated
    sampling = dict(GREEDY, max_tokens=40)
    async with aiohttp.ClientSession() as s:
        async def prefill(i: int, prompt: list[int]) -> dict:
            async with s.post(f"{pw.url}/internal/prefill", json={"request_id": f"s{i}", "prompt_token_ids": prompt,
                                                                  "sampling": sampling}) as r:
                res = await r.json()
                assert r.status == 200, res
                return res

        async def decode(i: int, prompt: list[int], res: dict) -> list[int]:
            body = {"request_id": f"s{i}", "prompt_token_ids": prompt, "sampling": sampling,
                    "kv_source": res["kv"], "first_token_id": res["first_token_id"]}
            async with s.post(f"{dw.url}/internal/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return [res["first_token_id"]] + stream_tokens(await ndjson_events(r))

        # Every prompt is prefilled (leased) before any handoff, so all six land on the decode
        # worker at once: its pool cannot hold them as they grow, whatever the machine's speed.
        results = [await prefill(i, p) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(decode(i, p, r) for i, (p, r) in enumerate(zip(prompts, results, strict=True))))
    for p, toks in zip(prompts, got, strict=True):
        assert toks == reference_generate(hf, p, 40)
    metrics = {s.name: s.value for fam in text_string_to_metric_families(dw.get_text("/metrics"))
               for s in fam.samples}
    assert metrics["tandem_worker_preemptions_total"] > 0, "the pool was meant to be too small for all six"
    assert metrics["tandem_worker_prefix_cache_evictions_total"] > 0
    assert metrics["tandem_worker_kv_pull_saved_bytes_total"] > 0
    for w in procs:
        await all_blocks_free(w)
