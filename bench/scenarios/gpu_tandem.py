"""Tandem itself on one GPU: its own workers and router, colocated against disaggregated.

The arms are real `tandem worker` and `tandem router` processes (the same CLIs a pod runs), on a
random-initialised Llama built on the device in Hugging Face format (no download):

  colocated       one colocated worker owning the GPU's KV memory, behind a router
  disaggregated   a prefill worker and a decode worker SHARING the one GPU (half the KV memory
                  each), KV handed off over NIXL (UCX: CUDA IPC between the two processes)

What one GPU can and cannot show: the two disaggregated processes time-slice the same SMs and HBM
(no MPS), so a decode step can run between the prefill process's kernels instead of waiting for a
whole prefill, but decode gets no capacity of its own and the handoff is a device-local copy, not a
network transfer. It measures Tandem's scheduling, handoff and streaming on real hardware, not the
two-pool cluster; the gpu_engine scenario checks the CUDA path's parity and the HBM bound.

Two loads per arm, from the CPU benchmark's load generator (bench/lib/loadgen.py):
  interference   prompts of 2k-8k tokens, 128 output tokens, Poisson arrivals
  decode         32 streams in flight, 256-token prompts, 256 output tokens (throughput)

    python -m bench gpu_tandem                                      (bench/gpu/run_h200.sh)
    python -m bench gpu_tandem --shape tiny --device cpu --dtype float32 --kv-backend tcp  (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.lib.arms import Arm, ArmSpec
from bench.lib.processes import BenchProcess

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 8.0B parameters, 128 KiB of bf16 KV per token.
    "llama-3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, inter=14336, vocab=128256,
                         rope_theta=500000.0, max_len=16384),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, inter=256, vocab=1000, rope_theta=10000.0,
                 max_len=4096),
}


def build_model(path: Path, shape: str, device: str, dtype: str) -> Path:
    """A random Llama in HF format, weights drawn on `device` (an 8B model in seconds on a GPU)."""
    import torch
    from safetensors.torch import save_file
    from tandem.worker.local.toy_model import toy_tokenizer
    from transformers import LlamaConfig

    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    tok = toy_tokenizer()
    tok.save_pretrained(path)
    LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"], max_position_embeddings=s["max_len"],
                rope_theta=s["rope_theta"], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                torch_dtype=dtype).save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(0)
    dt = getattr(torch, dtype)
    h, d = s["hidden"], s["hidden"] // s["heads"]

    def w(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=dt) * 0.02).cpu()

    weights = {"model.embed_tokens.weight": w(s["vocab"], h), "model.norm.weight": torch.ones(h, dtype=dt),
               "lm_head.weight": w(s["vocab"], h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(s["heads"] * d, h),
            p + "self_attn.k_proj.weight": w(s["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": w(s["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": w(h, s["heads"] * d),
            p + "mlp.gate_proj.weight": w(s["inter"], h),
            p + "mlp.up_proj.weight": w(s["inter"], h),
            p + "mlp.down_proj.weight": w(h, s["inter"]),
            p + "input_layernorm.weight": torch.ones(h, dtype=dt),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dt),
        }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def run_load(url: str, model: Path, spec: Any) -> dict[str, Any]:
    from bench.lib.loadgen import run_workload, token_counter
    from bench.lib.metrics import summarize
    from bench.lib.ready import served_model
    from bench.lib.workload import plan

    reqs = plan(spec, token_counter(model))
    name = asyncio.run(served_model(url))
    records = asyncio.run(run_workload(url, name, spec, reqs, timeout_s=600))
    return summarize(records) | {"texts": {r.index: r.text for r in records if r.ok}}


def step_seconds(worker: BenchProcess) -> dict[str, float]:
    """Mean engine step time from the worker's own histogram."""
    from bench.lib.scrape import mean_delta, parse_prometheus

    m = parse_prometheus(worker.get_text("/metrics"))
    return {"steps": m.get("tandem_worker_step_seconds_count", 0.0),
            "mean_step_s": mean_delta({}, m, "tandem_worker_step_seconds") or float("nan")}


