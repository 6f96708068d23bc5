"""`make bench`: issue 13's interference load, disaggregated against the strongest colocated
configurations on the same two cores.

The load (the issue's): a random-init 42M-parameter Llama (bench/engine_model.py), prompts of
300-1,000 tokens, 64 output tokens (ignore_eos, greedy), Poisson arrivals at 0.6 requests/s, 40
requests. Every arm (ArmSpec, bench/arms.py) is started fresh for each run and stopped after it;
the arms run interleaved, repetition after repetition, the arm that goes first rotating, while the
time budget allows; then PROFILE_ARMS run once more under py-spy (bench/profile_summary.py).
Compares each disaggregated arm with the best colocated arm of its dtype (bench/compare.py).
Writes bench/out/bench-<time>.json (+ latest.json, every request's chunk times); unless --quick
or --no-markdown, also bench/results/interference/summary.json, bench/figures/interference_*.png
and the generated section of BENCHMARKS.md.

    .venv/bin/python -m bench.run [--reps 3] [--budget-s 1800] [--arms ...] [--quick]
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.arms import Arm
from bench.compare import compare
from bench.engine_model import ENGINE_MODEL
from bench.loadgen import run_workload, token_counter
from bench.metrics import RequestRecord, summarize, text_mismatches
from bench.profile_summary import pyspy_exe, start_pyspy, stop_pyspy
from bench.profile_summary import summarize as summarize_profile
from bench.scrape import delta, kv_from_health, kv_health, route_counts, scrape
from bench.workload import PlannedRequest, WorkloadSpec, plan

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# The multi-turn part (bench/multiturn.py), bench/disagg_path.py and the simulator's calibration use this
# ~40M-parameter model: 8 x (attention 0.79M + MLP 4.13M) + embeddings and head 0.52M, fp32.
MODEL = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=2688,
             vocab_size=512, max_position_embeddings=2048, seed=0)

# Issue 13's model (bench/engine_model.py's shape): ~42M parameters, 32k vocabulary, tied embeddings.
ISSUE_MODEL = {**ENGINE_MODEL}

# Issue 13's interference load: prompts of about 300-1,000 tokens, 64 out, Poisson at 0.6 req/s.
INTERFERENCE = WorkloadSpec("interference", "poisson", 40, (300, 1000), 64, rate=0.6, seed=13)
QUICK = WorkloadSpec("interference-quick", "poisson", 6, (32, 128), 8, rate=2.0, seed=13)


def model_params(cfg: dict[str, Any]) -> int:
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"]
    kv = h // cfg["num_heads"] * cfg["num_kv_heads"]
    heads = 1 if cfg.get("tie_word_embeddings") else 2
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + heads * cfg["vocab_size"] * h + h


def kv_bytes_per_token(cfg: dict[str, Any], dtype: str) -> int:
    """K and V of every layer for one token."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["hidden_size"] // cfg["num_heads"] * size


