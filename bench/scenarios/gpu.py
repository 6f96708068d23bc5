"""Tandem on one GPU: its own workers and router, colocated against disaggregated, then its engine's parity on CUDA.

Two parts (--parts), one result, on a random-initialised Llama built on the device in Hugging Face
format (no download; --shape llama-3.1-8b: 8.0B parameters, 128 KiB of bf16 KV per token):

  arms     real `tandem worker` and `tandem router` processes (bench/lib/arms.py's gpu-colocated
           and gpu-disagg layouts): one colocated worker owning the GPU's KV memory, against a
           prefill and a decode worker SHARING the one GPU, KV over NIXL (UCX: CUDA IPC). Loads
           from bench/lib/loadgen.py: interference (prompts of 2k-8k tokens, 128 out, Poisson) and
           decode (32 streams in flight, 256 in, 256 out). The two disaggregated processes
           time-slice the same SMs and HBM: this measures Tandem's scheduling, handoff and
           streaming on real hardware, not a two-pool cluster.
  parity   (CUDA only) the toy Llama in fp32 (TF32 off), Tandem's paged engine batched against
           transformers' greedy generate, token for token.

The decode step of the model built here against the HBM bound is engine_decode's, on the device:
`python -m bench engine_decode --device cuda --model-dir DIR` (bench/gpu/run_h200.sh runs both).

    python -m bench gpu [--model-dir DIR]                            (bench/gpu/run_h200.sh)
    python -m bench gpu --shape tiny --device cpu --dtype float32 --kv-backend tcp  (a CPU smoke run of the arms)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.arms import Arm, ArmSpec
from bench.lib.hf_generate import generate
from bench.lib.loadgen import run_workload, token_counter
from bench.lib.metrics import ratio, summarize
from bench.lib.ready import served_model
from bench.lib.scrape import read_counters
from bench.lib.workload import WorkloadSpec, plan

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=16384),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=4096),
}


def build_model(path: Path, shape: str, device: str, dtype: str) -> Path:
    """A random Llama in HF format, its weights drawn on `device` (an 8B model in seconds on a GPU)."""
    import torch
    from tandem.worker.local.toy_model import toy_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        tok = toy_tokenizer()
        tok.save_pretrained(path)
        cfg = LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          tie_word_embeddings=False, torch_dtype=dtype)
        torch.manual_seed(0)
        with torch.device(device):
            LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return path


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
        result["ready_s"] = {w.name: w.ready_after for w in arm.workers}
        served = asyncio.run(served_model(arm.url))
        for load, spec in loads.items():
            print(f"  {name}: {load} ...", flush=True)
            records = asyncio.run(run_workload(arm.url, served, spec, plan(spec, token_counter(model)), timeout_s=600))
            result[load] = summarize(records) | {"texts": {r.index: r.text for r in records if r.ok}}
        counted = asyncio.run(read_counters(arm.workers))
        result["steps"] = {n: {"steps": m.get("tandem_worker_step_seconds_count", 0.0),
                               "mean_step_s": counted.mean(n, "tandem_worker_step_seconds") or float("nan")}
                           for n, m in counted.metrics.items()}
    finally:
        arm.stop()
    return result


def arms_part(a: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    os.environ.setdefault("TANDEM_INTERNAL_SECRET", "gpu-bench-" + "s" * 24)  # the arms run with a service secret
    loads = {"interference": WorkloadSpec("interference", "poisson", a.requests, tuple(a.prompt_len), 128, rate=a.rate),
             "decode": WorkloadSpec("decode", "closed", 2 * a.streams, (256, 256), 256, concurrency=a.streams)}
    arms = {arm: run_arm(arm, a, model, out, loads) for arm in ("colocated", "disaggregated")}
    c, d = arms["colocated"], arms["disaggregated"]
    # In bf16 a different batch mix may flip a near-tie: equal text is reported, not required (parity is fp32's).
    same_text = all(c[n]["texts"].get(i) == t for n in loads for i, t in d[n]["texts"].items())
    inter = lambda arm, m, q: arm["interference"][m][q]  # noqa: E731
    ratios = {f"{m}_{q}": ratio(inter(d, m, q), inter(c, m, q)) for m, q in (("ttft", "p50"), ("itl", "p50"), ("itl", "p99"))}
    ratios["decode_tokens_per_s"] = ratio(d["decode"]["output_tokens_per_s"], c["decode"]["output_tokens_per_s"])
    for arm in arms.values():
        for n in loads:
            arm[n].pop("texts")
    print(json.dumps({"ratios": ratios, "greedy_text_equal_across_arms": same_text}, indent=2), flush=True)
    return {"ok": sum(arm[n]["errors"] for arm in arms.values() for n in loads) == 0,
            "loads": {n: s.__dict__ for n, s in loads.items()}, "arms": arms,
            "ratios_disaggregated_over_colocated": ratios, "greedy_text_equal_across_arms": same_text}


def parity(torch) -> dict[str, Any]:
    from tandem.testing.engine_helpers import OfflineEngine
    from tandem.worker.engine.loader import load_model
    from tandem.worker.local.toy_model import make_toy_model

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    d = make_toy_model(Path(tempfile.gettempdir()) / "tandem-toy-gpu", num_layers=4, hidden_size=128,
                       num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512)
    loaded = load_model(str(d), dtype="float32", device="cuda")
    engine = OfflineEngine(loaded=loaded, model=str(d), num_blocks=512, block_size=16, max_num_seqs=8,
                           max_batched_tokens=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 100, 250)]
    got = engine.generate(prompts, 24, "parity")
    rows = [{"prompt_len": len(p), "equal": generate(torch, loaded.model, [p], 24, torch.cuda.synchronize)[0][0] == g}
            for p, g in zip(prompts, got, strict=True)]
    return {"model": "toy llama 4 layers fp32, cuda, tf32 off", "new_tokens": 24, "prompts": rows,
            "all_equal": all(r["equal"] for r in rows), "blocks_leaked": engine.engine.allocator.num_used}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="arms,parity", help="arms, parity (CUDA only), or both")
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
    import torch

    t0 = time.monotonic()
    model = build_model(a.model_dir or Path(a.out_dir) / "model", a.shape, a.device, a.dtype)
    print(f"model ready in {time.monotonic() - t0:.0f}s at {model}", flush=True)
    out: dict[str, Any] = {"shape": a.shape, **SHAPES[a.shape], "device": a.device, "dtype": a.dtype,
                           "kv_backend": a.kv_backend, "torch": torch.__version__}
    parts = a.parts.split(",")
    if "arms" in parts:
        out |= arms_part(a, model, Path(a.out_dir))
    if "parity" in parts and not torch.cuda.is_available():
        print("gpu: no CUDA device: parity is skipped", file=sys.stderr)
        out["parity_error"] = "no CUDA device"
    elif "parity" in parts:
        try:  # recorded, so that the arms' figures are still saved
            out["parity"] = parity(torch)
            print("parity on CUDA:", json.dumps(out["parity"]), flush=True)
        except Exception as e:  # noqa: BLE001
            out["parity_error"] = repr(e)
            print(f"parity failed: {e!r}", file=sys.stderr, flush=True)
    return out | {"wall_s": time.monotonic() - t0}
