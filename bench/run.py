"""`make bench`: colocated against disaggregated serving on this machine, side by side.

Starts every arm (bench/arms.py) once, calibrates on the colocated arm (isolated prefill time,
isolated decode-step time, saturation capacity), then replays the same request sequences
against each arm in turn, rotating which arm goes first, repetition after repetition while
the time budget allows. Writes bench/out/bench-<time>.json (+ latest.json), PNG plots, and the
results section of BENCHMARKS.md.

    .venv/bin/python -m bench.run [--budget-s 780] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.arms import ARMS, Arm
from bench.loadgen import run_workload, token_counter
from bench.metrics import (
    RequestRecord,
    make_slos,
    percentile,
    ratio,
    spread,
    summarize,
    text_mismatches,
)
from bench.scrape import delta, kv_from_health, kv_health, scrape
from bench.workload import PlannedRequest, WorkloadSpec, plan

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# ~40M parameters: 8 x (attention 0.79M + MLP 4.13M) + embeddings and head 0.52M, fp32.
MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=2688,
             vocab_size=512, max_position_embeddings=2048, seed=0)

INTERFERENCE_PROMPT = (256, 1024)
INTERFERENCE_OUTPUT = 64
LOAD_FRACTIONS = (0.3, 0.6, 0.9)
CLOSED_CONCURRENCY = {1: 3, 2: 4, 4: 8, 8: 12}  # concurrency -> requests


def model_params(cfg: dict[str, int]) -> int:
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"]
    kv = h // cfg["num_heads"] * cfg["num_kv_heads"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * cfg["vocab_size"] * h + h


# Run in a child process (this one, the load generator, never imports torch): zero the output
# head's rows of the tokens that decode to no complete text (lone UTF-8 bytes, special tokens).
# A random model picks such tokens often; their text is held back and the router sends no
# chunk for them, so two gaps would merge into one and look like a stall. With those rows at
# zero, greedy decoding never picks them (the best of ~350 random logits is always > 0) and
# every generated token reaches the client as its own chunk.
RESTRICT_HEAD = """
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
path = Path(sys.argv[1])
tok = Tokenizer.from_file(str(path / "tokenizer.json"))
bad = [i for i in range(tok.get_vocab_size())
       if (t := tok.decode([i], skip_special_tokens=True)) == "" or "\ufffd" in t]
for f in sorted(path.glob("*.safetensors")):
    w = load_file(str(f))
    if "lm_head.weight" in w:
        w["lm_head.weight"][bad] = 0.0
        save_file(w, str(f), metadata={"format": "pt"})
        print(f"output head restricted: {len(bad)} of {tok.get_vocab_size()} tokens never generated")
