"""The disaggregated path, measured (issue 13 item 4): how long the first gap after a KV handoff is
against the ordinary gap on a loaded decode worker, and what streaming costs the event loops of
the router and the workers per token at 50 concurrent streams, with the engine thread's cadence
beside it.

    python -m bench disagg_path [--baseline DIR] [--reps 2]
        [--profile]   # also py-spy the router and the decode worker under the 50 streams

Arms: `tandem router` + `tandem worker --role prefill` pinned to core 0 + `--role decode` pinned
to core 1, KV over TCP, fp32 (--dtype), the multi-turn scenario's 40M model (bench/lib/models.py: every
token it generates has text, so every token is its own chunk at the client). `after` is this tree;
`before` (with --baseline DIR, a folder holding tandem/{cli,contracts,worker,...} of another commit)
runs that tree's workers behind this tree's router. Both arms are up side by side and the one that
goes first rotates per repetition; the load generator is not pinned.

- handoff: 32 requests through the router, 16 in flight, prompts of 256-512 tokens, 48 out: every
  one is prefilled on the prefill worker and handed off. First gap = second streamed token minus
  the first (the first comes from the prefill worker, the second is the decode worker's first);
  ordinary gaps = every later gap. The decode worker's pull seconds and step seconds come from its
  /metrics over the run.
- stream50: 50 requests at once, prompts of 32 tokens, 128 out. CPU seconds per thread of every
  process over the run (psutil): a process's main thread is its event loop; a worker's busiest
  other thread is its engine thread. Reported per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench.lib.arms import Arm, ArmSpec, rotated
from bench.lib.handoff import greedy, handoff, worker_client
from bench.lib.loadgen import run_closed_loop, token_counter
from bench.lib.metrics import percentile, spread
from bench.lib.models import MULTITURN_MODEL, bench_model_dir
from bench.lib.pyspy import profiling
from bench.lib.ready import served_model
from bench.lib.scrape import read_counters
from bench.lib.workload import WorkloadSpec, plan

WORKLOADS = {
    "handoff": WorkloadSpec("handoff", "closed", 32, (256, 512), 48, concurrency=16, seed=7),
    # the same requests sent to the workers themselves: the first gap split where the decode
    # worker's answer starts (request, pull: its headers) and its first token (a seat, a step)
    "handoff-direct": WorkloadSpec("handoff-direct", "closed", 32, (256, 512), 48, concurrency=16, seed=7),
    "stream50": WorkloadSpec("stream50", "closed", 50, (32, 32), 128, concurrency=50, seed=8),
}


def make_arm(name: str, model_dir: Path, log_dir: Path, pythonpath: str | None, dtype: str) -> Arm:
    """1P+1D over TCP; `pythonpath`: the workers of another tree (behind this tree's router). Every
    prompt goes through the prefill worker (no load-aware decode-side prefill): this bench measures
    the handoff path, not the routing policy."""
    spec = ArmSpec(name, "disagg-tcp", dtype, router_args=("--prefill-saturated-tokens", "0"))
    return Arm(spec, model_dir, log_dir, worker_env={"PYTHONPATH": pythonpath} if pythonpath else {}, num_blocks=2048)


def thread_cpu_delta(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """From two per-thread readings (BenchProcess.thread_cpu): the main thread's CPU seconds (the
    event loop), the busiest other thread's (a worker's engine thread), the process's."""
    d = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    loop = d.pop(pid, 0.0)
    return {"loop": loop, "other_max": max(d.values(), default=0.0), "total": loop + sum(d.values())}


async def direct_loop(prefill: str, decode: str, reqs: list, concurrency: int) -> list[dict]:
    """Every request prefilled on `prefill` and handed to `decode` by this client, as the router does."""
    todo, out = list(reqs), []
    async with worker_client() as client:

        async def one() -> None:
            while todo:
                req = todo.pop(0)
                res, t0, s = await handoff(client, prefill, decode, greedy(max_tokens=req.max_tokens, prompt=req.prompt))
                times = [t0, *s.token_times]
                out.append({"index": req.index, "headers_s": s.started_s - t0, "first_s": times[1] - s.started_s,
                            "text": res.first_token_text + s.text,
                            "gaps": [b - a for a, b in zip(times, times[1:], strict=False)]})

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return sorted(out, key=lambda d: d["index"])


