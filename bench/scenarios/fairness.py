"""Flow control (issue 31): a quiet tenant's TTFT p90 beside a flood over alone (target <= 1.2), router flow control off, on
(headroom 1) and reserved (headroom --slots - 1); one colocated worker of --slots sequences on core 1 (arms.py colocated-c1):
--quiet requests in turn from this process, --flood in flight from another process on core 0 (the tenants are two clients)."""
import argparse
import asyncio
import multiprocessing
import os
import time

import aiohttp

from bench.lib.arms import Arm, ArmSpec
from bench.lib.loadgen import greedy_body, stream_into
from bench.lib.metrics import RequestRecord, percentile


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quiet", type=int, default=400, help="quiet tenant's requests per phase")
    ap.add_argument("--flood", type=int, default=16, help="flooding tenant's requests in flight")
    ap.add_argument("--slots", type=int, default=4, help="the worker's --max-num-seqs, and the router's --max-concurrent-requests")


async def _tenant(url: str, model: str, name: str, n: int, words: int, max_tokens: int, stop) -> list:
    ttfts, t0, body = [], time.perf_counter(), greedy_body(model, max_tokens, prompt="hello " * words)
    async with aiohttp.ClientSession(headers={"x-gateway-inference-fairness-id": name}) as s:
        while not stop.is_set() and (n == 0 or len(ttfts) < n):
            rec = await stream_into(s, f"{url}/v1/completions", body, RequestRecord(0, 0, max_tokens), t0, 300)
            ttfts += [rec.ttft] if rec.ok else []
    return ttfts


def _flood(url: str, model: str, n: int, stop) -> None:  # its own process on core 0, not tasks on the measuring client's loop
    async def tenants() -> None:
        await asyncio.gather(*(_tenant(url, model, "flood", 0, 400, 64, stop) for _ in range(n)))
    os.sched_setaffinity(0, {0}), asyncio.run(tenants())


async def _p90(url: str, model: str, args: argparse.Namespace, flood: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    floods = [ctx.Process(target=_flood, args=(url, model, flood, stop))][:1 if flood else 0]
    [p.start() for p in floods], await asyncio.sleep(5 if flood else 0)  # the flood fills the service first
    quiet, _ = await _tenant(url, model, "quiet", args.quiet, 2, 8, asyncio.Event()), stop.set()
    [p.join() for p in floods]
    return percentile(quiet, 90)


def run(args: argparse.Namespace) -> dict:
    from tandem.worker.local.toy_model import make_toy_model

    model, out = make_toy_model(args.out_dir / "toy"), {"target_ratio": 1.2}
    for arm, headroom in (("flow_control", 1), ("flow_control_reserved", args.slots - 1), ("off", None)):
        gate = () if headroom is None else (f"--max-concurrent-requests={args.slots}", f"--flow-headroom={headroom}")
        stack = Arm(ArmSpec(arm, "colocated-c1", None, None, (f"--max-num-seqs={args.slots}",), gate), model, args.out_dir).start()
        try:
            asyncio.run(stack.wait_ready())
            alone, flooded = (asyncio.run(_p90(stack.url, model.name, args, f)) for f in (0, args.flood))
        finally:
            stack.stop()
        out[arm] = {"headroom": headroom, "ttft_p90_alone_s": alone, "ttft_p90_flooded_s": flooded, "ratio": flooded / alone}
    return out | {"met": min(out[a]["ratio"] for a in ("flow_control", "flow_control_reserved")) <= 1.2}
