"""Which worker holds which prefix-cache blocks: the router's copy of every worker's KV events.

Fed by kv_feed.py (one GET /internal/kv/events stream per worker, lines of
tandem.contracts.kv_events.KVEventMessage) and read once per decision by the worker set
(`WorkerSet.snapshot`): `cached(request, urls)`, how many leading tokens of the prompt each worker
holds, becomes the snapshot's `cached`, so a policy never reads this live index. A
worker's entry is what its current stream said: every stream starts with a snapshot that replaces
the entry (a restarted worker's old blocks go with it), updates must follow one by one (a gap:
`apply` returns False and the feed reconnects for a new snapshot), and a worker whose stream
breaks, or that leaves, is forgotten. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.router.policies.base import RequestInfo


@dataclass
class _Held:
    """One worker's blocks, as of `seq` of its current stream."""

    engine_id: str
    block_size: int
    salt: bytes
    enabled: bool
    seq: int
    hashes: set[bytes] = field(default_factory=set)
    in_snapshot: bool = True  # more snapshot lines of this seq may follow


def _hashes(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]  # ValueError on a malformed hash: the stream resyncs


class PrefixIndex:
    """Block hashes per worker URL; `cached_tokens` matches a prompt's leading blocks against them."""

    def __init__(self) -> None:
        self._workers: dict[str, _Held] = {}

    def start(self, url: str, snapshot: KVEventMessage) -> None:
        """The first line of a new stream from `url`: what it holds replaces what was known."""
        if snapshot.type is not KVEventType.SNAPSHOT:
            raise ValueError(f"a KV event stream must start with a snapshot, not {snapshot.type}")
        if snapshot.block_size < 1 and snapshot.enabled:
            raise ValueError(f"a KV event snapshot needs a block size >= 1, got {snapshot.block_size}")
        self._workers[url] = _Held(snapshot.engine_id, snapshot.block_size, bytes.fromhex(snapshot.salt),
                                   snapshot.enabled, snapshot.seq, set(_hashes(snapshot.hashes)))

    def apply(self, url: str, msg: KVEventMessage) -> bool:
        """A later line of `url`'s stream; False when it does not follow on (the caller resyncs)."""
        held = self._workers.get(url)
        if held is None:
            return False
        if msg.type is KVEventType.SNAPSHOT:  # a snapshot's further lines, before anything else
            if not held.in_snapshot or msg.seq != held.seq:
                return False
            held.hashes.update(_hashes(msg.hashes))
            return True
        held.in_snapshot = False
        if msg.type is KVEventType.HEARTBEAT:
            return msg.seq == held.seq
        if msg.seq != held.seq + 1:
            return False
        held.hashes.difference_update(_hashes(msg.removed))
        held.hashes.update(_hashes(msg.stored))
        held.seq = msg.seq
        return True

    def forget(self, url: str) -> None:
        """`url` left, or its stream broke: nothing is known of it until its next snapshot."""
        self._workers.pop(url, None)

    def cached_tokens(self, url: str, request: RequestInfo) -> int:
        """Leading prompt tokens whose blocks `url` holds; the last prompt token never counts (a
        worker computes it to sample the first output token)."""
        held = self._workers.get(url)
        if held is None or not held.enabled or request.prompt_token_ids is None:
            return 0
        matched = 0
        for h in request.block_hashes(held.block_size, held.salt):
            if h not in held.hashes:
                break
            matched += 1
        return max(0, min(matched * held.block_size, request.prompt_tokens - 1))

    def cached(self, request: RequestInfo, urls: list[str]) -> dict[str, int]:
        """`cached_tokens` for each of `urls` that holds any of the prompt (a snapshot's `cached`)."""
        if request.prompt_token_ids is None:
            return {}
        held = {url: self.cached_tokens(url, request) for url in urls if url in self._workers}
        return {url: n for url, n in held.items() if n}

    def blocks(self, url: str) -> int:
        """Block hashes known for `url` (0 when nothing is known)."""
        held = self._workers.get(url)
        return len(held.hashes) if held else 0

    def engine_id(self, url: str) -> str | None:
        held = self._workers.get(url)
        return held.engine_id if held else None

    def workers(self) -> int:
        """Workers whose current stream has delivered its snapshot."""
        return len(self._workers)

    def total_blocks(self) -> int:
        return sum(len(h.hashes) for h in self._workers.values())
