"""Decode throughput over HTTP, as a client sees it: N concurrent streams (64 prompt tokens, 64 out,
greedy, ignore_eos) to one colocated `tandem worker` pinned to one core with one thread, against
transformers' `generate` with a batch of N on one thread pinned to the same core, same model; fp32
and bf16, interleaved (the arm that goes first rotates per repetition), repeated, median and
range reported. One stream alone gives the batch-1 gap.

    .venv/bin/python -m bench.engine_http [--dtypes float32,bfloat16] [--reps 3]
        [--profile-dir DIR]   # also py-spy the worker under the N-stream load (bench/profile_summary.py)
        [--baseline DIR]      # also a worker from another tree (before/after in one run)
        [--worker-arg=--prefill-chunk-tokens=256 ...]

The load generator runs on the other core. Throughput = N x 64 / (first send to last token),
prefill included, the same measure for both; step = the median gap between a stream's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from bench.arms import Proc, free_port, tandem_exe

WORKER_CPU, CLIENT_CPU = 0, 1
ENV = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def prompts_for(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 600) for _ in range(length)] for _ in range(n)]


# ---- transformers' generate, in a child pinned to the worker's core ------------------------------

def hf_child(dtypes: list[str], model_dir: str) -> None:
    """Reads `dtype n prompt_len new_tokens seed` lines; answers JSON lines with seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    models = {d: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, d)).eval() for d in dtypes}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        dtype, n, plen, new, seed = line.split()
        ids = torch.tensor(prompts_for(int(n), int(plen), int(seed)))
        out = {}
        for key, new_tokens in (("total_s", int(new)), ("first_s", 1)):
            with torch.no_grad():
                t0 = time.perf_counter()
                gen = models[dtype].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                             pad_token_id=0)
                out[key] = time.perf_counter() - t0
            assert gen.shape[1] == ids.shape[1] + new_tokens
        print(json.dumps(out), flush=True)


