"""Chaos soak: steady streaming load while a random worker or router is killed every 20-40 s
(SIGKILL or SIGTERM) and restarted; counts what became of every request and what was left behind.

    python -m bench chaos [--duration-s 600] [--kv-backend nixl] [--streams 6]

Two prefill workers, two decode workers and two routers (each router over all four workers: the
chaos layout of bench/lib/arms.py) on loopback, fp32 (greedy text is then the same in every path), the multi-turn scenario's 40M model.
First every prompt of the pool runs once undisturbed (its text is the answer); then --streams
clients loop over the pool, alternating the routers, while the chaos loop picks a process that is
up and ready, signals it, waits for it to exit and starts it again on the same port. Every request
is classified (bench/lib/chaos_outcomes.py): identical, clean error (retryable), refused (a 4xx a
client takes as final), truncated, wrong text, hung (target: 0 of the last four). After the load stops and the restarts are back: KV
blocks held and leases left on every worker (/internal/info, target 0), requests in flight at the
routers, and each process's open file descriptors and RSS at the start and at the end. --spare
keeps processes out of the kills (e.g. decode-0 while prefill workers churn): their fds, RSS and
KV peers are sampled every --watch-s through the soak, growth within one process.

--tp 2 makes every worker a tensor-parallel group of two ranks (rank 0 starts rank 1), and a kill
may then land on a follower rank: the group fails, rank 0's /health says so, and the soak then does
what a kubelet's liveness probe does (SIGTERM rank 0, SIGKILL past the grace, start it again).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from bench.lib.arms import Arm, ArmSpec
from bench.lib.chaos_outcomes import FAILURES, tally
from bench.lib.chaos_report import publish
from bench.lib.loadgen import request_body, run_closed_loop, stream_into, token_counter
from bench.lib.metrics import RequestRecord
from bench.lib.models import MULTITURN_MODEL, bench_model_dir
from bench.lib.processes import BenchProcess
from bench.lib.ready import served_model, wait_ready
from bench.lib.results import ROOT, scenario_settings
from bench.lib.scrape import get_json, scrape
from bench.lib.workload import PlannedRequest, WorkloadSpec, plan

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}


def resources(p: BenchProcess) -> dict[str, float]:
    """Open file descriptors and RSS (MiB) of a process and its children."""
    try:
        ps = psutil.Process(p.pid)
        group = [ps, *ps.children(recursive=True)]
        return {"pid": p.pid, "fds": sum(q.num_fds() for q in group),
                "rss_mib": sum(q.memory_info().rss for q in group) / 2**20}
    except psutil.NoSuchProcess:
        return {"pid": p.pid, "fds": -1, "rss_mib": -1}


class Soak:
    """The load, the chaos loop and the accounting of one soak."""

    def __init__(self, args: argparse.Namespace, procs: list[BenchProcess], model: str,
                 pool: list[PlannedRequest]) -> None:
        self.args, self.procs, self.model, self.pool = args, procs, model, pool
        self.routers = [p for p in procs if p.role == "router"]
        self.rng = random.Random(args.seed)
        self.records: list[RequestRecord] = []
        self.events: list[dict] = []
        self.restarts: set[asyncio.Task] = set()
        self.t0 = time.perf_counter()
        self.stop_load = asyncio.Event()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def client(self, session: aiohttp.ClientSession, turns: itertools.count) -> None:
        """Requests back to back until the load stops, over the pool and the routers in turn."""
        while not self.stop_load.is_set():
            n = next(turns)
            req, router = self.pool[n % len(self.pool)], self.routers[n % len(self.routers)]
            rec = RequestRecord(req.index, req.prompt_tokens_target, req.max_tokens, scheduled_s=self.now())
            await stream_into(session, f"{router.url}/v1/completions", request_body(self.model, req), rec,
                              self.t0, self.args.request_timeout_s, self.args.read_timeout_s)
            self.records.append(rec)
            if rec.error and not rec.timed_out:
                await asyncio.sleep(0.2)  # a client backs off a little before it retries

    async def kill_follower(self, p: BenchProcess, sig: str, event: dict) -> None:
        """Signal p's rank 1, wait for it to exit and for rank 0's /health to fail (the group is
        broken); then rank 0 is restarted as a kubelet would after its liveness probe failed."""
        rank = follower_of(p)
        if rank is None:
            event["restart_error"] = "no follower rank found"
            return
        rank.send_signal(SIGNALS[sig])
        if not await exited(rank, self.args.term_grace_s):  # a follower waits for rank 0 on SIGTERM
            rank.kill()
            await exited(rank, 10.0)
        event["rank_down_s"] = self.now() - event["t_s"]
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + self.args.read_timeout_s
            while time.monotonic() < deadline:
                try:
                    async with s.get(f"{p.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status != 200:
                            event["leader_unhealthy_after_s"] = self.now() - event["t_s"]
                            break
                except (aiohttp.ClientError, TimeoutError):
                    event["leader_unhealthy_after_s"] = self.now() - event["t_s"]
                    break
                await asyncio.sleep(0.5)

    async def restart(self, p: BenchProcess, sig: str, event: dict) -> None:
        """Signal p, wait for it to exit (SIGKILL its group past the grace), start it again, wait ready.
        With event["rank"], the signal goes to p's follower rank, and p is then stopped by SIGTERM."""
        if event.get("rank"):
            await self.kill_follower(p, sig, event)
            sig = "SIGTERM"
        p.signal(SIGNALS[sig])
        try:
            event["exit_code"] = await asyncio.to_thread(p.proc.wait, self.args.term_grace_s)
        except subprocess.TimeoutExpired:  # still running after the grace: what a kubelet does next
            event["exit_code"] = "killed after grace"
        p.kill()  # the whole group: anything it started goes with it
        event["down_s"] = self.now() - event["t_s"]
        await asyncio.sleep(self.args.restart_delay_s)
        p.start()
        try:
            await wait_ready([p], self.args.ready_timeout_s)
            event["back_after_s"] = self.now() - event["t_s"]
        except (RuntimeError, TimeoutError) as e:
            event["restart_error"] = str(e)[:500]

    async def chaos(self) -> None:
        """Every 20-40 s until the end: one process that is up, a random signal, then its restart."""
        end = self.args.duration_s
        while True:
            wait = self.rng.uniform(*self.args.interval_s)
            if self.now() + wait > end:
                await asyncio.sleep(max(0.0, end - self.now()))
                return
            await asyncio.sleep(wait)
            busy = {e["process"] for e in self.events if "back_after_s" not in e and "restart_error" not in e}
            up = [p for p in self.procs if p.name not in busy and p.name not in self.args.spare and p.alive()]
            targets = [(p, "") for p in up] + [(p, "rank-1") for p in up if p.role != "router" and self.args.tp > 1]
            if not targets:
                continue
            (victim, rank), sig = self.rng.choice(targets), self.rng.choice(list(SIGNALS))
            event = {"t_s": self.now(), "process": victim.name, "rank": rank, "signal": sig, "pid": victim.pid}
            self.events.append(event)
            print(f"[{event['t_s']:6.1f}s] {sig} {victim.name}{'/' + rank if rank else ''} (pid {victim.pid}); "
                  f"{len(self.records)} requests so far", flush=True)
            task = asyncio.create_task(self.restart(victim, sig, event))
            self.restarts.add(task)
            task.add_done_callback(self.restarts.discard)

    async def watch(self, series: list[dict]) -> None:
        """Every --watch-s: the spared processes' fds, RSS and KV peers known (growth within one
        process under churn around it, issue 21 item 9), until the load stops."""
        spared = [p for p in self.procs if p.name in self.args.spare]
        async with aiohttp.ClientSession() as s:
            while spared:
                point: dict = {"t_s": round(self.now(), 1)}
                for p in spared:
                    health = await get_json(s, p.url, "/internal/kv/health") if p.role != "router" else {}
                    point[p.name] = {**resources(p), "kv_peers": len(health.get("peers") or {})}
                series.append(point)
                try:
                    await asyncio.wait_for(self.stop_load.wait(), self.args.watch_s)
                    return
                except TimeoutError:
                    pass

    async def run(self) -> dict:
        before = {p.name: resources(p) for p in self.procs}
        series: list[dict] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            turns = itertools.count()
            clients = [asyncio.create_task(self.client(session, turns)) for _ in range(self.args.streams)]
            watcher = asyncio.create_task(self.watch(series))
            await self.chaos()
            await asyncio.gather(*list(self.restarts))
            self.stop_load.set()
            await asyncio.gather(*clients, watcher)
        load_end = self.now()
        left = await settle(self.procs, self.args.settle_s)
        after = {p.name: resources(p) for p in self.procs}
        return {"load_s": load_end, "events": self.events, "left": left, "spared_series": series,
                "resources": {n: {"start": before[n], "end": after[n],
                                  "restarts": sum(e["process"] == n for e in self.events)} for n in before}}


