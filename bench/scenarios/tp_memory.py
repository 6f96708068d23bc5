"""Tensor parallelism's memory on the transformers path (issue 30): each rank's resident memory at --tensor-parallel 2
against one rank's, for a mixture-of-experts model (Qwen3-MoE, random bf16 weights, mostly experts), with a worker that
loads nothing as the floor (torch, transformers and the server). A rank reads only its heads, MLP rows and experts
(hf/rank_loading.py); embedding, norms, routers and the head stay whole on every rank."""
import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from tandem.worker.local.cache import cache_root

from bench.lib.processes import BenchProcess, thread_env, worker_process

BUILD = """
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig
from tandem.worker.local.toy_model import toy_tokenizer
out, sizes = Path(sys.argv[1]), json.loads(sys.argv[2])
tok = toy_tokenizer()
ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
cfg = Qwen3MoeConfig(vocab_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, decoder_sparse_step=1,
                     num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048, **sizes, **ids)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
GenerationConfig(do_sample=False, **ids).save_pretrained(out)
tok.save_pretrained(out)
(out / ".complete").write_text("built")
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=1024)


def _model(args: argparse.Namespace) -> tuple[str, int]:
    sizes = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_experts=args.experts,
                 moe_intermediate_size=args.moe_intermediate, intermediate_size=4 * args.hidden)
    path = cache_root() / "models" / ("bench-moe-" + "-".join(str(v) for v in sizes.values()))
    if not (path / ".complete").is_file():
        print(f"building the MoE model at {path} ...", flush=True)
        BenchProcess("build", "", "", [sys.executable, "-c", BUILD, str(path), json.dumps(sizes)], None,
                     path.parent / f"{path.name}.build.log").run_to_end(1200)
    return str(path), sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _resident(p: BenchProcess) -> list[dict[str, int]]:
    """Resident MiB of the worker and of each rank it started (its children), the worker first: in all, anonymous
    (the process's own) and file-backed (pages of the checkpoint and libraries it maps, which the kernel can drop)."""
    out = []
    for q in [p.proc.pid, *(c.pid for c in psutil.Process(p.proc.pid).children(recursive=True))]:
        with open(f"/proc/{q}/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "RssAnon", "RssFile")}
        out.append({"rss": kb["VmRSS"] // 1024, "anon": kb["RssAnon"] // 1024, "file": kb["RssFile"] // 1024})
    return out


def _arm(name: str, model: Any, out: Path, *flags: str) -> list[dict[str, int]]:
    p = worker_process(name, "colocated", model, out / f"{name}.log", None, "--dtype", "bfloat16", "--compile", "off",
                       *flags, num_blocks=64)
    p.start(os.environ | thread_env(1))
    try:
        p.wait_ready("/ready", 900)
        time.sleep(2)  # the start-up check's buffers freed
        return _resident(p)
    finally:
        p.kill()


def run(args: argparse.Namespace) -> dict:
    model, weights = _model(args)
    from tandem.worker.local.toy_model import make_toy_model

    floor = _arm("floor", make_toy_model(args.out_dir / "toy"), args.out_dir)  # the process, nearly no weights
    one = _arm("tp1", model, args.out_dir)
    two = _arm("tp2", model, args.out_dir, "--tensor-parallel", "2")
    read = [int(line.split(" read ")[1].split(" MiB")[0].split(".")[0]) for line in
            (args.out_dir / "tp2.log").read_text().splitlines() if "of the checkpoint" in line]
    result = {"model": model, "weights_mib": round(weights / 2**20), "floor": floor[0], "tp1": one[0], "tp2_ranks": two,
              "tp2_read_mib": read}
    for kind in ("rss", "anon"):  # each rank above the floor, over one rank above the floor
        result[f"{kind}_rank_over_one"] = [round((r[kind] - floor[0][kind]) / (one[0][kind] - floor[0][kind]), 2)
                                           for r in two]
    print(json.dumps(result, indent=1))
    return result
