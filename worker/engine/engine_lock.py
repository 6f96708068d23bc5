"""The engine's lock: reentrant, and it publishes the prefix cache's changes as it is let go."""

from __future__ import annotations

import threading
from collections.abc import Callable


class PublishingLock:
    """The engine's lock (reentrant), which publishes the prefix cache's changes whenever its
    outermost holder lets go: every path that changes the cache does so under this lock, so none
    can forget to publish, and subscribers hear of each change while the lock is still held, as
    worker/server/kv_events.py's KVEventSource asks."""

    def __init__(self, publish: Callable[[], None]):
        self._lock = threading.RLock()
        self._depth = 0  # changed only by the thread that holds _lock
        self._owner: int | None = None
        self._publish = publish

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth += 1
            self._owner = threading.get_ident()
        return got

    def release(self) -> None:
        try:
            if self._depth == 1:
                self._publish()
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
            self._lock.release()

    def __enter__(self) -> PublishingLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
