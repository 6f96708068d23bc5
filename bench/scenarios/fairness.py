"""Flow control (issue 31): a quiet tenant's TTFT p90 beside a flood over alone (target <= 1.2), with the router's flow
control on (headroom 1), reserved (headroom --slots - 1) and off. The service: issue 13's 42M Llama in bf16 (--model toy:
the tiny test model), one colocated worker of --slots sequences on core 1 (arms.py colocated-c1; --layout disagg-nixl: a
prefill and a decode worker). The quiet tenant: one request at a time of --quiet-words words (3 tokens each), 8 tokens
out, a pause of --quiet-think-s on average after each answer, sent from this process; the flood: --flood streams of --flood-words-word prompts, 64 tokens out, back to back,
from another process on core 0, under another fairness id. Every prompt is its own (no prefix-cache hits)."""
import argparse
import asyncio
import math
import multiprocessing
import os
import random
import time

import aiohttp
from tandem.worker.engine.scheduler import FLOW_ACTIVE_S

from bench.lib.arms import Arm, ArmSpec
from bench.lib.loadgen import greedy_body, stream_into
from bench.lib.metrics import RequestRecord, percentile

ARMS = ("flow_control", "flow_control_reserved", "off")  # the gate with headroom 1, with --slots - 1, none


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quiet", type=int, default=200, help="quiet tenant's requests per phase")
    ap.add_argument("--quiet-think-s", type=float, default=0.5, help="quiet tenant's mean pause between an answer and its next request")
    ap.add_argument("--phase-s", type=float, default=120, help="a phase ends after --quiet requests or this long")
    ap.add_argument("--flood", type=int, default=16, help="flooding tenant's requests in flight")
    ap.add_argument("--slots", type=int, default=4, help="the worker's --max-num-seqs, and the router's --max-concurrent-requests")
    ap.add_argument("--model", choices=("bench", "toy"), default="bench",
                    help="bench: issue 13's 42M Llama (the serving scenarios' model); toy: the tiny test model")
    ap.add_argument("--layout", choices=("colocated-c1", "disagg-nixl"), default="colocated-c1",
                    help="one colocated worker on core 1, or a prefill worker on core 0 and a decode worker on core 1")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which of the arms to run")
    ap.add_argument("--worker-arg", action="append", default=[], help="an extra `tandem worker` flag for every worker")
    ap.add_argument("--router-arg", action="append", default=[], help="an extra `tandem router` flag")
    ap.add_argument("--quiet-words", type=int, default=100, help="the quiet tenant's prompt, in words (3 tokens each)")
    ap.add_argument("--flood-words", type=int, default=400, help="the flood's prompts, in words")
    ap.add_argument("--dtype", default="bfloat16", help="the workers' dtype (the serving scenarios' bf16)")


def _body(model: str, name: str, words: int, max_tokens: int) -> dict:
    # each prompt its own from the first token: no request finds another's in the prefix cache
    return greedy_body(model, max_tokens, prompt=f"{name} {os.getpid()} {time.perf_counter_ns()} " + "hello " * words)


