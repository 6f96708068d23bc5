"""Tensor parallelism: step time at each tensor size, and the KV handoff's bytes and time for each (p, d).

    python -m bench tensor_parallel [--tp 1,2] [--pairs 1-1,1-2,2-1,2-2] [--backends tcp,nixl]
                                    [--device cpu|cuda] [--repeats 5]

Real `tandem worker` processes on loopback, one thread per rank, the engine scenarios' ~42M Llama
(8 heads, 4 KV heads, fp32; bench/lib/models.py). Steps: a colocated worker of each tensor size
(compiled decode step where the machine compiles) serves decode streams at batch 1 and 8 (the
median gap between a stream's tokens is one step) and 512-token prompts alone (the time to the
first token is one prefill). Handoffs: prefill workers of TP p and decode workers of TP d, per
backend; a prompt of 512 and of 2048 tokens is prefilled on P and decoded on D `repeats` times;
the decode worker's own figures give the time of each pull (tandem_worker_kv_pull_seconds: every
rank reads its heads, then rank 0 releases the lease) and the bytes the group moved
(tandem_kv_transfer_bytes_total, pull).

On a CPU of two cores shared with other work, a second rank cannot make a step faster: the ranks
take turns on the same cores and add two all-reduces per layer; what TP 2 shows here is the cost
of the collectives and of the processes, not a speed-up. On GPUs (`--device cuda`, bench/gpu/)
each rank has its own device; a size larger than the devices present is skipped and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.worker.local.processes import Supervisor

from bench.lib.direct_worker import prompts_for
from bench.lib.handoff import greedy, handoff, stream, worker_client
from bench.lib.processes import thread_env, worker_process
from bench.lib.ready import wait_ready
from bench.lib.scrape import read_counters

PROMPTS = (512, 2048)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", default="1,2", help="tensor sizes for the step times (default 1,2)")
    p.add_argument("--pairs", default="1-1,1-2,2-1,2-2", help="prefill-decode tensor sizes for the handoffs")
    p.add_argument("--backends", default="tcp,nixl", help="KV backends for the handoffs (default tcp,nixl)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU per rank")
    p.add_argument("--repeats", type=int, default=5, help="handoffs per prompt length (default 5)")
    p.add_argument("--steps", type=int, default=48, help="decode steps per stream (default 48)")
    p.add_argument("--model", default=None, help="model folder (default: the engine scenarios' 42M Llama)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _devices(device: str) -> int:
    if device == "cpu":
        return 1 << 20
    import torch

    return torch.cuda.device_count()


def _prompt(n: int, seed: int) -> list[int]:
    return prompts_for(1, n, seed)[0]


async def _step_times(url: str, steps: int, tag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with worker_client() as client:
        for batch in (1, 8):
            got = await asyncio.gather(*(stream(client, url, greedy(_prompt(16, 100 * batch + i), steps,
                                                                    request_id=f"{tag}-b{batch}-{i}"))
                                         for i in range(batch)))
            gaps = [b - a for g in got for a, b in zip(g.token_times[1:], g.token_times[2:], strict=False)]
            out[f"decode_step_ms_batch{batch}"] = 1e3 * statistics.median(gaps)
        ttfts = []
        for i in range(3):
            got = await stream(client, url, greedy(_prompt(512, 7000 + i), 1, request_id=f"{tag}-p{i}"))
            ttfts.append(got.token_times[0] - got.sent_s)
        out["prefill_512_ms"] = 1e3 * statistics.median(ttfts)
    return out


def _worker(role: str, tp: int, model_dir: Path, log_dir: Path, device: str, *extra: str, backend: str = "tcp") -> Any:
    return worker_process(f"{role}-tp{tp}", role, model_dir, log_dir / f"{role}-tp{tp}-{backend}.log", None,
                          "--tensor-parallel", str(tp), "--device", device, "--dtype", "float32",
                          "--no-prefix-caching", *extra, kv_backend=backend, num_blocks=512,
                          env=os.environ | thread_env(1) | {"UCX_TLS": os.environ.get("UCX_TLS", "tcp")})


def measure_steps(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tp in _ints(args.tp):
        if tp > _devices(args.device):
            out[f"tp{tp}"] = {"skipped": f"{tp} ranks need {tp} devices, {_devices(args.device)} here"}
            continue
        w = _worker("colocated", tp, model_dir, args.out_dir, args.device)
        sup = Supervisor([w])
        try:
            sup.start(w)
            asyncio.run(wait_ready([w], 1800))
            out[f"tp{tp}"] = asyncio.run(_step_times(w.url, args.steps, f"tp{tp}"))
        finally:
            sup.stop()
        print(f"TP {tp}: {out[f'tp{tp}']}", flush=True)
    return out


async def _handoffs(p: Any, d: Any, repeats: int, tag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with worker_client() as client:
        for n in PROMPTS:
            before = await read_counters([d])
            for i in range(repeats):
                await handoff(client, p.url, d.url, greedy(_prompt(n, hash((tag, n, i)) & 0xFFFF), 2,
                                                           request_id=f"{tag}-{n}-{i}"))
            c = await read_counters([d]) - before
            pulls = c.metrics[d.name].get("tandem_worker_kv_pull_seconds_count", 0.0)
            nbytes = c.metrics[d.name].get("tandem_kv_transfer_bytes_total", 0.0)  # a decode worker only pulls
            seconds = c.mean(d.name, "tandem_worker_kv_pull_seconds")
            out[f"{n}_tokens"] = {"pulls": pulls, "bytes_per_pull": nbytes / pulls if pulls else None,
                                  "pull_ms": 1e3 * seconds if seconds else None,
                                  "gb_per_s": nbytes / pulls / seconds / 1e9 if pulls and seconds else None}
    return out


def measure_handoffs(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    pairs = [tuple(_ints(x.replace("-", ","))) for x in args.pairs.split(",") if x]
    sizes = sorted({n for pair in pairs for n in pair})
    out: dict[str, Any] = {}
    for backend in [b for b in args.backends.split(",") if b]:
        fits = [n for n in sizes if n <= _devices(args.device)]
        prefill = {n: _worker("prefill", n, model_dir, args.out_dir, args.device, backend=backend) for n in fits}
        decode = {n: _worker("decode", n, model_dir, args.out_dir, args.device, "--compile", "off",
                             "--no-migrate-on-drain", backend=backend) for n in fits}
        sup = Supervisor([*prefill.values(), *decode.values()])
        try:
            for w in sup.children:
                sup.start(w)
            asyncio.run(wait_ready(sup.children, 1800))
            for p, d in pairs:
                key = f"{backend} {p}-{d}"
                if p not in prefill or d not in decode:
                    out[key] = {"skipped": f"needs {max(p, d)} devices"}
                    continue
                out[key] = asyncio.run(_handoffs(prefill[p], decode[d], args.repeats, f"{backend}{p}{d}"))
                print(f"{key}: {out[key]}", flush=True)
        finally:
            sup.stop()
    return out


def run(args: argparse.Namespace) -> dict:
    from bench.lib.models import ENGINE_MODEL, engine_model_dir, kv_bytes_per_token

    model_dir = Path(args.model) if args.model else engine_model_dir()
    t0 = time.monotonic()
    steps = measure_steps(args, model_dir)
    handoffs = measure_handoffs(args, model_dir)
    return {"model": str(model_dir), "device": args.device, "kv_bytes_per_token": kv_bytes_per_token(ENGINE_MODEL),
            "steps": steps, "handoffs": handoffs, "seconds": time.monotonic() - t0,
            "note": "two shared CPU cores: TP 2 ranks take turns on the same cores (no speed-up possible)"}