async def run_workload(arm: Arm, name: str, reqs: list, model: str) -> dict:
    spec = WORKLOADS[name]
    (prefill, decode), router = arm.workers, arm.router
    c0, cpu0 = await read_counters(arm.procs), {p.role: p.thread_cpu() for p in arm.procs}
    split = {}
    if name == "handoff-direct":
        done = await direct_loop(prefill.url, decode.url, reqs, spec.concurrency)
        gaps, texts = [d["gaps"] for d in done], [d["text"] for d in done]
        split = {"headers_p50": percentile([d["headers_s"] for d in done], 50),
                 "headers_to_first_p50": percentile([d["first_s"] for d in done], 50)}
        ttft, tokens = [], sum(len(g) + 1 for g in gaps)
    else:
        records = await run_closed_loop(router.url, model, reqs, spec.concurrency)
        bad = [r.error for r in records if not r.ok]
        if bad:
            raise RuntimeError(f"{name}: {len(bad)} requests failed: {bad[:3]}")
        gaps, texts = [r.gaps for r in records], [r.text for r in records]
        ttft, tokens = [r.ttft for r in records], sum(r.output_tokens for r in records)
    cpu = {p.role: thread_cpu_delta(p.pid, cpu0[p.role], p.thread_cpu()) for p in arm.procs}
    d = await read_counters(arm.procs) - c0
    first = [g[0] for g in gaps if len(g) > 1]
    later = [x for g in gaps for x in g[1:]]
    return {
        "tokens": tokens, "first_gap_p50": percentile(first, 50), "first_gap_p90": percentile(first, 90),
        "gap_p50": percentile(later, 50), "gap_p90": percentile(later, 90), "gap_p99": percentile(later, 99),
        "ttft_p50": percentile(ttft, 50) if ttft else None, **split,
        **{f"{k}_s_mean": d.mean("decode", f"tandem_worker_{k}_seconds") for k in ("kv_pull", "step", "step_gap")},
        "decode_steps": d.metrics["decode"].get("tandem_worker_steps_total", 0.0),
        "cpu_s": cpu, "cpu_us_per_token": {role: {k: v / tokens * 1e6 for k, v in c.items()}
                                           for role, c in cpu.items()},
        "routes": d.routes, "texts": texts,
    }


async def main_async(args: argparse.Namespace) -> dict:
    model_dir = bench_model_dir(MULTITURN_MODEL)
    log_dir = Path(args.out_dir) / "logs"
    count = token_counter(model_dir)
    reqs = {name: plan(spec, count) for name, spec in WORKLOADS.items()}
    arms = {"after": make_arm("after", model_dir, log_dir, None, args.dtype).start()}
    if args.baseline:
        arms["before"] = make_arm("before", model_dir, log_dir, args.baseline, args.dtype).start()
    res: dict = {"runs": [], "baseline": args.baseline, "dtype": args.dtype}
    try:
        await asyncio.gather(*(a.wait_ready() for a in arms.values()))
        model = await served_model(arms["after"].url)
        for a in arms.values():  # warm-up: every shape the runs use
            await run_closed_loop(a.url, model, reqs["stream50"][:8], 8)
        for rep in range(args.reps):
            for arm in rotated(list(arms), rep):
                for w in WORKLOADS:
                    r = await run_workload(arms[arm], w, reqs[w], model)
                    res["runs"].append({"rep": rep, "arm": arm, "workload": w, **r})
                    print(f"rep {rep} {arm:6s} {w:8s} first gap {r['first_gap_p50'] * 1e3:6.1f} ms "
                          f"(p90 {r['first_gap_p90'] * 1e3:6.1f}), gaps p50 {r['gap_p50'] * 1e3:5.1f} "
                          f"p99 {r['gap_p99'] * 1e3:6.1f} ms; loop CPU/token: router "
                          f"{r['cpu_us_per_token']['router']['loop']:5.0f} us, decode "
                          f"{r['cpu_us_per_token']['decode']['loop']:5.0f} us", flush=True)
        if args.profile:
            out = Path(args.out_dir) / "profiles"
            for arm, a in arms.items():
                async with profiling({p.pid: out / f"{arm}-{p.role}-stream50.txt" for p in a.procs[1:]}) as got:
                    await run_closed_loop(a.url, model, reqs["stream50"], 50)
                res.setdefault("profiles", {})[arm] = {path.stem: s for path, s in got.items()}
    finally:
        for a in arms.values():
            a.stop()
    res["summary"] = summarize(res["runs"])
    same = {(r["workload"], r["rep"]): r["texts"] for r in res["runs"] if r["arm"] == "after"}
    res["texts_equal"] = all(r["texts"] == same[r["workload"], r["rep"]] for r in res["runs"])
    for r in res["runs"]:
        del r["texts"]
    return res


def summarize(runs: list[dict]) -> dict:
    """Per arm and workload: the median over repetitions of each figure (and its range)."""
    out: dict = {}
    for r in runs:
        out.setdefault(r["arm"], {}).setdefault(r["workload"], []).append(r)
    keys = ("first_gap_p50", "first_gap_p90", "gap_p50", "gap_p90", "gap_p99", "ttft_p50", "kv_pull_s_mean",
            "step_s_mean", "step_gap_s_mean", "headers_p50", "headers_to_first_p50")
    summary: dict = {}
    for arm, by_w in out.items():
        for w, rs in by_w.items():
            s = {k: spread([x[k] for x in rs if x.get(k) is not None]) for k in keys}
            s["first_gap_over_gap_p50"] = spread([x["first_gap_p50"] / x["gap_p50"] for x in rs])
            s["cpu_us_per_token"] = {role: {k: spread([x["cpu_us_per_token"][role][k] for x in rs])
                                            for k in ("loop", "other_max", "total")}
                                     for role in rs[0]["cpu_us_per_token"]}
            summary.setdefault(arm, {})[w] = s
    return summary


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of another Tandem tree for the `before` arm")
    ap.add_argument("--profile", action="store_true", help="py-spy the decode worker and router under stream50")
    ap.add_argument("--dtype", default="float32", help="float32 (greedy text must then match across arms) "
                    "or bfloat16")


def run(args: argparse.Namespace) -> dict:
    res = asyncio.run(main_async(args))
    print(json.dumps(res["summary"], indent=1))
    print(f"texts equal across arms: {res['texts_equal']}")
    return res
