"""The driver (orchestrator.py) against in-process fake workers: it performs what `decide` asks on
the wire (calls in order, aborts with lease tokens, the worker set's counts, metrics) and ends every
request cleanly, whether it finishes, fails, or its consumer goes away. The decisions themselves
are tested without I/O in test_request_state_machine.py. No processes: milliseconds each."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import FinishReason
from tandem.contracts.routing import RouteReason
from tandem.router.errors import RouterError
from tandem.router.journey import Finished, Journey, Phase, Started, Tokens
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.registry import create_policy
from tandem.router.validation import Limits
from tandem.router.worker_client import HandoffDiverged
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import (
    FakeWorkers,
    busy,
    died,
    fail,
    finish,
    migrate,
    prefilled,
    start,
    token,
)
from tandem.testing.journeys import IDS, request


@pytest.fixture
def fake() -> FakeWorkers:
    return FakeWorkers()


async def machine(fake: FakeWorkers, **kw) -> Orchestrator:
    workers = WorkerSet(fake)
    workers.set_targets([Target(url) for url in fake.infos])
    await workers.poll_once()
    return Orchestrator(fake, workers, create_policy("least-loaded"), RouterMetrics(), limits=kw.pop("limits", Limits()),
                        **kw)


async def run(orch: Orchestrator, ctx: Journey, req=None) -> list:
    events = []
    try:
        async for ev in orch.run(req or request(), ctx):
            events.append(ev)
    finally:
        await orch.drain()
    return events


def text(events: list) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, Tokens))


def metric(orch: Orchestrator, name: str, **labels: str) -> float:
    return orch.metrics.registry.get_sample_value(name, labels or None) or 0.0


def disaggregated(fake: FakeWorkers, *decode: str) -> None:
    fake.add("p1", Role.PREFILL)
    for d in decode or ("d1",):
        fake.add(d, Role.DECODE)


async def test_a_handoff_reaches_the_client_as_one_stream(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), finish(FinishReason.LENGTH)])
    orch = await machine(fake)
    ctx = Journey("r1")
    events = await run(orch, ctx)
    assert events == [Started(5), Tokens([7], "A"), Tokens([8], "B", offset=1), Tokens([9], "C", offset=2),
                      Finished("length", 5, 3)]
    (gen,) = fake.made("generate")
    assert gen.request.kv_source is not None and gen.request.generated_token_ids == [7]
    assert ctx.route_reason is RouteReason.DISAGGREGATED and ctx.phase is Phase.FINISHED
    assert metric(orch, "tandem_router_routes_total", route="disaggregated") == 1
    assert metric(orch, "tandem_router_worker_requests_total", role="prefill") == 1
    assert fake.aborts == [] and all(v.router_inflight == 0 for v in orch.workers.views())


async def test_failed_prefill_workers_are_aborted_and_the_dead_one_kept_out(fake):
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    fake.on_prefill("p1", died())
    fake.on_prefill("p2", fail(503, "not_ready", type_="service_unavailable"))
    fake.on_generate("d1", [start(5), token(7, "A"), finish()])
    orch = await machine(fake)
    ctx = Journey("r1")
    events = await run(orch, ctx)
    assert [c.url for c in fake.calls] == ["p1", "p2", "d1"] and events[-1] == Finished("stop", 5, 1)
    assert ctx.route_reason is RouteReason.PREFILL_FAILED
    assert metric(orch, "tandem_router_routes_total", route="prefill_failed") == 1
    assert metric(orch, "tandem_router_worker_failures_total", role="prefill") == 2
    assert {url for url, _ in fake.aborts} == {"p1", "p2"}
    ready = {v.url: v.ready for v in orch.workers.views()}
    assert ready == {"p1": False, "p2": True, "d1": True}  # dead is out until it polls well; busy is not


async def test_a_stream_that_ends_without_a_finish_is_resumed_and_counted(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B")])
    fake.on_generate("d2", [start(5), token(9, "C"), finish()])
    orch = await machine(fake)
    events = await run(orch, Journey("r1"))
    assert text(events) == "ABC" and fake.made("generate")[1].request.generated_token_ids == [7, 8]
    assert metric(orch, "tandem_router_decode_resumes_total") == 1
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 1
    assert sorted(fake.aborts) == [("d1", "r1"), ("p1", "r1")]
    assert not {v.url: v.ready for v in orch.workers.views()}["d1"]


async def test_a_diverged_handoff_is_recomputed_under_a_cache_salt_of_its_own(fake):
    """A decode worker that continued from KV that was not the prompt's (vLLM: HandoffDiverged) may
    keep it in its prefix cache under the prompt's blocks: the resume, even on that worker, must not
    reuse them (found by tests/router/runtimes/test_vllm_kv_of_another_prompt_is_caught_and_recomputed.py)."""
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [HandoffDiverged("generated 9 where the client has 7")], [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    req = request()
    req.cache_salt = "tenant-a"
    events = await run(orch, Journey("r1"), req)
    assert text(events) == "AB"
    assert metric(orch, "tandem_router_handoffs_diverged_total") == 1
    first, resume = (c.request for c in fake.made("generate"))
    assert first.cache_salt == "tenant-a" and first.kv_source is not None
    assert resume.kv_source is None and resume.cache_salt not in (None, "tenant-a")
    other = Journey("r2")
    other.request, other.cache_apart = req, True
    assert other.cache_salt() != resume.cache_salt, "two requests' recomputations would share blocks"


async def test_a_refused_handoff_is_aborted_before_the_resume_goes_out(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [fail(400, "kv_mismatch", "kv_source")], [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, Journey("r1"))
    assert text(events) == "AB"
    assert fake.aborts[0] == ("d1", "r1") and ("p1", "r1") in fake.aborts
    assert fake.abort_tokens[fake.aborts.index(("p1", "r1"))] == "token-of-p1"


async def test_a_consumer_that_stops_early_aborts_every_touched_worker(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), finish()])
    orch = await machine(fake)
    ctx = Journey("r1")
    events = orch.run(request(), ctx)
    async for ev in events:
        if ev == Tokens([8], "B", offset=1):
            break
    await events.aclose()
    await orch.drain()
    # the prefill worker's lease is only freed with its token
    assert sorted(zip(fake.aborts, fake.abort_tokens, strict=True)) == [
        (("d1", "r1"), None), (("p1", "r1"), "token-of-p1")]
    assert not ctx.done and ctx.phase is Phase.DECODE
    assert all(v.router_inflight == 0 and v.router_prompt_tokens == 0 for v in orch.workers.views())


async def test_a_prompt_over_the_limit_after_prefill_frees_the_lease_at_once(fake):
    limits = Limits(max_prompt_tokens=4)
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    orch = await machine(fake, limits=limits)
    with pytest.raises(RouterError) as info:
        await run(orch, Journey("r1"), request(limits=limits))
    assert info.value.body["error"]["code"] == "context_length_exceeded"
    assert fake.aborts == [("p1", "r1")] and fake.abort_tokens == ["token-of-p1"]


async def test_a_started_stream_waits_for_a_busy_decode_worker_then_continues(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy(429, "1")], [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, Journey("r1"))
    assert text(events) == "AB" and events[-1] == Finished("stop", 5, 2)
    assert [c.request.kv_source is not None for c in fake.made("generate")] == [True, True]
    assert metric(orch, "tandem_router_worker_busy_total", role="decode") == 1
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 0


async def test_giving_up_on_busy_workers_frees_the_unpulled_lease(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy(429, "1")])
    orch = await machine(fake, busy_wait_s=0)
    ctx = Journey("r1")
    events: list = []
    with pytest.raises(RouterError) as info:
        async for ev in orch.run(request(), ctx):
            events.append(ev)
    await orch.drain()
    assert text(events) == "A" and info.value.status == 503 and ctx.phase is Phase.FAILED
    assert sorted(zip(fake.aborts, fake.abort_tokens, strict=True)) == [
        (("d1", "r1"), None), (("p1", "r1"), "token-of-p1")]


async def test_a_migration_is_measured_and_is_not_a_failure(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), migrate("d1", [7, 8], 6)])
    fake.on_generate("d2", [start(5), token(9, "C"), finish()])
    orch = await machine(fake)
    events = await run(orch, Journey("r1"))
    assert text(events) == "ABC" and fake.made("generate")[1].request.migrated_from == "d1"
    assert metric(orch, "tandem_router_migrations_total", outcome="kv") == 1
    assert metric(orch, "tandem_router_migration_seconds_count") == 1
    assert metric(orch, "tandem_router_decode_resumes_total") == 0
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 0
    assert fake.aborts == [], "the pull frees the lease; nothing to abort"


async def test_a_migration_with_nowhere_to_go_is_a_failed_migration_and_frees_the_lease(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), migrate("d1", [7, 8], 6)])
    orch = await machine(fake)
    with pytest.raises(RouterError) as err:
        await run(orch, Journey("r1"))
    assert err.value.status == 502 and [c.url for c in fake.made("generate")] == ["d1"]
    assert ("d1", "r1") in fake.aborts and "token-of-d1" in fake.abort_tokens
    assert metric(orch, "tandem_router_migrations_total", outcome="failed") == 1


async def test_a_busy_handoff_never_sends_kv_to_a_decode_worker_of_another_kv_compat(fake):
    fake.add("p1", Role.PREFILL)
    fake.add("d1", Role.DECODE)
    fake.add("d2", Role.DECODE, kv_compat="g2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy()])
    fake.on_generate("d2", [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, Journey("r1"))
    assert text(events) == "AB"
    first, second = fake.made("generate")
    assert (first.url, second.url) == ("d1", "d2") and first.request.kv_source is not None
    assert second.request.kv_source is None, "g1's KV must not reach a g2 worker: it recomputes"
    assert second.request.generated_token_ids == [7] and second.request.emitted_chars == 1
    assert list(zip(fake.aborts, fake.abort_tokens, strict=True)) == [(("p1", "r1"), "token-of-p1")]


# --- a MIGRATE crossing a client disconnect (issue 21, defect 13) --------------------------------


async def _disconnect_when(orch: Orchestrator, ctx: Journey, reached: Callable[[], bool]) -> list:
    """Run a request as a handler does, and cancel it (the client went away) once `reached()`."""
    events: list = []

    async def handler() -> None:
        async for ev in orch.run(request(), ctx):
            events.append(ev)

    task = asyncio.create_task(handler())
    for _ in range(10_000):  # each turn lets the request run to its next await
        if reached() or task.done():
            break
        await asyncio.sleep(0)
    assert reached() and not task.done(), "the request got past the point to disconnect at"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await orch.drain()
    return events


async def test_a_client_gone_while_its_stream_is_handed_on_frees_the_leaving_workers_lease(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), migrate("d1", [7, 8], 6)])
    fake.on_generate("d2", [start(5), token(9, "C"), finish()])
    closing, _ = fake.slow_close("d1")  # the connection to the leaving worker takes a while to close
    orch = await machine(fake)
    ctx = Journey("r1")
    events = await _disconnect_when(orch, ctx, closing.is_set)
    assert text(events) == "AB" and [c.url for c in fake.made("generate")] == ["d1"]
    aborts = dict(zip(fake.aborts, fake.abort_tokens, strict=True))
    assert aborts[("d1", "r1")] == "token-of-d1", "the migration's lease there is freed by its token"
    assert metric(orch, "tandem_router_migrations_total", outcome="failed") == 1


async def test_a_client_gone_after_the_move_frees_the_lease_the_next_worker_has_not_pulled(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), migrate("d1", [7, 8], 6)])
    pulling = asyncio.Event()  # d2 is still pulling the KV: no line yet
    fake.on_generate("d2", [pulling])
    orch = await machine(fake)
    ctx = Journey("r1")
    await _disconnect_when(orch, ctx, lambda: [c.url for c in fake.made("generate")] == ["d1", "d2"])
    aborts = dict(zip(fake.aborts, fake.abort_tokens, strict=True))
    assert aborts == {("p1", "r1"): "token-of-p1", ("d1", "r1"): "token-of-d1", ("d2", "r1"): None}
    assert all(v.router_inflight == 0 for v in orch.workers.views())
