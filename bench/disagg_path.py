"""The disaggregated path, measured (issue 13 item 4): how long the first gap after a KV handoff is
against the ordinary gap on a loaded decode worker, and what streaming costs the event loops of
the router and the workers per token at 50 concurrent streams, with the engine thread's cadence
beside it.

    .venv/bin/python -m bench.disagg_path [--baseline DIR] [--reps 2] [--out bench/out/disagg_path.json]
        [--profile-dir DIR]   # also py-spy the router and the decode worker under the 50 streams

Arms: `tandem router` + `tandem worker --role prefill` pinned to core 0 + `--role decode` pinned
to core 1, KV over TCP, bf16, the issue's 42M model (bench/engine_model.py). `after` is this tree;
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
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench.arms import Proc, _wait_router_serves, free_port, tandem_exe
from bench.loadgen import run_closed_loop
from bench.metrics import percentile
from bench.workload import WorkloadSpec, plan

WORKLOADS = {
    "handoff": WorkloadSpec("handoff", "closed", 32, (256, 512), 48, concurrency=16, seed=7),
    "stream50": WorkloadSpec("stream50", "closed", 50, (32, 32), 128, concurrency=50, seed=8),
}
ENV = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def start_arm(name: str, model_dir: Path, log_dir: Path, pythonpath: str | None) -> list[Proc]:
    procs = []
    env = os.environ | ENV | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    for role, cpu in (("prefill", 0), ("decode", 1)):
        port = free_port()
        cmd = [*tandem_exe(), "worker", "--role", role, "--model", str(model_dir), "--dtype", "bfloat16",
               "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--num-blocks", "2048",
               "--kv-backend", "tcp", "--kv-port", "0"]
        p = Proc(f"{name}-{role}", role, f"http://127.0.0.1:{port}", cmd, cpu, log_dir / f"{name}-{role}.log")
        p.start(env)
        procs.append(p)
    port = free_port()
    cmd = [*tandem_exe(), "router", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", procs[0].url, "--decode", procs[1].url]
    router = Proc(f"{name}-router", "router", f"http://127.0.0.1:{port}", cmd, None, log_dir / f"{name}-router.log")
    router.start(os.environ | ENV)
    return [*procs, router]


async def wait_ready(procs: list[Proc], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        for p in procs:
            path = "/ready" if p.role != "router" else "/health"
            while True:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited\n{p.log_tail()}")
                try:
                    async with s.get(p.url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{p.name} not ready\n{p.log_tail()}")
                await asyncio.sleep(0.5)
        await _wait_router_serves(s, procs[-1].url, deadline)


def thread_cpu(p: Proc) -> dict[str, float]:
    """CPU seconds: the main thread (the event loop), the busiest other one, the whole process."""
    ps = p.ps()
    threads = {t.id: t.user_time + t.system_time for t in ps.threads()}
    main = threads.pop(ps.pid, 0.0)
    return {"loop": main, "other_max": max(threads.values(), default=0.0),
            "total": main + sum(threads.values())}


async def scrape(url: str) -> dict[str, float]:
    """The worker's Prometheus sums and counts this bench reads."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for name in ("kv_pull_seconds", "step_seconds", "step_gap_seconds"):
        for part in ("sum", "count"):
            m = re.search(rf"^tandem_worker_{name}_{part} (\S+)$", text, re.M)
            if m:
                out[f"{name}_{part}"] = float(m.group(1))
    return out


def _mean(after: dict, before: dict, name: str) -> float | None:
    n = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / n if n else None


async def run_workload(arm: list[Proc], name: str, reqs: list, model: str) -> dict:
    spec = WORKLOADS[name]
    prefill, decode, router = arm
    m0 = await scrape(decode.url)
    cpu0 = {p.role: thread_cpu(p) for p in arm}
    records = await run_closed_loop(router.url, model, reqs, spec.concurrency)
    cpu1 = {p.role: thread_cpu(p) for p in arm}
    m1 = await scrape(decode.url)
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} requests failed: {bad[:3]}")
    tokens = sum(r.output_tokens for r in records)
    first = [r.gaps[0] for r in records if len(r.gaps) > 1]
    later = [g for r in records for g in r.gaps[1:]]
    cpu = {role: {k: cpu1[role][k] - cpu0[role][k] for k in cpu1[role]} for role in cpu1}
    return {
        "tokens": tokens, "first_gap_p50": percentile(first, 50), "first_gap_p90": percentile(first, 90),
        "gap_p50": percentile(later, 50), "gap_p90": percentile(later, 90), "gap_p99": percentile(later, 99),
        "ttft_p50": percentile([r.ttft for r in records], 50),
        "pull_s_mean": _mean(m1, m0, "kv_pull_seconds"), "step_s_mean": _mean(m1, m0, "step_seconds"),
        "step_gap_s_mean": _mean(m1, m0, "step_gap_seconds"),
        "cpu_s": cpu, "cpu_us_per_token": {role: {k: v / tokens * 1e6 for k, v in c.items()}
                                           for role, c in cpu.items()},
        "texts": [r.text for r in records],
    }


