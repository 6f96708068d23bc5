"""Multi-turn chat against the prefix cache, colocated and disaggregated (part of `make bench`).

Conversations share a system prompt and resend the whole conversation every turn
(bench/chat_workload.py). Six arms replay the same conversations, all started once and kept up,
interleaved (the arm that goes first rotates every repetition; the cores are shared with other
users, so every figure is a median over repetitions and the machine's other load is recorded):

  colocated cache-off / cache-on least-loaded / cache-on prefix-aware   (two colocated workers)
  disagg    cache-off / cache-on least-loaded / cache-on prefix-aware   (prefill + decode, tcp)

Reports TTFT of first and later turns apart, ITL, the prefix hit rate (tokens found cached over
tokens looked up, from the workers' metrics) and the KV bytes each request moved and saved.
The result is every run's summary; the records go to bench/out/multiturn/<run-id>/; unless
--no-markdown, the plot bench/figures/multiturn.png and the multi-turn section of BENCHMARKS.md
are rewritten too.

    python -m bench multiturn [--budget-s 900] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.arms import Arm, ArmSpec, rotated
from bench.lib.chat_workload import ChatPlan, ChatSpec, messages_for, plan_chat
from bench.lib.loadgen import greedy_body, stream_into, token_counter
from bench.lib.metrics import RequestRecord, text_mismatches
from bench.lib.models import MULTITURN_MODEL as MODEL
from bench.lib.models import bench_model_dir, kv_bytes_per_token, model_params
from bench.lib.multiturn_report import summarize_run, summary_json, write_outputs
from bench.lib.ready import served_model
from bench.lib.results import ROOT, host_info
from bench.lib.scrape import read_counters

# Prompts whose uncached tail is shorter than this are prefilled by the decode worker (the
# router's short-prompt bypass; with prefix-aware routing, the `cached_prefix` route). The same
# in every disaggregated arm.
SHORT_PROMPT = 128
KV_BYTES_PER_TOKEN = kv_bytes_per_token(MODEL, "float32")  # K and V of every layer for one token


def arm_spec(name: str, layout: str, cache: bool, policy: str) -> ArmSpec:
    """Two colocated workers, or 1P+1D over TCP; the prefix cache on or off; the router's policy."""
    router = ("--policy", policy) + (("--short-prompt-threshold", str(SHORT_PROMPT)) if layout != "colocated" else ())
    return ArmSpec(name, layout, None, worker_args=() if cache else ("--no-prefix-caching",), router_args=router)


ARM_SPECS = tuple(arm_spec(f"{short}-{name}", layout, name != "cache-off", "prefix-aware" if name == "prefix-aware"
                           else "least-loaded")
                  for short, layout in (("colocated", "colocated"), ("disagg", "disagg-tcp"))
                  for name in ("cache-off", "least-loaded", "prefix-aware"))


def workload(quick: bool) -> ChatSpec:
    if quick:
        return ChatSpec("chat-quick", conversations=2, turns=2, system_tokens=96, user_tokens=(16, 32),
                        output_len=8, rate=1.0, think_s=0.2, seed=1)
    return ChatSpec("chat", conversations=12, turns=4, system_tokens=320, user_tokens=(32, 96),
                    output_len=32, rate=0.5, think_s=1.0, seed=1)


async def run_chat(url: str, model: str, plan: ChatPlan, timeout_s: float) -> tuple[list[RequestRecord], dict]:
    """Every conversation from its start time, turn after turn (each waits for the last answer
    and a think time); returns the records and each record's turn by index."""
    spec = plan.spec
    records: list[RequestRecord] = []
    turns: dict[int, int] = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()

        async def conversation(conv) -> None:
            await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
            answers: list[str] = []
            for t in range(spec.turns):
                if t:
                    await asyncio.sleep(conv.think_s[t])
                body = greedy_body(model, spec.output_len, messages=messages_for(plan, conv, answers))
                i = plan.request_index(conv.index, t)
                rec = RequestRecord(i, 0, spec.output_len, scheduled_s=time.perf_counter() - t0)
                await stream_into(session, f"{url}/v1/chat/completions", body, rec, t0, timeout_s)
                records.append(rec)
                turns[i] = t
                if not rec.ok:
                    return  # the conversation cannot go on without its answer
                answers.append(rec.text)

        await asyncio.gather(*(conversation(c) for c in plan.conversations))
    return sorted(records, key=lambda r: r.index), turns


WORKER_COUNTERS = ("tandem_worker_prefix_cache_query_tokens_total", "tandem_worker_prefix_cache_hit_tokens_total",
                   "tandem_kv_transfer_bytes_total", "tandem_worker_kv_pull_saved_bytes_total",
                   "tandem_worker_prompt_tokens_total")