"""
HEAD_MARKER = ".bench-head-restricted"


def ensure_model(cfg: dict[str, int]) -> Path:
    """The benchmark model, built once and cached under ~/.cache/tandem/models/<key>."""
    key = hashlib.sha256(json.dumps({**cfg, "head": "complete-text"}, sort_keys=True).encode())
    path = Path.home() / ".cache" / "tandem" / "models" / f"bench-llama-{key.hexdigest()[:12]}"
    if not (path / HEAD_MARKER).is_file():
        print(f"building the benchmark model at {path} ...", flush=True)
        code = ("import json,sys; from tandem.worker.local.toy_model import make_toy_model; "
                "make_toy_model(sys.argv[1], **json.loads(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, str(path), json.dumps(cfg)], check=True)
        subprocess.run([sys.executable, "-c", RESTRICT_HEAD, str(path)], check=True)
        (path / HEAD_MARKER).write_text("lm_head rows of tokens without complete text zeroed\n")
    return path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.monotonic()
        self.out_dir = Path(args.out)
        self.stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.log_dir = self.out_dir / "logs" / self.stamp
        self.model_dir = ensure_model(MODEL)
        self.count_tokens = token_counter(self.model_dir)
        self.arms = [Arm(n, self.model_dir, self.log_dir) for n in args.arms]
        self.runs: list[dict[str, Any]] = []
        self.reference: dict[tuple[str, int], dict[int, str]] = {}
        self.me = psutil.Process()
        self.result: dict[str, Any] = {}
        self.model_name = ""
        self.calibration: dict[str, Any] = {}
        self.skipped: list[str] = []
        self.loadavg_at_start = os.getloadavg()
        # The quick smoke run keeps every shape small: it checks the pipeline, not the speed.
        self.prompt_range = (32, 128) if args.quick else INTERFERENCE_PROMPT
        self.output_len = 8 if args.quick else INTERFERENCE_OUTPUT

    def other_arms_cpu(self, arm: Arm) -> float:
        return sum(p.cpu_seconds() for a in self.arms if a is not arm for p in a.procs)

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    async def run_one(self, arm: Arm, spec: WorkloadSpec, reqs: list[PlannedRequest], rep: int,
                      ) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            before = {p.name: await scrape(s, p.url) for p in arm.workers}
            h0 = {p.name: await kv_health(s, p.url) for p in arm.workers if p.role == "decode"}
            cpu0 = {p.name: p.cpu_seconds() for p in arm.procs}
            me0 = sum(self.me.cpu_times()[:2])
            sys0 = busy_cpu_seconds()
            idle0 = self.other_arms_cpu(arm)
            records = await run_workload(arm.url, self.model_name, spec, reqs,
                                         timeout_s=self.args.request_timeout_s)
            me1 = sum(self.me.cpu_times()[:2])
            sys1 = busy_cpu_seconds()
            idle1 = self.other_arms_cpu(arm)
            cpu1 = {p.name: p.cpu_seconds() for p in arm.procs}
            after = {p.name: await scrape(s, p.url) for p in arm.workers}
            h1 = {p.name: await kv_health(s, p.url) for p in arm.workers if p.role == "decode"}
        kv = kv_delta(arm, before, after)
        if kv["count"] == 0 and h1:
            name = next(iter(h1))
            kv = kv_from_health(h0.get(name, {}), h1[name])
        return {"workload": spec.name, "rep": rep, "arm": arm.name,
                "records": records, "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
                "loadgen_cpu_s": me1 - me0, "kv": kv,
                # CPU the whole machine was busy with, to tell how much was not this benchmark.
                "machine_busy_cpu_s": sys1 - sys0,
                # The arms not under test, idle: an idle arm that polls steals from this one.
                "idle_arms_cpu_s": idle1 - idle0}

    async def calibrate(self, colo: Arm) -> dict[str, Any]:
        """Isolated prefill and decode-step times, and the colocated arm's capacity."""
        lo, hi = self.prompt_range
        q = self.args.quick
        prefill = WorkloadSpec("cal-prefill", "closed", 2, (hi, hi), 1, seed=901)
        step = WorkloadSpec("cal-step", "closed", 1, (32, 32), 16 if q else 64, seed=902)
        cap = WorkloadSpec("cal-capacity", "closed", 4 if q else 8, (lo, hi), self.output_len,
                           concurrency=4, seed=903)
        out: dict[str, Any] = {}
        recs = await run_workload(colo.url, self.model_name, prefill, plan(prefill, self.count_tokens))
        out["isolated_prefill_s"] = min(r.ttft for r in recs if r.ttft is not None)
        out["isolated_prefill_tokens"] = hi
        recs = await run_workload(colo.url, self.model_name, step, plan(step, self.count_tokens))
        out["isolated_step_s"] = percentile([g for r in recs for g in r.gaps], 50)
        t = time.monotonic()
        recs = await run_workload(colo.url, self.model_name, cap, plan(cap, self.count_tokens))
        ok = [r for r in recs if r.ok]
        if not ok:
            raise RuntimeError(f"calibration failed on {colo.name}: {recs[0].error}")
        dur = max(r.end_s for r in ok) - min(r.send_s for r in ok)
        out["capacity_rps"] = len(ok) / dur
        out["capacity_workload"] = (f"closed loop, {cap.concurrency} in flight, {cap.num_requests} "
                                    f"requests, prompts {lo}-{hi}, {cap.output_len} out")
        out["calibration_wall_s"] = time.monotonic() - t
        return out

    def workloads(self, cal: dict[str, Any]) -> list[WorkloadSpec]:
        q = self.args.quick
        cap = cal["capacity_rps"]
        specs = []
        for frac in LOAD_FRACTIONS[1:2] if q else LOAD_FRACTIONS:
            rate = frac * cap
            n = 4 if q else max(4, min(12, round(rate * self.args.span_s)))
            specs.append(WorkloadSpec(f"interference@{frac:.1f}", "poisson", n, self.prompt_range,
                                      self.output_len, rate=rate, seed=10 + int(frac * 10)))
        specs.append(WorkloadSpec("short-prompt", "closed", 2 if q else 4, (32, 32),
                                  32 if q else 256, concurrency=2, seed=20))
        for c, n in CLOSED_CONCURRENCY.items():
            if q and c not in (2,):
                continue
            specs.append(WorkloadSpec(f"closed-c{c}", "closed", n, self.prompt_range,
                                      self.output_len, concurrency=c, seed=30 + c))
        return specs

    async def main(self) -> dict[str, Any]:
        print(f"arms: {', '.join(a.name for a in self.arms)}; model {self.model_dir}", flush=True)
        for a in self.arms:
            a.start()
        try:
            await asyncio.gather(*(a.wait_ready() for a in self.arms))
            print(f"arms ready after {self.elapsed():.0f}s", flush=True)
            async with aiohttp.ClientSession() as s, s.get(self.arms[0].url + "/v1/models") as r:
                self.model_name = (await r.json())["data"][0]["id"]
            placement = {a.name: {p.name: {"cpu": p.cpu, **p.placement()} for p in a.procs}
                         for a in self.arms}
            idle = await self.idle_cpu()
            print(f"idle CPU per arm (cores): {idle}", flush=True)
            for a in self.arms:  # warm-up: one long prompt per arm
                hi = self.prompt_range[1]
                warm = WorkloadSpec("warmup", "closed", 1, (hi, hi), 4, seed=999)
                await run_workload(a.url, self.model_name, warm, plan(warm, self.count_tokens))
            colo = next((a for a in self.arms if a.name == "colocated"), self.arms[0])
            cal = self.calibration = await self.calibrate(colo)
            print(f"calibration: {json.dumps(cal)}", flush=True)
            slos = make_slos(cal["isolated_prefill_s"], cal["isolated_step_s"])
            specs = self.workloads(cal)
            await self.run_items(specs)
        finally:
            for a in self.arms:
                a.stop()
        return self.assemble(cal, slos, specs, placement, idle)

    async def idle_cpu(self, seconds: float = 2.0) -> dict[str, float]:
        """CPU each arm burns while idle: another arm's progress thread would skew every run."""
        c0 = {a.name: sum(p.cpu_seconds() for p in a.procs) for a in self.arms}
        await asyncio.sleep(seconds)
        return {a.name: round((sum(p.cpu_seconds() for p in a.procs) - c0[a.name]) / seconds, 3)
                for a in self.arms}

    def guess_s(self, spec: WorkloadSpec) -> float:
        """A rough duration of one arm's run, from the calibration, before it has been timed."""
        cal = self.calibration
        mean_prompt = sum(spec.prompt_len) / 2
        service = (cal["isolated_prefill_s"] * mean_prompt / cal["isolated_prefill_tokens"]
                   + spec.output_len * cal["isolated_step_s"])
        if spec.mode == "poisson":
            return spec.num_requests / spec.rate + service
        return spec.num_requests * service / min(spec.concurrency, 2)

    async def run_items(self, specs: list[WorkloadSpec]) -> None:
        est: dict[str, float] = {}
        for i, (spec, rep) in enumerate(schedule(specs, self.args.reps)):
            left = self.args.budget_s - self.elapsed()
            guess = est.get(spec.name) or self.guess_s(spec) * len(self.arms)
            if guess > left:
                print(f"skip {spec.name} rep {rep}: ~{guess:.0f}s needed, {left:.0f}s left",
                      flush=True)
                self.skipped.append(f"{spec.name} rep {rep}")
                continue
            s = WorkloadSpec(**{**asdict(spec), "seed": spec.seed + 1000 * rep})
            reqs = plan(s, self.count_tokens)
            t = time.monotonic()
            k = i % len(self.arms)
            for arm in self.arms[k:] + self.arms[:k]:  # rotate which arm goes first
                run = await self.run_one(arm, s, reqs, rep)
                ref = self.reference.setdefault((spec.name, rep), {})
                # Greedy: every arm must stream the text the first arm to run it streamed.
                run["text_mismatches"] = text_mismatches(run["records"], ref)
                for r in run["records"]:
                    if r.ok:
                        ref.setdefault(r.index, r.text)
                self.runs.append(run)
                sm = summarize(run["records"], [])
                print(f"[{self.elapsed():5.0f}s] {spec.name} rep {rep} {arm.name}: "
                      f"ttft p50 {sm['ttft']['p50']:.3f}s itl p50 {sm['itl']['p50']:.3f}s "
                      f"p99 {sm['itl']['p99']:.3f}s max {sm['itl']['max']:.3f}s "
                      f"errors {sm['errors']}", flush=True)
                await asyncio.sleep(0.5)
            est[spec.name] = time.monotonic() - t

    def assemble(self, cal, slos, specs, placement, idle) -> dict[str, Any]:
        runs_out = []
        for run in self.runs:
            recs: list[RequestRecord] = run["records"]
            sm = summarize(recs, slos)
            ok = [r for r in recs if r.ok]
            kv = run["kv"]
            n = max(1, len(ok))
            dur = sm["duration_s"] or math.nan
            sm["kv_bytes_per_request"] = kv["bytes"] / n if kv["count"] else math.nan
            sm["handoff_s_per_request"] = kv["seconds"] / kv["count"] if kv["count"] else math.nan
            sm["handoff_share_of_ttft"] = ratio(sm["handoff_s_per_request"], sm["ttft"]["mean"])
            sm["router_cpu_cores"] = run["cpu_s"].get("router", 0.0) / dur
            sm["loadgen_cpu_cores"] = run["loadgen_cpu_s"] / dur
            sm["router_cpu_ms_per_request"] = 1000 * run["cpu_s"].get("router", 0.0) / n
            sm["worker_cpu_cores"] = {k: v / dur for k, v in run["cpu_s"].items() if k != "router"}
            sm["text_mismatches"] = len(run["text_mismatches"])
            ours = sum(run["cpu_s"].values()) + run["loadgen_cpu_s"] + run["idle_arms_cpu_s"]
            sm["other_cpu_cores"] = max(0.0, run["machine_busy_cpu_s"] - ours) / dur
            sm["idle_arms_cpu_cores"] = run["idle_arms_cpu_s"] / dur
            runs_out.append({k: v for k, v in run.items() if k != "records"}
                            | {"summary": sm, "records": [r.to_dict() for r in recs]})
        return {
            "started_utc": self.stamp,
            "wall_s": self.elapsed(),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                     "python": platform.python_version(),
                     "loadavg_at_start": self.loadavg_at_start, "loadavg_at_end": os.getloadavg()},
            "model": {"dir": str(self.model_dir), "params": model_params(MODEL), **MODEL,
                      "dtype": "float32",
                      "kv_bytes_per_token": 2 * MODEL["num_layers"] * MODEL["num_kv_heads"]
                      * MODEL["hidden_size"] // MODEL["num_heads"] * 4},
            "arms": [a.name for a in self.arms],
            "placement": placement,
            "idle_cpu_cores": idle,
            "calibration": cal,
            "slos": [asdict(s) for s in slos],
            "workloads": [asdict(s) for s in specs],
            "quick": self.args.quick,
            "budget_s": self.args.budget_s,
            "skipped_for_budget": self.skipped,
            "runs": runs_out,
            "ratios": ratios(runs_out, [s.name for s in slos]),
        }


