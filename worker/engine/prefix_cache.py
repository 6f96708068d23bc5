"""Automatic prefix caching: a sequence starts from the longest run of its full blocks that the
pool already holds, and every block it completes is named for the next one.

Blocks are named by tandem.contracts.prefix.block_hashes over the sequence's tokens (prompt and
output), chained, with a salt that separates pools whose KV could differ. A block is named once
all its tokens are computed, so a sequence never writes into a named block and sharing needs no
copy. At least one token is always left to compute (its logits give the next sample), so a hit
stops a block short of a prompt that is all full blocks. With caching off nothing is ever named
and every lookup misses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.prefix import block_hashes, request_salt
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.sequence import EngineSequence


def prefix_salt(layout: KVLayout, model_type: str, vocab_size: int) -> bytes:
    """What must match for two pools' blocks of equal tokens to hold the same KV (the pool size
    and the tensor-parallel group need not): the model's shape, the dtype and the block size."""
    shape = {k: v for k, v in layout.to_dict().items() if k not in ("num_blocks", "tp_size", "tp_rank")}
    doc = json.dumps({"layout": shape, "model_type": model_type, "vocab": vocab_size}, sort_keys=True)
    return hashlib.sha256(doc.encode()).digest()[:8]


@dataclass
class PullReservation:
    """Blocks held for a pulled sequence's KV: `cached` already hold its leading blocks, `fresh`
    receive the rest from the peer."""

    cached: list[int]
    fresh: list[int]

    @property
    def blocks(self) -> list[int]:
        return self.cached + self.fresh


@dataclass
class PrefixCacheStats:
    query_tokens_total: int = 0  # tokens of the sequences that looked up a prefix
    hit_tokens_total: int = 0  # of those, the tokens found cached


class PrefixCache:
    """Looks prefixes up and names computed blocks, over the engine's BlockAllocator (under the
    engine's lock, like the allocator itself), and tells a follower which names come and go."""

    def __init__(self, allocator: BlockAllocator, block_size: int, salt: bytes, enabled: bool = True):
        self.allocator = allocator
        self.block_size = block_size
        self.salt = salt
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._on_change: Callable[[list[bytes], list[bytes]], None] | None = None

    def hashes(self, seq: EngineSequence, num_blocks: int) -> list[bytes]:
        """The hashes of seq's first num_blocks full blocks, extending those it has already."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            bs = self.block_size
            tokens = seq.all_ids[len(have) * bs: num_blocks * bs]
            salt = request_salt(self.salt, seq.cache_salt)
            have.extend(block_hashes(tokens, bs, salt, parent=have[-1] if have else None))
        return have[:num_blocks]

    def match(self, seq: EngineSequence, num_tokens: int) -> list[int]:
        """Cached blocks holding the longest prefix of seq's first num_tokens tokens (full blocks
        only); nothing is taken yet."""
        if not self.enabled:
            return []
        return self.allocator.lookup(self.hashes(seq, num_tokens // self.block_size))

    def match_to_compute(self, seq: EngineSequence) -> list[int]:
        """match() for a sequence about to be computed: at least its last token stays to run."""
        return self.match(seq, seq.num_tokens - 1)

    def hit(self, blocks: list[int], query_tokens: int) -> None:
        """Take a reference to each of the found `blocks` and count the lookup."""
        self.allocator.take(blocks)
        if self.enabled:
            self.stats.query_tokens_total += query_tokens
            self.stats.hit_tokens_total += len(blocks) * self.block_size

    def take(self, seq: EngineSequence, blocks: list[int], query_tokens: int) -> None:
        """Start seq's block table with the found `blocks` (hit())."""
        self.hit(blocks, query_tokens)
        seq.block_table = list(blocks)
        seq.num_registered_blocks = len(blocks)

    def commit(self, seq: EngineSequence) -> None:
        """Name seq's blocks that are now full and computed (called after each step)."""
        if not self.enabled:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = full

    def release(self, seq: EngineSequence) -> None:
        """Give back seq's blocks (its tail first, so the shared prefix is evicted last)."""
        if seq.block_table:
            self.allocator.free(reversed(seq.block_table))
            seq.block_table = []
        seq.num_registered_blocks = 0

    def reserve(self, seq: EngineSequence, spare: int) -> PullReservation | None:
        """Blocks for the KV of all but seq's last token before a pull: the leading blocks cached here
        (at least the last block is still pulled: the pull also ends the peer's lease), then fresh
        ones for the rest, now seq's block table; None when that would leave fewer than `spare`
        blocks free (one per running sequence, for its next token)."""
        n = seq.num_tokens - 1
        hit = self.match(seq, n - 1)
        need = -(-n // self.block_size) - len(hit)
        if self.allocator.num_free - need - self.allocator.num_to_take(hit) < spare:
            return None
        self.hit(hit, n)
        res = PullReservation(cached=hit, fresh=self.allocator.allocate(need))
        seq.block_table = res.blocks
        return res

    # ---- the names as a follower sees them (worker/server/kv_events.py) -------------------------

    def follow(self, on_snapshot: Callable[[int, bytes, list[bytes]], None],
               on_change: Callable[[list[bytes], list[bytes]], None]) -> bool:
        """Under the engine's lock: on_snapshot(block_size, salt, every hash named now), then
        on_change(stored, removed) for each change from then on (publish), so nothing is lost or
        counted twice. False, following nothing, when caching is off."""
        if not self.enabled:
            return False
        on_snapshot(self.block_size, self.salt, self.allocator.cached_hashes())
        self._on_change = on_change
        return True

    def publish(self) -> None:
        """The changes since the last call, to the follower, in one call (the engine's lock calls
        this as its outermost holder lets go)."""
        stored, removed = self.allocator.take_events()
        if (stored or removed) and self._on_change is not None:
            self._on_change(stored, removed)
