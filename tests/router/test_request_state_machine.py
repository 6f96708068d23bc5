"""The request state machine against in-process fake workers: the handoff, every fault path (prefill
retry and fallback, client vs worker 4xx, decode death and resume, exhausted resumes, a stream
without a finish), the early finish, early consumers and the prompt limit. No processes: ms each."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import FinishReason
from tandem.contracts.routing import RouteReason
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import (
    Finished,
    Orchestrator,
    Phase,
    RequestContext,
    Started,
    Tokens,
)
from tandem.router.policies.registry import create_policy
from tandem.router.pool import Target, WorkerPool
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.router.worker_client import WorkerBusy, WorkerFailed, classify
from tandem.testing.fake_workers import (
    FakeWorkers,
    busy,
    died,
    fail,
    finish,
    prefilled,
    start,
    token,
)

PROMPT = "a prompt long enough to be worth a prefill worker"
IDS = [1, 2, 3, 4, 5]


@pytest.fixture
def fake() -> FakeWorkers:
    return FakeWorkers()


async def machine(fake: FakeWorkers, **kw) -> Orchestrator:
    pool = WorkerPool(fake)
    pool.set_targets([Target(url) for url in fake.infos])
    await pool.poll_once()
    limits = kw.pop("limits", Limits())
    return Orchestrator(fake, pool, create_policy(kw.pop("policy", "least-loaded")), RouterMetrics(),
                        limits=limits, **kw)


def request(max_tokens: int = 16, limits: Limits | None = None):
    return parse_request({"model": "toy", "prompt": PROMPT, "max_tokens": max_tokens}, Endpoint.COMPLETION,
                         limits or Limits())


async def run(orch: Orchestrator, ctx: RequestContext, req=None) -> list:
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


async def test_handoff_streams_every_token_once(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), finish(FinishReason.LENGTH)])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert events == [Started(5), Tokens([7], "A"), Tokens([8], "B"), Tokens([9], "C"), Finished("length", 5, 3)]
    (gen,) = fake.made("generate")
    # the decode worker replays the first token and continues after the text the client has
    assert gen.request.kv_source is not None and gen.request.generated_token_ids == [7]
    assert gen.request.emitted_chars == 1
    assert (gen.request.prompt, gen.request.prompt_token_ids) == (None, IDS)
    assert ctx.route is RouteReason.DISAGGREGATED and ctx.phase is Phase.FINISHED
    assert metric(orch, "tandem_router_routes_total", route="disaggregated") == 1
    assert fake.aborts == []


async def test_prefill_fails_retries_elsewhere_then_falls_back_to_decode_side_prefill(fake):
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    fake.on_prefill("p1", died())
    fake.on_prefill("p2", fail(503, "not_ready", type_="service_unavailable"))
    fake.on_generate("d1", [start(5), token(7, "A"), finish()])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert [c.url for c in fake.calls] == ["p1", "p2", "d1"]
    gen = fake.made("generate")[0].request
    assert gen.kv_source is None and gen.generated_token_ids == [] and gen.prompt == PROMPT
    assert events[-1] == Finished("stop", 5, 1)
    assert ctx.route is RouteReason.PREFILL_FAILED
    assert metric(orch, "tandem_router_routes_total", route="prefill_failed") == 1
    assert {url for url, _ in fake.aborts} == {"p1", "p2"}
    ready = {v.url: v.ready for v in orch.pool.views()}
    assert ready == {"p1": False, "p2": True, "d1": True}  # dead is out until it polls well; busy is not


async def test_prefill_retry_that_succeeds_hands_off_from_the_second_worker(fake):
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    fake.on_prefill("p1", died())
    fake.on_prefill("p2", prefilled("p2", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert text(events) == "AB"
    assert fake.made("generate")[0].request.kv_source.url == "p2"


async def test_a_client_4xx_from_prefill_passes_through_unchanged(fake):
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    refusal = fail(400, "invalid_value", "max_tokens", message="max_tokens is too large for this prompt")
    fake.on_prefill("p1", refusal)
    orch = await machine(fake)
    ctx = RequestContext("r1")
    with pytest.raises(RouterError) as info:
        await run(orch, ctx)
    assert info.value is refusal and info.value.status == 400
    assert info.value.body["error"]["message"] == "max_tokens is too large for this prompt"
    assert [c.url for c in fake.calls] == ["p1"]  # no retry, no decode
    assert ctx.phase is Phase.FAILED


@pytest.mark.parametrize(("status", "code"), [
    (400, "kv_mismatch"), (400, "kv_backend_mismatch"), (400, "wrong_role"),
    (409, "duplicate_request_id"), (503, "not_ready"),
])
async def test_worker_side_4xx_codes_are_worker_failures(fake, status, code):
    assert isinstance(fail(status, code), WorkerFailed)
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    fake.on_prefill("p1", fail(status, code))
    fake.on_prefill("p2", prefilled("p2", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), finish()])
    events = await run(await machine(fake), RequestContext("r1"))
    assert text(events) == "AB" and [c.url for c in fake.calls] == ["p1", "p2", "d1"]


def test_failures_are_classified_by_status_code_and_param():
    assert isinstance(classify(400, {"error": {"param": "max_tokens"}}, "x"), RouterError)
    assert isinstance(classify(404, "not json", "x"), RouterError)
    for param in ("kv_source", "first_token_id", "generated_token_ids", "emitted_chars"):
        assert isinstance(classify(400, {"error": {"param": param}}, "x"), WorkerFailed)
    for status in (408, 429, 500, 503):
        failure = classify(status, {"error": {}}, "x")
        assert isinstance(failure, WorkerFailed) and not failure.dead


async def test_a_refused_handoff_resumes_without_the_kv(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [fail(400, "kv_mismatch", "kv_source")], [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert text(events) == "AB"
    first, resume = (c.request for c in fake.made("generate"))
    assert first.kv_source is not None and resume.kv_source is None
    assert (resume.generated_token_ids, resume.emitted_chars) == ([7], 1)
    assert ("p1", "r1") in fake.aborts  # the lease nobody will pull is freed
    assert ("d1", "r1") in fake.aborts  # and d1's copy is gone before it gets the resume


async def test_decode_dies_mid_stream_and_resumes_elsewhere_with_the_tokens_so_far(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    # token 9's text is held back by d1 (say, half a UTF-8 character) when it dies
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, ""), died()])
    fake.on_generate("d2", [start(5), token(10, "CD"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert text(events) == "ABCD" and events[-1] == Finished("stop", 5, 4)
    resume = fake.made("generate")[1]
    assert resume.url == "d2" and resume.request.kv_source is None
    assert (resume.request.generated_token_ids, resume.request.emitted_chars) == ([7, 8, 9], 2)
    assert resume.request.prompt_token_ids == IDS
    assert metric(orch, "tandem_router_decode_resumes_total") == 1
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 1
    assert ("d1", "r1") in fake.aborts


async def test_a_stream_that_ends_without_a_finish_is_a_failure(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B")])
    fake.on_generate("d2", [start(5), token(9, "C"), finish()])
    events = await run(await machine(fake), RequestContext("r1"))
    assert text(events) == "ABC"
    assert fake.made("generate")[1].request.generated_token_ids == [7, 8]


async def test_resumes_exhausted_is_a_502(fake):
    disaggregated(fake, "d1", "d2", "d3")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    for d in ("d1", "d2", "d3"):
        fake.on_generate(d, [start(5), token(8, "B"), died()])
    orch = await machine(fake, max_resumes=1)
    ctx = RequestContext("r1")
    with pytest.raises(RouterError) as info:
        await run(orch, ctx)
    assert info.value.status == 502 and info.value.body["error"]["code"] == "worker_failed"
    assert [c.url for c in fake.made("generate")] == ["d1", "d2"]
    assert ctx.phase is Phase.FAILED


async def test_no_worker_left_to_resume_on_is_a_502(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), died()])
    with pytest.raises(RouterError) as info:
        await run(await machine(fake), RequestContext("r1"))
    assert info.value.status == 502 and "no other could resume" in info.value.message


async def test_a_worker_that_dies_after_its_last_token_is_not_resumed(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), died()])
    events = await run(await machine(fake), RequestContext("r1"), request(max_tokens=3))
    assert text(events) == "ABC" and events[-1] == Finished("length", 5, 3)
    assert [c.url for c in fake.made("generate")] == ["d1"]


async def test_the_first_token_can_finish_the_request(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A", finish_reason=FinishReason.STOP))
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert events == [Started(5), Tokens([7], "A"), Finished("stop", 5, 1)]
    assert fake.made("generate") == [] and fake.aborts == [] and ctx.done
    assert metric(orch, "tandem_router_routes_total", route="disaggregated") == 1


async def test_a_consumer_that_stops_early_aborts_every_touched_worker(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [start(5), token(8, "B"), token(9, "C"), finish()])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = orch.run(request(), ctx)
    async for ev in events:
        if ev == Tokens([8], "B"):
            break
    await events.aclose()
    await orch.drain()
    assert sorted(fake.aborts) == [("d1", "r1"), ("p1", "r1")]
    # the prefill worker's lease is only freed with its token
    assert sorted(zip(fake.aborts, fake.abort_tokens, strict=True)) == [
        (("d1", "r1"), None), (("p1", "r1"), "token-of-p1")]
    assert not ctx.done and ctx.phase is Phase.DECODE
    assert all(v.router_inflight == 0 for v in orch.pool.views())


async def test_max_prompt_tokens_is_checked_once_a_worker_tokenized_the_prompt(fake):
    limits = Limits(max_prompt_tokens=4)
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    orch = await machine(fake, limits=limits)
    with pytest.raises(RouterError) as info:
        await run(orch, RequestContext("r1"), request(limits=limits))
    assert info.value.status == 400 and info.value.body["error"]["code"] == "context_length_exceeded"
    assert fake.aborts == [("p1", "r1")] and fake.abort_tokens == ["token-of-p1"]  # its lease is freed at once
    # decode-side prefill: the decode worker's START carries the count
    fake2 = FakeWorkers()
    fake2.add("d1", Role.DECODE)
    fake2.on_generate("d1", [start(5), token(7, "A"), finish()])
    orch = await machine(fake2, limits=limits)
    with pytest.raises(RouterError) as info:
        await run(orch, RequestContext("r2"), request(limits=limits))
    assert info.value.body["error"]["code"] == "context_length_exceeded"
    assert fake2.aborts == [("d1", "r2")]


async def test_a_worker_refusing_the_request_before_any_token_is_the_clients_400(fake):
    fake.add("d1", Role.DECODE)
    bad = {"message": "stop is too long", "type": "invalid_request_error", "param": "stop", "code": None}
    from tandem.contracts.protocol import EventType, StreamEvent

    fake.on_generate("d1", [start(5), StreamEvent(EventType.ERROR, error=bad)])
    with pytest.raises(RouterError) as info:
        await run(await machine(fake), RequestContext("r1"))
    assert info.value.status == 400 and info.value.body == {"error": bad}


async def test_no_ready_decode_worker_is_a_503(fake):
    fake.add("p1", Role.PREFILL)
    with pytest.raises(RouterError) as info:
        await run(await machine(fake), RequestContext("r1"))
    assert info.value.status == 503 and info.value.headers["Retry-After"]
    assert fake.calls == []


async def test_the_configured_policy_is_the_one_asked(fake):
    fake.add("d1", Role.DECODE)
    fake.add("d2", Role.DECODE)
    for d in ("d1", "d2"):
        fake.on_generate(d, [start(5), token(7, "A"), finish()])
    orch = await machine(fake, policy="round-robin")
    for i in range(2):
        await run(orch, RequestContext(f"r{i}"))
    assert [c.url for c in fake.calls] == ["d1", "d2"]
    assert metric(orch, "tandem_router_routes_total", route="no_prefill_worker") == 2


# --- busy workers (429, or 503 with Retry-After): alive and full, never taken for dead -----------


def test_429_and_503_with_retry_after_are_busy_not_dead():
    for failure in (busy(429, None), busy(429, "3"), busy(503, "2")):
        assert isinstance(failure, WorkerBusy) and not failure.dead
    assert busy(429, "3").retry_after_s == 3 and busy(429, "9999").retry_after_s == 60
    assert not isinstance(fail(503, "not_ready"), WorkerBusy)  # no Retry-After: a failure


async def test_busy_prefill_workers_fall_back_to_decode_side_prefill_as_saturated(fake):
    disaggregated(fake)
    fake.add("p2", Role.PREFILL)
    fake.on_prefill("p1", busy())
    fake.on_prefill("p2", busy(503, "2"))
    fake.on_generate("d1", [start(5), token(7, "A"), finish()])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    events = await run(orch, ctx)
    assert [c.url for c in fake.calls] == ["p1", "p2", "d1"] and text(events) == "A"
    assert ctx.route is RouteReason.PREFILL_SATURATED
    assert metric(orch, "tandem_router_routes_total", route="prefill_saturated") == 1
    assert metric(orch, "tandem_router_worker_busy_total", role="prefill") == 2
    assert metric(orch, "tandem_router_worker_failures_total", role="prefill") == 0
    assert fake.aborts == []  # they refused it: nothing to abort
    assert all(v.ready for v in orch.pool.views())


async def test_a_busy_decode_worker_passes_the_same_handoff_to_another(fake):
    disaggregated(fake, "d1", "d2")
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy()])
    fake.on_generate("d2", [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert text(events) == "AB"
    first, second = (c.request for c in fake.made("generate"))
    assert second.kv_source == first.kv_source is not None  # the lease is still good: no re-prefill
    assert second.generated_token_ids == [7] and fake.aborts == []
    assert metric(orch, "tandem_router_decode_resumes_total") == 0
    assert metric(orch, "tandem_router_worker_failures_total", role="decode") == 0
    assert all(v.ready for v in orch.pool.views())


async def test_every_decode_worker_busy_before_any_token_is_a_503_with_retry_after(fake):
    fake.add("d1", Role.DECODE)
    fake.add("d2", Role.DECODE)
    fake.on_generate("d1", [busy(429, "4")])
    fake.on_generate("d2", [busy(503, "2")])
    orch = await machine(fake)
    ctx = RequestContext("r1")
    with pytest.raises(RouterError) as info:
        await run(orch, ctx)
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "2"
    assert info.value.body["error"]["code"] == "server_overloaded"
    assert all(v.ready for v in orch.pool.views()) and ctx.phase is Phase.FAILED


async def test_a_started_stream_waits_for_a_busy_decode_worker_then_continues(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy(429, "1")], [start(5), token(8, "B"), finish()])
    orch = await machine(fake)
    events = await run(orch, RequestContext("r1"))
    assert text(events) == "AB" and events[-1] == Finished("stop", 5, 2)
    assert [c.request.kv_source is not None for c in fake.made("generate")] == [True, True]


async def test_a_started_stream_gives_up_on_busy_workers_after_busy_wait_s(fake):
    disaggregated(fake)
    fake.on_prefill("p1", prefilled("p1", IDS, 7, "A"))
    fake.on_generate("d1", [busy(429, "1")])
    orch = await machine(fake, busy_wait_s=0)
    ctx = RequestContext("r1")
    events: list = []
    with pytest.raises(RouterError) as info:
        async for ev in orch.run(request(), ctx):
            events.append(ev)
    await orch.drain()
    assert text(events) == "A" and info.value.status == 503
    assert sorted(fake.aborts) == [("d1", "r1"), ("p1", "r1")]  # the unpulled lease is freed


async def test_heartbeats_are_not_tokens(fake):
    from tandem.contracts.protocol import EventType, StreamEvent

    fake.add("d1", Role.DECODE)
    beat = StreamEvent(EventType.HEARTBEAT)
    fake.on_generate("d1", [start(5), beat, beat, token(7, "A"), beat, finish()])
    events = await run(await machine(fake), RequestContext("r1"))
    assert events == [Started(5), Tokens([7], "A"), Finished("stop", 5, 1)]


async def test_the_client_never_sees_a_worker_address():
    """5xx messages say what failed, not where: addresses go to the log."""
    fake = FakeWorkers()
    p, d = fake.add("http://10.1.2.3:8000", Role.PREFILL), fake.add("http://10.4.5.6:8000", Role.DECODE)
    fake.on_prefill(p, prefilled(p, IDS, 7, "A"))
    fake.on_generate(d, [start(5), died(f"generate on {d} failed: connection reset")])
    with pytest.raises(RouterError) as info:
        await run(await machine(fake), RequestContext("r1"))
    assert info.value.status == 502
    assert "10.1.2.3" not in str(info.value.body) and "10.4.5.6" not in str(info.value.body)
