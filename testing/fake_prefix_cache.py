"""A stand-in for an engine with a prefix cache, as the KV event stream sees it
(tandem.worker.server.kv_events.KVEventSource): the hashes it holds, its block size and salt,
given to a follower with every change after, under its lock. For the tests of the worker's
GET /internal/kv/events and of the router's prefix index (`enabled=False`: an engine without one)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class FakePrefixCache:
    def __init__(self, held: Iterable[bytes] = (), block_size: int = 4, salt: bytes = b"salt",
                 enabled: bool = True) -> None:
        self.lock = threading.RLock()
        self.block_size = block_size
        self.salt = salt
        self.held = set(held)
        self.enabled = enabled
        self.on_kv_event: Callable[[list[bytes], list[bytes]], None] = lambda stored, removed: None

    def follow_kv_events(self, on_snapshot: Callable[[int, bytes, list[bytes]], None],
                         on_change: Callable[[list[bytes], list[bytes]], None]) -> bool:
        if not self.enabled:
            return False
        with self.lock:
            on_snapshot(self.block_size, self.salt, list(self.held))
            self.on_kv_event = on_change
        return True

    def change(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = ()) -> None:
        """Store and evict blocks as an engine would: its set and the callback change together."""
        stored, removed = list(stored), list(removed)
        with self.lock:
            self.held.difference_update(removed)
            self.held.update(stored)
            self.on_kv_event(stored, removed)
