"""The engine in-process on one CPU thread: decode step time at batch 1 against the
memory-bandwidth bound, and at batch N against transformers' generate; fp32 and bf16 (prefill
against the matmul rate: the prefill scenario).

    python -m bench engine_decode [--dtypes float32,bfloat16] [--batches 1,32] [--reps 3]
        [--backends auto,transformers]   # two engines side by side (their step ratio; the native path ran at 07354ca)
        [--device cuda --model-dir DIR]   # on a GPU (bench/gpu/run_h200.sh: the gpu scenario's model)

Model: issue 13's random ~42M-parameter Llama (bench/lib/models.py's ENGINE_MODEL). A decode step must read
every weight once (the tied embedding/output matrix once) and the KV of every context token,
so it takes at least (weight bytes + KV bytes) / DRAM bandwidth; the bandwidth is measured here,
on this thread, by summing a 512 MiB tensor (a read stream, like a step's weight reads; a copy's
read + write rate is reported beside it). transformers and Tandem alternate per repetition
(the cores are shared: read the spread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.lib.hf_generate import step_seconds


def best_of(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(torch, nbytes: int = 512 * 2**20, device: str = "cpu", sync=lambda: None) -> dict[str, float]:
    """Bytes per second one thread (or a device) reads (sum) and moves (copy: read + write counted)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return {"read_bytes_per_s": nbytes / best_of(lambda: (src.sum(), sync())),
            "copy_bytes_per_s": 2 * nbytes / best_of(lambda: (dst.copy_(src), sync()))}


def tandem_step(drv, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    """The engine over the steps where every sequence decodes: the median step in wall seconds and
    in the engine thread's CPU seconds (what the step itself spent; wall adds the time other
    processes held the core), and the host's share of that CPU (everything outside the compiled
    decode graph: scheduling, index tensors, the KV write, sampling, detokenizing)."""
    from tandem.testing.engine_helpers import tokens_of

    engine = drv.engine
    kernels = getattr(engine.runner, "kernels", None)  # None on a path without a compiled step (CUDA)
    graph, graph_cpu = getattr(kernels, "decode_step", None), [0.0]

    def timed_graph(*a):
        c = time.thread_time()
        out = graph(*a)
        graph_cpu[0] += time.thread_time() - c
        return out

    outs = [drv.submit(f"{tag}-{i}", p, new_tokens) for i, p in enumerate(prompts)]
    walls, cpus, graphs = [], [], []
    if graph is not None:
        kernels.decode_step = timed_graph
    try:
        while engine.has_work():
            w, c, graph_cpu[0] = time.perf_counter(), time.thread_time(), 0.0
            n = engine.step()
            if n == len(prompts) and len(outs[0]) > 1:  # decode-only steps after the first token
                walls.append(time.perf_counter() - w)
                cpus.append(time.thread_time() - c)
                graphs.append(graph_cpu[0])
    finally:
        if graph is not None:
            kernels.decode_step = graph
    assert all(len(tokens_of(o)) == new_tokens for o in outs) and engine.allocator.num_used == 0
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "host_share": 1 - sum(graphs) / sum(cpus) if graph is not None else None}


