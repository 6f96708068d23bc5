"""The request state machine's MIGRATE transition, against in-process fake workers: a decode worker
that leaves hands the stream to another decode worker of its generation with its KV lease, the
client's events run on without a gap in tokens or text, and it is counted as a migration, not a
failure; without KV (none, another generation, a pull that fails) the stream is recomputed; with
no worker left it is a 502 and the lease is freed."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import FinishReason
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import (
    Finished,
    Orchestrator,
    RequestContext,
    Started,
    Tokens,
)
from tandem.router.policies.registry import create_policy
from tandem.router.pool import Target, WorkerPool
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.testing.fake_workers import FakeWorkers, fail, finish, migrate, prefilled, start, token

PROMPT = "a prompt long enough to be worth a prefill worker"
IDS = [1, 2, 3, 4, 5]


async def machine(fake: FakeWorkers) -> Orchestrator:
    pool = WorkerPool(fake)
    pool.set_targets([Target(url) for url in fake.infos])
    await pool.poll_once()
    return Orchestrator(fake, pool, create_policy("least-loaded"), RouterMetrics(), limits=Limits())


async def run(orch: Orchestrator, ctx: RequestContext) -> list:
    req = parse_request({"model": "toy", "prompt": PROMPT, "max_tokens": 6}, Endpoint.COMPLETION, Limits())
    events = []
    try:
        async for ev in orch.run(req, ctx):
            events.append(ev)
    finally:
        await orch.drain()
    return events


def metric(orch: Orchestrator, name: str, **labels: str) -> float:
    return orch.metrics.registry.get_sample_value(name, labels or None) or 0.0


def stack(*decode: tuple[str, str]) -> FakeWorkers:
    """A prefill worker p1 and decode workers (url, generation); the request starts on d1."""
    fake = FakeWorkers()
    fake.add("p1", Role.PREFILL)
    for url, gen in decode:
        fake.add(url, Role.DECODE, generation=gen)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), migrate("d1", [7, 8, 9], 7)])
    return fake


async def test_migrate_moves_the_stream_and_its_kv_to_another_decode_worker():
    fake = stack(("d1", "g1"), ("d2", "g1"))
    fake.on_generate("d2", [start(5), token(10, "D"), token(11, "E"), finish(FinishReason.LENGTH)])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert events == [Started(5), Tokens([7], "A"), Tokens([8], "B"), Tokens([9], "C"), Tokens([10], "D"),
                      Tokens([11], "E"), Finished("length", 5, 5)]
    first, moved = fake.made("generate")
    assert first.url == "d1" and moved.url == "d2"
    req = moved.request
    assert req.kv_source is not None and req.kv_source.url == "d1" and req.kv_source.num_tokens == 7
    assert req.generated_token_ids == [7, 8, 9] and req.emitted_chars == 3 and req.migrated_from == "d1"
    assert metric(orch, "tandem_router_migrations_total", outcome="kv") == 1
    assert metric(orch, "tandem_router_migration_seconds_count") == 1
    assert metric(orch, "tandem_router_decode_resumes_total") == 0
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 0
    assert fake.aborts == [], "the pull frees the lease; nothing to abort"


async def test_failed_pull_falls_back_to_recompute_and_frees_the_lease():
    fake = stack(("d1", "g1"), ("d2", "g1"))
    fake.on_generate("d2", [fail(503, "kv_transfer_failed", type_="service_unavailable")],
                     [start(5), token(10, "D"), token(11, "E"), finish(FinishReason.LENGTH)])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert "".join(e.text for e in events if isinstance(e, Tokens)) == "ABCDE"
    _, pull, recompute = fake.made("generate")
    assert pull.request.kv_source is not None
    assert recompute.url == "d2" and recompute.request.kv_source is None
    assert recompute.request.generated_token_ids == [7, 8, 9] and recompute.request.emitted_chars == 3
    assert ("d1", "r1") in fake.aborts
    assert fake.abort_tokens[fake.aborts.index(("d1", "r1"))] == "token-of-d1", "the lease is freed by its token"
    assert metric(orch, "tandem_router_migrations_total", outcome="recompute") == 1
    assert metric(orch, "tandem_router_migrations_total", outcome="kv") == 0


@pytest.mark.parametrize("case", ["no_kv", "other_generation"])
async def test_without_usable_kv_the_stream_is_recomputed(case):
    if case == "no_kv":
        fake = stack(("d1", "g1"), ("d2", "g1"))
        fake.streams["d1"][0][-1] = migrate("d1", [7, 8, 9], 7, with_kv=False)
    else:  # KV of one generation's model must never reach another's
        fake = stack(("d1", "g1"), ("d2", "g2"))
    fake.on_generate("d2", [start(5), token(10, "D"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert events[-1] == Finished("stop", 5, 4)
    moved = fake.made("generate")[-1]
    assert moved.url == "d2" and moved.request.kv_source is None and moved.request.generated_token_ids == [7, 8, 9]
    assert metric(orch, "tandem_router_migrations_total", outcome="recompute") == 1


async def test_no_decode_worker_left_is_a_502_and_frees_the_lease():
    fake = stack(("d1", "g1"))
    orch = await machine(fake)
    ctx = RequestContext("r1")
    with pytest.raises(RouterError) as err:
        await run(orch, ctx)
    assert err.value.status == 502
    assert [c.url for c in fake.made("generate")] == ["d1"], "never back to the worker that is leaving"
    assert ("d1", "r1") in fake.aborts
    assert "token-of-d1" in fake.abort_tokens
    assert metric(orch, "tandem_router_migrations_total", outcome="failed") == 1
