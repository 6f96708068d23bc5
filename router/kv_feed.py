"""Keeps the PrefixIndex current: one GET /internal/kv/events stream per worker the router knows.

Each stream starts with a snapshot that replaces the worker's entry in the index, then updates
apply one by one. Whatever breaks the chain (a gap in the numbering, the stream ending, the worker
unreachable or restarted) forgets the worker and reconnects, with a growing pause while it keeps
failing: the next snapshot brings it back exactly, and a restarted worker comes back with what its
new engine holds. A worker that leaves the pool is forgotten and its stream closed. Only a policy
that uses the index (`uses_prefix_index`) makes the router run this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.contracts.kv_events import KVEventMessage
from tandem.router.metrics import RouterMetrics
from tandem.router.prefix_index import PrefixIndex
from tandem.router.worker_client import WorkerFailed

log = logging.getLogger("tandem.router.kv_feed")


class KVEventClient(Protocol):
    def kv_events(self, url: str) -> AsyncIterator[KVEventMessage]:
        """The lines of `url`'s /internal/kv/events until it ends; raises WorkerFailed."""
        ...


@dataclass
class KVEventFeed:
    client: KVEventClient
    index: PrefixIndex
    metrics: RouterMetrics | None = None
    retry_min_s: float = 0.5  # pause before reconnecting after a stream that had synced
    retry_max_s: float = 10.0  # the pause doubles up to this while a worker keeps failing
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)

    def set_targets(self, urls: Iterable[str]) -> None:
        """Follow exactly these workers (called on every change of the pool's targets)."""
        wanted = set(urls)
        for url in list(self._tasks):
            if url not in wanted:
                self._tasks.pop(url).cancel()
                self.index.forget(url)
        for url in sorted(wanted - self._tasks.keys()):
            self._tasks[url] = asyncio.get_running_loop().create_task(self._follow(url))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, url: str) -> None:
        pause, failing = self.retry_min_s, False
        while True:
            synced, error = await self._read(url)
            self.index.forget(url)
            if synced:
                pause, failing = self.retry_min_s, False
            elif not failing:
                log.info("no KV events from %s (%s); retrying", url, error)
                failing = True
            await asyncio.sleep(pause)  # a pause between reconnects, not a wait for a condition
            if not synced:
                pause = min(pause * 2, self.retry_max_s)

    async def _read(self, url: str) -> tuple[bool, str]:
        """One stream, until it ends or breaks: (whether it got as far as a snapshot, why it ended)."""
        synced = False
        try:
            async with contextlib.aclosing(self.client.kv_events(url)) as stream:
                async for msg in stream:
                    if not synced:
                        self.index.start(url, msg)
                        synced = True
                        log.info("following the KV events of %s (engine %s, %d blocks)", url,
                                 self.index.engine_id(url), self.index.blocks(url))
                    elif not self.index.apply(url, msg):
                        log.warning("KV events from %s skipped past seq %d: resyncing", url, msg.seq)
                        if self.metrics is not None:
                            self.metrics.kv_event_resyncs.inc()
                        return synced, "a gap"
            return synced, "the stream ended"
        except WorkerFailed as exc:
            return synced, str(exc)
        except ValueError as exc:  # a line the index cannot take (a malformed hash)
            log.warning("a malformed KV event from %s: %s; resyncing", url, exc)
            return synced, str(exc)
