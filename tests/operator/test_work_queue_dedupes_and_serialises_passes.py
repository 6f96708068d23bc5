"""The operator's work queue: duplicate work is removed by construction, one pass at a time per
InferenceService, nothing kept for a forgotten one. Real asyncio, no cluster."""

from __future__ import annotations

import asyncio

import pytest
from tandem.operator.work import PLAN, RESYNC, RETRY, SPEC, STATUS, Trigger, Work, merge
from tandem.operator.workqueue import WorkQueue


class Recorder:
    """A handler that records each pass and can be held inside a pass."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, Work]] = []
        self.running: set[str] = set()
        self.overlaps: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def __call__(self, key: str, work: Work) -> None:
        if key in self.running:
            self.overlaps.append(key)
        self.running.add(key)
        self.passes.append((key, work))
        await self._notify()
        try:
            if key in self.gates:
                await self.gates[key].wait()
            if key == "boom":
                raise RuntimeError("a failing pass")
        finally:
            self.running.discard(key)
            await self._notify()


async def settle() -> None:
    """Lets the queue's workers take what is ready (a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def until(queue, predicate, limit_s: float = 5.0) -> None:
    """Until predicate() holds after some pass started or ended."""
    async with asyncio.timeout(limit_s), queue.rec.changed:
        await queue.rec.changed.wait_for(predicate)


@pytest.fixture
async def queue():
    rec = Recorder()
    q: WorkQueue[str, Work] = WorkQueue(rec, merge, workers=4)
    task = asyncio.create_task(q.run())
    q.rec = rec
    try:
        yield q
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_merged_work_does_what_both_asked_and_names_the_strongest_trigger():
    assert merge(STATUS, RESYNC) == Work(Trigger.RESYNC, apply=True)
    assert merge(RESYNC, SPEC) == Work(Trigger.SPEC, apply=True)
    assert merge(PLAN, STATUS) == Work(Trigger.PLANNER, plan=True)
    both = merge(PLAN, RESYNC)
    assert both.apply and both.plan and both.drift, "a resync riding on a plan still corrects drift"
    assert not merge(RESYNC, SPEC).drift and not RETRY.drift and RESYNC.drift


async def test_a_key_queued_twice_before_it_runs_runs_once(queue):
    gate = queue.rec.gates["a"] = asyncio.Event()
    queue.add("a", STATUS)
    await until(queue, lambda: queue.rec.passes)  # the first pass holds "a"
    queue.add("a", STATUS)
    queue.add("a", RESYNC)
    queue.add("a", PLAN)
    assert queue.depth == 1
    gate.set()
    await until(queue, lambda: len(queue.rec.passes) == 2 and not queue.rec.running)
    await settle()
    assert [w for _, w in queue.rec.passes] == [STATUS, Work(Trigger.PLANNER, apply=True, plan=True)]
    assert queue.depth == 0 and not queue.keys()


async def test_one_pass_at_a_time_per_key_while_other_keys_run(queue):
    gate = queue.rec.gates["a"] = asyncio.Event()
    queue.add("a", SPEC)
    await until(queue, lambda: "a" in queue.rec.running)
    queue.add("a", STATUS)  # waits for the pass that holds "a"
    queue.add("b", SPEC)  # runs meanwhile
    await until(queue, lambda: ("b", SPEC) in queue.rec.passes)
    assert [k for k, _ in queue.rec.passes] == ["a", "b"] and queue.active == 1
    gate.set()
    await until(queue, lambda: len(queue.rec.passes) == 3 and not queue.rec.running)
    assert queue.rec.passes[-1] == ("a", STATUS)
    assert not queue.rec.overlaps


async def test_a_slot_keeps_one_timer_the_earlier_with_both_works(queue):
    queue.schedule("a", RESYNC, 0.3, "resync")
    queue.schedule("a", STATUS, 0.05, "resync")  # earlier: replaces the time, keeps both works
    queue.schedule("a", PLAN, 5.0, "plan")  # another slot, untouched
    assert queue.scheduled("a", "resync") and queue.scheduled("a", "plan")
    await until(queue, lambda: queue.rec.passes)
    await asyncio.sleep(0.4)
    assert queue.rec.passes == [("a", Work(Trigger.RESYNC, apply=True))]
    assert not queue.scheduled("a", "resync") and queue.scheduled("a", "plan")
    queue.schedule("a", STATUS, 0.05, "child")
    queue.schedule("a", STATUS, 1.0, "child")  # later: the first time stands
    await until(queue, lambda: len(queue.rec.passes) == 2, limit_s=0.8)


async def test_forget_drops_queued_work_and_timers(queue):
    gate = queue.rec.gates["a"] = asyncio.Event()
    queue.add("a", SPEC)
    await until(queue, lambda: "a" in queue.rec.running)
    queue.add("a", STATUS)
    queue.schedule("a", RESYNC, 0.05, "resync")
    queue.schedule("a", PLAN, 0.05, "plan")
    queue.forget("a")
    gate.set()
    await asyncio.sleep(0.2)
    assert queue.rec.passes == [("a", SPEC)], "nothing ran for the forgotten key after its pass"
    assert not queue.keys()


async def test_a_failing_pass_leaves_the_queue_working(queue):
    queue.add("boom", SPEC)
    await until(queue, lambda: queue.rec.passes)
    queue.add("ok", SPEC)
    await until(queue, lambda: ("ok", SPEC) in queue.rec.passes)
