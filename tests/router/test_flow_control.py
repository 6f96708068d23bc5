"""Flow control's gate (router/flow_control.py, issue 31 item 4): flows take turns within a priority
band, higher bands first, a full band and an outlasted TTL are 429s with Retry-After, and a client
that leaves while waiting, or just after it was let in, never loses a place for the others."""

from __future__ import annotations

import asyncio

import pytest
from tandem.contracts.protocol import MAX_FAIRNESS_ID_CHARS
from tandem.router.errors import RouterError
from tandem.router.flow_control import (
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    SHARED_FLOW,
    FlowConfig,
    FlowController,
    flow_of,
)


class Gate:
    """Requests through one controller: each holds its place until released by the test."""

    def __init__(self, **config) -> None:
        self.flow = FlowController(FlowConfig(**config))
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, name: str, flow: str, priority: int = 0) -> asyncio.Task:
        self.release[name] = asyncio.Event()

        async def run() -> None:
            async with self.flow.admit(flow, priority):
                self.order.append(name)
                await self.release[name].wait()

        self.tasks[name] = asyncio.create_task(run(), name=name)
        return self.tasks[name]

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def finish(self, name: str) -> None:
        self.release[name].set()
        await self.tasks[name]
        await self.settle()


async def test_off_lets_everything_through_at_once():
    g = Gate(max_concurrent=0)
    for i in range(5):
        g.send(f"r{i}", "a")
    await g.settle()
    assert len(g.order) == 5 and g.flow.in_flight == 0


async def test_a_flooding_flow_waits_behind_its_own_requests():
    """One place: the flood's four queue first, then another tenant's one; the other tenant goes
    second, not fifth."""
    g = Gate(max_concurrent=1)
    g.send("a0", "flood")
    await g.settle()
    for i in range(1, 5):
        g.send(f"a{i}", "flood")
    await g.settle()
    g.send("b0", "quiet")
    await g.settle()
    assert g.order == ["a0"] and g.flow.waiting() == 5
    for name in ("a0", "a1", "b0", "a2", "a3"):
        await g.finish(name)
    assert g.order == ["a0", "a1", "b0", "a2", "a3", "a4"]
    await g.finish("a4")
    assert g.flow.in_flight == 0 and g.flow.waiting() == 0


async def test_a_higher_priority_goes_first():
    g = Gate(max_concurrent=1)
    g.send("hold", "a")
    await g.settle()
    g.send("low", "a", priority=0)
    g.send("high", "b", priority=10)
    g.send("sheddable", "c", priority=-1)
    await g.settle()
    for name in ("hold", "high", "low"):
        await g.finish(name)
    assert g.order == ["hold", "high", "low", "sheddable"]
    await g.finish("sheddable")


async def test_a_full_band_is_refused_at_once_and_other_bands_still_queue():
    g = Gate(max_concurrent=1, band_capacity=2)
    g.send("hold", "a")
    await g.settle()
    g.send("w1", "a")
    g.send("w2", "b")
    third = g.send("w3", "c")
    other_band = g.send("urgent", "c", priority=1)
    await g.settle()
    with pytest.raises(RouterError) as refused:
        await third
    assert refused.value.status == 429 and refused.value.headers["Retry-After"]
    assert refused.value.body["error"]["code"] == "rate_limit_exceeded"
    assert not other_band.done() and g.flow.waiting(1) == 1 and g.flow.refused["band_full"] == 1
    for name in ("hold", "urgent", "w1", "w2"):
        await g.finish(name)
    assert g.order == ["hold", "urgent", "w1", "w2"]


async def test_a_wait_past_the_ttl_is_a_429_and_frees_its_place():
    g = Gate(max_concurrent=1, ttl_s=0.05)
    g.send("hold", "a")
    await g.settle()
    late = g.send("late", "b")
    with pytest.raises(RouterError) as refused:
        await late
    assert refused.value.status == 429 and "waited" in refused.value.message
    assert g.flow.waiting() == 0 and g.flow.refused["ttl"] == 1
    g.send("next", "c")
    await g.finish("hold")
    assert g.order == ["hold", "next"]
    await g.finish("next")
    assert g.flow.in_flight == 0


async def test_a_client_that_leaves_loses_nothing_for_the_others():
    g = Gate(max_concurrent=1)
    g.send("hold", "a")
    await g.settle()
    gone = g.send("gone", "b")
    g.send("stays", "c")
    await g.settle()
    gone.cancel()  # left while waiting
    await g.settle()
    assert g.flow.waiting() == 1
    await g.finish("hold")
    assert g.order == ["hold", "stays"]
    await g.finish("stays")
    assert g.flow.in_flight == 0 and g.flow.waiting() == 0