def busy_cpu_seconds() -> float:
    """Non-idle CPU seconds of the whole machine so far (every core)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def schedule(specs: list[WorkloadSpec], reps: int) -> list[tuple[WorkloadSpec, int]]:
    """(workload, repetition) in run order: one repetition of every workload first (the
    open-loop interference workloads, which carry the claim, leading), then a second of the
    interference workloads, then the remaining repetitions. Coverage first: on a slow machine
    the budget runs out before the later repetitions, never before a workload was measured."""
    inter = [s for s in specs if s.mode == "poisson"]
    rest = [s for s in specs if s.mode != "poisson"]
    order = [(s, 0) for s in inter + rest] if reps >= 1 else []
    order += [(s, 1) for s in inter] if reps >= 2 else []
    order += [(s, 1) for s in rest] if reps >= 2 else []
    order += [(s, r) for r in range(2, reps) for s in specs]
    return order


def kv_delta(arm: Arm, before: dict, after: dict) -> dict[str, float]:
    """KV bytes and handoff time during one run, as the decode (pulling) side counted them."""
    side = next((p.name for p in arm.workers if p.role == "decode"), None)
    if side is None:
        return {"bytes": 0.0, "seconds": 0.0, "count": 0.0, "source": "none"}
    b, a = before.get(side, {}), after.get(side, {})
    return {"bytes": delta(b, a, "tandem_kv_transfer_bytes_total"),
            "seconds": delta(b, a, "tandem_kv_transfer_seconds_sum"),
            "count": delta(b, a, "tandem_kv_transfer_seconds_count"), "source": "metrics"}


RATIO_METRICS = ("ttft.p50", "ttft.p90", "ttft.p99", "ttft.max", "itl.p50", "itl.p90", "itl.p99",
                 "itl.max", "tpot.p50", "tpot.p90", "tpot.p99", "throughput_rps",
                 "output_tokens_per_s")


def ratios(runs: list[dict[str, Any]], slo_names: list[str]) -> dict[str, Any]:
    """arm/colocated for each metric, per (workload, repetition), then median and range."""
    from bench.metrics import get_path

    metrics = [*RATIO_METRICS, *(f"goodput.{n}.goodput_rps" for n in slo_names)]
    base = {(r["workload"], r["rep"]): r["summary"] for r in runs if r["arm"] == "colocated"}
    per: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in runs:
        if r["arm"] == "colocated" or (r["workload"], r["rep"]) not in base:
            continue
        b = base[(r["workload"], r["rep"])]
        d = per.setdefault((r["workload"], r["arm"]), {m: [] for m in metrics})
        for m in metrics:
            d[m].append(ratio(get_path(r["summary"], m), get_path(b, m)))
    return {f"{w}|{a}": {m: spread(v) for m, v in d.items()} for (w, a), d in per.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--reps", type=int, default=3, help="repetitions, while the budget allows")
    p.add_argument("--budget-s", type=float, default=720.0,
                   help="stop starting repetitions past this (the first always runs)")
    p.add_argument("--span-s", type=float, default=12.0,
                   help="an open-loop run's arrivals span about this long")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of the whole pipeline")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = p.parse_args(argv)

    from bench.report import write_outputs

    result = asyncio.run(Bench(args).main())
    paths = write_outputs(result, Path(args.out), None if args.no_markdown else ROOT / "BENCHMARKS.md")
    for path in paths:
        print(f"wrote {path}")
    from bench.report import fmt_ratio

    print("headline ratios, disaggregated / colocated (median [range] over repetitions):")
    for key, d in result["ratios"].items():
        print(f"  {key:32s} TTFT p50 {fmt_ratio(d['ttft.p50'])}, ITL p50 {fmt_ratio(d['itl.p50'])}, "
              f"ITL p99 {fmt_ratio(d['itl.p99'])}, ITL max {fmt_ratio(d['itl.max'])}, "
              f"throughput {fmt_ratio(d['throughput_rps'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
