"""vLLM's KV cache events as the router's KV event stream, pure: one `KVEventTranslator` per
subscription turns vLLM's batches (vllm/distributed/kv_events.py: a msgpack `KVEventBatch` of
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) into a SNAPSHOT then numbered UPDATEs.

vLLM names a block by its own hash; the router's prefix index names it by tandem.contracts.prefix
(SHA-256 chained over the token ids). A `BlockStored` carries each block's token ids and the vLLM
hash of the block before the first, so the translator computes Tandem's hash of every block,
chaining on the parent's Tandem hash it computed earlier, and remembers vLLM's hash -> Tandem's for
later events. A request's `cache_salt` reaches the first block's extra keys and is mixed in as
contracts.prefix.request_salt mixes it, so a salted prompt is named as the router names it. What
cannot be named (a parent stored before the subscription, a LoRA adapter, multimodal or embedding
keys, another block size, another KV cache group) is skipped: routing then just misses that prefix.

vLLM's publisher keeps no snapshot, so the stream starts empty and learns blocks as they are stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any

from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.prefix import block_hashes, request_salt

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one published batch (vLLM encodes KVEventBatch with msgspec: an array
    [ts, events, data_parallel_rank], each event a map tagged by its `type`)."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch must be [ts, events, ...]")
    return [e for e in batch[1] if isinstance(e, dict)]


def _salt_of(extra: Any) -> str | None | bool:
    """A first block's extra keys: its cache salt (None: none); False when they hold anything else."""
    if extra is None:
        return None
    if isinstance(extra, list | tuple) and len(extra) == 1 and isinstance(extra[0], str):
        return extra[0]
    return False


class KVEventTranslator:
    """One subscription to one vLLM server: vLLM's events in, the router's KVEventMessages out."""

    def __init__(self, engine_id: str, block_size: int) -> None:
        self.engine_id, self.block_size = engine_id, block_size
        self.seq = 0
        self.skipped = 0  # blocks that could not be named
        self._names: dict[tuple[Hashable, Hashable], bytes] = {}  # (medium, vLLM hash) -> Tandem's hash
        self._held: Counter[bytes] = Counter()  # Tandem's hash -> how many (medium, vLLM hash) name it
        self._last_batch: int | None = None

    def snapshot(self) -> KVEventMessage:
        return KVEventMessage(KVEventType.SNAPSHOT, self.seq, engine_id=self.engine_id,
                              block_size=self.block_size, salt="", hashes=[])

    def follows(self, batch_seq: int) -> bool:
        """Whether vLLM's batch number continues the last one (the first one seen always does): a gap
        lost events, a smaller number is a restarted publisher."""
        ok = self._last_batch is None or batch_seq == self._last_batch + 1
        self._last_batch = batch_seq
        return ok

    def updates(self, events: list[dict[str, Any]]) -> list[KVEventMessage]:
        """One UPDATE per event that changed what the server holds, numbered on from the last."""
        out = []
        for ev in events:
            kind = ev.get("type")
            stored, removed = [], []
            if kind == STORED:
                stored = self._stored(ev)
            elif kind == REMOVED:
                removed = self._removed(ev)
            elif kind == CLEARED:
                removed = list(self._held)
                self._names.clear()
                self._held.clear()
            if stored or removed:
                self.seq += 1
                out.append(KVEventMessage(KVEventType.UPDATE, self.seq, stored=[h.hex() for h in stored],
                                          removed=[h.hex() for h in removed]))
        return out

    def _stored(self, ev: dict[str, Any]) -> list[bytes]:
        hashes, tokens, size = ev.get("block_hashes") or [], ev.get("token_ids") or [], ev.get("block_size")
        if (size != self.block_size or ev.get("lora_id") is not None or ev.get("lora_name") is not None
                or ev.get("group_idx") not in (None, 0) or len(tokens) != size * len(hashes)):
            self.skipped += len(hashes)
            return []
        medium, parent_vllm = ev.get("medium"), ev.get("parent_block_hash")
        parent = None if parent_vllm is None else self._names.get((medium, parent_vllm))
        extras = ev.get("extra_keys") or [None] * len(hashes)
        new: list[bytes] = []
        for i, h in enumerate(hashes):
            block = tokens[i * size:(i + 1) * size]
            if parent is None and parent_vllm is None and i == 0:
                salt = _salt_of(extras[i] if i < len(extras) else None)
                if salt is False:
                    break
                ours = block_hashes(block, size, request_salt(b"", salt))[0]
            elif parent is None or (i < len(extras) and extras[i] is not None):
                break  # the chain starts outside what we know, or carries keys we cannot name
            else:
                ours = block_hashes(block, size, parent=parent)[0]
            if (medium, h) not in self._names:
                self._names[medium, h] = ours
                self._held[ours] += 1
                if self._held[ours] == 1:
                    new.append(ours)
            parent = ours
        else:
            return new
        self.skipped += len(hashes) - i
        return new

    def _removed(self, ev: dict[str, Any]) -> list[bytes]:
        if ev.get("group_idx") not in (None, 0):
            return []
        gone = []
        for h in ev.get("block_hashes") or []:
            ours = self._names.pop((ev.get("medium"), h), None)
            if ours is None:
                continue
            self._held[ours] -= 1
            if self._held[ours] <= 0:
                del self._held[ours]
                gone.append(ours)
        return gone
