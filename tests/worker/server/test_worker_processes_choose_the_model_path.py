"""`tandem worker` processes judge the model before loading it: a Qwen3-MoE runs on the transformers
path (prefill and decode processes, KV over tcp, greedy output equal to transformers' generate),
and a model it cannot serve stops the worker at start with the same words the operator's condition
uses (contracts/model_support.py); the native path, gone, is refused by name."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from tandem.contracts.model_support import check_model_config
from tandem.testing.engine_helpers import ndjson_events, reference_generate, stream_tokens
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(400)]

N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
FLAGS = ("--num-blocks", "128", "--block-size", "4", "--kv-timeout-s", "5", "--drain-s", "1")


async def test_moe_model_hands_off_between_worker_processes(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen3_moe")
    procs = [WorkerProcess(path, "prefill", "--kv-backend", "tcp", *FLAGS),
             WorkerProcess(path, "decode", "--kv-backend", "tcp", "--model-backend", "transformers", *FLAGS)]
    try:
        await asyncio.gather(*(asyncio.to_thread(w.start) for w in procs))
        p, d = (w.url for w in procs)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(3)
        prompts = [[0] + torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 25)]
        async with aiohttp.ClientSession() as s:
            for i, ids in enumerate(prompts):
                async with s.post(f"{p}/internal/prefill", json={"request_id": f"r{i}", "prompt_token_ids": ids,
                                                                 "sampling": GREEDY}) as r:
                    res = await r.json()
                    assert r.status == 200, res
                body = {"request_id": f"r{i}", "prompt_token_ids": ids, "sampling": GREEDY,
                        "kv_source": res["kv"], "first_token_id": res["first_token_id"]}
                async with s.post(f"{d}/internal/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    got = [res["first_token_id"]] + stream_tokens(await ndjson_events(r))
                assert got == reference_generate(hf, ids, N)
    finally:
        for w in procs:
            w.kill()
    assert "transformers path" in procs[0].log() and "transformers path" in procs[1].log()


def _worker(model: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", "worker", "--model", str(model),
                           "--host", "127.0.0.1", "--port", "0", *flags], capture_output=True, text=True, timeout=120)


def test_unservable_models_stop_the_worker_with_the_operators_words(tmp_path: Path, tiny_model) -> None:
    latent = {"model_type": "deepseek_v3", "num_attention_heads": 16, "kv_lora_rank": 512}
    (tmp_path / "config.json").write_text(json.dumps(latent))  # no weights: refused before any load
    r = _worker(tmp_path)
    assert r.returncode == 1 and check_model_config(latent) in r.stderr, r.stderr

    r = _worker(tiny_model("qwen3"), "--model-backend", "native")  # the path that is gone: named, refused
    assert r.returncode == 2 and "invalid choice: 'native'" in r.stderr, r.stderr
