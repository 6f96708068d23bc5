"""A Qwen3-MoE worker of two ranks runs the transformers path with its attention heads and its
experts split across the ranks (expert parallelism over the tensor-parallel group): colocated
output equals transformers' generate, and its KV hands over to and from a one-rank worker over tcp
(each decode rank reads its heads) with the output still equal. A Phi-3 model, whose plan does not
split attention by heads on this path, is refused at start with the contract's words."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from tandem.contracts.model_support import check_model_config
from tandem.testing.tiny_models import WINDOW, LoadedForTests, random_prompt
from tandem.testing.worker_http import all_blocks_back, colocated, disaggregated
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import ManagedProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

FLAGS = ("--num-blocks", "128", "--block-size", "4", "--kv-timeout-s", "10", "--kv-backend", "tcp",
         "--dtype", "float32")
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe(tiny_model):
    path = tiny_model("qwen3_moe")
    procs = {"c1": WorkerProcess(path, "colocated", *FLAGS),
             "c2": WorkerProcess(path, "colocated", "--tensor-parallel", "2", *FLAGS)}
    try:
        for p in procs.values():
            ManagedProcess.start(p)  # both at once; then wait for each
        for p in procs.values():
            p.wait_ready("/ready", 600)
        yield SimpleNamespace(ref=LoadedForTests("qwen3_moe", path), **procs)
    finally:
        for p in procs.values():
            p.kill()


async def test_two_ranks_split_heads_and_experts_and_equal_generate(moe):
    assert moe.c2.get_json("/internal/info")["tensor_parallel"] == 2
    prompts = [random_prompt(n, seed) for seed, n in enumerate((2, WINDOW + 5, 40))]
    want = [moe.ref.reference(ids, N) for ids in prompts]
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(*(colocated(s, moe.c2.url, f"c{i}", ids, GREEDY) for i, ids in enumerate(prompts)))
        assert got == want
        for p, d in ((moe.c2, moe.c1), (moe.c1, moe.c2)):
            got = [await disaggregated(s, p.url, d.url, f"{p.name}-{i}", ids, GREEDY) for i, ids in enumerate(prompts)]
            assert got == want, f"prefill {p.get_json('/internal/info')['tensor_parallel']} ranks, decode " \
                                f"{d.get_json('/internal/info')['tensor_parallel']}"
    assert "rank 0 of 2 (heads and experts split)" in moe.c2.log()
    await all_blocks_back([moe.c1, moe.c2])


def test_a_model_whose_plan_does_not_split_heads_is_refused_at_start(tiny_model):
    path = tiny_model("phi3")
    w = WorkerProcess(path, "colocated", "--tensor-parallel", "2", *FLAGS)
    with pytest.raises(RuntimeError, match="exited with 1"):
        w.start(ready_timeout_s=300)
    reason = check_model_config(json.loads((path / "config.json").read_text()), tensor_parallel=2)
    assert reason and reason in w.log()
