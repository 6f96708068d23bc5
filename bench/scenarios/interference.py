"""Issue 13's interference load: disaggregated against the strongest colocated configurations on
the same two cores (part of `make bench`).

The load: a random-init 42M-parameter Llama (bench/lib/models.py), prompts of 300-1,000 tokens, 64
output tokens (ignore_eos, greedy), Poisson arrivals at 0.6 requests/s, 40 requests. Every arm
(ArmSpec, bench/lib/arms.py) is started fresh for each run and stopped after it; the arms run
interleaved, repetition after repetition, the arm that goes first rotating, while the time budget
allows; then --profile arms run once more under py-spy. Compares each disaggregated arm with the
best colocated arm of its dtype (bench/lib/compare.py). The result is the run's summaries,
comparison, targets and profile; every request's chunk times go to bench/out/interference/<run-id>/;
unless --quick or --no-markdown, bench/figures/interference_*.png and the generated section of
BENCHMARKS.md are rewritten too.

    python -m bench interference [--reps 3] [--budget-s 1800] [--arms ...] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib.arms import CATALOG, DEFAULT_ARMS, Arm, ArmSpec, peers_or_skip, rotated
from bench.lib.compare import compare
from bench.lib.loadgen import run_workload, token_counter
from bench.lib.metrics import RequestRecord, summarize, text_mismatches
from bench.lib.models import ENGINE_MODEL, bench_model_dir, kv_bytes_per_token, model_params
from bench.lib.pyspy import profiling
from bench.lib.ready import served_model
from bench.lib.results import ROOT, host_info
from bench.lib.scrape import Counters, read_counters
from bench.lib.workload import PlannedRequest, WorkloadSpec, plan
from bench.scenarios.startup import MODEL as STARTUP_MODEL

# Issue 13's model (bench/lib/models.py's ENGINE_MODEL shape): ~42M parameters, 32k vocabulary, tied embeddings.
ISSUE_MODEL = {**ENGINE_MODEL}
# --model l30: issue 30's 30-layer shape (the startup scenario's), its head restricted the same way.
MODELS = {"issue13": ISSUE_MODEL, "l30": {**STARTUP_MODEL, "max_position_embeddings": 4096, "seed": 0}}

# Issue 13's interference load: prompts of about 300-1,000 tokens, 64 out, Poisson at 0.6 req/s.
INTERFERENCE = WorkloadSpec("interference", "poisson", 40, (300, 1000), 64, rate=0.6, seed=13)
QUICK = WorkloadSpec("interference-quick", "poisson", 6, (32, 128), 8, rate=2.0, seed=13)


PROFILE_ARMS = ("disagg-bf16",)


class Bench:
    """Every arm started fresh for each run, the arms interleaved per repetition (the first one
    rotating), then a profiled run of PROFILE_ARMS."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.monotonic()
        self.stamp = args.run_id
        self.log_dir = Path(args.out_dir) / "logs"
        self.shape = MODELS[args.model]
        self.model_dir = bench_model_dir(self.shape)
        self.count_tokens = token_counter(self.model_dir)
        self.specs, self.skipped_arms = peers_or_skip([CATALOG[n] for n in args.arms])
        base = QUICK if args.quick else INTERFERENCE
        self.workload = WorkloadSpec(**{**asdict(base), "num_requests": args.requests or base.num_requests})
        self.runs: list[dict[str, Any]] = []
        self.reference: dict[tuple[int, str, str], dict[int, str]] = {}
        self.skipped: list[str] = []
        self.profiles: dict[str, Any] = {}
        self.host = host_info()

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    async def start(self, spec: ArmSpec, tag: str) -> tuple[Arm, str, float]:
        """A fresh arm, ready and warmed up (one long prompt); its served model name and start time."""
        t = time.monotonic()
        arm = Arm(spec.with_args(tuple(self.args.worker_arg)), self.model_dir, self.log_dir, f"{spec.name}-{tag}")
        arm.start()
        try:
            await arm.wait_ready()
            model = await served_model(arm.url)
            hi = self.workload.prompt_len[1]
            warm = WorkloadSpec("warmup", "closed", 2, (hi, hi), 4, concurrency=2, seed=999)
            await run_workload(arm.url, model, warm, plan(warm, self.count_tokens))
        except BaseException:
            arm.stop()
            raise
        return arm, model, time.monotonic() - t

    async def measure(self, spec: ArmSpec, rep: int, reqs: list[PlannedRequest]) -> dict[str, Any]:
        arm, model, start_s = await self.start(spec, f"r{rep}")
        try:
            placement = {p.name: {"cpu": p.cpu, **p.placement()} for p in arm.procs}
            before = await read_counters(arm.procs)
            records = await run_workload(arm.url, model, self.workload, reqs, timeout_s=self.args.request_timeout_s)
            d = await read_counters(arm.procs) - before
        finally:
            arm.stop()
        return {"workload": self.workload.name, "rep": rep, "arm": spec.name, "records": records,
                "start_s": start_s, "placement": placement, "kv": kv_moved(arm, d), "cpu_s": d.cpu_s,
                "loadgen_cpu_s": d.loadgen_s, "machine_busy_cpu_s": d.busy_s, "routes": d.routes}

    async def repetitions(self) -> None:
        est = 60.0 + self.workload.num_requests / self.workload.rate
        reqs: dict[int, list[PlannedRequest]] = {}
        for rep, spec in [(r, spec) for r in range(self.args.reps) for spec in rotated(self.specs, r)]:
            left = self.args.budget_s - self.elapsed()
            if rep > 0 and est > left:
                print(f"skip {spec.name} rep {rep}: ~{est:.0f}s needed, {left:.0f}s left", flush=True)
                self.skipped.append(f"{spec.name} rep {rep}")
                continue
            if rep not in reqs:
                reqs[rep] = plan(WorkloadSpec(**{**asdict(self.workload), "seed": self.workload.seed + 1000 * rep}),
                                 self.count_tokens)
            t = time.monotonic()
            run = await self.measure(spec, rep, reqs[rep])
            est = max(est, time.monotonic() - t)
            # Greedy: an arm streams the text the first arm of its dtype streamed. Required in fp32;
            # in bf16 a different batch mix may flip a near-tie, so there it is reported only.
            ref = self.reference.setdefault((rep, spec.dtype, spec.runtime), {})  # vLLM's numerics are its own
            run["text_mismatches"] = text_mismatches(run["records"], ref)
            self.runs.append(run)
            sm = summarize(run["records"])
            print(f"[{self.elapsed():5.0f}s] rep {rep} {spec.name:20s} ttft p50 {sm['ttft']['p50']:.3f}s "
                  f"itl p50 {sm['itl']['p50'] * 1e3:.0f} p99 {sm['itl']['p99'] * 1e3:.0f} max "
                  f"{sm['itl']['max'] * 1e3:.0f} ms, errors {sm['errors']}, text≠ "
                  f"{len(run['text_mismatches'])}, routes {run['routes']} (start {run['start_s']:.0f}s)",
                  flush=True)

    async def profile(self, name: str) -> None:
        """py-spy the arm's workers over one run of the load (not counted in the tables)."""
        spec = CATALOG[name]
        reqs = plan(WorkloadSpec(**{**asdict(self.workload), "seed": self.workload.seed + 99}), self.count_tokens)
        arm, model, _ = await self.start(spec, "profile")
        files = {p.role: Path(self.args.out_dir) / "profiles" / f"{name}-{p.role}.txt" for p in arm.workers}
        try:
            async with profiling({p.pid: files[p.role] for p in arm.workers}) as summaries:
                records = await run_workload(arm.url, model, self.workload, reqs,
                                             timeout_s=self.args.request_timeout_s)
        except RuntimeError as e:  # py-spy missing: everything else is still measured
            self.profiles[name] = {"error": str(e)}
            print(f"profile {name}: {e}", flush=True)
            return
        finally:
            arm.stop()
        sm = summarize(records)
        self.profiles[name] = {
            "latency": {"ttft_p50": sm["ttft"]["p50"], "itl_p50": sm["itl"]["p50"], "itl_p99": sm["itl"]["p99"]},
            "workers": {role: summaries[f] for role, f in files.items() if f in summaries},
            "raw": {role: str(f) for role, f in files.items()}}
        print(f"profile {name}: {json.dumps(self.profiles[name]['workers'])[:600]}", flush=True)

    async def main(self) -> dict[str, Any]:
        print(f"arms: {', '.join(s.name for s in self.specs)}; model {self.model_dir}; "
              f"workload {self.workload}", flush=True)
        await self.repetitions()
        for name in self.args.profile:
            await self.profile(name)
        return self.assemble()

    def assemble(self) -> dict[str, Any]:
        runs_out = []
        for run in self.runs:
            recs: list[RequestRecord] = run["records"]
            sm = summarize(recs)
            n, dur = max(1, sum(r.ok for r in recs)), sm["duration_s"] or math.nan
            kv = run["kv"]
            sm["kv_bytes_per_request"] = kv["bytes"] / n if kv["count"] else math.nan
            sm["handoff_s_per_request"] = kv["seconds"] / kv["count"] if kv["count"] else math.nan
            sm["router_cpu_cores"] = run["cpu_s"].get("router", 0.0) / dur
            sm["loadgen_cpu_cores"] = run["loadgen_cpu_s"] / dur
            sm["worker_cpu_cores"] = {k: v / dur for k, v in run["cpu_s"].items() if k != "router"}
            ours = sum(run["cpu_s"].values()) + run["loadgen_cpu_s"]
            sm["other_cpu_cores"] = max(0.0, run["machine_busy_cpu_s"] - ours) / dur
            sm["text_mismatches"] = len(run["text_mismatches"])
            runs_out.append({k: v for k, v in run.items() if k != "records"}
                            | {"summary": sm, "records": [r.to_dict() for r in recs]})
        arms = {s.name: {"layout": s.layout, "dtype": s.dtype, "chunk": s.chunk, "peer": s.peer, "runtime": s.runtime,
                         "disaggregated": s.disaggregated, "description": s.describe()} for s in self.specs}
        return {
            "started_utc": self.stamp, "wall_s": self.elapsed(), "quick": self.args.quick,
            "command": " ".join(["python -m bench", *sys.argv[1:]]),
            "host": {**self.host, "loadavg_at_start": self.host["loadavg"], "loadavg_at_end": host_info()["loadavg"]},
            "model": {"dir": str(self.model_dir), "params": model_params(self.shape), **self.shape,
                      "kv_bytes_per_token": {d: kv_bytes_per_token(self.shape, d) for d in ("float32", "bfloat16")}},
            "workload": asdict(self.workload), "reps": self.args.reps, "budget_s": self.args.budget_s,
            "skipped_for_budget": self.skipped, "skipped_arms": self.skipped_arms, "arms": arms, "runs": runs_out,
            "comparison": by_runtime(runs_out, arms), "profiles": self.profiles,
        }


