"""The transformers path at tensor parallelism 2: two real rank processes (gloo) split each model by
its own plan, attention heads (Mistral's one KV head replicated on both) and dense MLPs, and
Mixtral's and Qwen3-MoE's experts whole per rank (expert parallelism over the same ranks); rank 0's
engine drives the group through batched, chunked and prefix-cached steps (decode steps through each
rank's compiled graph), and every greedy output
equals transformers' generate on the unsplit model. One pair of processes serves every model in
turn (testing/hf_tensor_parallel_ranks.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tandem.contracts.model_support import TRANSFORMERS_TENSOR_PARALLEL_TYPES
from tandem.testing.tiny_models import WINDOW, LoadedForTests, random_prompt
from tandem.worker.local.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

NEW_TOKENS = 10  # testing/hf_tensor_parallel_ranks.py's
ARCHS = {"gemma3_text": "gemma3"}  # the tiny model that stands for a listed type


def test_every_listed_type_splits_across_two_ranks_and_equals_generate(tiny_model, tmp_path):
    types = sorted(TRANSFORMERS_TENSOR_PARALLEL_TYPES)
    paths = [str(tiny_model(ARCHS.get(t, t))) for t in types]
    prompts = [random_prompt(n, seed) for seed, n in enumerate((3, WINDOW + 5, 30))]
    out = tmp_path / "outputs.json"
    out.write_text(json.dumps({"prompts": prompts}))
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "tandem.testing.hf_tensor_parallel_ranks", "--rank", str(r),
                               "--port", str(port), "--out", str(out), *paths],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={"OMP_NUM_THREADS": "1", **_env()})
             for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=840)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    outputs = json.loads(out.read_text())["outputs"]
    torch.set_num_threads(1)
    for model_type, path in zip(types, paths, strict=True):
        ref = LoadedForTests(model_type, path, backend="transformers")
        want = [ref.reference(ids, NEW_TOKENS) for ids in prompts] * 2  # served twice: the second from the cache
        assert outputs[path] == want, f"{model_type} at tensor parallelism 2 differs from generate"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
