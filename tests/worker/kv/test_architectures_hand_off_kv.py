"""Every architecture of testing/tiny_models.py served by workers: colocated, and disaggregated with
the KV handed from a prefill worker to a decode worker over tcp and nixl, greedy output equals
transformers' generate token for token (several handoffs at once too); a decode worker that holds
a conversation's leading blocks pulls only the rest and still matches; a draining decode worker
migrates a stream to another over the transport; every block comes back.

The workers run in this process (engine thread, the worker's HTTP app on a loopback port, a real
transport), over one load of each model, so the whole matrix costs seconds per case.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tandem.testing.engine_helpers import events_until, ndjson_events, stream_tokens
from tandem.testing.inprocess_worker import InProcessWorkers
from tandem.testing.tiny_models import ARCHITECTURES, WINDOW, LoadedForTests
from tandem.testing.tiny_models import random_prompt as prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
BS = 4


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request, tiny_model):
    torch.set_num_threads(1)
    return LoadedForTests(request.param, tiny_model(request.param))


async def colocated(c, rid: str, ids: list[int]) -> list[int]:
    async with c.client.post("/internal/generate", json={"request_id": rid, "prompt_token_ids": ids,
                                                         "sampling": GREEDY}) as r:
        assert r.status == 200, await r.text()
        return stream_tokens(await ndjson_events(r))


async def disaggregated(p, d, rid: str, ids: list[int]) -> list[int]:
    async with p.client.post("/internal/prefill", json={"request_id": rid, "prompt_token_ids": ids,
                                                        "sampling": GREEDY}) as r:
        res = await r.json()
        assert r.status == 200, res
    body = {"request_id": rid, "prompt_token_ids": ids, "sampling": GREEDY, "kv_source": res["kv"],
            "first_token_id": res["first_token_id"]}
    async with d.client.post("/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [res["first_token_id"]] + stream_tokens(await ndjson_events(r))


def saved_bytes(w) -> float:
    return w.state.metrics.kv_pull_saved_bytes._value.get()


async def test_colocated_and_disaggregated_equal_generate(arch, backend: str):
    workers = InProcessWorkers(arch.loaded, arch.path, block_size=BS, num_blocks=160, prefill_chunk_tokens=16,
                               compile="off")
    try:
        p = await workers.start("prefill", kv_backend=backend)
        d = await workers.start("decode", kv_backend=backend)
        c = await workers.start("colocated")
        prompts = [prompt(n, seed) for seed, n in enumerate((1, 6, WINDOW + 5, 30))]
        for i, ids in enumerate(prompts):
            want = arch.reference(ids, N)
            assert await colocated(c, f"c{i}", ids) == want, f"{arch.name}: colocated differs at {len(ids)} tokens"
            assert await disaggregated(p, d, f"d{i}", ids) == want, \
                f"{arch.name}: disaggregated over {backend} differs at {len(ids)} tokens"
        got = await asyncio.gather(*(disaggregated(p, d, f"m{i}", ids) for i, ids in enumerate(prompts)))
        assert got == [arch.reference(ids, N) for ids in prompts]

        # The next turn resends the conversation: decode holds its leading blocks and pulls the rest.
        turn1 = prompts[3]
        turn2 = turn1 + arch.reference(turn1, N) + prompt(9, 11)[1:]
        before = saved_bytes(d)
        assert await disaggregated(p, d, "turn2", turn2) == arch.reference(turn2, N)
        assert saved_bytes(d) - before >= (len(turn1) // BS) * d.engine.layout.block_bytes
    finally:
        errors = await workers.close()
    assert not errors, errors


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
async def test_draining_decode_migrates_streams_on_the_transformers_path(name, tiny_model, backend: str):
    """A decode worker draining mid-stream hands the sequence (its prompt and generated KV) to another
    decode worker, which pulls it over the transport and continues: together they equal generate."""
    arch = LoadedForTests(name, tiny_model(name))
    workers = InProcessWorkers(arch.loaded, arch.path, block_size=BS, num_blocks=64, compile="off")
    max_tokens = 20
    sampling = dict(GREEDY, max_tokens=max_tokens)
    try:
        a = await workers.start("decode", kv_backend=backend, serve_kv=True)
        b = await workers.start("decode", kv_backend=backend)

        def drain() -> None:
            a.state.ready, a.state.draining = False, True
            a.state.engine.start_migration()

        ids = prompt(WINDOW + 3, 21)
        async with a.client.post("/internal/generate", json={"request_id": "mig", "prompt_token_ids": ids,
                                                             "sampling": sampling}) as r:
            first = await events_until(r, 5, drain)
        assert first[-1]["type"] == "migrate", first[-1]
        generated = stream_tokens(first)
        body = {"request_id": "mig", "prompt_token_ids": ids, "sampling": sampling, "kv_source": first[-1]["kv"],
                "generated_token_ids": generated, "migrated_from": a.url}
        async with b.client.post("/internal/generate", json=body) as r:
            assert r.status == 200, await r.text()
            second = await ndjson_events(r)
        assert generated + stream_tokens(second) == arch.reference(ids, max_tokens)
        assert b.engine.stats.prefill_tokens_computed_total == 0, "the second worker pulled, never recomputed"
    finally:
        errors = await workers.close()
    assert not errors, errors