async def exited(proc: psutil.Process, within_s: float) -> bool:
    """Whether `proc` exits within `within_s` (a zombie its parent has not reaped yet counts)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        await asyncio.sleep(0.1)
    return False


def follower_of(p: BenchProcess) -> psutil.Process | None:
    """The rank process a tensor-parallel worker started (`tandem worker ... --rank 1`), if any."""
    try:
        return next((c for c in psutil.Process(p.pid).children(recursive=True) if "--rank" in c.cmdline()), None)
    except psutil.NoSuchProcess:
        return None


async def leftovers(procs: list[BenchProcess]) -> dict[str, dict]:
    """KV blocks held, leases and sequences on every worker; requests in flight at every router."""
    out = {}
    async with aiohttp.ClientSession() as s:
        for p in procs:
            if p.role == "router":
                m = await scrape(s, p.url)
                out[p.name] = {"in_flight": m.get("tandem_requests_in_flight", -1.0)}
            else:
                i = await get_json(s, p.url, "/internal/info")
                out[p.name] = {"blocks_held": i.get("kv_blocks_total", 0) - i.get("kv_blocks_free", 0),
                               "leased": i.get("leased", -1), "running": i.get("running", -1),
                               "waiting": i.get("waiting", -1)} if i else {"unreachable": True}
    return out


async def settle(procs: list[BenchProcess], within_s: float) -> dict:
    """Leftovers as soon as none remain (or after within_s: a lease expires on its own after
    --kv-lease-s, which is what this waits out), with how long it took."""
    t0 = time.monotonic()
    first = await leftovers(procs)
    while True:
        now = await leftovers(procs)
        clean = all(not any(v for k, v in d.items() if k != "unreachable") and not d.get("unreachable")
                    for d in now.values())
        if clean or time.monotonic() - t0 > within_s:
            return {"at_load_end": first, "final": now, "settled_after_s": time.monotonic() - t0, "clean": clean}
        await asyncio.sleep(1.0)


async def reference(url: str, model: str, pool: list[PlannedRequest], concurrency: int,
                    timeout_s: float) -> dict[int, str]:
    """Every prompt once, undisturbed: the text each must stream under chaos (fp32 greedy: the same
    text whatever the batch)."""
    records = await run_closed_loop(url, model, pool, concurrency, timeout_s)
    bad = [(r.index, r.error) for r in records if not (r.ok and r.done)]
    if bad:
        raise RuntimeError(f"the undisturbed run failed: {bad[:3]}")
    return {r.index: r.text for r in records}


async def soak(args: argparse.Namespace) -> dict:
    model_dir = bench_model_dir(MULTITURN_MODEL)
    spec = WorkloadSpec("chaos", "closed", args.pool, tuple(args.prompt_len), args.output_len, concurrency=1,
                        seed=args.seed)
    pool = plan(spec, token_counter(model_dir))
    arm = Arm(ArmSpec("chaos", "chaos", None, worker_args=tuple(args.worker_arg)), model_dir, Path(args.out_dir) / "logs",
              worker_env={"UCX_TLS": os.environ.get("UCX_TLS", "tcp")}, num_blocks=512, kv_backend=args.kv_backend)
    procs = arm.start().procs
    try:
        await wait_ready(procs, args.ready_timeout_s)
        model = await served_model(procs[-1].url)
        expected = await reference(procs[-1].url, model, pool, args.streams, args.request_timeout_s)
        print(f"cluster up, {len(pool)} answers recorded; chaos for {args.duration_s:.0f} s", flush=True)
        soak = Soak(args, procs, model, pool)
        result = await soak.run()
    finally:
        arm.stop(grace_s=5)
    counts = tally(soak.records, expected)
    (Path(args.out_dir) / "records.json").write_text(json.dumps([r.to_dict() for r in soak.records]))
    failed = sum(counts["outcomes"][o.value] for o in FAILURES)
    left = result["left"]["final"]
    leaked = sum(d.get("blocks_held", 0) + max(0, d.get("leased", 0)) for d in left.values())
    return {"ok": failed == 0 and leaked == 0 and result["left"]["clean"], **counts,
            "settings": scenario_settings(args),
            "model": MULTITURN_MODEL, **result}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the chaos lasts (default 10 min)")
    p.add_argument("--interval-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("LO", "HI"),
                   help="seconds between two kills, uniform")
    p.add_argument("--streams", type=int, default=6, help="clients, each with one request in flight")
    p.add_argument("--kv-backend", choices=("nixl", "tcp"), default="nixl")
    p.add_argument("--pool", type=int, default=24, help="distinct prompts the clients cycle through")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 600), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--spare", nargs="*", default=[], metavar="NAME",
                   help="processes never killed (e.g. decode-0: its fds and RSS then show growth under churn)")
    p.add_argument("--watch-s", type=float, default=30.0,
                   help="how often the spared processes' fds, RSS and KV peers are sampled")
    p.add_argument("--tp", type=int, default=1, help="ranks per worker (tensor parallelism); with 2 or more a kill "
                   "may land on a follower rank")
    p.add_argument("--worker-arg", action="append", default=None,
                   help="extra `tandem worker` flags (default --compile=off: restarts in seconds)")
    p.add_argument("--term-grace-s", type=float, default=45.0, help="after SIGTERM, SIGKILL past this")
    p.add_argument("--restart-delay-s", type=float, default=1.0)
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--read-timeout-s", type=float, default=60.0, help="a stream silent this long is hung")
    p.add_argument("--settle-s", type=float, default=120.0, help="wait this long at most for nothing to be left")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite the chaos section of BENCHMARKS.md")


def run(args: argparse.Namespace) -> dict:
    if args.worker_arg is None:
        args.worker_arg = ["--compile=off"]
    if args.tp > 1:
        args.worker_arg += ["--tensor-parallel", str(args.tp)]
    res = asyncio.run(soak(args))
    res["loadavg"] = args.load.summary() if hasattr(args, "load") else None
    o = res["outcomes"]
    print(f"{res['requests']} requests: " + ", ".join(f"{k} {v}" for k, v in o.items())
          + f"; errors by kind {res['errors_by_kind']}; kills {len(res['events'])}; "
          f"left at the end {res['left']['final']} (clean: {res['left']['clean']})", flush=True)
    if not args.no_markdown:
        print(f"wrote {publish(res, args.run_id, ' '.join(['python -m bench', *sys.argv[1:]]), ROOT / 'BENCHMARKS.md')}")
    return res
