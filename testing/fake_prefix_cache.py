"""A stand-in for an engine with a prefix cache, as the KV event stream sees it
(tandem.worker.server.kv_events.KVEventSource): its lock, block size and salt, the hashes it holds,
and the callback it calls, under its lock, when they change. For the tests of the worker's
GET /internal/kv/events and of the router's prefix index, until the engine has its own cache."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import SimpleNamespace


class FakePrefixCache:
    def __init__(self, held: Iterable[bytes] = (), block_size: int = 4, salt: bytes = b"salt") -> None:
        self.lock = threading.RLock()
        self.layout = SimpleNamespace(block_size=block_size)
        self.prefix_hash_salt = salt
        self.held = set(held)
        self.on_kv_event = lambda stored, removed: None

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.held)

    def change(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = ()) -> None:
        """Store and evict blocks as an engine would: its set and the callback change together."""
        stored, removed = list(stored), list(removed)
        with self.lock:
            self.held.difference_update(removed)
            self.held.update(stored)
            self.on_kv_event(stored, removed)