async def _tenant(url: str, model: str, name: str, words: int, max_tokens: int, stop, served) -> None:
    """One of the flood's streams: a request, then the next, until stopped; the tokens of those answered
    (prompt and completion) added to served[0]."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(headers={"x-gateway-inference-fairness-id": name}) as s:
        while not stop.is_set():
            rec = await stream_into(s, f"{url}/v1/completions", _body(model, name, words, max_tokens),
                                    RequestRecord(0, 0, max_tokens), t0, 300)
            served[0] += (rec.prompt_tokens or 0) + (rec.completion_tokens or 0) if rec.ok else 0


async def _quiet(url: str, model: str, args: argparse.Namespace) -> tuple[list[float], list[str]]:
    """The quiet tenant, as a person at a chat: a request, its answer, then a pause (exponential, mean
    --quiet-think-s, seeded), --quiet times or for --phase-s; its times to first token, and the errors of those refused."""
    rng, t0, until, ttfts, errors = random.Random(0), time.perf_counter(), time.perf_counter() + args.phase_s, [], []
    async with aiohttp.ClientSession(headers={"x-gateway-inference-fairness-id": "quiet"}) as s:
        while len(ttfts) < args.quiet and time.perf_counter() < until:
            rec = await stream_into(s, f"{url}/v1/completions", _body(model, "quiet", args.quiet_words, 8),
                                    RequestRecord(0, 0, 8), t0, 300)
            ttfts, errors = (ttfts + [rec.ttft], errors) if rec.ok else (ttfts, errors + [str(rec.error)[:80]])
            await asyncio.sleep(rng.expovariate(1 / args.quiet_think_s))
    return ttfts, errors


def _flood(url: str, model: str, n: int, words: int, stop, served) -> None:  # its own process on core 0, not tasks on the measuring client's loop
    async def tenants() -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(_tenant(url, model, "flood", words, 64, stop, served) for _ in range(n)))
        served[1] = time.perf_counter() - t0
    os.sched_setaffinity(0, {0}), asyncio.run(tenants())


async def _p90(url: str, model: str, args: argparse.Namespace, flood: int) -> tuple[float | None, int, list[str], float]:
    """The quiet tenant's TTFT p90, its answers, its refusals, and the flood's tokens answered per second."""
    ctx = multiprocessing.get_context("spawn")
    stop, served = ctx.Event(), ctx.Array("d", 2)
    floods = [ctx.Process(target=_flood, args=(url, model, flood, args.flood_words, stop, served))][:1 if flood else 0]
    # The flood fills the service first; alone, the readiness probe's flow (no fairness id) is let go
    # first, else the quiet tenant, served more than it, prefills short chunks (FLOW_ACTIVE_S).
    [p.start() for p in floods], await asyncio.sleep(5 if flood else FLOW_ACTIVE_S + 1)
    (quiet, errors), _ = await _quiet(url, model, args), stop.set()
    [p.join() for p in floods]
    return (percentile(quiet, 90) if quiet else None), len(quiet), errors, served[0] / max(served[1], 1e-9)


def run(args: argparse.Namespace) -> dict:
    from tandem.worker.local.toy_model import make_toy_model

    from bench.lib.models import ENGINE_MODEL, bench_model_dir
    from bench.lib.ready import served_model

    model = bench_model_dir(ENGINE_MODEL) if args.model == "bench" else make_toy_model(args.out_dir / "toy")
    out = {"target_ratio": 1.2, "model": args.model, "quiet_words": args.quiet_words,
           "flood_words": args.flood_words, "dtype": args.dtype, "layout": args.layout,
           "worker_args": args.worker_arg, "router_args": args.router_arg}
    headrooms = {"flow_control": 1, "flow_control_reserved": args.slots - 1, "off": None}
    for arm, headroom in ((a, headrooms[a]) for a in args.arms):
        gate = () if headroom is None else (f"--max-concurrent-requests={args.slots}", f"--flow-headroom={headroom}")
        stack = Arm(ArmSpec(arm, args.layout, args.dtype, None, (f"--max-num-seqs={args.slots}", *args.worker_arg),
                             gate + tuple(args.router_arg)), model, args.out_dir).start()
        try:
            asyncio.run(stack.wait_ready())
            name = asyncio.run(served_model(stack.url))
            (alone, n_alone, _, _), (flooded, n_flooded, refused, flood_tps) = (
                asyncio.run(_p90(stack.url, name, args, f)) for f in (0, args.flood))
        finally:
            stack.stop()
        ratio = flooded / alone if alone and flooded else None
        out[arm] = {"headroom": headroom, "ttft_p90_alone_s": alone, "ttft_p90_flooded_s": flooded, "ratio": ratio,
                    "quiet_requests": [n_alone, n_flooded], "quiet_refused_flooded": len(refused),
                    "flood_tokens_per_s": flood_tps,
                    "refusals": sorted(set(refused))[:3]}
        print(f"{arm}: quiet TTFT p90 {alone} s alone, {flooded} s flooded ({ratio}x; "
              f"{n_alone} / {n_flooded} requests, {len(refused)} refused beside the flood; the flood's "
              f"prompt and completion tokens answered: {flood_tps:.0f}/s)", flush=True)
    gated = [out[a]["ratio"] or math.inf for a in args.arms if a != "off"]
    return out | {"met": bool(gated) and min(gated) <= 1.2}
