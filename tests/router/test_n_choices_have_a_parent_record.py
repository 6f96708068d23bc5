"""`n` > 1: the request's parent record (`ClientRequest`) owns one journey per choice. Each choice
is a request of its own to the workers (ids `<id>-<i>`), counts its own characters (its events'
offsets start at 0), takes its own round-robin turn from the worker set's cursor, and the record
reports every choice in the `request done` line. Fake workers in process: milliseconds."""

from __future__ import annotations

import contextlib

from tandem.contracts.names import Role
from tandem.router.fan_out import choices
from tandem.router.journey import ClientRequest, Finished, Phase, Tokens
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.registry import create_policy
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import FakeWorkers, finish, start, token


async def served(n: int) -> tuple[ClientRequest, FakeWorkers, list]:
    """A request for `n` choices over two decode workers taking turns; its record, the workers, and
    the (choice, event) pairs the client got."""
    fake = FakeWorkers()
    for url in ("d1", "d2"):
        fake.add(url, Role.DECODE)
        fake.on_generate(url, *([start(5), token(7, "ab"), token(8, "c"), finish()] for _ in range(n)))
    workers = WorkerSet(fake)
    workers.set_targets([Target(url) for url in fake.infos])
    await workers.poll_once()
    orch = Orchestrator(fake, workers, create_policy("round-robin"), RouterMetrics())
    parsed = parse_request({"model": "toy", "prompt": "a prompt", "max_tokens": 4, "n": n}, Endpoint.COMPLETION,
                           Limits())
    record = ClientRequest("r1")
    async with contextlib.aclosing(choices(orch, parsed, record)) as events:
        got = [pair async for pair in events]
    await orch.drain()
    assert all(v.router_inflight == 0 and v.router_planned == 0 for v in workers.views()), "nothing left counted"
    return record, fake, got


async def test_each_choice_is_a_journey_of_the_parent_record():
    record, fake, got = await served(3)
    assert [j.request_id for j in record.choices] == ["r1", "r1-1", "r1-2"]
    assert all(j.phase is Phase.FINISHED for j in record.choices)
    assert sorted(c.request.request_id for c in fake.made("generate")) == ["r1", "r1-1", "r1-2"]
    # the cursor is the worker set's: each choice took the next turn
    assert [j.decode_url for j in record.choices] == ["d1", "d2", "d1"]
    for i in range(3):  # characters are counted per choice, in its journey
        assert [(ev.text, ev.offset) for c, ev in got if c == i and isinstance(ev, Tokens)] == [("ab", 0), ("c", 2)]
        assert [ev for c, ev in got if c == i and isinstance(ev, Finished)] == [Finished("stop", 5, 2)]
    summary = record.summary()
    assert (summary["route"], summary["phase"], summary["decode"]) == ("no_prefill_worker", "finished", "d1")
    assert [c["decode"] for c in summary["choices"]] == ["d1", "d2", "d1"]


async def test_one_choice_is_the_records_own_journey():
    record, fake, got = await served(1)
    assert [j.request_id for j in record.choices] == ["r1"] and "choices" not in record.summary()
    assert [c.request.request_id for c in fake.made("generate")] == ["r1"]
