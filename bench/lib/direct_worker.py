"""One `tandem worker` alone, pinned to one core, and streams sent straight to its
/internal/generate (no router): what the engine scenarios measure a worker with."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path

import aiohttp

from bench.lib.handoff import greedy, stream, worker_client
from bench.lib.metrics import percentile
from bench.lib.processes import BenchProcess, thread_env, worker_process

WORKER_CPU, CLIENT_CPU = 0, 1


def prompts_for(n: int, length: int, seed: int) -> list[list[int]]:
    """n random prompts of token ids (the same for a seed in every arm)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 600) for _ in range(length)] for _ in range(n)]


def start_worker(model_dir: Path, dtype: str, log_dir: Path, extra: list[str], name: str = "tandem",
                 env: dict[str, str] | None = None) -> BenchProcess:
    """`tandem worker --role colocated` pinned to WORKER_CPU, one thread (env PYTHONPATH=... runs
    another tree)."""
    p = worker_process(f"{name}-{dtype}", "colocated", model_dir, log_dir / f"{name}-{dtype}.log", WORKER_CPU,
                       "--dtype", dtype, *extra)
    return p.start(os.environ | thread_env(1) | (env or {}))


def stream_figures(arrivals: list[list[float]], n: int, new: int) -> dict:
    """From each stream's arrival times (seconds since the first send) of its `new` tokens: tokens/s
    (first send to last token), the median gap (the step), the p99 gap and the latest first token."""
    wall, gaps = max(a[-1] for a in arrivals), [b - a for t in arrivals for a, b in zip(t, t[1:], strict=False)]
    return {"tokens_per_s": n * new / wall, "step_s": statistics.median(gaps), "wall_s": wall,
            "gap_p99_s": percentile(gaps, 99), "ttft_max_s": max(a[0] for a in arrivals)}


async def concurrent_streams(url: str, n: int, plen: int, new: int, seed: int) -> dict:
    """n streams at once straight to a worker's /internal/generate."""
    async with worker_client() as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream(client, url, greedy(p, new)) for p in prompts_for(n, plen, seed)))
    if bad := [len(s.token_times) for s in streams if len(s.token_times) != new]:
        raise RuntimeError(f"expected {new} tokens in each of {n} streams, got {bad[:3]}")
    return stream_figures([[t - t0 for t in s.token_times] for s in streams], n, new)


async def openai_streams(url: str, model: str, n: int, plen: int, new: int, seed: int) -> dict:
    """The same n streams through an OpenAI server's /v1/completions (token-id prompts, greedy,
    ignore_eos): how a peer such as vLLM is measured beside a worker."""
    from bench.lib.loadgen import greedy_body, stream_into
    from bench.lib.metrics import RequestRecord

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(stream_into(s, f"{url}/v1/completions", greedy_body(model, new, prompt=p),
                                                  RequestRecord(i, plen, new), t0, 600.0)
                                      for i, p in enumerate(prompts_for(n, plen, seed))))
    if bad := [r.error for r in recs if not r.ok or r.output_tokens != new]:
        raise RuntimeError(f"{len(bad)} of {n} streams failed or came short: {bad[:2]}")
    return stream_figures([r.chunk_times_s for r in recs], n, new)
