"""Flow control (issue 31): a quiet tenant's TTFT p90 beside a flood over alone (target <= 1.2), router flow control off, on
(headroom 1) and reserved (headroom --slots - 1); one colocated worker of --slots sequences: --quiet requests in turn, --flood in flight."""
import argparse
import asyncio
import time

import aiohttp
from tandem.testing.local_stack import LocalStack

from bench.lib.loadgen import greedy_body, stream_into
from bench.lib.metrics import RequestRecord, percentile


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quiet", type=int, default=200, help="quiet tenant's requests per phase")
    ap.add_argument("--flood", type=int, default=16, help="flooding tenant's requests in flight")
    ap.add_argument("--slots", type=int, default=4, help="the worker's --max-num-seqs, and the router's --max-concurrent-requests")


async def _tenant(url: str, model: str, name: str, n: int, words: int, max_tokens: int, stop: asyncio.Event) -> list:
    ttfts, t0, body = [], time.perf_counter(), greedy_body(model, max_tokens, prompt="hello " * words)
    async with aiohttp.ClientSession(headers={"x-gateway-inference-fairness-id": name}) as s:
        while not stop.is_set() and (n == 0 or len(ttfts) < n):
            rec = await stream_into(s, f"{url}/v1/completions", body, RequestRecord(0, 0, max_tokens), t0, 300)
            ttfts += [rec.ttft] if rec.ok else []
    return ttfts


async def _p90(url: str, model: str, args: argparse.Namespace, flood: int) -> float:
    stop = asyncio.Event()
    floods = [asyncio.create_task(_tenant(url, model, "flood", 0, 400, 64, stop)) for _ in range(flood)]
    await asyncio.sleep(3 if flood else 0)  # the flood fills the service first
    quiet, _ = await _tenant(url, model, "quiet", args.quiet, 2, 8, asyncio.Event()), stop.set()
    await asyncio.gather(*floods)
    return percentile(quiet, 90)


def run(args: argparse.Namespace) -> dict:
    from tandem.worker.local.toy_model import make_toy_model

    model, out = make_toy_model(args.out_dir / "toy"), {"target_ratio": 1.2}
    for arm, headroom in (("flow_control", 1), ("flow_control_reserved", args.slots - 1), ("off", None)):
        gate = [] if headroom is None else [f"--router-arg=--max-concurrent-requests={args.slots}", f"--router-arg=--flow-headroom={headroom}"]
        with LocalStack(model, "colocated", [f"--worker-arg=--max-num-seqs={args.slots}", *gate]) as stack:
            alone, flooded = (asyncio.run(_p90(stack.url, model.name, args, f)) for f in (0, args.flood))
        out[arm] = {"headroom": headroom, "ttft_p90_alone_s": alone, "ttft_p90_flooded_s": flooded, "ratio": flooded / alone}
    return out | {"met": min(out[a]["ratio"] for a in ("flow_control", "flow_control_reserved")) <= 1.2}
