"""What rank 0 decides for its whole group and every other rank adopts, so that no two ranks can
disagree: the model and its engine settings (the pool's size in blocks above all: block ids are
the group's), the context the decode graphs are compiled for, and the KV transport's settings.
Rank 0 publishes it in the rendezvous store before it builds its engine; the others read it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Agreement:
    engine: dict[str, Any]  # tandem.worker.engine.config.EngineConfig, num_blocks resolved
    max_context: int  # the engine's context length: what the decode graphs are compiled for
    engine_id: str  # rank 0's; rank K's KV agent is f"{engine_id}-r{K}"
    leader_url: str  # rank 0's HTTP API (the ranks ask it about leases)
    role: str
    kv_backend: str
    kv: dict[str, Any] = field(default_factory=dict)  # timeout_s, lease_s, extra, serve

    def engine_config(self) -> Any:
        from tandem.worker.engine.config import EngineConfig

        return EngineConfig(**self.engine)

    def rank_engine_id(self, rank: int) -> str:
        return self.engine_id if rank == 0 else f"{self.engine_id}-r{rank}"
