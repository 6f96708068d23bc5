"""transformers' `generate` as a baseline: greedy tokens of a batch and their seconds, in this
process (engine_decode, gpu) or on one thread in a child process pinned to the core a Tandem
worker would use (engine_http)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.lib.direct_worker import WORKER_CPU, prompts_for
from bench.lib.processes import BenchProcess, thread_env
from bench.lib.results import ROOT

CHILD = "import sys; from bench.lib.hf_generate import child; child(*sys.argv[1:])"


def generate(torch, model, prompts: list[list[int]], tokens: int, sync=lambda: None) -> tuple[list[list[int]], float]:
    """Exactly `tokens` greedy tokens for each of equal-length prompts in one batch, and the seconds
    they took (`sync`: wait for the device, e.g. torch.cuda.synchronize)."""
    ids = torch.tensor(prompts, device=model.device)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    sync()
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def step_seconds(torch, model, prompts: list[list[int]], tokens: int, sync=lambda: None) -> float:
    """Seconds per decode step: (`tokens` tokens - 1 token) / (tokens - 1), the prefill left out."""
    total, first = (generate(torch, model, prompts, n, sync)[1] for n in (tokens, 1))
    return (total - first) / (tokens - 1)


def child(model_dir: str, dtype: str, n: str, plen: str, new: str, seed: str, out: str) -> None:
    """In the child: seconds for `new` tokens and for 1 token of n prompts, written as JSON to out."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    prompts = prompts_for(int(n), int(plen), int(seed))
    times = {key: generate(torch, model, prompts, tokens)[1] for key, tokens in (("warm_s", 2), ("total_s", int(new)),
                                                                                  ("first_s", 1))}
    Path(out).write_text(json.dumps(times))


def hf_generate(model_dir: Path, dtype: str, n: int, plen: int, new: int, seed: int, log_dir: Path) -> dict:
    """tokens/s and the per-step time of transformers' generate on n prompts (model load not timed)."""
    out = log_dir / f"hf-{dtype}-{n}-{seed}.json"
    env = os.environ | thread_env(1) | {"PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", CHILD, str(model_dir), dtype, str(n), str(plen), str(new), str(seed), str(out)]
    BenchProcess("hf", "hf", "", argv, WORKER_CPU, log_dir / "hf.log", env).run_to_end(1800)
    r = json.loads(out.read_text())
    return {"tokens_per_s": n * new / r["total_s"], "step_s": (r["total_s"] - r["first_s"]) / (new - 1),
            "wall_s": r["total_s"]}
