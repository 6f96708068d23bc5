"""A group that spans nodes, as LeaderWorkerSet runs it, on one machine: two "pods" (processes with
LWS_GROUP_SIZE=2 and their LWS_WORKER_INDEX), each the first rank of its node and starting the
other, meet at the leader's address as four ranks. The toy model's two KV heads are then held
twice each (four ranks), and its greedy output still equals transformers'; its KV, handed to a
one-rank worker, is read from one replica of each head."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from tandem.testing.engine_helpers import reference_generate
from tandem.testing.worker_http import all_blocks_back, colocated, disaggregated
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import ManagedProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

FLAGS = ("--num-blocks", "96", "--block-size", "8", "--compile", "off", "--dtype", "float32", "--kv-backend", "tcp")
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pods(toy_model_dir):
    leader = f"127.0.0.1:{free_port()}"
    group = ["--tensor-parallel", "4", "--leader-address", leader, *FLAGS]
    procs = [WorkerProcess(toy_model_dir, "colocated", *group, env={"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": i})
             for i in ("0", "1")]
    single = WorkerProcess(toy_model_dir, "colocated", *FLAGS)
    try:
        for p in [*procs, single]:
            ManagedProcess.start(p)
        procs[0].wait_ready("/ready", 600)  # rank 0: ready once all four ranks serve
        procs[1].wait_ready("/ready", 60)  # rank 2's own endpoint (what a follower pod's probes read)
        single.wait_ready("/ready", 600)
        yield procs[0], procs[1], single
    finally:
        for p in [*procs, single]:
            p.kill()


def test_four_ranks_over_two_nodes_replicate_the_kv_heads(pods):
    info = pods[0].get_json("/internal/info")
    assert info["tensor_parallel"] == 4 and len(info["ranks"]) == 3
    assert info["kv_layout"]["tp_size"] == 4 and info["kv_layout"]["num_kv_heads"] == 2  # one head per rank
    assert pods[1].get_json("/health")["rank"] == 2 and pods[1].get_json("/ready")["status"] == "ready"


async def test_greedy_output_and_handoff_to_one_rank_equal_transformers(pods, toy_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [[0] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in (3, 20, 70)]
    rank0, _, single = pods
    async with aiohttp.ClientSession() as s:
        here = await asyncio.gather(*(colocated(s, rank0.url, f"c{i}", ids, GREEDY) for i, ids in enumerate(prompts)))
        moved = [await disaggregated(s, rank0.url, single.url, f"d{i}", ids, GREEDY) for i, ids in enumerate(prompts)]
    for ids, a, b in zip(prompts, here, moved, strict=True):
        assert a == b == reference_generate(hf, ids, 8), f"{len(ids)} prompt tokens"
    await all_blocks_back([rank0, single])
