"""Measures what one worker can do: prefill time by prompt length, decode step time by batch size.

Tandem's engine runs in this process on the model, dtype and threads given (the caller pins the
process as the worker will be pinned). Prefill: the one engine step that prefills a prompt of L
tokens, best of 2 x repeats, interleaved; fitted as c + L / mu. Decode: the step time with n = 1..N
sequences running (staggered lengths, so the batch shrinks by one every few steps); the median per
size within a repeat, the least over repeats (others' load on a shared machine only ever adds time).
The result is a calibration (capacity.py reads it; `tandem plan --calibration` takes the file).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.testing.engine_helpers import OfflineEngine

PROMPTS = (128, 256, 512, 1024)
BATCHES = (1, 2, 4, 8, 12, 16, 24, 32)  # printed; every size up to max_batch is measured
MAX_BATCH = 32


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = intercept + slope * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def fitted(prefill: dict, decode: dict) -> dict:
    """The calibration's fit: prefill c + L / mu, decode a + b * n."""
    c, per_token = fit_line([float(x) for x in prefill], [float(v) for v in prefill.values()])
    a, b = fit_line([float(x) for x in decode], [float(v) for v in decode.values()])
    return {"prefill_overhead_s": c, "prefill_tokens_per_s": 1.0 / per_token,
            "decode_step_base_s": a, "decode_step_per_seq_s": b}


def _engine(model_dir: Path, dtype: str, max_batch: int, context: int, compile: str) -> OfflineEngine:
    """The engine as a worker of this model and dtype runs it, with room for max_batch sequences."""
    blocks = max_batch * (context // 16 + 8) + 16
    return OfflineEngine(model=str(model_dir), dtype=dtype, device="cpu", num_blocks=max(blocks, 128), block_size=16,
                         max_num_seqs=max_batch, max_batched_tokens=max(max_batch * context, 1024), compile=compile)


def measure_decode(drv: OfflineEngine, rand: Callable[[int], list[int]], context: int, per_batch: int, repeats: int,
                   max_batch: int, say: Callable[[str], None]) -> dict[int, float]:
    """Step time at every batch size 1..max_batch (see the module docstring)."""
    best: dict[int, float] = {}
    for r in range(repeats):
        for i in range(max_batch):
            drv.submit(f"d{r}-{i}", rand(context), per_batch * (i + 1) + 1)
        by_n: dict[int, list[float]] = {}
        for s, n in drv.run():
            if n <= max_batch:  # pure decode steps (a prefill step carries the prompts' tokens)
                by_n.setdefault(n, []).append(s)
        for n, times in by_n.items():
            med = statistics.median(times[1:] if len(times) > 2 else times)
            best[n] = min(best.get(n, med), med)
        say(f"decode repeat {r + 1}/{repeats}: " + ", ".join(
            f"{n}:{best[n] * 1e3:.0f}" for n in sorted(best) if n in BATCHES) + " ms")
    return dict(sorted(best.items()))


def measure(model_dir: Path, *, dtype: str = "float32", repeats: int = 2, context: int = 256,
            decode_steps: int = 8, max_batch: int = MAX_BATCH, prompts: tuple[int, ...] = PROMPTS,
            compile: str = "auto", say: Callable[[str], None] = print) -> dict[str, Any]:
    """A calibration of the model at `model_dir` on this process's threads (see the module docstring);
    `compile` as the worker's setting (auto: the decode step compiled where a C++ compiler is)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    drv = _engine(model_dir, dtype, max_batch, context + decode_steps * max_batch + max(prompts), compile)

    def rand(n: int) -> list[int]:
        return torch.randint(3, min(500, drv.engine.vocab_size), (n,), generator=gen).tolist()

    drv.submit("warm", rand(64), 4)
    drv.run()
    prefill: dict[int, float] = {}
    for r in range(2 * repeats):  # interleaved, so a busy spell on the machine hits every length alike
        for length in prompts:
            drv.submit(f"p{length}-{r}", rand(length), 1)
            took = next(s for s, n in drv.run() if n >= length)
            prefill[length] = min(prefill.get(length, took), took)
    for length, took in prefill.items():
        say(f"prefill {length:5d} tokens: {took * 1e3:8.1f} ms (best of {2 * repeats})")
    decode = measure_decode(drv, rand, context, decode_steps, repeats, max_batch, say)
    return {"prefill_seconds": {str(k): v for k, v in prefill.items()},
            "decode_step_seconds": {str(k): v for k, v in decode.items()},
            "fit": fitted(prefill, decode), "dtype": str(drv.engine.pool.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "compile": compile,
            "context": context, "torch": torch.__version__}


def measure_pinned(model_dir: Path, cpus: set[int] | None = None, threads: int = 1, **options: Any) -> dict[str, Any]:
    """measure() as a worker pinned to `cpus` with `threads` compute threads runs: this process is
    pinned first (every thread it starts inherits the mask); the result says where and when, and how
    busy the machine was before and after (a shared machine only ever adds time)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by OpenMP when torch first loads
    import torch

    torch.set_num_threads(threads)
    t0, load_before = time.time(), os.getloadavg()[0]
    cal = measure(model_dir, **options)
    return cal | {"cpus": sorted(cpus or os.sched_getaffinity(0)), "load_average_before": load_before,
                  "load_average_after": os.getloadavg()[0], "measured_at_unix": int(t0),
                  "wall_s": round(time.time() - t0, 1)}


def merge(old: dict, new: dict) -> dict:
    """Per point, the lesser time of two runs (load from others only ever adds time); refitted."""
    out = dict(new)
    for key in ("prefill_seconds", "decode_step_seconds"):
        out[key] = {k: min(v, old.get(key, {}).get(k, v)) for k, v in new[key].items()}
    out["fit"] = fitted(out["prefill_seconds"], out["decode_step_seconds"])
    out["runs"] = old.get("runs", 1) + 1
    return out
