"""Found by the curves benchmark (`python -m bench curves`, BENCHMARKS.md): one request at a time, a
2,048-token prompt sent right after another was routed `prefill_saturated` to the idle decode
worker, which prefilled it itself, though the prefill worker had nothing queued.

The router counts a prefill worker's queue as its last /internal/info (polled every 0.5 s) plus
what this router sent since. A poll taken while a long prompt was being prefilled still reports
its tokens after the prefill returned, until the next poll; with prefill_saturated_tokens 2048 the
pool then looks saturated. A prefill this router saw finish must stop counting at once.
"""

import dataclasses

from tandem.contracts.names import Role
from tandem.contracts.protocol import FinishReason
from tandem.contracts.routing import RouteReason
from tandem.router.journey import Charge, Journey
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.base import PolicySettings, RequestInfo, queued_prompt_tokens
from tandem.router.policies.registry import create_policy
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import FakeWorkers, finish, prefilled, start, token
from tandem.testing.journeys import IDS, request

PREFILL, DECODE = "http://prefill-0", "http://decode-0"


def view(pool: WorkerSet, url: str):
    return next(v for v in pool.views() if v.url == url)


async def polled_mid_prefill(tokens: int) -> tuple[FakeWorkers, WorkerSet]:
    """A prefill worker this router sent `tokens` prompt tokens (request "r0"), polled while it
    prefilled them."""
    fake = FakeWorkers()
    fake.add(PREFILL, Role.PREFILL)
    fake.add(DECODE, Role.DECODE)
    pool = WorkerSet(fake)
    pool.set_targets([Target(PREFILL), Target(DECODE)])
    pool.account("r0", {PREFILL: Charge(inflight=1, prompt_tokens=tokens)})
    fake.infos[PREFILL] = dataclasses.replace(fake.infos[PREFILL], outstanding_prompt_tokens=tokens)
    await pool.poll_once()
    return fake, pool


async def test_a_finished_prefill_no_longer_saturates_the_pool_before_the_next_poll():
    fake, pool = await polled_mid_prefill(2048)
    assert queued_prompt_tokens(view(pool, PREFILL)) >= 2048
    pool.account("r0", {})  # the prefill returned; the worker's last report still says 2048
    assert queued_prompt_tokens(view(pool, PREFILL)) == 0
    route = create_policy("least-loaded", PolicySettings()).route(RequestInfo("next", prompt_tokens=2048), pool.snapshot())
    assert (route.reason, route.prefill.url) == (RouteReason.DISAGGREGATED, PREFILL)


async def test_the_next_poll_is_the_workers_word_again():
    fake, pool = await polled_mid_prefill(2048)
    pool.account("r0", {})
    # another router's prompt is queued there now: the worker's own count is the truth
    fake.infos[PREFILL] = dataclasses.replace(fake.infos[PREFILL], outstanding_prompt_tokens=3000)
    await pool.poll_once()
    assert queued_prompt_tokens(view(pool, PREFILL)) == 3000


async def test_work_sent_after_the_poll_is_not_taken_off_its_report():
    fake, pool = await polled_mid_prefill(500)
    pool.account("later", {PREFILL: Charge(inflight=1, prompt_tokens=700)})  # after the poll: not in its report
    pool.account("later", {})
    assert view(pool, PREFILL).outstanding_prompt_tokens == 500  # the first prompt still waits there
    pool.account("r0", {})
    assert queued_prompt_tokens(view(pool, PREFILL)) == 0


async def test_a_decode_worker_that_prefilled_a_prompt_stops_counting_it_too():
    fake = FakeWorkers()
    fake.add(DECODE, Role.DECODE)
    pool = WorkerSet(fake)
    pool.set_targets([Target(DECODE)])
    pool.account("r", {DECODE: Charge(inflight=1, prompt_tokens=1200)})
    fake.infos[DECODE] = dataclasses.replace(fake.infos[DECODE], outstanding_prompt_tokens=1200)
    await pool.poll_once()
    # its first token came: the stream runs on, the prompt no longer waits
    pool.account("r", {DECODE: Charge(inflight=1, prompt_tokens=0)})
    assert queued_prompt_tokens(view(pool, DECODE)) == 0 and view(pool, DECODE).router_inflight == 1
    pool.account("r", {})
    assert view(pool, DECODE).router_inflight == 0


class PolledDuringPrefill(FakeWorkers):
    """Scripted workers whose router polls them while a prefill runs (its report then counts it)."""

    pool: WorkerSet | None = None

    async def prefill(self, url, request):
        queued = len(request.prompt_token_ids)
        self.infos[url] = dataclasses.replace(self.infos[url], outstanding_prompt_tokens=queued)
        await self.pool.poll_once()
        return await super().prefill(url, request)


async def test_through_the_driver_the_next_long_prompt_is_disaggregated():
    fake = PolledDuringPrefill()
    fake.add(PREFILL, Role.PREFILL)
    fake.add(DECODE, Role.DECODE)
    fake.on_prefill(PREFILL, prefilled(PREFILL, IDS, 7, "A"))
    fake.on_generate(DECODE, [start(5), token(8, "B"), finish(FinishReason.LENGTH)])
    pool = fake.pool = WorkerSet(fake)
    pool.set_targets([Target(PREFILL), Target(DECODE)])
    await pool.poll_once()
    settings = PolicySettings(prefill_saturated_tokens=len(IDS))  # one prompt of this length saturates
    orch = Orchestrator(fake, pool, create_policy("least-loaded", settings), RouterMetrics())
    ctx = Journey("r1")
    async for _ in orch.run(request(prompt=list(IDS)), ctx):  # token ids: the router counts them exactly
        pass
    await orch.drain()
    assert ctx.route_reason is RouteReason.DISAGGREGATED and fake.infos[PREFILL].outstanding_prompt_tokens == len(IDS)
    route = create_policy("least-loaded", settings).route(RequestInfo("next", prompt_tokens=len(IDS)), pool.snapshot())
    assert (route.reason, route.prefill.url) == (RouteReason.DISAGGREGATED, PREFILL)
