"""The handoff parity probe: what one probe costs, how far a good pairing's logprobs stray, and how
far a broken one's do, per dtype.

    python -m bench parity_probe [--dtypes float32 bfloat16] [--probes 20] [--load-streams 8] [--rss-probes 200]

Per dtype, a prefill and a decode worker (the ~42M-parameter engine Llama, TCP, one core each) and
the router's own probe (router/parity_probe.py: the decode worker alone, then prefill -> KV pulled
-> decode, 96 prompt and 8 teacher-forced tokens) run `probes` times on idle workers, then `probes`
times beside a load: `load-streams` long greedy streams on the decode worker and a stream of
prompts on the prefill worker, so the probe's rows share batches (and their kernels' shapes) with
other requests. Then a broken pairing: the same prefill worker with a decode worker of the same
shapes and other weights (seed 1), `probes` / 4 times. Reported: the probe's seconds and the largest
|logprob difference| per probe (its distribution), idle, loaded and broken, against the router's
tolerance for that dtype (router/parity.py TOLERANCE). `ok` is false when a good pairing ever
exceeds the tolerance or a broken one stays within it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random

from bench.lib.metrics import distribution
from bench.lib.models import engine_model_dir
from bench.lib.processes import worker_process
from bench.lib.ready import wait_ready


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--probes", type=int, default=20, help="probes per phase (idle, loaded)")
    parser.add_argument("--load-streams", type=int, default=8, help="decode streams beside the loaded probes")
    parser.add_argument("--rss-probes", type=int, default=0,
                        help="then this many more idle probes with both workers' RSS read after each: a leak grows "
                             "by the same amount every probe, a cache stops growing (0: skip)")


def _random_request(request_id: str, *, prompt_tokens: int, max_tokens: int) -> dict:
    """A greedy internal request over random token ids that runs exactly `max_tokens` (EOS ignored)."""
    return {"request_id": request_id, "prompt_token_ids": [random.randrange(3, 256) for _ in range(prompt_tokens)],
            "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


async def _decode_load(session, url: str, stop: asyncio.Event, n: int) -> None:
    """n greedy streams of 256 tokens on the decode worker, restarted until `stop`."""
    async def one(i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            body = _random_request(f"load-{i}-{k}", prompt_tokens=64, max_tokens=256)
            with contextlib.suppress(Exception):
                async with session.post(url + "/internal/generate", json=body) as r:
                    async for _ in r.content:
                        if stop.is_set():
                            break

    await asyncio.gather(*(one(i) for i in range(n)))


async def _prefill_load(session, url: str, stop: asyncio.Event) -> None:
    """Prompts of 200 tokens on the prefill worker, one after another, each lease freed at once."""
    k = 0
    while not stop.is_set():
        k += 1
        body = _random_request(f"pload-{k}", prompt_tokens=200, max_tokens=4)
        with contextlib.suppress(Exception):
            async with session.post(url + "/internal/prefill", json=body) as r:
                res = await r.json()
            token = (res.get("kv") or {}).get("lease_token")
            await session.post(url + "/internal/abort", json={"request_id": body["request_id"], "lease_token": token})


def _rss_mib(proc) -> float:
    ps = proc.ps()
    return round(ps.memory_info().rss / 2**20, 1) if ps else float("nan")


async def _rss_series(client, pair, tolerance: float, n: int, procs: dict) -> dict:
    """n idle probes, each worker's RSS (MiB) before the first and after each; growth per probe over
    each quarter of the series (a leak: about equal in every quarter; a cache: falling to 0)."""
    from tandem.router.parity_probe import run_probe

    series = {name: [_rss_mib(p)] for name, p in procs.items()}
    for _ in range(n):
        await run_probe(client, pair, tolerance, timeout_s=60)
        for name, p in procs.items():
            series[name].append(_rss_mib(p))
    q = max(1, n // 4)
    per_probe = {name: [round((s[min(n, (i + 1) * q)] - s[i * q]) / q, 3) for i in range(4)]
                 for name, s in series.items()}
    return {"probes": n, "rss_mib": series, "growth_mib_per_probe_by_quarter": per_probe}


async def _probes(client, pair, tolerance: float, n: int) -> dict:
    from tandem.router.parity_probe import run_probe

    results = [await run_probe(client, pair, tolerance, timeout_s=60) for _ in range(n)]
    diffs = [r.max_abs_diff for r in results if r.max_abs_diff is not None]
    return {"seconds": distribution([r.seconds for r in results]), "max_abs_diff": distribution(diffs),
            "outcomes": {o: sum(r.outcome.value == o for r in results) for o in ("match", "mismatch", "error")},
            "errors": sorted({r.message for r in results if r.outcome.value == "error"})[:3]}


def _other_model_dir():
    """ENGINE_MODEL's shapes and tokenizer with other weights (seed 1): a broken pairing."""
    import hashlib
    import json

    from tandem.worker.local.toy_model import make_toy_model

    from bench.lib.models import ENGINE_MODEL, cache_root

    cfg = {**ENGINE_MODEL, "seed": 1}
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    return make_toy_model(cache_root() / "models" / f"engine-llama42m-{key}", **cfg)


