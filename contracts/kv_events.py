"""The prefix cache's changes as a worker streams them (GET /internal/kv/events) to the router's
prefix index: a snapshot, then numbered updates and heartbeats."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class KVEventType(enum.StrEnum):
    SNAPSHOT = "snapshot"  # first line of every stream: all the block hashes held, as of `seq`
    UPDATE = "update"  # hashes stored and removed since the previous line; seq is the previous + 1
    HEARTBEAT = "heartbeat"  # nothing changed; `seq` repeats the last one


@dataclass
class KVEventMessage:
    """One NDJSON line of GET /internal/kv/events. Hashes (tandem.contracts.prefix.block_hashes over
    `block_size` tokens with `salt`) travel as hex. `enabled` is false on a worker whose engine keeps
    no prefix cache: its snapshot is empty and no update follows."""

    type: KVEventType
    seq: int
    engine_id: str = ""  # on SNAPSHOT: a restarted worker has a new one
    block_size: int = 0  # on SNAPSHOT
    salt: str = ""  # on SNAPSHOT, hex
    enabled: bool = True  # on SNAPSHOT
    hashes: list[str] = field(default_factory=list)  # on SNAPSHOT
    stored: list[str] = field(default_factory=list)  # on UPDATE
    removed: list[str] = field(default_factory=list)  # on UPDATE

    def to_dict(self) -> dict[str, Any]:
        keep = {KVEventType.SNAPSHOT: ("engine_id", "block_size", "salt", "enabled", "hashes"),
                KVEventType.UPDATE: ("stored", "removed"), KVEventType.HEARTBEAT: ()}[self.type]
        return {"type": self.type.value, "seq": self.seq} | {k: getattr(self, k) for k in keep}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventMessage:
        d = dict(d)
        d["type"] = KVEventType(d["type"])
        known = {f.name for f in dataclasses.fields(cls)}
        msg = cls(**{k: v for k, v in d.items() if k in known})
        if not isinstance(msg.seq, int) or isinstance(msg.seq, bool):
            raise ValueError(f"kv event seq must be an integer, got {msg.seq!r}")
        return msg