async def test_a_client_let_in_that_leaves_before_it_runs_passes_its_place_on():
    flow = FlowController(FlowConfig(max_concurrent=1))
    entered: list[str] = []

    async def enter(name: str) -> None:
        async with flow.admit(name):
            entered.append(name)

    async with flow.admit("hold"):
        first, second = asyncio.create_task(enter("first")), asyncio.create_task(enter("second"))
        for _ in range(5):
            await asyncio.sleep(0)
    first.cancel()  # let in as "hold" left, and gone before it could run
    await asyncio.gather(first, second, return_exceptions=True)
    assert entered == ["second"] and flow.in_flight == 0 and flow.waiting() == 0


def test_the_flow_comes_from_the_headers_or_the_api_key():
    config = FlowConfig(max_concurrent=4, objectives={"interactive": 10, "batch": -5})
    assert flow_of({FAIRNESS_HEADER: "team-a", OBJECTIVE_HEADER: "interactive"}, "k", config) == ("team-a", 10)
    by_key, priority = flow_of({OBJECTIVE_HEADER: "batch"}, "sk-secret", config)
    assert by_key.startswith("key:") and "sk-secret" not in by_key and priority == -5
    assert flow_of({}, "sk-secret", config)[0] == by_key, "one key, one flow"
    assert flow_of({}, "other", config)[0] != by_key
    assert flow_of({OBJECTIVE_HEADER: "unknown"}, None, config) == (SHARED_FLOW, 0)
    long = flow_of({FAIRNESS_HEADER: "t" * 300}, None, config)[0]
    assert len(long) <= MAX_FAIRNESS_ID_CHARS and long == flow_of({FAIRNESS_HEADER: "t" * 300}, None, config)[0]
    assert long != flow_of({FAIRNESS_HEADER: "t" * 301}, None, config)[0], "a long id is kept apart, by its hash"


def test_the_flow_goes_to_every_worker_of_the_request():
    """The workers' schedulers share their prefill by flow (scheduler.py): the router's worker request
    carries the tenant and priority app.py read from the headers, to prefill and to decode."""
    from tandem.router.journey import Journey
    from tandem.router.openai_schema import Endpoint
    from tandem.router.validation import Limits, parse_request

    parsed = parse_request({"model": "m", "prompt": "hi", "max_tokens": 2}, Endpoint.COMPLETION, Limits())
    parsed.flow = flow_of({FAIRNESS_HEADER: "team-a", OBJECTIVE_HEADER: "interactive"}, None,
                          FlowConfig(objectives={"interactive": 10}))
    journey = Journey("r1", request=parsed)
    for decode in (False, True):
        req = journey.worker_request(decode)
        assert (req.fairness_id, req.priority) == ("team-a", 10)


def test_the_settings_are_checked_where_they_are_read(tmp_path):
    from tandem.router.cli import config_from_args
    from tandem.router.config import RouterConfig, apply, flow_config

    good = apply(RouterConfig(), {"max_concurrent_requests": 8, "flow_ttl_s": 2.5,
                                  "objectives": {"interactive": 10}}, "test")
    assert flow_config(good) == FlowConfig(8, 256, 2.5, {"interactive": 10})
    for bad in ({"max_concurrent_requests": -1}, {"flow_band_capacity": 0}, {"flow_ttl_s": 0}, {"flow_headroom": -1},
                {"objectives": {"interactive": "high"}}, {"objectives": ["interactive"]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            apply(RouterConfig(), bad, "test")
    config_file = tmp_path / "router.yaml"
    config_file.write_text("routing:\n  maxConcurrentRequests: 4\n  objectives: {batch: -1}\n")
    import argparse

    from tandem.router.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(config_file), "--decode", "http://w", "--objective", "interactive=5"])
    config = config_from_args(args)
    assert (config.max_concurrent_requests, config.objectives) == (4, {"batch": -1, "interactive": 5})
    with pytest.raises(SystemExit, match="NAME=PRIORITY"):
        config_from_args(parser.parse_args(["--decode", "http://w", "--objective", "interactive"]))


async def test_a_flood_never_takes_the_headroom_so_another_tenant_starts_at_once():
    g = Gate(max_concurrent=4, headroom=1)
    for i in range(8):
        g.send(f"flood{i}", "flood")
    await g.settle()
    assert g.order == ["flood0", "flood1", "flood2"] and g.flow.waiting() == 5  # the 4th place is kept
    g.send("quiet", "quiet")
    await g.settle()
    assert g.order[-1] == "quiet"  # in at once, no flood request had to end first
    await g.finish("flood0")
    assert g.order[-1] == "flood3"  # the flood takes the freed place: at its limit of 3 again
    await g.finish("quiet")
    assert g.flow.in_flight == 3 and g.flow.waiting() == 4  # the headroom is free again, not the flood's
    for name in [n for n in list(g.tasks) if n.startswith("flood")]:
        g.release[name].set()
    await asyncio.gather(*g.tasks.values())
    assert g.flow.in_flight == 0 and not g.flow.held
