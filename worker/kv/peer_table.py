"""The KV peers a decode worker knows, by URL, kept bounded.

A decode worker meets prefill workers (and draining decode workers) as their KVSources name them,
and keeps, per URL, the metadata of the engine last seen there, plus what its backend attached to
it (TCP: pooled connections; NIXL: the remote agent). Prefill pods come and go (scale-down,
rescheduling, a new address each time), so a table that only grows leaks sockets, UCX endpoints
and memory under churn (issue 21, defect 9). This table says which peers to forget: any no pull
has used for `idle_s`, and the least recently used beyond `max_peers`; never one a pull is using.
Pure bookkeeping on the event loop; the transport does the forgetting (pull_transport.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

PEER_IDLE_S = 120.0  # a peer no pull used for this long is forgotten (config.extra["kv_peer_idle_s"])
MAX_PEERS = 256  # at most this many peers are kept (config.extra["kv_max_peers"])


class PeerTable:
    def __init__(self, idle_s: float = PEER_IDLE_S, max_peers: int = MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic):
        if idle_s <= 0 or max_peers < 1:
            raise ValueError("kv_peer_idle_s must be > 0 and kv_max_peers >= 1")
        self.idle_s = idle_s
        self.max_peers = max_peers
        self._clock = clock
        self._md: dict[str, dict[str, Any]] = {}  # url -> metadata of the engine last seen there
        self._used: dict[str, float] = {}  # url -> when a pull last used it (time.monotonic())
        self._busy: dict[str, int] = {}  # url -> pulls using it now
        self._locks: dict[str, asyncio.Lock] = {}  # url -> one discovery at a time

    def get(self, url: str) -> dict[str, Any] | None:
        return self._md.get(url)

    def put(self, url: str, md: dict[str, Any]) -> None:
        self._md[url] = md
        self._used.setdefault(url, self._clock())

    def pop(self, url: str) -> dict[str, Any] | None:
        """Forget url (its lock too, unless a discovery holds it)."""
        self._used.pop(url, None)
        lock = self._locks.get(url)
        if lock is not None and not lock.locked() and not self._busy.get(url):
            del self._locks[url]
        return self._md.pop(url, None)

    def lock(self, url: str) -> asyncio.Lock:
        return self._locks.setdefault(url, asyncio.Lock())

    @contextlib.contextmanager
    def using(self, url: str) -> Iterator[None]:
        """A pull uses url meanwhile: it is not forgotten, and counts as used when it is done."""
        self._busy[url] = self._busy.get(url, 0) + 1
        try:
            yield
        finally:
            self._busy[url] -= 1
            if not self._busy[url]:
                del self._busy[url]
            if url in self._md:
                self._used[url] = self._clock()

    def stale(self) -> list[str]:
        """The peers to forget now: idle too long, then the least recently used beyond max_peers;
        never one in use. Also drops the locks of URLs that never became peers."""
        now = self._clock()
        free = sorted((u for u in self._md if not self._busy.get(u)), key=lambda u: self._used.get(u, now))
        idle = [u for u in free if now - self._used.get(u, now) > self.idle_s]
        rest = [u for u in free if u not in idle]
        excess = max(0, len(self._md) - len(idle) - self.max_peers)
        for url in [u for u, lock in self._locks.items()
                    if u not in self._md and not lock.locked() and not self._busy.get(u)]:
            del self._locks[url]
        return idle + rest[:excess]

    def __len__(self) -> int:
        return len(self._md)

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self._md.items())

    def values(self) -> list[dict[str, Any]]:
        return list(self._md.values())
