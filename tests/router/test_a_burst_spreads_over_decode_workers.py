"""A burst of disaggregated requests spreads over the decode workers (least-loaded, the default).

Found by the scale-down test on a fresh clone: 20 streams sent at once all decoded on one of two
idle decode workers. The decode worker is chosen when the request is planned, but the router
counted a sequence on it only once its decode call opened, after the prefill: every request planned
while the first prompts were still being prefilled saw both decode workers idle and took the same
one. A sequence now counts on its planned decode worker from the moment its prefill starts.
"""

import asyncio
from collections import Counter

from tandem.contracts.names import Role
from tandem.contracts.protocol import FinishReason
from tandem.router.journey import Journey
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.base import PolicySettings, decode_seqs
from tandem.router.policies.registry import create_policy
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import FakeWorkers, finish, prefilled, start, token
from tandem.testing.journeys import IDS, request

PREFILL, DECODES = "http://prefill-0", ("http://decode-0", "http://decode-1")
BURST = 8


class HeldPrefill(FakeWorkers):
    """Every prefill waits until `release` is set: the whole burst is planned before any returns."""

    release: asyncio.Event | None = None
    all_in: asyncio.Event | None = None
    entered = 0

    async def prefill(self, url, request):
        self.entered += 1
        if self.entered == BURST:
            self.all_in.set()
        await self.release.wait()
        return await super().prefill(url, request)


async def test_requests_planned_during_one_prefill_spread_over_both_decode_workers():
    fake = HeldPrefill()
    fake.release, fake.all_in = asyncio.Event(), asyncio.Event()
    fake.add(PREFILL, Role.PREFILL)
    for d in DECODES:
        fake.add(d, Role.DECODE)
        fake.on_generate(d, *([start(5), token(8, "B"), finish(FinishReason.LENGTH)] for _ in range(BURST)))
    fake.on_prefill(PREFILL, *(prefilled(PREFILL, IDS, 7, "A") for _ in range(BURST)))
    pool = WorkerSet(fake)
    pool.set_targets([Target(PREFILL), *(Target(d) for d in DECODES)])
    await pool.poll_once()  # one poll: every worker idle, and no other poll during the burst
    orch = Orchestrator(fake, pool, create_policy("least-loaded", PolicySettings()), RouterMetrics())

    async def one(i: int) -> None:
        async for _ in orch.run(request(prompt=list(IDS)), Journey(f"r{i}")):
            pass

    runs = [asyncio.create_task(one(i)) for i in range(BURST)]
    await asyncio.wait_for(fake.all_in.wait(), 10)  # every request planned and waiting in prefill
    waiting = {v.url: decode_seqs(v) for v in pool.views() if v.role is Role.DECODE}
    assert waiting == dict.fromkeys(DECODES, BURST // 2), waiting
    fake.release.set()
    await asyncio.gather(*runs)
    await orch.drain()
    assert Counter(c.url for c in fake.made("generate")) == dict.fromkeys(DECODES, BURST // 2)
    assert all(decode_seqs(v) == 0 for v in pool.views()), "nothing planned is left counted"
