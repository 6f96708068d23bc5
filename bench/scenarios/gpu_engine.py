"""Tandem's own engine on one GPU: correctness of the CUDA path, and decode against the HBM bound.

Two parts, one result:

  parity   the toy Llama (tandem.worker.local.toy_model) in float32 on CUDA (TF32 off): Tandem's
           paged engine, several prompts batched, against transformers' greedy generate, token
           for token. The CPU suite checks the same on the CPU; this checks the CUDA path.
  decode   a random-initialised Llama-3.1-8B shape in bf16, built on the device (no download):
           decode step time at batch 1/8/32 under Tandem and under transformers' generate, and
           batch-1 step time against the bound (weight bytes / measured device copy bandwidth:
           one decode step must read every weight once). Prefill time of 2k and 8k prompts too.

    python -m bench gpu_engine        (bench/gpu/run_h200.sh runs it after gpu_tandem)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.hf_generate import generate, step_seconds


def copy_bandwidth(torch, nbytes: int = 4 * 2**30) -> float:
    """Bytes/s read + written by a large device-to-device copy (the achievable HBM rate)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def tandem_greedy(drv, prompts: list[list[int]], new_tokens: int, tag: str):
    """Tandem's engine (an OfflineEngine) on the same prompts: tokens per prompt, seconds, pure-decode step times."""
    from tandem.testing.engine_helpers import tokens_of

    t0 = time.perf_counter()
    outs = [drv.submit(f"{tag}-{i}", p, new_tokens) for i, p in enumerate(prompts)]
    steps = drv.run()
    dt = time.perf_counter() - t0
    decode = [s for s, n in steps if n == len(prompts)][1:]
    return [tokens_of(o) for o in outs], dt, decode


def parity(torch, out: dict) -> None:
    from tandem.testing.engine_helpers import OfflineEngine
    from tandem.worker.engine.loader import load_model
    from tandem.worker.local.toy_model import make_toy_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = make_toy_model(Path(tempfile.gettempdir()) / "tandem-toy-gpu", num_layers=4, hidden_size=128,
                       num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512)
    loaded = load_model(str(d), dtype="float32", device="cuda")
    engine = OfflineEngine(loaded=loaded, model=str(d), num_blocks=512, block_size=16, max_num_seqs=8,
                           max_batched_tokens=256)
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 7, 16, 33, 100, 250]
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    got, _, _ = tandem_greedy(engine, prompts, 24, "parity")
    rows = []
    for p, g in zip(prompts, got, strict=True):
        ref, _ = generate(torch, loaded.model, [p], 24, torch.cuda.synchronize)
        rows.append({"prompt_len": len(p), "equal": ref[0] == g,
                     "first_divergence": next((i for i, (a, b) in enumerate(zip(ref[0], g, strict=False)) if a != b), None)})
    out["parity"] = {"model": "toy llama 4 layers fp32, cuda, tf32 off", "new_tokens": 24, "prompts": rows,
                     "all_equal": all(r["equal"] for r in rows), "blocks_leaked": engine.engine.allocator.num_used}
    print("parity on CUDA:", json.dumps(out["parity"]), flush=True)


def decode_8b(torch, out: dict) -> None:
    from tandem.testing.engine_helpers import OfflineEngine
    from tandem.worker.engine.loader import LoadedModel
    from tandem.worker.local.toy_model import make_toy_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=16384,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.eval()
    torch.cuda.synchronize()
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built 8B-shape model in {time.perf_counter() - t0:.1f}s: {n_params / 1e9:.2f}B params", flush=True)
    tok_dir = make_toy_model(Path(tempfile.gettempdir()) / "tandem-toy-gpu-tok")  # only a tokenizer object
    loaded = LoadedModel(model, AutoTokenizer.from_pretrained(tok_dir), cfg, torch.bfloat16,
                         torch.device("cuda"), 16384, frozenset(), "llama-3.1-8b-shape")
    engine = OfflineEngine(loaded=loaded, model="llama-3.1-8b-shape", num_blocks=8192, block_size=16, max_num_seqs=32,
                           max_batched_tokens=8192)
    bw = copy_bandwidth(torch)
    bound = model_bytes / bw
    gen = torch.Generator().manual_seed(0)
    res: dict = {"params": n_params, "bytes": model_bytes, "copy_bandwidth_bytes_per_s": bw,
                 "bandwidth_bound_step_s": bound, "batches": {}, "prefill": {}}
    warm = [torch.randint(3, 128000, (64,), generator=gen).tolist()]
    generate(torch, model, warm, 4, torch.cuda.synchronize)
    tandem_greedy(engine, warm, 4, "warm")
    new = 32
    for b in (1, 8, 32):
        prompts = [torch.randint(3, 128000, (256,), generator=gen).tolist() for _ in range(b)]
        hf_step = step_seconds(torch, model, prompts, new, torch.cuda.synchronize)
        _, td_total, td_steps = tandem_greedy(engine, prompts, new, f"b{b}")
        td_step = statistics.median(td_steps)
        res["batches"][str(b)] = {"hf_decode_step_s": hf_step, "tandem_decode_step_s": td_step,
                                  "tandem_over_hf": td_step / hf_step, "tandem_over_bound": td_step / bound}
        print(f"8B bf16 batch {b:2d}: decode step transformers {hf_step * 1e3:7.2f} ms, tandem "
              f"{td_step * 1e3:7.2f} ms (ratio {td_step / hf_step:.2f}; bound {bound * 1e3:.2f} ms)", flush=True)
    for n in (2048, 8192):
        p = [torch.randint(3, 128000, (n,), generator=gen).tolist()]
        _, hf_t = generate(torch, model, p, 1, torch.cuda.synchronize)
        _, td_t, _ = tandem_greedy(engine, p, 1, f"pf{n}")
        res["prefill"][str(n)] = {"hf_s": hf_t, "tandem_s": td_t, "tandem_over_hf": td_t / hf_t}
        print(f"8B bf16 prefill {n} tokens: transformers {hf_t * 1e3:.1f} ms, tandem {td_t * 1e3:.1f} ms", flush=True)
    res["blocks_leaked"] = engine.engine.allocator.num_used
    out["decode_8b"] = res


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options: the parts and shapes are fixed so runs stay comparable."""


def run(args: argparse.Namespace) -> dict:
    import torch

    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA device: nothing to measure", file=sys.stderr)
        return {"ok": False, "error": "no CUDA device"}
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for part in (parity, decode_8b):
        try:
            part(torch, out)
        except Exception as e:  # noqa: BLE001 - record and go on to the next part
            out[part.__name__ + "_error"] = repr(e)
            print(f"{part.__name__} failed: {e!r}", file=sys.stderr, flush=True)
    return out
