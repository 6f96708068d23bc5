"""Worker processes killed around a handoff: the survivor frees its blocks within the bound, a restarted
prefill worker is used (never its predecessor's metadata), and after cancelled and failed requests
every block is back in both pools. The workers run with the service's internal secret, as in a
cluster: every internal call and the KV transfer carry it."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from tandem.contracts.internal_auth import auth_headers
from tandem.testing.engine_helpers import ndjson_events, reference_generate, stream_tokens
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(500)]

LEASE_S = 3.0
FLAGS = ("--num-blocks", "256", "--block-size", "8", "--kv-timeout-s", "4",
         "--kv-lease-s", str(LEASE_S), "--drain-s", "1")
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
IDS = [0] + list(range(40, 140))
SECRET = "end-to-end-service-secret-01234"


async def prefill(s: aiohttp.ClientSession, p: WorkerProcess, rid: str, ids: list[int] = IDS) -> dict:
    async with s.post(f"{p.url}/internal/prefill", json={"request_id": rid, "prompt_token_ids": ids,
                                                         "sampling": GREEDY}) as r:
        res = await r.json()
        assert r.status == 200, res
        return res


def generate_body(rid: str, res: dict, ids: list[int] = IDS, sampling: dict = GREEDY) -> dict:
    return {"request_id": rid, "prompt_token_ids": ids, "sampling": sampling,
            "kv_source": res["kv"], "first_token_id": res["first_token_id"]}


def _get_info(w: WorkerProcess) -> dict:
    req = urllib.request.Request(w.url + "/internal/info", headers=auth_headers(SECRET))
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


async def info(w: WorkerProcess) -> dict:
    return await asyncio.to_thread(_get_info, w)


async def wait_all_free(w: WorkerProcess, within_s: float) -> float:
    """Seconds until every block of w is free and nothing is leased; fails after within_s."""
    t0 = time.monotonic()
    while True:
        i = await info(w)
        if i["kv_blocks_free"] == i["kv_blocks_total"] and not i["leased"]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"blocks still held after {within_s} s: {i}"
        await asyncio.sleep(0.05)


async def test_killed_and_restarted_workers(backend: str, toy_model_dir: Path, peer_process: list) -> None:
    from transformers import AutoModelForCausalLM

    args = ("--kv-backend", backend, *FLAGS)
    p = WorkerProcess(toy_model_dir, "prefill", *args, secret=SECRET)
    d = WorkerProcess(toy_model_dir, "decode", *args, secret=SECRET)
    peer_process.extend([p, d])
    p.start()
    d.start()
    want = reference_generate(AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval(),
                              IDS, GREEDY["max_tokens"])
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(SECRET)) as s:
        # 1. The decode worker dies while the handoff is pending: the prefill side frees the blocks.
        res = await prefill(s, p, "dies")
        assert (await info(p))["leased"] == 1
        d.signal(signal.SIGSTOP)
        pending = asyncio.create_task(s.post(f"{d.url}/internal/generate", json=generate_body("dies", res)))
        await asyncio.sleep(0.2)
        killed_at = time.monotonic()
        d.kill()
        with pytest.raises(aiohttp.ClientError):
            await pending
        await wait_all_free(p, LEASE_S + 2.0)
        assert time.monotonic() - killed_at < LEASE_S + 2.0
        d2 = WorkerProcess(toy_model_dir, "decode", *args, secret=SECRET)
        peer_process.append(d2)
        d2.start()
        ok1 = await prefill(s, p, "ok1")
        async with s.post(f"{d2.url}/internal/generate", json=generate_body("ok1", ok1)) as r:
            assert r.status == 200 and stream_tokens(await ndjson_events(r)) == want[1:]  # after the first

        # 2. The prefill worker is killed and restarted on the same URL with a new engine_id.
        stale = await prefill(s, p, "stale")
        old_engine = stale["kv"]["engine_id"]
        p.kill()
        p2 = WorkerProcess(toy_model_dir, "prefill", *args, port=p.port, secret=SECRET)
        peer_process.append(p2)
        p2.start()
        t0 = time.monotonic()
        async with s.post(f"{d2.url}/internal/generate", json=generate_body("stale", stale)) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "kv_transfer_failed", body
        assert time.monotonic() - t0 < 4 + 1.0
        fresh = await prefill(s, p2, "fresh")
        assert fresh["kv"]["engine_id"] != old_engine
        async with s.post(f"{d2.url}/internal/generate", json=generate_body("fresh", fresh)) as r:
            assert r.status == 200 and stream_tokens(await ndjson_events(r)) == want[1:]
        peers = (await asyncio.to_thread(d2.get_json, "/internal/kv/health"))["peers"]
        assert list(peers.values()) == [fresh["kv"]["engine_id"]]

        # 3. Many requests, some cancelled or failed: every block comes back in both pools.
        async def full(i: int) -> None:
            async with s.post(f"{d2.url}/internal/generate",
                               json=generate_body(f"f{i}", await prefill(s, p2, f"f{i}"))) as r:
                assert stream_tokens(await ndjson_events(r)) == want[1:]

        async def disconnect(i: int) -> None:  # the client goes away mid-stream
            long = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
            res = await prefill(s, p2, f"x{i}")
            async with s.post(f"{d2.url}/internal/generate",
                              json=generate_body(f"x{i}", res, sampling=long)) as r:
                await r.content.readline()

        async def aborted_on_prefill(i: int) -> None:
            res = await prefill(s, p2, f"a{i}")
            async with s.post(f"{p2.url}/internal/abort", json={"request_id": f"a{i}",
                                                               "lease_token": res["kv"]["lease_token"]}) as r:
                assert r.status == 200 and (await r.json())["aborted"] is True

        async def failed_pull(i: int) -> None:  # a source naming an engine that is gone
            res = await prefill(s, p2, f"b{i}")
            bad = dict(res, kv=dict(res["kv"], engine_id="gone-1"))
            async with s.post(f"{d2.url}/internal/generate", json=generate_body(f"b{i}", bad)) as r:
                assert r.status == 503

        async def never_pulled(i: int) -> None:  # reclaimed by the lease
            await prefill(s, p2, f"n{i}")

        jobs = [f(i) for i in range(3) for f in (full, disconnect, aborted_on_prefill, failed_pull,
                                                   never_pulled)]
        await asyncio.gather(*jobs)
        await wait_all_free(d2, 10.0)
        await wait_all_free(p2, LEASE_S + 3.0)
        h = await asyncio.to_thread(d2.get_json, "/internal/kv/health")
        assert h["failures_total"]["pull"] >= 4 and h["transfers_total"]["pull"] >= 8