class HF:
    def __init__(self, dtypes: list[str], model_dir: Path, log_dir: Path):
        cmd = [sys.executable, "-m", "bench.engine_http", "--hf-child", "--dtypes", ",".join(dtypes),
               "--model-dir", str(model_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=open(log_dir / "hf.log", "ab"),  # noqa: SIM115
                                     env=os.environ | ENV, preexec_fn=lambda: os.sched_setaffinity(0, {WORKER_CPU}))
        assert json.loads(self.proc.stdout.readline()).get("ready")

    def run(self, dtype: str, n: int, plen: int, new: int, seed: int) -> dict:
        self.proc.stdin.write(f"{dtype} {n} {plen} {new} {seed}\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return {"tokens_per_s": n * new / r["total_s"], "step_s": (r["total_s"] - r["first_s"]) / (new - 1),
                "wall_s": r["total_s"]}

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# ---- Tandem over HTTP ----------------------------------------------------------------------------

def start_worker(model_dir: Path, dtype: str, log_dir: Path, extra: list[str], name: str = "tandem",
                 env: dict[str, str] | None = None) -> Proc:
    """`tandem worker --role colocated` pinned to WORKER_CPU (env PYTHONPATH=... runs another tree)."""
    port = free_port()
    cmd = [*tandem_exe(), "worker", "--role", "colocated", "--model", str(model_dir), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--num-blocks", "1024",
           "--kv-backend", "none", *extra]
    p = Proc(f"{name}-{dtype}", "colocated", f"http://127.0.0.1:{port}", cmd, WORKER_CPU,
             log_dir / f"{name}-{dtype}.log")
    p.start(os.environ | ENV | (env or {}))
    return p


def worker_arms(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (extra worker flags, extra env): this tree, and optionally a baseline tree."""
    arms = {"tandem": (list(args.worker_arg), {})}
    if args.baseline:
        arms["baseline"] = ([], {"PYTHONPATH": args.baseline})
    return arms


async def wait_ready(p: Proc, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited\n{p.log_tail()}")
            try:
                async with s.get(p.url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not ready after {timeout_s:.0f}s\n{p.log_tail()}")
            await asyncio.sleep(0.5)


async def one_stream(s: aiohttp.ClientSession, url: str, prompt: list[int], new: int) -> list[float]:
    """Arrival times of each generated token (one NDJSON token event each)."""
    body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": prompt,
            "sampling": {"max_tokens": new, "temperature": 0, "ignore_eos": True}}
    times: list[float] = []
    async with s.post(url + "/internal/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.strip():
                continue
            ev = json.loads(line)
            if ev["type"] == "token":
                times.extend([time.perf_counter()] * len(ev.get("token_ids", [])))
            elif ev["type"] == "error":
                raise RuntimeError(str(ev))
    if len(times) != new:
        raise RuntimeError(f"expected {new} tokens, got {len(times)}")
    return times


async def tandem_run(url: str, n: int, plen: int, new: int, seed: int) -> dict:
    prompts = prompts_for(n, plen, seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        arrivals = await asyncio.gather(*(one_stream(s, url, p, new) for p in prompts))
        wall = max(a[-1] for a in arrivals) - t0
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    return {"tokens_per_s": n * new / wall, "step_s": statistics.median(gaps), "wall_s": wall,
            "gap_p99_s": sorted(gaps)[int(0.99 * (len(gaps) - 1))], "ttft_max_s": max(a[0] for a in arrivals) - t0}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def start_pyspy(worker: Proc, out: Path) -> subprocess.Popen:
    """py-spy on the worker (all threads, Python frames, without pausing it)."""
    from bench.profile_summary import pyspy_exe
    from bench.profile_summary import start_pyspy as spy_on

    return spy_on(pyspy_exe() or "py-spy", worker.pid, out)


async def profile(worker: Proc, out: Path, args: argparse.Namespace) -> None:
    """py-spy the worker over one N-stream run; SIGINT makes py-spy write its file."""
    spy = start_pyspy(worker, out)
    await asyncio.sleep(1.0)  # py-spy gives no sign that it attached; a second is plenty
    await tandem_run(worker.url, args.streams, args.prompt_len, args.new_tokens, 999)
    spy.send_signal(signal.SIGINT)
    await asyncio.to_thread(spy.wait, 60)


async def main_async(args: argparse.Namespace) -> dict:
    from bench.engine_model import engine_model_dir

    os.sched_setaffinity(0, {CLIENT_CPU})
    model_dir = Path(args.model_dir) if args.model_dir else engine_model_dir()
    log_dir = Path(args.out).parent / "engine_http_logs"
    dtypes = args.dtypes.split(",")
    arms = worker_arms(args)
    workers = {(a, d): start_worker(model_dir, d, log_dir, extra, a, env)
               for a, (extra, env) in arms.items() for d in dtypes}
    hf = HF(dtypes, model_dir, log_dir)
    res: dict = {"streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "worker_args": args.worker_arg, "baseline": args.baseline, "runs": []}
    try:
        for w in workers.values():
            await wait_ready(w)
            await tandem_run(w.url, args.streams, args.prompt_len, 8, 1)  # warm-up
        for d in dtypes:
            hf.run(d, 2, args.prompt_len, 4, 1)
        names = ["hf", *arms]
        for rep in range(args.reps):
            for d in dtypes:
                for arm in names[rep % len(names):] + names[: rep % len(names)]:  # the first arm rotates
                    res["runs"].append(await one_arm(arm, d, rep, hf, workers, args))
        if args.profile_dir:
            for (a, d), w in workers.items():
                await profile(w, Path(args.profile_dir) / f"{a}-{d}-{args.streams}streams.txt", args)
    finally:
        hf.stop()
        for w in workers.values():
            w.stop()
    res["summary"] = summarize(res["runs"], dtypes, list(arms))
    return res


async def one_arm(arm: str, dtype: str, rep: int, hf: HF, workers: dict, args: argparse.Namespace) -> dict:
    seed = 100 + rep
    if arm == "hf":
        r = hf.run(dtype, args.streams, args.prompt_len, args.new_tokens, seed)
    else:
        url = workers[arm, dtype].url
        r = await tandem_run(url, args.streams, args.prompt_len, args.new_tokens, seed)
        r["single_step_s"] = (await tandem_run(url, 1, args.prompt_len, args.new_tokens, seed))["step_s"]
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
            out[d][a] = {"tokens_per_s": spread([r["tokens_per_s"] for r in rs]),
                         "ratio_over_hf": spread([r["tokens_per_s"] / hf[r["rep"]]["tokens_per_s"] for r in rs]),
                         "step_s": spread([r["step_s"] for r in rs]),
                         "single_stream_step_s": spread([r["single_step_s"] for r in rs])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/engine_http.json")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--worker-arg", action="append", default=[], help="extra `tandem worker` argument")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of another Tandem tree to run beside this one "
                    "(a folder holding tandem/{cli,contracts,worker,...}), e.g. the commit before a change")
    ap.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hf_child:
        hf_child(args.dtypes.split(","), args.model_dir)
        return 0
    (Path(args.out).parent / "engine_http_logs").mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    res = asyncio.run(main_async(args))
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