async def _one_dtype(dtype: str, args: argparse.Namespace) -> dict:
    import aiohttp
    from tandem.contracts.names import Role
    from tandem.router.parity import Pair, tolerance_for
    from tandem.router.policies.base import WorkerView
    from tandem.router.worker_client import HttpWorkerClient

    specs = (("prefill", "prefill", engine_model_dir(), 0), ("decode", "decode", engine_model_dir(), 1),
             ("other", "decode", _other_model_dir(), 0))
    procs = [worker_process(f"{name}-{dtype}", role, model, args.out_dir / f"{name}-{dtype}.log", cpu,
                            "--dtype", dtype) for name, role, model, cpu in specs]
    for p in procs:
        p.start()
    try:
        await wait_ready(procs)
        prefill = WorkerView(procs[0].url, Role.PREFILL, dtype=dtype)
        pair = Pair(prefill, WorkerView(procs[1].url, Role.DECODE, dtype=dtype), frozenset())
        broken_pair = Pair(prefill, WorkerView(procs[2].url, Role.DECODE, dtype=dtype), frozenset())
        tolerance = tolerance_for(dtype)
        async with aiohttp.ClientSession() as session:
            client = HttpWorkerClient(session)
            idle = await _probes(client, pair, tolerance, args.probes)
            broken = await _probes(client, broken_pair, tolerance, max(1, args.probes // 4))
            stop = asyncio.Event()
            load = asyncio.gather(_decode_load(session, procs[1].url, stop, args.load_streams),
                                  _prefill_load(session, procs[0].url, stop))
            await asyncio.sleep(2.0)  # the load is running before the first probe
            loaded = await _probes(client, pair, tolerance, args.probes)
            stop.set()
            await load
            rss = (await _rss_series(client, pair, tolerance, args.rss_probes,
                                     {"prefill": procs[0], "decode": procs[1]}) if args.rss_probes else None)
    finally:
        for p in procs:
            p.stop()
    return {"tolerance": tolerance, "idle": idle, "loaded": loaded, "broken": broken, "rss": rss}


def run(args: argparse.Namespace) -> dict:
    out = {dtype: asyncio.run(_one_dtype(dtype, args)) for dtype in args.dtypes}
    ok = all(phase["outcomes"]["mismatch"] == 0 and phase["outcomes"]["error"] == 0
             for r in out.values() for phase in (r["idle"], r["loaded"]))
    ok = ok and all(r["broken"]["outcomes"]["match"] == 0 for r in out.values())  # never passes a broken pair
    return {"ok": ok, "dtypes": out, "probes": args.probes, "load_streams": args.load_streams,
            "note": "noisy: shared 2-core machine; seconds are wall time of one probe (2 model paths, 1 pull)"}