def by_runtime(runs: list[dict[str, Any]], arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """compare() within each runtime: a disaggregated arm against the colocated arms of its own engine,
    and against the peer (vLLM) in every runtime."""
    return {k: v for rt in sorted({m["runtime"] for m in arms.values()})
            for k, v in compare(runs, {a: m for a, m in arms.items() if m["runtime"] == rt or m["peer"]}).items()}


def kv_moved(arm: Arm, d: Counters) -> dict[str, float]:
    """KV bytes and handoff time during one run, as the decode (pulling) side counted them."""
    side = next((p.name for p in arm.workers if p.role == "decode"), None)
    m = d.metrics.get(side, {}) if side else {}
    return {"bytes": m.get("tandem_kv_transfer_bytes_total", 0.0), "seconds": m.get("tandem_kv_transfer_seconds_sum", 0.0),
            "count": m.get("tandem_kv_transfer_seconds_count", 0.0), "source": "metrics" if side else "none"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(CATALOG), metavar="ARM",
                   help=f"from: {', '.join(CATALOG)} (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, while the budget allows")
    p.add_argument("--budget-s", type=float, default=1800.0,
                   help="start no run past this (the first repetition always runs)")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: the issue's 40)")
    p.add_argument("--profile", nargs="*", default=list(PROFILE_ARMS), choices=list(CATALOG), metavar="ARM",
                   help="arms to run once more under py-spy (default: %(default)s)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--worker-arg", action="append", default=[], help="an extra `tandem worker` flag for every "
                   "worker of every arm, e.g. --worker-arg=--compile=off")
    p.add_argument("--model", choices=list(MODELS), default="issue13", help="the model's shape (random weights)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of the whole pipeline")
    p.add_argument("--no-markdown", action="store_true", help="write no BENCHMARKS.md section or figures")


def run(args: argparse.Namespace) -> dict:
    from bench.lib.interference_report import all_targets, summary_json, write_outputs
    from bench.lib.tables import fmt_ratio

    result = asyncio.run(Bench(args).main())
    publish = not (args.no_markdown or args.quick)
    for path in write_outputs(result, Path(args.out_dir), ROOT if publish else None):
        print(f"wrote {path}")
    print("disaggregated / best colocated of the same dtype (median [range] over repetitions):")
    for dtype, d in result["comparison"].items():
        print(f"  {dtype}: " + ", ".join(f"{m} {fmt_ratio(d['ratios'][m])}" for m in ("ttft.p50", "itl.p50", "itl.p99")))
    for t in all_targets(result):
        if "Tandem-on-vLLM" in t["target"]:
            print(f"  {t['arm']}: {t['target']} {t['measured']:.2f} (bound {t['bound']:g}, {'met' if t['met'] else 'missed'})")
    return summary_json(result)
