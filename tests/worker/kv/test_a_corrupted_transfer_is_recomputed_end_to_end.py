"""Every KV transfer verified, with real worker processes (issue 28 item 11): the prefill worker's
TCP KV port flips a byte of the first read it serves (the test-only TANDEM_TEST_KV_CORRUPT_READS,
after the digests were taken), the decode worker finds that block's digest wrong, never serves
that KV and prefills the prompt itself: the client gets the colocated worker's greedy output, and
tandem_kv_transfer_verify_failures_total counts the one failure. The next transfer is verified and
used; every block is back in both pools afterwards."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from tandem.testing.worker_http import all_blocks_back, colocated, disaggregated
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.kv.corruption import ENV as CORRUPT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(400)]

FLAGS = ("--num-blocks", "256", "--block-size", "8", "--kv-timeout-s", "5", "--drain-s", "1")
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_corrupted_transfer_is_recomputed_and_counted(toy_model_dir: Path, peer_process: list) -> None:
    procs = [WorkerProcess(toy_model_dir, "prefill", "--kv-backend", "tcp", *FLAGS, env={CORRUPT_ENV: "1"}),
             WorkerProcess(toy_model_dir, "decode", "--kv-backend", "tcp", *FLAGS),
             WorkerProcess(toy_model_dir, "colocated", *FLAGS)]
    peer_process.extend(procs)  # killed at the end whatever happens
    for w in procs:
        w.start()
    p, d, c = (w.url for w in procs)
    g = torch.Generator().manual_seed(11)
    ids = [0] + torch.randint(3, 512, (59,), generator=g).tolist()
    other = [0] + torch.randint(3, 512, (40,), generator=g).tolist()
    async with aiohttp.ClientSession() as s:
        want = [*(await colocated(s, c, "c1", ids, GREEDY))]
        got = await disaggregated(s, p, d, "bad", ids, GREEDY)
        assert got == want, "the corrupted transfer's KV was served"
        assert await asyncio.to_thread(_metric, d, "tandem_kv_transfer_verify_failures_total") == 1.0
        assert await asyncio.to_thread(_metric, d, "tandem_kv_transfer_verified_total") == 0.0
        want2 = await colocated(s, c, "c2", other, GREEDY)
        assert await disaggregated(s, p, d, "good", other, GREEDY) == want2
    assert await asyncio.to_thread(_metric, d, "tandem_kv_transfer_verify_failures_total") == 1.0
    assert await asyncio.to_thread(_metric, d, "tandem_kv_transfer_verified_total") == 1.0
    await all_blocks_back(procs[:2])