def run_dtype(torch, dtype: str, model_dir: Path, args, bandwidth: dict, sync) -> dict:
    from tandem.testing.engine_helpers import OfflineEngine
    from transformers import AutoModelForCausalLM

    batches = [int(b) for b in args.batches.split(",")]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(args.device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied: counted once
    drvs, out = {}, {"weight_bytes": weight_bytes, "batches": {}, "engine_start_s": {}}
    gen = torch.Generator().manual_seed(0)
    rand = lambda b: [torch.randint(3, 600, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]  # noqa: E731
    for backend in args.backends.split(","):  # each engine's start: loading and, with compile, compiling its step
        t0 = time.perf_counter()
        drvs[backend] = OfflineEngine(model=str(model_dir), dtype=dtype, num_blocks=max(batches) * 12 + 16,
                                      max_num_seqs=max(batches), max_batched_tokens=max(batches) * args.prompt_len,
                                      compile=args.compile, device=args.device, model_backend=backend)
        tandem_step(drvs[backend], rand(min(2, max(batches))), 4, "warm")
        out["engine_start_s"][backend] = time.perf_counter() - t0
    step_seconds(torch, hf, rand(2), 3, sync)
    out["kv_bytes_per_token"] = kv_per_token = next(iter(drvs.values())).engine.layout.bytes_per_token
    for b in batches:
        rows = []
        for rep in range(args.reps):
            prompts, pair = rand(b), {}
            for arm in (["hf", *drvs] if rep % 2 == 0 else [*drvs, "hf"]):
                pair[arm] = (step_seconds(torch, hf, prompts, args.new_tokens, sync) if arm == "hf"
                             else tandem_step(drvs[arm], prompts, args.new_tokens, f"{dtype}-{b}-{rep}-{arm}"))
            pair["load_avg"] = os.getloadavg()[0]
            rows.append(pair)
        # KV read by a step at the median context (prompt + half the output), every sequence
        bound = (weight_bytes + b * (args.prompt_len + args.new_tokens // 2) * kv_per_token) / bandwidth["read_bytes_per_s"]
        hs = [r["hf"] for r in rows]
        res = out["batches"][str(b)] = {"load_avg": [r["load_avg"] for r in rows], "hf_step_s": hs, "bound_s": bound,
                                        "paths": {}}
        for backend in drvs:
            td = [r[backend]["wall_s"] for r in rows]
            cpu, host = [r[backend]["cpu_s"] for r in rows], [r[backend]["host_share"] for r in rows]
            res["paths"][backend] = {"tandem_step_s": td, "tandem_step_cpu_s": cpu, "tandem_host_share": host,
                            "tandem_over_bound": [t / bound for t in td], "hf_over_tandem": [h / t for h, t in zip(hs, td, strict=True)]}
            print(f"{dtype:8s} batch {b:3d} {backend} (started in {out['engine_start_s'][backend]:.1f} s): step {statistics.median(td) * 1e3:6.2f} ms "
                  f"[{min(td) * 1e3:.2f}-{max(td) * 1e3:.2f}], transformers {statistics.median(hs) * 1e3:6.2f} ms; "
                  f"bound {bound * 1e3:.2f} ms -> /bound {statistics.median(td) / bound:.2f}x; CPU/step {statistics.median(cpu) * 1e3:.2f} ms, "
                  f"host {statistics.median([h for h in host if h is not None] or [0]):.1%} of it", flush=True)
        res |= res["paths"][next(iter(drvs))]  # the first path's figures, where the summary reads them
        if len(drvs) == 2:  # the two paths' ratio, rep by rep (they ran side by side)
            a, c = drvs
            res["ratio"] = [r[c]["wall_s"] / r[a]["wall_s"] for r in rows]
            print(f"{dtype:8s} batch {b:3d} {c}/{a} step: {statistics.median(res['ratio']):.3f}", flush=True)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--backends", default="auto", help="engines' model_backend, one or two (auto: the transformers path)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the bound is then the device's bandwidth")
    ap.add_argument("--model-dir", default=None, help="another model folder (default: issue 13's model)")


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.lib.models import engine_model_dir

    torch.set_num_threads(1)
    model_dir = Path(args.model_dir) if args.model_dir else engine_model_dir()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    bandwidth = measure_bandwidth(torch, device=args.device, sync=sync)
    print(f"{args.device}: read {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s, copy (read + write) "
          f"{bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    results = {"device": args.device, "bandwidth": bandwidth, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "compile": args.compile, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        results["dtypes"][dtype] = run_dtype(torch, dtype, model_dir, args, bandwidth, sync)
    results["bandwidth_after"] = measure_bandwidth(torch, device=args.device, sync=sync)
    return results
