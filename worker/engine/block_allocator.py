"""A free list over the KV pool's block ids; sequences hold block tables of ids from it."""

from __future__ import annotations

import threading
from collections import deque


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for; the scheduler preempts instead of letting this escape."""


class BlockAllocator:
    """Hands out whole blocks; thread-safe so the HTTP side can reserve blocks for a KV pull."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
            ids = [self._free.popleft() for _ in range(n)]
            self._used.update(ids)
            return ids

    def try_allocate(self, n: int) -> list[int] | None:
        try:
            return self.allocate(n)
        except OutOfBlocksError:
            return None

    def free(self, ids: list[int]) -> None:
        with self._lock:
            for b in ids:
                if b not in self._used:
                    raise ValueError(f"block {b} freed twice or never allocated")
                self._used.remove(b)
                self._free.append(b)
