"""Waiting until processes serve: the one readiness wait of every scenario.

Each process must answer 200 on /ready (/health for a peer server such as vLLM; ManagedProcess.wait_ready:
a child that exits or times out raises with its log's tail). A router (and a peer) also has to
serve a real request: a router learns its workers by polling them, so /ready alone does not mean a
completion would succeed yet; and its handoff parity probe has to have judged every worker, or the
load's first requests are prefilled on a decode worker while the probe still runs (vLLM's pairs
take seconds to prove).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import aiohttp
from tandem.worker.local.processes import ManagedProcess


async def served_model(url: str) -> str:
    """The first model id an OpenAI-compatible server lists."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def router_serves(url: str, deadline: float) -> None:
    """Until the router at url completes a 2-token request (monotonic deadline)."""
    last = ""
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    model = (await r.json())["data"][0]["id"]
                body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}: {(await r.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.5)
    raise TimeoutError(f"router {url} does not serve a request: {last}")


async def parity_judged(url: str, deadline: float) -> None:
    """Until the router at url has a parity verdict on every worker (or does not probe, or has no
    prefill worker: then nothing is handed off and nothing probed)."""
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            async with s.get(url + "/internal/parity", timeout=aiohttp.ClientTimeout(total=5)) as r:
                report = await r.json()
            workers = report["workers"] if report["enabled"] else []
            if all(w["role"] != "prefill" for w in workers) or all(w["state"] != "unchecked" for w in workers):
                return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"router {url}: its parity probe judged no pairing in time")


async def wait_ready(procs: Iterable[ManagedProcess], timeout_s: float = 600.0) -> None:
    """Every process ready (in order), then every router serving, all within timeout_s."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        path = "/health" if p.role == "peer" else "/ready"
        await asyncio.to_thread(p.wait_ready, path, max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.role in ("router", "peer"):
            await router_serves(p.url, deadline)
        if p.role == "router":
            await parity_judged(p.url, deadline)