def run_arm(name: str, a: argparse.Namespace, model: Path, out: Path, loads: dict[str, Any]) -> dict[str, Any]:
    layout, fraction = ("gpu-colocated", 0.8) if name == "colocated" else ("gpu-disagg", 0.35)
    gpu = a.device != "cpu"  # a GPU worker takes a share of the free HBM; a CPU smoke run a small fixed pool
    flags = ("--device", a.device, "--max-num-seqs", "64", *(("--kv-memory-fraction", str(fraction)) if gpu else ()))
    arm = Arm(ArmSpec(name, layout, a.dtype, worker_args=flags), model, out / "logs", num_blocks=None if gpu else 2048,
              kv_backend=a.kv_backend, worker_env={} if gpu else {"UCX_TLS": "tcp"})
    result: dict[str, Any] = {"arm": name}
    try:
        for p in arm.plan_processes():  # one at a time: each worker takes its KV share of what is free
            p.start().wait_ready("/ready", a.startup_timeout_s)
        t0 = time.monotonic()
        result["ready_s"] = {w.name: w.ready_after for w in arm.workers}
        for load, spec in loads.items():
            print(f"  {name}: {load} ...", flush=True)
            result[load] = run_load(arm.url, model, spec)
        result["seconds"] = time.monotonic() - t0
        result["steps"] = {w.name: step_seconds(w) for w in arm.workers}
    finally:
        arm.stop()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, default=None, help="where the random model is built "
                   "(default: the run's bench/out folder)")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-backend", default="nixl", choices=["nixl", "tcp"],
                   help="tcp needs a CPU pool (the smoke run); a GPU pool moves over nixl")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(2048, 8192))
    p.add_argument("--rate", type=float, default=1.0, help="interference arrivals per second")
    p.add_argument("--requests", type=int, default=24, help="interference requests per arm")
    p.add_argument("--streams", type=int, default=32, help="decode load: streams in flight")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)


def run(a: argparse.Namespace) -> dict:
    from bench.lib.metrics import ratio
    from bench.lib.workload import WorkloadSpec

    out = Path(a.out_dir)
    os.environ.setdefault("TANDEM_INTERNAL_SECRET", "gpu-bench-" + "s" * 24)  # the arms run with a service secret
    t0 = time.monotonic()
    model = build_model(a.model_dir or out / "model", a.shape, a.device, a.dtype)
    print(f"model ready in {time.monotonic() - t0:.0f}s at {model}", flush=True)
    lo, hi = a.prompt_len
    loads = {
        "interference": WorkloadSpec("interference", "poisson", a.requests, (lo, hi), 128, rate=a.rate),
        "decode": WorkloadSpec("decode", "closed", 2 * a.streams, (256, 256), 256, concurrency=a.streams),
    }
    arms = {arm: run_arm(arm, a, model, out, loads) for arm in ("colocated", "disaggregated")}
    c, d = arms["colocated"], arms["disaggregated"]
    same_text = all(c[n]["texts"].get(i) == t for n in loads for i, t in d[n]["texts"].items())
    ratios = {
        "ttft_p50": ratio(d["interference"]["ttft"]["p50"], c["interference"]["ttft"]["p50"]),
        "itl_p50": ratio(d["interference"]["itl"]["p50"], c["interference"]["itl"]["p50"]),
        "itl_p99": ratio(d["interference"]["itl"]["p99"], c["interference"]["itl"]["p99"]),
        "decode_tokens_per_s": ratio(d["decode"]["output_tokens_per_s"], c["decode"]["output_tokens_per_s"]),
    }
    for arm in arms.values():
        for name in loads:
            arm[name].pop("texts")
    print(json.dumps({"ratios": ratios, "greedy_text_equal_across_arms": same_text}, indent=2), flush=True)
    # In bf16 a different batch mix may flip a near-tie, so equal text is reported, not required
    # (gpu_engine checks parity in fp32); a request that failed is a failed run.
    failed = sum(arm[n]["errors"] for arm in arms.values() for n in loads)
    return {"ok": failed == 0, "shape": a.shape, **SHAPES[a.shape], "device": a.device, "dtype": a.dtype,
            "kv_backend": a.kv_backend, "loads": {n: s.__dict__ for n, s in loads.items()},
            "arms": arms, "ratios_disaggregated_over_colocated": ratios,
            "greedy_text_equal_across_arms": same_text, "wall_s": time.monotonic() - t0}