def pyspy(proc: Proc, out: Path) -> subprocess.Popen:
    spy = os.environ.get("PY_SPY") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([spy, "record", "--pid", str(proc.popen.pid), "--rate", "250", "--format", "raw",
                             "--threads", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def main_async(args: argparse.Namespace) -> dict:
    from bench.engine_model import engine_model_dir
    from bench.loadgen import token_counter

    model_dir = engine_model_dir()
    log_dir = Path(args.out).parent / "disagg_path_logs"
    count = token_counter(model_dir)
    reqs = {name: plan(spec, count) for name, spec in WORKLOADS.items()}
    arms = {"after": start_arm("after", model_dir, log_dir, None)}
    if args.baseline:
        arms["before"] = start_arm("before", model_dir, log_dir, args.baseline)
    res: dict = {"runs": [], "baseline": args.baseline}
    try:
        for procs in arms.values():
            await wait_ready(procs)
        async with aiohttp.ClientSession() as s, s.get(arms["after"][-1].url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        for procs in arms.values():  # warm-up: every shape the runs use
            await run_closed_loop(procs[-1].url, model, reqs["stream50"][:8], 8)
        names = list(arms)
        for rep in range(args.reps):
            for arm in names[rep % len(names):] + names[: rep % len(names)]:
                for w in WORKLOADS:
                    r = await run_workload(arms[arm], w, reqs[w], model)
                    res["runs"].append({"rep": rep, "arm": arm, "workload": w, **r})
                    print(f"rep {rep} {arm:6s} {w:8s} first gap {r['first_gap_p50'] * 1e3:6.1f} ms "
                          f"(p90 {r['first_gap_p90'] * 1e3:6.1f}), gaps p50 {r['gap_p50'] * 1e3:5.1f} "
                          f"p99 {r['gap_p99'] * 1e3:6.1f} ms; loop CPU/token: router "
                          f"{r['cpu_us_per_token']['router']['loop']:5.0f} us, decode "
                          f"{r['cpu_us_per_token']['decode']['loop']:5.0f} us", flush=True)
        if args.profile_dir:
            out = Path(args.profile_dir)
            for arm, procs in arms.items():
                spies = [pyspy(p, out / f"{arm}-{p.role}-stream50.txt") for p in procs[1:]]
                await asyncio.sleep(1.0)  # py-spy gives no sign that it attached
                await run_closed_loop(procs[-1].url, model, reqs["stream50"], 50)
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    await asyncio.to_thread(spy.wait, 60)
    finally:
        for procs in arms.values():
            for p in reversed(procs):
                p.stop()
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
    keys = ("first_gap_p50", "first_gap_p90", "gap_p50", "gap_p90", "gap_p99", "ttft_p50", "pull_s_mean",
            "step_s_mean", "step_gap_s_mean")
    summary: dict = {}
    for arm, by_w in out.items():
        for w, rs in by_w.items():
            s = {k: _spread([x[k] for x in rs if x[k] is not None]) for k in keys}
            s["first_gap_over_gap_p50"] = _spread([x["first_gap_p50"] / x["gap_p50"] for x in rs])
            s["cpu_us_per_token"] = {role: {k: _spread([x["cpu_us_per_token"][role][k] for x in rs])
                                            for k in ("loop", "other_max", "total")}
                                     for role in rs[0]["cpu_us_per_token"]}
            summary.setdefault(arm, {})[w] = s
    return summary


def _spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/disagg_path.json")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of another Tandem tree for the `before` arm")
    ap.add_argument("--profile-dir", default=None)
    args = ap.parse_args(argv)
    (Path(args.out).parent / "disagg_path_logs").mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    res = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=1))
    print(f"texts equal across arms: {res['texts_equal']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
