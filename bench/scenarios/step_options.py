"""Inductor options for the decode step, A/B paired in one process: the engine's compiled step
against a copy compiled with other options, called alternately on the same inputs; the engine
thread's CPU seconds per call (the same contention falls on both, so a shared machine still ranks
them), and whether their logits are equal.

    taskset -c 0 python -m bench step_options [--dtype bfloat16] [--batch 1] [--calls 400]
        [--options '{"cpp_wrapper": true}']    # the other arm: the engine's options updated with these

Model: issue 13's random ~42M Llama (bench/lib/models.py), one thread. The first call of the other
arm compiles it (minutes on a busy machine, then from inductor's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types


def other_step(torch, weights, options: dict):
    from tandem.worker.engine.decode_step import DecodeStep, step_compile_options

    step = DecodeStep(weights).eval()
    own = DecodeStep.forward.__code__.replace()  # its own code object: its own graphs
    step.forward = types.MethodType(types.FunctionType(own, DecodeStep.forward.__globals__), step)
    return torch.compile(step, dynamic=False, fullgraph=True,
                         options={**step_compile_options(), **options})


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine

    from bench.lib.models import engine_model_dir

    torch.set_num_threads(1)
    b, options = args.batch, json.loads(args.options)
    eng = Engine(EngineConfig(model=str(engine_model_dir()), dtype=args.dtype, num_blocks=b * 12 + 80,
                              max_num_seqs=max(b, 2), max_batched_tokens=2048, compile="on"))
    arms = {"engine": eng.runner.kernels.decode_step, "other": other_step(torch, eng.runner.w, options)}
    pool = eng.pool
    ids, pos = torch.randint(3, 600, (b,)), torch.full((b,), 80)
    tables = torch.arange(b * 6).reshape(b, 6) % pool.shape[0]
    for t, dim in [(tables, 1), (pool, 0)] + ([(ids, 0), (pos, 0), (tables, 0)] if b > 1 else []):
        torch._dynamo.mark_dynamic(t, dim)  # as the engine's warm-up marks them
    with torch.inference_mode(), fx_config.patch(use_duck_shape=False), \
            inductor_config.patch(realize_opcount_threshold=4 if b == 1 else inductor_config.realize_opcount_threshold):
        t0 = time.monotonic()
        outs = {name: fn(ids, pos, tables, pool) for name, fn in arms.items()}
        compile_s = time.monotonic() - t0
        cpu: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(args.calls):
            for name in (("engine", "other") if i % 2 == 0 else ("other", "engine")):
                c = time.thread_time()
                arms[name](ids, pos, tables, pool)
                cpu[name].append(time.thread_time() - c)
    med = {name: statistics.median(v) for name, v in cpu.items()}
    diff = (outs["engine"][0] - outs["other"][0]).abs().max().item()
    print(f"{args.dtype} batch {b}: engine {med['engine'] * 1e3:.3f} ms, {options} {med['other'] * 1e3:.3f} ms CPU "
          f"per call: other/engine {med['other'] / med['engine']:.3f}; logits max difference {diff:.3g}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    return {"dtype": args.dtype, "batch": b, "options": options, "cpu_s": cpu, "median_cpu_s": med,
            "other_over_engine": med["other"] / med["engine"], "logits_max_abs_diff": diff,
            "compile_s": compile_s, "load_avg": os.getloadavg()[0]}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--options", default='{"cpp_wrapper": true}', help="JSON: inductor options for the other arm")
