"""The KV pool's blocks: reference counts, a free list, and the prefix-cache registry.

A block is in use while some sequence (or lease, or pull) holds a reference to it. A full block
may carry the hash of its token prefix (tandem.contracts.prefix); when its last holder lets go it
stays cached, evictable, in least-recently-freed order, until a new allocation needs it (and
blocks that hold nothing reusable are handed out first). A hash names at most one block.
Changes to the set of cached hashes are collected, net, until `take_events` drains them.
Not thread-safe on its own: the engine calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for; the scheduler preempts instead of letting this escape."""


class BlockAllocator:
    """Hands out whole blocks and takes them back; keeps freed hashed blocks until evicted."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._plain: deque[int] = deque(range(num_blocks))  # free, nothing cached: used first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached: oldest first
        self._num_used = 0
        self.evictions_total = 0
        self._stored: set[bytes] = set()  # net changes since the last take_events()
        self._removed: set[bytes] = set()

    # ---- counts ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: never used, or cached and held by nobody."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence, lease or pull holds (what KV usage reports)."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks that carry a prefix hash, in use or not."""
        return len(self._by_hash)

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash[block]

    # ---- allocate and free ---------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (no hash), evicting the least recently freed cached blocks if needed."""
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} KV blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._plain:
                b = self._plain.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.evictions_total += 1
            self._refs[b] = 1
            ids.append(b)
        self._num_used += n
        return ids

    def try_allocate(self, n: int) -> list[int] | None:
        try:
            return self.allocate(n)
        except OutOfBlocksError:
            return None

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference to each block. Pass a sequence's blocks last first: its tail is then
        evicted before the prefix it may share with others."""
        ids = list(ids)
        for b in ids:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice or never allocated")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._num_used -= 1
                if self._hash[b] is None:
                    self._plain.append(b)
                else:
                    self._evictable[b] = None

    # ---- the prefix cache ------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes`, from the first, that are all cached."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_to_take(self, blocks: Iterable[int]) -> int:
        """How many of these cached blocks are free now (taking them lowers num_free)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks: Iterable[int]) -> None:
        """Add a reference to each cached block (a prefix hit), taking free ones off the free list."""
        for b in blocks:
            if self._hash[b] is None:
                raise ValueError(f"block {b} holds no cached prefix")
            if self._refs[b] == 0:
                del self._evictable[b]
                self._num_used += 1
            self._refs[b] += 1

    def register(self, block: int, h: bytes) -> bool:
        """Name a full, computed block in use by its prefix hash; False (nothing changes) when
        another block already holds that hash or this one is already named."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not in use: only computed blocks are cached")
        if self._hash[block] is not None or h in self._by_hash:
            return False
        self._hash[block] = h
        self._by_hash[h] = block
        if h in self._removed:
            self._removed.discard(h)
        else:
            self._stored.add(h)
        return True

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        if h is None:
            return
        self._hash[block] = None
        del self._by_hash[h]
        if h in self._stored:
            self._stored.discard(h)
        else:
            self._removed.add(h)

    def cached_hashes(self) -> list[bytes]:
        """Every hash cached as of the last take_events() (what subscribers have been told)."""
        return [h for h in self._by_hash if h not in self._stored] + list(self._removed)

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) since the last call, net: a hash is in at most one of them."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed
