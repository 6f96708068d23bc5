"""Prefill throughput in-process on one CPU thread: prompt tokens per second, Tandem's engine
against transformers' forward pass, at prompt lengths of 128 to 8k tokens (issue 23 point 1).

    taskset -c 0 python -m bench prefill [--lengths 128,512,2048,8192] [--dtypes bfloat16] [--reps 3]
        [--chunks 0,256]      # Tandem arms: 0 = the whole prompt in one step (a prefill worker),
                              # N = N-token chunks (a colocated or decode worker's default 256)
        [--profile]           # torch.profiler's top operators of one Tandem prefill at --profile-len

Beside each length: the FLOPs of its prefill at the engine's own matmul rate measured in the run
(oneDNN, prepacked, at a prefill-sized batch): how close prefill comes to the hardware.

Model: issue 13's random ~42M Llama (bench/lib/models.py) with an 8k context. One prompt at a time,
prefix cache off, its first token sampled (Tandem: steps until the first token; transformers:
`model(ids, logits_to_keep=1)`, as the engine computes only the last row). Arms rotate per
repetition; each figure is given in wall seconds and in the thread's CPU seconds (the machine is
shared: CPU time is what the arm itself spent, wall adds the time other processes held the core).
vLLM is not an arm here: its prefill is measured through its server by `curves` (TTFT against
prompt length), as a client sees it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.lib.arms import rotated


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def engines(model_dir, dtype: str, chunks: list[int], longest: int) -> dict:
    """An engine per Tandem arm: 0 = the whole prompt in one step, N = N-token chunks."""
    from tandem.testing.engine_helpers import OfflineEngine

    return {"tandem" + (f"-c{chunk}" if chunk else ""): OfflineEngine(
        model=str(model_dir), dtype=dtype, num_blocks=longest // 16 + 8, max_num_seqs=1, max_batched_tokens=longest,
        prefill_chunk_tokens=chunk or None, prefix_caching=False, compile="off") for chunk in chunks}


def matmul_rate(torch, dtype: str, m: int = 1024, k: int = 512, n: int = 1536) -> float:
    """FLOP/s of the engine's matmul (oneDNN, prepacked) at a prefill-sized batch: the hardware's rate."""
    from tandem.worker.engine.hf.packed_linears import PackedLinear

    lin = PackedLinear(torch.randn(n, k, dtype=getattr(torch, dtype)))
    x = torch.randn(m, k, dtype=getattr(torch, dtype))
    return 2 * m * k * n / min(timed(lambda: lin(x))[1] for _ in range(6))  # CPU seconds: what it cost itself


def prefill_flops(cfg, layer_params: int, n: int) -> float:
    """The matmuls of a prefill of n tokens: every layer weight once per token, and causal attention."""
    head = cfg.hidden_size // cfg.num_attention_heads
    return 2 * n * layer_params + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head * n * n / 2


def run_dtype(torch, dtype: str, model_dir, args) -> dict:
    from transformers import AutoModelForCausalLM

    lengths = [int(n) for n in args.lengths.split(",")]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    arms = engines(model_dir, dtype, [int(c) for c in args.chunks.split(",")], max(lengths))
    gen = torch.Generator().manual_seed(0)

    def hf_forward(prompt):
        with torch.no_grad():
            hf(torch.tensor([prompt]), logits_to_keep=1)

    names = [*arms, "transformers"]
    run_arm = {name: (lambda p, e=e: e.generate([p], 1, f"p{time.monotonic_ns()}")) for name, e in arms.items()}
    run_arm["transformers"] = hf_forward
    for fn in run_arm.values():  # warm: first calls allocate and pick kernels
        fn(torch.randint(3, 600, (64,), generator=gen).tolist())
    rate = matmul_rate(torch, dtype)
    layer_params = sum(p.numel() for name, p in hf.named_parameters() if ".layers." in name and p.dim() == 2)
    result: dict = {"matmul_flops_per_s": rate}
    for n in lengths:
        rows: dict = {name: {"wall_s": [], "cpu_s": []} for name in names}
        loads = []
        for rep in range(args.reps):
            prompt = torch.randint(3, 600, (n,), generator=gen).tolist()
            for name in rotated(names, rep):
                w, c = timed(lambda: run_arm[name](prompt))  # noqa: B023 - called at once
                rows[name]["wall_s"].append(w)
                rows[name]["cpu_s"].append(c)
            loads.append(os.getloadavg()[0])
        flops = prefill_flops(hf.config, layer_params, n)
        result[str(n)] = {"arms": rows, "load_avg": loads, "flops": flops,
                          "tandem_share_of_matmul_rate": flops / rate / statistics.median(rows["tandem"]["cpu_s"])
                          if "tandem" in rows else None}
        print(f"{dtype} {n:5d} tokens (load {min(loads):.1f}-{max(loads):.1f}): " + "; ".join(
            f"{name} {n / statistics.median(r['cpu_s']):7.0f} tok/s cpu [{n / max(r['cpu_s']):.0f}-"
            f"{n / min(r['cpu_s']):.0f}], {n / statistics.median(r['wall_s']):7.0f} wall"
            for name, r in rows.items()) + f"; at the matmul rate {flops / rate:.3f} s", flush=True)
    if args.profile:
        result["profile"] = profile(torch, next(iter(arms.values())), args.profile_len, dtype)
    return result


def profile(torch, engine, n: int, dtype: str) -> list[dict]:
    """The operators of one Tandem prefill of n tokens, by their own CPU time."""
    prompt = [3 + (i * 7919) % 590 for i in range(n)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate([prompt], 1, f"profile-{dtype}")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    top = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
            "calls": e.count} for e in events[:15]]
    print(f"{dtype} prefill of {n} tokens, top operators (self CPU, of {total / 1e6:.2f} s):")
    for t in top:
        print(f"  {t['share']:6.1%} {t['self_cpu_s']:7.3f} s  {t['calls']:5d} calls  {t['op']}")
    return top


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--chunks", default="0,256", help="Tandem arms: 0 = whole prompt, N = N-token chunks")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-len", type=int, default=2048)


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.lib.models import engine_model_dir

    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    model_dir = engine_model_dir(max_positions=max(4096, max(lengths) + 64))  # room for the first token
    return {"lengths": lengths, "reps": args.reps,
            "dtypes": {d: run_dtype(torch, d, model_dir, args) for d in args.dtypes.split(",")}}