class MultiTurn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.monotonic()
        self.stamp = args.run_id
        self.out_dir = Path(args.out_dir)
        self.model_dir = bench_model_dir(MODEL)
        self.count_tokens = token_counter(self.model_dir)
        log_dir = self.out_dir / "logs"
        self.specs = [s for s in ARM_SPECS if not args.arms or s.name in args.arms]
        self.arms = [Arm(s, self.model_dir, log_dir) for s in self.specs]
        self.chat = workload(args.quick)
        self.runs: list[dict[str, Any]] = []
        self.skipped: list[int] = []
        self.host = host_info()

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    async def run_one(self, arm: Arm, plan: ChatPlan, rep: int, model: str) -> dict[str, Any]:
        before = await read_counters(arm.procs)
        records, turns = await run_chat(arm.url, model, plan, self.args.request_timeout_s)
        d = await read_counters(arm.procs) - before
        counters = {p.name: {"role": p.role, **{k: d.metrics[p.name].get(k, 0.0) for k in WORKER_COUNTERS}}
                    for p in arm.workers}
        return {"arm": arm.spec.name, "rep": rep, "records": records, "turns": turns, "workers": counters,
                "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "routes": d.routes, "cpu_s": d.cpu_s,
                "machine_busy_cpu_s": d.busy_s}

    async def main(self) -> dict[str, Any]:
        print(f"arms: {', '.join(a.name for a in self.arms)}; model {self.model_dir}", flush=True)
        for a in self.arms:
            a.start()
        try:
            await asyncio.gather(*(a.wait_ready() for a in self.arms))
            print(f"arms ready after {self.elapsed():.0f}s", flush=True)
            model = await served_model(self.arms[0].url)
            await self.warm_up(model)
            await self.repetitions(model)
        finally:
            for a in self.arms:
                a.stop()
        return self.assemble()

    async def warm_up(self, model: str) -> None:
        """One short conversation per arm, with its own system prompt (it shares nothing with the runs)."""
        spec = ChatSpec("warmup", 1, 2, 64, (16, 16), 4, rate=1.0, think_s=0.0, seed=999)
        plan = plan_chat(spec, self.count_tokens)
        for a in self.arms:
            recs, _ = await run_chat(a.url, model, plan, self.args.request_timeout_s)
            bad = [r.error for r in recs if not r.ok]
            if bad or len(recs) != spec.turns:
                raise RuntimeError(f"{a.name}: the warm-up conversation failed: {bad}")

    async def repetitions(self, model: str) -> None:
        took = 0.0
        for rep in range(self.args.reps):
            left = self.args.budget_s - self.elapsed()
            if rep and took > left:
                print(f"skip rep {rep}: ~{took:.0f}s needed, {left:.0f}s left", flush=True)
                self.skipped.append(rep)
                continue
            t = time.monotonic()
            spec = ChatSpec(**{**asdict(self.chat), "seed": self.chat.seed + 1000 * rep})
            plan = plan_chat(spec, self.count_tokens)
            reference: dict[int, str] = {}
            for arm in rotated(self.arms, rep):
                run = await self.run_one(arm, plan, rep, model)
                # Greedy: every arm must stream the text the first arm to run it streamed.
                run["text_mismatches"] = text_mismatches(run["records"], reference)
                self.runs.append(run)
                sm = summarize_run(run)
                print(f"[{self.elapsed():5.0f}s] rep {rep} {arm.name}: TTFT first p50 "
                      f"{sm['ttft_first']['p50']:.3f}s later p50 {sm['ttft_later']['p50']:.3f}s, ITL p50 "
                      f"{sm['itl']['p50']:.3f}s, hit {sm['hit_rate']:.2f}, KV/req "
                      f"{sm['kv_bytes_per_request'] / 2**20:.2f} MiB, errors {sm['errors']}", flush=True)
                await asyncio.sleep(0.5)
            took = time.monotonic() - t

    def assemble(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            recs = run["records"]
            runs.append({k: v for k, v in run.items() if k not in ("records", "turns")}
                        | {"summary": summarize_run(run),
                           "records": [r.to_dict() | {"turn": run["turns"].get(r.index)} for r in recs]})
        return {
            "started_utc": self.stamp, "wall_s": self.elapsed(), "quick": self.args.quick,
            "host": {**self.host, "loadavg_at_start": self.host["loadavg"], "loadavg_at_end": host_info()["loadavg"]},
            "model": {"params": model_params(MODEL), **MODEL, "dtype": "float32",
                      "kv_bytes_per_token": KV_BYTES_PER_TOKEN},
            "workload": asdict(self.chat), "short_prompt_threshold": SHORT_PROMPT,
            "arms": [a.name for a in self.arms], "arm_specs": {s.name: asdict(s) for s in self.specs},
            "skipped_reps": self.skipped, "runs": runs,
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=None, help="a subset of the arms, by name with dashes")
    p.add_argument("--reps", type=int, default=3, help="repetitions, while the budget allows")
    p.add_argument("--budget-s", type=float, default=900.0,
                   help="stop starting repetitions past this (the first always runs)")
    p.add_argument("--request-timeout-s", type=float, default=180.0)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of the whole pipeline")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md or the figure")


def run(args: argparse.Namespace) -> dict:
    result = asyncio.run(MultiTurn(args).main())
    markdown = None if (args.no_markdown or args.quick) else ROOT / "BENCHMARKS.md"
    for path in write_outputs(result, Path(args.out_dir), markdown):
        print(f"wrote {path}")
    return summary_json(result)
