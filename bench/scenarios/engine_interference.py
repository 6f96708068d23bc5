"""Long prompts landing on a colocated worker that is decoding: how long its running streams stall
(inter-token gaps) and how soon the long prompts start (TTFT), per prefill chunk size. One worker
per variant, each pinned to the same core with one thread, run in turn (the order rotating).

    python -m bench engine_interference [--dtype bfloat16] [--reps 3]
        [--variant chunk128=--prefill-chunk-tokens=128 ...]   # default: 128, 256, 512, whole prompts
        [--baseline DIR] [--profile]

The load, the same for every variant: D streams (64 prompt tokens, O out) start together; long
prompts (1000, 500, 750 tokens, 16 out) arrive 1.0, 2.0 and 3.0 s later. Reported: the pooled
gaps of the D streams (p50, p99, max), the long prompts' TTFT, and output tokens/s overall.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import aiohttp

from bench.lib.direct_worker import CLIENT_CPU, one_stream, prompts_for, start_worker
from bench.lib.metrics import spread
from bench.lib.pyspy import profiling
from bench.lib.ready import wait_ready

LONG = ((1.0, 1000), (2.0, 500), (3.0, 750))  # (arrival s, prompt tokens)
DEFAULT_VARIANTS = ["chunk128=--prefill-chunk-tokens=128", "chunk256=--prefill-chunk-tokens=256",
                    "chunk512=--prefill-chunk-tokens=512", "whole=--prefill-chunk-tokens=2048"]


async def load(url: str, streams: int, out_tokens: int, seed: int) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()

        async def late(at: float, n: int, i: int) -> float:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))  # the arrival schedule itself
            sent = time.perf_counter()
            return (await one_stream(s, url, prompts_for(1, n, seed + 1 + i)[0], 16))[0] - sent

        background = [one_stream(s, url, p, out_tokens) for p in prompts_for(streams, 64, seed)]
        results = await asyncio.gather(*background, *(late(at, n, i) for i, (at, n) in enumerate(LONG)))
        wall = time.perf_counter() - t0
    arrivals, ttfts = results[:streams], results[streams:]
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:], strict=False))
    return {"itl_p50_s": gaps[len(gaps) // 2], "itl_p99_s": gaps[int(0.99 * (len(gaps) - 1))], "itl_max_s": gaps[-1],
            "ttft_s": ttfts, "ttft_p50_s": statistics.median(ttfts),
            "tokens_per_s": (streams * out_tokens + 16 * len(LONG)) / wall}


async def main_async(args: argparse.Namespace) -> dict:
    from bench.lib.models import engine_model_dir

    os.sched_setaffinity(0, {CLIENT_CPU})
    model_dir = engine_model_dir()
    log_dir = Path(args.out_dir) / "logs"
    variants = dict(v.split("=", 1) for v in (args.variant or DEFAULT_VARIANTS))
    workers = {name: start_worker(model_dir, args.dtype, log_dir, flags.split(), name) for name, flags in variants.items()}
    if args.baseline:
        workers["baseline"] = start_worker(model_dir, args.dtype, log_dir, [], "baseline", {"PYTHONPATH": args.baseline})
    runs = []
    try:
        await wait_ready(workers.values())
        for w in workers.values():
            await load(w.url, 4, 8, 1)  # warm-up: every code path once
        names = list(workers)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                r = await load(workers[name].url, args.streams, args.out_tokens, 100 + rep)
                runs.append({"rep": rep, "variant": name, **r})
                print(f"rep {rep} {name:9s} ITL p50 {r['itl_p50_s'] * 1e3:5.0f} ms  p99 {r['itl_p99_s'] * 1e3:5.0f} ms  "
                      f"max {r['itl_max_s'] * 1e3:5.0f} ms | long-prompt TTFT p50 {r['ttft_p50_s']:.2f} s "
                      f"| {r['tokens_per_s']:.0f} tok/s", flush=True)
        if args.profile:
            for name, w in workers.items():
                async with profiling({w.pid: Path(args.out_dir) / "profiles" / f"{name}-{args.dtype}-interference.txt"}):
                    await load(w.url, args.streams, args.out_tokens, 999)
    finally:
        for w in workers.values():
            w.stop()
    summary = {name: {k: spread([r[k] for r in runs if r["variant"] == name])
                      for k in ("itl_p50_s", "itl_p99_s", "itl_max_s", "ttft_p50_s", "tokens_per_s")}
               for name in workers}
    return {"dtype": args.dtype, "streams": args.streams, "out_tokens": args.out_tokens, "long_prompts": LONG,
            "variants": variants, "baseline": args.baseline, "runs": runs, "summary": summary}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variant", action="append", help="NAME=WORKER FLAGS (repeatable)")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of another Tandem tree (see engine_http)")
    ap.add_argument("--profile", action="store_true", help="py-spy every variant over one more run")


def run(args: argparse.Namespace) -> dict:
    res = asyncio.run(main_async(args))
    for name, s in res["summary"].items():
        m = {k: v["median"] for k, v in s.items()}
        print(f"{name:9s} ITL p50 {m['itl_p50_s'] * 1e3:.0f} ms, p99 {m['itl_p99_s'] * 1e3:.0f} ms, max "
              f"{m['itl_max_s'] * 1e3:.0f} ms; long-prompt TTFT p50 {m['ttft_p50_s']:.2f} s; {m['tokens_per_s']:.0f} tok/s")
    return res
