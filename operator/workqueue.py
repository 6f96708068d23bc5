"""One asyncio work queue for every InferenceService: what kopf's events, the resync timer, child
events and the planner's timer ask for goes through here, keyed by (namespace, name).

The rules that remove duplicate work by construction (as client-go's workqueue does):

- a key queued twice before it runs runs once, with the two requests merged (`merge`);
- one pass at a time per key: a key queued while its pass runs waits and runs once more after it;
- timers (`schedule`) are per key and slot (the resync, the planner, a retry, a coalescing delay):
  a slot holds one timer, the earlier of two wins and their work is merged;
- `forget` drops a key's queued work and timers: nothing is kept for a deleted service.

Different keys run concurrently, up to `workers` passes at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")


@dataclass
class _Timer(Generic[W]):
    when: float  # loop.time()
    work: W
    handle: asyncio.TimerHandle


class WorkQueue(Generic[K, W]):
    """Keyed, deduplicated work for `handler(key, work)`, run by `workers` tasks once `run()` runs."""

    def __init__(self, handler: Callable[[K, W], Awaitable[None]], merge: Callable[[W, W], W],
                 workers: int = 8, waited: Callable[[float], None] | None = None) -> None:
        """`waited(seconds)` hears how long each pass waited from its first request to its start."""
        self.handler, self.merge, self.workers, self.waited = handler, merge, workers, waited
        self._pending: dict[K, W] = {}  # merged work per key, not yet started
        self._since: dict[K, float] = {}  # when the key's pending work was first queued (loop time)
        self._ready: asyncio.Queue[K] = asyncio.Queue()  # keys in _pending that no pass holds
        self._active: set[K] = set()  # keys whose pass runs now
        self._timers: dict[K, dict[str, _Timer[W]]] = {}

    def add(self, key: K, work: W) -> None:
        """Queue `work` for `key` now (merged with what is already queued for it)."""
        if key in self._pending:
            self._pending[key] = self.merge(self._pending[key], work)
            return
        self._pending[key] = work
        self._since[key] = asyncio.get_running_loop().time()
        if key not in self._active:
            self._ready.put_nowait(key)

    def schedule(self, key: K, work: W, delay_s: float, slot: str) -> None:
        """Queue `work` for `key` after `delay_s`; a timer already in `slot` keeps the earlier time
        and takes both works."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay_s)
        slots = self._timers.setdefault(key, {})
        old = slots.get(slot)
        if old is not None:
            work = self.merge(old.work, work)
            if old.when <= when:
                old.work = work
                return
            old.handle.cancel()
        handle = loop.call_at(when, self._fire, key, slot)
        slots[slot] = _Timer(when, work, handle)

    def scheduled(self, key: K, slot: str) -> bool:
        """Whether a timer waits in that slot."""
        return slot in self._timers.get(key, {})

    def _fire(self, key: K, slot: str) -> None:
        slots = self._timers.get(key, {})
        timer = slots.pop(slot, None)
        if not slots:
            self._timers.pop(key, None)
        if timer is not None:
            self.add(key, timer.work)

    def forget(self, key: K) -> None:
        """Drop the key's queued work and its timers (a pass that runs now finishes)."""
        self._pending.pop(key, None)
        self._since.pop(key, None)
        for timer in self._timers.pop(key, {}).values():
            timer.handle.cancel()

    @property
    def depth(self) -> int:
        """Keys waiting for a pass (timers not counted)."""
        return len(self._pending)

    @property
    def active(self) -> int:
        """Passes running now."""
        return len(self._active)

    def keys(self) -> set[K]:
        """Every key the queue holds anything for: queued, running or with a timer."""
        return set(self._pending) | self._active | set(self._timers)

    async def run(self) -> None:
        """Runs the workers until cancelled."""
        tasks = [asyncio.create_task(self._worker(), name=f"workqueue-{i}") for i in range(self.workers)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _worker(self) -> None:
        while True:
            key = await self._ready.get()
            work = self._pending.pop(key, None)
            since = self._since.pop(key, None)
            if work is None:  # forgotten while it waited
                continue
            if self.waited is not None and since is not None:
                self.waited(asyncio.get_running_loop().time() - since)
            self._active.add(key)
            try:
                await self.handler(key, work)
            except asyncio.CancelledError:
                raise
            except Exception:  # a failing pass must not stop the worker; the handler says why
                log.exception("a pass for %s failed", key)
            finally:
                self._active.discard(key)
                if key in self._pending:
                    self._ready.put_nowait(key)
