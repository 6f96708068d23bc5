"""Measures what one replica can do, for the simulator: Tandem's engine on the bench model, one thread.

    python -m bench calibrate (bench/scenarios/calibrate.py)

Prefill: the time of the one engine step that prefills a prompt of L tokens (L = 128 .. 1024),
best of 2 x --repeats, interleaved; fitted as c + L / mu. Decode: the step time with n = 1..32 sequences running
(prompts of --context tokens, staggered lengths so the batch shrinks one by one); fitted as a + b * n. The model is the one
the multi-turn scenario uses (bench/lib/models.py's MULTITURN_MODEL, ~40M parameters, fp32), the process pinned to one core as the
bench pins each worker. The machine is shared: run it when it is quiet, and read the spread.
"""

from __future__ import annotations

import statistics
from pathlib import Path

PROMPTS = (128, 256, 512, 1024)
BATCHES = (1, 2, 4, 8, 12, 16, 24, 32)  # printed; every size up to MAX_BATCH is measured
MAX_BATCH = 32


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = intercept + slope * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _engine(model_dir: Path, batch: int, context: int):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.engine.loader import load_model

    loaded = load_model(str(model_dir), dtype="float32", device="cpu")
    blocks = batch * (context // 16 + 8) + 16
    return Engine(EngineConfig(model=str(model_dir), num_blocks=max(blocks, 128), block_size=16,
                               max_num_seqs=batch, max_batched_tokens=max(batch * context, 1024)), loaded=loaded)


def measure_decode(eng, steps: list, gen, vocab: int, context: int, per_batch: int, repeats: int) -> dict[int, float]:
    """Step time at every batch size 1..MAX_BATCH: MAX_BATCH sequences whose lengths are staggered,
    so the batch shrinks by one every `per_batch` steps; the median per size within a repeat, the
    least over repeats (others' load on a shared machine only ever adds time)."""
    import torch
    from tandem.testing.engine_helpers import greedy, run_to_completion, submit

    best: dict[int, float] = {}
    for r in range(repeats):
        steps.clear()
        for i in range(MAX_BATCH):
            prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
            submit(eng, f"d{r}-{i}", prompt, greedy(per_batch * (i + 1) + 1))
        run_to_completion(eng)
        by_n: dict[int, list[float]] = {}
        for s, n in steps:
            if n <= MAX_BATCH:  # pure decode steps (a prefill step carries the prompts' tokens)
                by_n.setdefault(n, []).append(s)
        for n, times in by_n.items():
            med = statistics.median(times[1:] if len(times) > 2 else times)
            best[n] = min(best.get(n, med), med)
        print(f"decode repeat {r + 1}/{repeats}: " + ", ".join(
            f"{n}:{best[n] * 1e3:.0f}" for n in sorted(best) if n in BATCHES) + " ms", flush=True)
    return dict(sorted(best.items()))


def measure(model_dir: Path, repeats: int, context: int, decode_steps: int) -> dict:
    import torch
    from tandem.testing.engine_helpers import greedy, run_to_completion, submit

    gen = torch.Generator().manual_seed(0)
    eng = _engine(model_dir, MAX_BATCH, context + decode_steps * MAX_BATCH + max(PROMPTS))
    vocab = 500
    steps: list[tuple[float, int]] = []
    eng.on_step = lambda s, n: steps.append((s, n))
    submit(eng, "warm", torch.randint(3, vocab, (64,), generator=gen).tolist(), greedy(4))
    run_to_completion(eng)
    prefill: dict[int, float] = {}
    for r in range(2 * repeats):  # interleaved, so a busy spell on the machine hits every length alike
        for length in PROMPTS:
            steps.clear()
            submit(eng, f"p{length}-{r}", torch.randint(3, vocab, (length,), generator=gen).tolist(), greedy(1))
            run_to_completion(eng)
            took = next(s for s, n in steps if n >= length)
            prefill[length] = min(prefill.get(length, took), took)
    for length, took in prefill.items():
        print(f"prefill {length:5d} tokens: {took * 1e3:8.1f} ms (best of {2 * repeats})", flush=True)
    decode = measure_decode(eng, steps, gen, vocab, context, decode_steps, repeats)
    c, per_token = fit_line([float(x) for x in prefill], list(prefill.values()))
    a, b_ = fit_line([float(x) for x in decode], list(decode.values()))
    decode = {b: decode[b] for b in decode}
    return {"prefill_seconds": {str(k): v for k, v in prefill.items()},
            "decode_step_seconds": {str(k): v for k, v in decode.items()},
            "fit": {"prefill_overhead_s": c, "prefill_tokens_per_s": 1.0 / per_token,
                    "decode_step_base_s": a, "decode_step_per_seq_s": b_}}


def merge(old: dict, new: dict) -> dict:
    """Per point, the lesser time of two runs (load from others only ever adds time); refitted."""
    out = dict(new)
    for key in ("prefill_seconds", "decode_step_seconds"):
        out[key] = {k: min(v, old.get(key, {}).get(k, v)) for k, v in new[key].items()}
    pre, dec = out["prefill_seconds"], out["decode_step_seconds"]
    c, per_token = fit_line([float(x) for x in pre], list(pre.values()))
    a, b = fit_line([float(x) for x in dec], list(dec.values()))
    out["fit"] = {"prefill_overhead_s": c, "prefill_tokens_per_s": 1.0 / per_token,
                  "decode_step_base_s": a, "decode_step_per_seq_s": b}
    out["runs"] = old.get("runs", 1) + 1
    return out
