"""Decode throughput of the Tandem engine against transformers' generate, and decode step time at
batch 1 against the memory-bandwidth bound, on one CPU thread (or the GPU when asked).

    .venv/bin/python -m bench.engine_decode [--out bench/out/engine_decode.json]

Model: a random ~40M-parameter Llama (8 layers, hidden 512, 8 heads / 4 KV heads, fp32) built by
tandem.worker.local.toy_model. Throughput = output tokens / wall time of the whole request (prefill
included), the same measure for both. Step time = time per decode step once prompts are in.
The bound: one decode step must read every weight once, so it takes at least model bytes /
DRAM bandwidth, measured here by copying a large tensor (bandwidth counts read + write bytes).
Not a test: it prints ratios and writes them to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def measure_copy_bandwidth(torch, nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second moved (read + write) by a large tensor copy: the DRAM bandwidth one thread gets."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def hf_generate(torch, model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for transformers' generate to produce new_tokens for every prompt (one batch)."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        dt = time.perf_counter() - t0
    assert out.shape == (len(prompts), ids.shape[1] + new_tokens)
    return dt


def tandem_generate(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[float]]:
    """Seconds for the engine to finish every prompt, and the durations of its pure decode steps."""
    from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of

    steps: list[tuple[float, int]] = []
    engine.on_step = lambda s, n: steps.append((s, n))
    t0 = time.perf_counter()
    outs = [submit(engine, f"{tag}-{i}", p, greedy(new_tokens)) for i, p in enumerate(prompts)]
    run_to_completion(engine)
    dt = time.perf_counter() - t0
    assert all(len(tokens_of(o)) == new_tokens for o in outs)
    assert engine.allocator.num_used == 0
    decode = [s for s, n in steps if n == len(prompts)][1:]  # steps where every sequence decodes
    return dt, decode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/engine_decode.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-dir", default=None, help="reuse a model folder (default: a temp one)")
    args = ap.parse_args(argv)

    import torch
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    from tandem.worker.engine.loader import load_model
    from tandem.worker.local.toy_model import make_toy_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "tandem-bench-llama-40m")
    make_toy_model(model_dir, num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                   intermediate_size=1408, vocab_size=16384, max_position_embeddings=2048, seed=0)
    dev = torch.device(args.device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    loaded = load_model(str(model_dir), dtype="float32", device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=max(batches) * 8 + 16, block_size=16,
                                 max_num_seqs=max(batches), max_batched_tokens=max(batches) * args.prompt_len),
                    loaded=loaded)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size

    bandwidth = measure_copy_bandwidth(torch) if dev.type == "cpu" else None
    results: dict = {
        "model": {"params": n_params, "bytes": model_bytes, "layers": 8, "hidden": 512, "kv_heads": 4,
                  "dtype": "float32"},
        "threads": args.threads, "device": str(dev), "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "copy_bandwidth_bytes_per_s": bandwidth, "batches": {},
    }
    # Warm up both paths (first calls allocate and pick kernels).
    warm = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()]
    hf_generate(torch, hf, warm, 4)
    tandem_generate(engine, warm, 4, "warm")
    for b in batches:
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]
        hf_total = hf_generate(torch, hf, prompts, args.new_tokens)
        hf_first = hf_generate(torch, hf, prompts, 1)  # prefill + first token only
        td_total, td_steps = tandem_generate(engine, prompts, args.new_tokens, f"b{b}")
        hf_step = (hf_total - hf_first) / (args.new_tokens - 1)
        td_step = statistics.median(td_steps)
        row = {
            "hf_tokens_per_s": b * args.new_tokens / hf_total,
            "tandem_tokens_per_s": b * args.new_tokens / td_total,
            "hf_decode_step_s": hf_step,
            "tandem_decode_step_s": td_step,
        }
        row["throughput_ratio_tandem_over_hf"] = row["tandem_tokens_per_s"] / row["hf_tokens_per_s"]
        row["step_ratio_tandem_over_hf"] = td_step / hf_step
        results["batches"][str(b)] = row
        print(f"batch {b:3d}: tokens/s  transformers {row['hf_tokens_per_s']:8.1f}   tandem "
              f"{row['tandem_tokens_per_s']:8.1f}   ratio {row['throughput_ratio_tandem_over_hf']:.2f}x   "
              f"| decode step  transformers {hf_step * 1e3:7.2f} ms   tandem {td_step * 1e3:7.2f} ms", flush=True)
    if bandwidth:
        bound = model_bytes / bandwidth  # one read of every weight at the full measured DRAM rate
        one = results["batches"].get("1")
        results["bandwidth_bound_step_s"] = bound
        print(f"model {n_params / 1e6:.1f}M params, {model_bytes / 2**20:.0f} MiB; copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s (read+write) -> bound {bound * 1e3:.2f} ms per decode step")
        if one:
            results["batch1_step_over_bound"] = {"transformers": one["hf_decode_step_s"] / bound,
                                                 "tandem": one["tandem_decode_step_s"] / bound}
            print(f"batch 1 decode step / bound: transformers {one['hf_decode_step_s'] / bound:.2f}x, "
                  f"tandem {one['tandem_decode_step_s'] / bound:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