# Run in a child process (this one, the load generator, never imports torch): zero the output
# head's rows of the tokens that decode to no complete text (lone UTF-8 bytes, special tokens).
# A random model picks such tokens often; their text is held back and the router sends no
# chunk for them, so two gaps would merge into one and look like a stall. With those rows at
# zero, greedy decoding never picks them (the best of ~350 random logits is always > 0) and
# every generated token reaches the client as its own chunk. The ids past the tokenizer's own
# (a 32k vocabulary over a few hundred learned tokens) decode to no text either. With tied
# embeddings the head is the embedding: its rows of tokens no prompt contains are zeroed; the
# matmul over the whole vocabulary, what the head costs, is unchanged.
RESTRICT_HEAD = """
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
path = Path(sys.argv[1])
tok = Tokenizer.from_file(str(path / "tokenizer.json"))
n = tok.get_vocab_size()
bad = [i for i in range(n) if (t := tok.decode([i], skip_special_tokens=True)) == "" or "\ufffd" in t]
for f in sorted(path.glob("*.safetensors")):
    w = load_file(str(f))
    key = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    if key in w:
        rows = bad + list(range(n, w[key].shape[0]))
        w[key][rows] = 0.0
        save_file(w, str(f), metadata={"format": "pt"})
        print(f"output head restricted: {len(rows)} of {w[key].shape[0]} tokens never generated")
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


@dataclass(frozen=True)
class ArmSpec:
    """One configuration of the two cores: a layout of bench/arms.py, a dtype, a prefill chunk."""

    name: str
    layout: str  # one of bench.arms.ARMS
    dtype: str  # float32 | bfloat16
    chunk: int | None = None  # --prefill-chunk-tokens of every worker; None: the role's default

    @property
    def disaggregated(self) -> bool:
        return self.layout.startswith("disagg")

    def worker_args(self) -> tuple[str, ...]:
        chunk = ("--prefill-chunk-tokens", str(self.chunk)) if self.chunk else ()
        return ("--dtype", self.dtype, *chunk)

    def describe(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        what = {"colocated": "colocated, 2 workers (1 thread, 1 core each)",
                "colocated-1": "colocated, 1 worker on 2 threads",
                "disagg-nixl": "disaggregated 1P+1D, NIXL",
                "disagg-tcp": "disaggregated 1P+1D, TCP"}[self.layout]
        chunk = f", prefill chunk {self.chunk}" if self.chunk else ""
        return f"{what}{chunk}, {short}"


def _catalog() -> dict[str, ArmSpec]:
    specs = []
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        specs.append(ArmSpec(f"disagg-{short}", "disagg-nixl", dtype))
        specs.append(ArmSpec(f"disagg-tcp-{short}", "disagg-tcp", dtype))
        for chunk in (64, 128, 256, 512):
            specs.append(ArmSpec(f"colo2-c{chunk}-{short}", "colocated", dtype, chunk))
            specs.append(ArmSpec(f"colo1-2t-c{chunk}-{short}", "colocated-1", dtype, chunk))
    return {s.name: s for s in specs}


CATALOG = _catalog()
# The strongest colocated configurations, picked by measuring the candidates of CATALOG on this
# load (BENCHMARKS.md, "Choosing the colocated arms"), and the disaggregated arms, in each dtype.
DEFAULT_ARMS = ("disagg-fp32", "colo2-c128-fp32", "colo1-2t-c256-fp32",
                "disagg-bf16", "colo2-c128-bf16", "colo1-2t-c256-bf16")
PROFILE_ARMS = ("disagg-bf16",)


class Bench:
    """Every arm started fresh for each run, the arms interleaved per repetition (the first one
    rotating), then a profiled run of PROFILE_ARMS."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.monotonic()
        self.stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.log_dir = Path(args.out) / "logs" / self.stamp
        self.model_dir = ensure_model(ISSUE_MODEL)
        self.count_tokens = token_counter(self.model_dir)
        self.specs = [CATALOG[n] for n in args.arms]
        base = QUICK if args.quick else INTERFERENCE
        self.workload = WorkloadSpec(**{**asdict(base), "num_requests": args.requests or base.num_requests})
        self.runs: list[dict[str, Any]] = []
        self.reference: dict[tuple[int, str], dict[int, str]] = {}
        self.skipped: list[str] = []
        self.profiles: dict[str, Any] = {}
        self.loadavg_at_start = os.getloadavg()
        self.me = psutil.Process()

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def make_arm(self, spec: ArmSpec, tag: str) -> Arm:
        return Arm(f"{spec.name}-{tag}", self.model_dir, self.log_dir, layout=spec.layout,
                   worker_args=spec.worker_args())

    async def start(self, spec: ArmSpec, tag: str) -> tuple[Arm, str, float]:
        """A fresh arm, ready and warmed up (one long prompt); its served model name and start time."""
        t = time.monotonic()
        arm = self.make_arm(spec, tag)
        arm.start()
        try:
            await arm.wait_ready(timeout_s=600.0)
            async with aiohttp.ClientSession() as s, s.get(arm.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
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
            async with aiohttp.ClientSession() as s:
                before = {p.name: await scrape(s, p.url) for p in arm.workers}
                h0 = {p.name: await kv_health(s, p.url) for p in arm.workers if p.role == "decode"}
                routes0 = await route_counts(s, arm.url)
                cpu0 = {p.name: p.cpu_seconds() for p in arm.procs}
                me0, busy0 = sum(self.me.cpu_times()[:2]), busy_cpu_seconds()
                records = await run_workload(arm.url, model, self.workload, reqs,
                                             timeout_s=self.args.request_timeout_s)
                me1, busy1 = sum(self.me.cpu_times()[:2]), busy_cpu_seconds()
                cpu1 = {p.name: p.cpu_seconds() for p in arm.procs}
                after = {p.name: await scrape(s, p.url) for p in arm.workers}
                h1 = {p.name: await kv_health(s, p.url) for p in arm.workers if p.role == "decode"}
                routes1 = await route_counts(s, arm.url)
        finally:
            arm.stop()
        kv = kv_delta(arm, before, after)
        if kv["count"] == 0 and h1:
            name = next(iter(h1))
            kv = kv_from_health(h0.get(name, {}), h1[name])
        return {"workload": self.workload.name, "rep": rep, "arm": spec.name, "records": records,
                "start_s": start_s, "placement": placement, "kv": kv,
                "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}, "loadgen_cpu_s": me1 - me0,
                "machine_busy_cpu_s": busy1 - busy0,
                "routes": {k: v - routes0.get(k, 0.0) for k, v in routes1.items() if v > routes0.get(k, 0.0)}}

    async def repetitions(self) -> None:
        est = 60.0 + self.workload.num_requests / self.workload.rate
        reqs: dict[int, list[PlannedRequest]] = {}
        for rep, name in run_order([s.name for s in self.specs], self.args.reps):
            spec = CATALOG[name]
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
            ref = self.reference.setdefault((rep, spec.dtype), {})
            run["text_mismatches"] = text_mismatches(run["records"], ref)
            for r in run["records"]:
                if r.ok:
                    ref.setdefault(r.index, r.text)
            self.runs.append(run)
            sm = summarize(run["records"], [])
            print(f"[{self.elapsed():5.0f}s] rep {rep} {spec.name:20s} ttft p50 {sm['ttft']['p50']:.3f}s "
                  f"itl p50 {sm['itl']['p50'] * 1e3:.0f} p99 {sm['itl']['p99'] * 1e3:.0f} max "
                  f"{sm['itl']['max'] * 1e3:.0f} ms, errors {sm['errors']}, text≠ "
                  f"{len(run['text_mismatches'])}, routes {run['routes']} (start {run['start_s']:.0f}s)",
                  flush=True)

    async def profile(self, name: str) -> None:
        """py-spy the arm's workers over one run of the load (not counted in the tables)."""
        exe = pyspy_exe()
        if exe is None:
            self.profiles[name] = {"error": "py-spy not installed (pip install py-spy, or set $PY_SPY)"}
            print(f"profile {name}: {self.profiles[name]['error']}", flush=True)
            return
        spec = CATALOG[name]
        reqs = plan(WorkloadSpec(**{**asdict(self.workload), "seed": self.workload.seed + 99}), self.count_tokens)
        arm, model, _ = await self.start(spec, "profile")
        out = Path(self.args.out) / "profiles" / self.stamp
        out.mkdir(parents=True, exist_ok=True)
        files = {p.role: out / f"{name}-{p.role}.txt" for p in arm.workers}
        try:
            spies = [start_pyspy(exe, p.pid, files[p.role]) for p in arm.workers]
            await asyncio.sleep(1.0)  # py-spy gives no sign that it attached
            records = await run_workload(arm.url, model, self.workload, reqs, timeout_s=self.args.request_timeout_s)
            for spy in spies:
                await asyncio.to_thread(stop_pyspy, spy)
        finally:
            arm.stop()
        sm = summarize(records, [])
        self.profiles[name] = {
            "latency": {"ttft_p50": sm["ttft"]["p50"], "itl_p50": sm["itl"]["p50"], "itl_p99": sm["itl"]["p99"]},
            "workers": {role: summarize_profile(f) for role, f in files.items() if f.is_file()},
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
            sm = summarize(recs, [])
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
        arms = {s.name: {"layout": s.layout, "dtype": s.dtype, "chunk": s.chunk,
                         "disaggregated": s.disaggregated, "description": s.describe()} for s in self.specs}
        return {
            "started_utc": self.stamp, "wall_s": self.elapsed(), "quick": self.args.quick,
            "command": " ".join(["python -m bench.run", *sys.argv[1:]]),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "loadavg_at_start": self.loadavg_at_start, "loadavg_at_end": os.getloadavg()},
            "model": {"dir": str(self.model_dir), "params": model_params(ISSUE_MODEL), **ISSUE_MODEL,
                      "kv_bytes_per_token": {d: kv_bytes_per_token(ISSUE_MODEL, d) for d in ("float32", "bfloat16")}},
            "workload": asdict(self.workload), "reps": self.args.reps, "budget_s": self.args.budget_s,
            "skipped_for_budget": self.skipped, "arms": arms, "runs": runs_out,
            "comparison": compare(runs_out, arms), "profiles": self.profiles,
        }

def run_order(names: list[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: every arm once per repetition, the first one rotating, so
    the machine's drift and the arm that follows another hit every arm alike."""
    order = []
    for rep in range(reps):
        k = rep % len(names)
        order += [(rep, n) for n in names[k:] + names[:k]]
    return order


def busy_cpu_seconds() -> float:
    """Non-idle CPU seconds of the whole machine so far (every core)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def kv_delta(arm: Arm, before: dict, after: dict) -> dict[str, float]:
    """KV bytes and handoff time during one run, as the decode (pulling) side counted them."""
    side = next((p.name for p in arm.workers if p.role == "decode"), None)
    if side is None:
        return {"bytes": 0.0, "seconds": 0.0, "count": 0.0, "source": "none"}
    b, a = before.get(side, {}), after.get(side, {})
    return {"bytes": delta(b, a, "tandem_kv_transfer_bytes_total"),
            "seconds": delta(b, a, "tandem_kv_transfer_seconds_sum"),
            "count": delta(b, a, "tandem_kv_transfer_seconds_count"), "source": "metrics"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(CATALOG), metavar="ARM",
                   help=f"from: {', '.join(CATALOG)} (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, while the budget allows")
    p.add_argument("--budget-s", type=float, default=1800.0,
                   help="start no run past this (the first repetition always runs)")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default: the issue's 40)")
    p.add_argument("--profile", nargs="*", default=list(PROFILE_ARMS), choices=list(CATALOG), metavar="ARM",
                   help="arms to run once more under py-spy (default: %(default)s)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of the whole pipeline")
    p.add_argument("--no-markdown", action="store_true", help="write no BENCHMARKS.md section, figures or summary")
    args = p.parse_args(argv)

    from bench.report import fmt_ratio, write_outputs

    result = asyncio.run(Bench(args).main())
    publish = not (args.no_markdown or args.quick)
    for path in write_outputs(result, Path(args.out), ROOT if publish else None):
        print(f"wrote {path}")
    print("disaggregated / best colocated of the same dtype (median [range] over repetitions):")
    for dtype, d in result["comparison"].items():
        print(f"  {dtype}: " + ", ".join(f"{m} {fmt_ratio(d['ratios'][m])}" for m in ("ttft.p50", "itl.p50", "itl.p99")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
