"""Prefill and decode with different tensor-parallel sizes hand KV over, over tcp and NIXL: each
decode rank reads exactly its heads from the prefill rank(s) that hold them, under one lease, and
greedy output equals transformers' generate for (p, d) = (2, 1), (1, 2) and (2, 2); a decode
worker whose prefix cache holds a prompt's leading blocks pulls only the rest; a draining TP 2
worker's streams continue on a TP 1 worker from its KV (its followers serve their heads). Real
processes: a TP 1 colocated worker (prefill and decode), a TP 2 colocated one and a TP 2 prefill
one, shared by the module's tests."""

from __future__ import annotations

import asyncio
import json
import signal
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from tandem.testing.engine_helpers import reference_generate, stream_tokens
from tandem.testing.worker_http import all_blocks_back, disaggregated
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import ManagedProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

FLAGS = ("--num-blocks", "160", "--block-size", "8", "--kv-timeout-s", "10", "--drain-s", "20", "--compile", "off",
         "--dtype", "float32")
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
PAIRS = {"2-1": ("p2", "c1"), "1-2": ("c1", "c2"), "2-2": ("p2", "c2"), "2-1 colocated": ("c2", "c1")}


def _nixl_or_skip(backend: str) -> None:
    if backend == "nixl":
        pytest.importorskip("tandem.worker.kv.nixl", reason="needs the nixl package (nixl-cu12, `make venv`)")


@pytest.fixture(scope="module", params=["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def group(request, toy_model_dir):
    backend = request.param
    _nixl_or_skip(backend)
    kv = ("--kv-backend", backend)
    procs = {"c1": WorkerProcess(toy_model_dir, "colocated", *kv, *FLAGS),
             "c2": WorkerProcess(toy_model_dir, "colocated", *kv, "--tensor-parallel", "2", "--migrate-on-drain",
                                 *FLAGS),
             "p2": WorkerProcess(toy_model_dir, "prefill", *kv, "--tensor-parallel", "2", *FLAGS)}
    try:
        for p in procs.values():
            ManagedProcess.start(p)  # all at once; then wait for each
        for p in procs.values():
            p.wait_ready("/ready", 600)
        yield SimpleNamespace(backend=backend, **procs)
    finally:
        for p in procs.values():
            p.kill()


@pytest.fixture(scope="module")
def hf(toy_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(18)
    return [[0] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in (1, 9, 33, 250)]


@pytest.mark.parametrize("pair", list(PAIRS))
async def test_greedy_output_equals_transformers_across_tensor_sizes(group, hf, pair):
    p, d = (getattr(group, name) for name in PAIRS[pair])
    assert p.get_json("/internal/info")["tensor_parallel"] == (2 if PAIRS[pair][0] != "c1" else 1)
    async with aiohttp.ClientSession() as s:
        many = prompts() * 2
        got = await asyncio.gather(*(disaggregated(s, p.url, d.url, f"{pair}-{i}", ids, GREEDY)
                                     for i, ids in enumerate(many)))
    for ids, toks in zip(many, got, strict=True):
        assert toks == reference_generate(hf, ids, N), f"{pair}: {len(ids)} prompt tokens"
    await all_blocks_back([group.c1, group.c2, group.p2])


VERIFY = ("tandem_kv_transfer_verified_total", "tandem_kv_transfer_verify_skipped_total",
          "tandem_kv_transfer_verify_failures_total")


@pytest.mark.parametrize("pair", ["2-1", "1-2", "2-2"])
async def test_every_handoff_between_tensor_sizes_is_verified(group, hf, pair):
    """Issue 28.11: a tensor-parallel source's digests cover every head (rank 0 gathers its ranks'),
    and each decode rank checks the heads it pulled: verified, never skipped."""
    p, d = (getattr(group, name) for name in PAIRS[pair])
    ids = prompts()[2]
    before = [d.metric(name) for name in VERIFY]
    async with aiohttp.ClientSession() as s:
        assert await disaggregated(s, p.url, d.url, f"verify-{pair}", ids, GREEDY) == reference_generate(hf, ids, N)
    after = [d.metric(name) for name in VERIFY]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0, 0], dict(zip(VERIFY, after, strict=True))
    await all_blocks_back([group.c1, group.c2, group.p2])


async def test_a_tensor_parallel_source_names_every_rank_under_one_lease(group):
    async with aiohttp.ClientSession() as s, s.post(f"{group.p2.url}/internal/prefill", json={
            "request_id": "shape", "prompt_token_ids": prompts()[2], "sampling": GREEDY}) as r:
        kv = (await r.json())["kv"]
    info = group.p2.get_json("/internal/info")
    assert [r["url"] for r in kv["ranks"]] == [r["url"] for r in info["ranks"]] and len(kv["ranks"]) == 1
    assert kv["ranks"][0]["engine_id"] == kv["engine_id"] + "-r1" and info["leased"] == 1
    assert kv["digest_algorithm"] == "crc32" and len(kv["block_digests"]) == len(kv["block_ids"]) * kv["digest_heads"]
    async with aiohttp.ClientSession() as s, s.post(f"{group.p2.url}/internal/kv/release", json={
            "request_id": "shape", "lease_token": kv["lease_token"]}) as r:
        assert (await r.json())["released"]
    await all_blocks_back([group.p2])


async def test_decode_pulls_only_what_its_prefix_cache_lacks(group, hf):
    ids = prompts()[3]
    before = group.c2.metric("tandem_worker_kv_pull_saved_bytes_total")
    async with aiohttp.ClientSession() as s:
        for i in range(2):  # the second handoff finds the leading blocks in the decode worker's cache
            assert await disaggregated(s, group.p2.url, group.c2.url, f"cached-{i}", ids, GREEDY) == \
                reference_generate(hf, ids, N)
    assert group.c2.metric("tandem_worker_kv_pull_saved_bytes_total") > before
    await all_blocks_back([group.c2, group.p2])


async def test_a_draining_tp2_worker_hands_its_stream_to_a_tp1_worker(group, hf):
    """Last in the module: it stops the TP 2 colocated worker."""
    ids, total = prompts()[2], 40
    sampling = {"max_tokens": total, "temperature": 0, "ignore_eos": True}
    events: list[dict] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{group.c2.url}/internal/generate", json={
                "request_id": "mig", "prompt_token_ids": ids, "sampling": sampling}) as r:
            async for line in r.content:
                if line.strip():
                    events.append(json.loads(line))
                    if len(stream_tokens(events)) == 4:
                        group.c2.signal(signal.SIGTERM)
        last = events[-1]
        assert last["type"] == "migrate" and last["kv"] is not None, last
        assert len(last["kv"]["ranks"]) == 1  # its rank 1 serves its heads while rank 0 drains
        async with s.post(f"{group.c1.url}/internal/generate", json={
                "request_id": "mig", "prompt_token_ids": ids, "sampling": sampling, "kv_source": last["kv"],
                "generated_token_ids": last["generated_token_ids"], "migrated_from": group.c2.url}) as r:
            assert r.status == 200, await r.text()
            rest = stream_tokens([json.loads(line) for line in (await r.read()).decode().splitlines() if line])
    assert last["generated_token_ids"] + rest == reference_generate(hf, ids, total)
    assert group.c1.metric("tandem_worker_migrations_in_total") >= 1
    assert await asyncio.to_thread(group.c2.proc.wait, 60) == 0
